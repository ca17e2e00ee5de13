"""Tensor parallelism on the CPU target: 2 real processes over gloo, tiny models, against one rank.

One TP=2 engine per model is started (process start-up with torch's import costs seconds) and reused for
several checks. GPT-style shapes: 4 query heads over 1 KV head (each rank keeps a replica of the KV head), an
odd vocabulary (the vocabulary-parallel LM head pads it), and a built .kiln engine split over 2 KV heads
with INT8 weights.
"""

import json
import os

import pytest
import torch

from kiln.errors import ConfigError, KilnError
from kiln.llm.config import ModelConfig
from kiln.llm.engine import LLM, LLMEngine, SamplingParams
from kiln.llm.parallel import check_tensor_parallel, layout, shard_quantized
from kiln.llm.runner import StepInputs
from kiln.llm.tp_workers import decode_step, encode_step
from tests.llm.tiny import make_tiny_llama

PROMPTS = ["Once upon a time", "The quick brown fox jumps over", "Hello world! How are", "a kiln is"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory):
    """4 query heads over ONE KV head (replicated on both ranks), vocabulary 385 (odd: padded to 386)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tp-mqa"), vocab=385, heads=4, kv_heads=1)


@pytest.fixture(scope="module")
def tp_pair(mqa_model):
    """One rank, and 2 ranks built from weights held in memory (the workers read them from a safetensors file)."""
    from kiln.llm.engine import load_model

    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, device="cpu")  # gloo ranks on the CPU
    ref = LLM(str(mqa_model), **kw)
    hf_config, tensors, tok, _ = load_model(mqa_model)
    tp = LLM.__new__(LLM)
    tp.llm_engine, tp._next_id = LLMEngine(hf_config, tensors, tok, tensor_parallel_size=2, **kw), 0
    yield ref, tp
    tp.shutdown()


def _same_generations(a, b, tol=1e-5):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert max(abs(lx[t] - ly[t]) for t in lx) < tol


def test_tp2_equals_one_rank(tp_pair):
    """Greedy tokens equal exactly and the top-5 logprobs agree to 1e-5, over chunked prefills (a 24-token
    step budget) and batched decode."""
    ref, tp = tp_pair
    eng = tp.llm_engine
    assert eng.tensor_parallel_size == 2 and all(eng.workers.alive)
    assert eng.model.num_heads == 2 and eng.model.num_kv_heads == 1 and eng.model.kv_head_ids == [0]
    assert eng.model.embed.shape[0] == 193  # 385 padded to 386, half of it
    long = [" ".join(["the potter lit the fire"] * 6)]
    _same_generations(ref.generate(PROMPTS + long, GREEDY), tp.generate(PROMPTS + long, GREEDY))
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]


def test_tp2_full_logits_match(tp_pair):
    """The gathered logits over the whole vocabulary (padding cut off) match one rank's to 1e-5."""
    ref, tp = tp_pair
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=385)
    for x, y in zip(ref.generate(PROMPTS[:2], p), tp.generate(PROMPTS[:2], p)):
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert len(lx) == 385
            a = torch.tensor([lx[t] for t in range(385)])
            b = torch.tensor([ly[t] for t in range(385)])
            assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_tp2_sampling_and_abort(tp_pair):
    """Seeded sampling stays on rank 0 (same draws as one rank); an aborted request frees its blocks on rank 0
    while the workers keep stepping."""
    ref, tp = tp_pair
    p = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in ref.generate(PROMPTS, p)] == \
           [o.outputs[0].token_ids for o in tp.generate(PROMPTS, p)]
    eng = tp.llm_engine
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]


def test_killed_worker_fails_the_step(tp_pair):
    """A worker killed outright (SIGKILL): the next step raises at once instead of hanging in a collective, and
    the engine lets go of its process group (the CLI test below starts another TP engine in this process)."""
    import os
    import signal

    from kiln.llm.tp_workers import WorkerError

    _, tp = tp_pair
    workers = tp.llm_engine.workers
    os.kill(workers.pids[0], signal.SIGKILL)
    workers.procs[0].wait(10)
    with pytest.raises(WorkerError, match="rank 1 exited with code -9"):
        tp.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    import torch.distributed as dist

    assert not dist.is_initialized() and not any(workers.alive)


def test_bad_tensor_parallel_sizes_refused(mqa_model):
    """Refused before any process starts, naming the config key."""
    with pytest.raises(ConfigError, match="num_attention_heads = 4"):
        LLM(str(mqa_model), max_model_len=64, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size = 0"):
        LLM(str(mqa_model), max_model_len=64, tensor_parallel_size=0)
    base = json.loads((mqa_model / "config.json").read_text())
    cfg = ModelConfig.from_hf({**base, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8})
    with pytest.raises(ConfigError, match="num_key_value_heads = 3"):
        check_tensor_parallel(cfg, 2)
    cfg = ModelConfig.from_hf({**base, "intermediate_size": 130})
    with pytest.raises(ConfigError, match="intermediate_size = 130"):
        check_tensor_parallel(cfg, 4)


def test_kv_head_layouts(mqa_model):
    """KV heads split when they divide among the ranks, replicated (the one each rank's query heads read)
    when there are fewer than ranks."""
    base = json.loads((mqa_model / "config.json").read_text())
    cfg = ModelConfig.from_hf({**base, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8})
    assert [layout(cfg, r, 2).kv_heads for r in range(2)] == [(0, 1), (1, 2)]
    assert [layout(cfg, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [layout(cfg, r, 8).heads for r in range(8)][-1] == (7, 8)


def test_quantized_shards_are_slices_of_the_whole():
    """A stored INT8 / INT4 matrix cut for a rank dequantizes to the same rows and columns of the whole."""
    from kiln.llm import quantize

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
                               "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    torch.manual_seed(0)
    down = torch.randn(256, 512)
    qkv = torch.randn((4 + 2 * 2) * 64, 256)
    lay = layout(cfg, 1, 2)
    for method in ("int8", "fp8"):
        q = quantize.quantize_weight(down, method, None)
        part = shard_quantized(cfg, "layers.0.down", q, lay)
        assert torch.equal(part.dequantize(), q.dequantize()[:, 256:])
        q = quantize.quantize_weight(qkv, method, None)
        part = shard_quantized(cfg, "layers.0.qkv", q, lay)
        rows = torch.cat([torch.arange(128, 256), torch.arange(320, 384), torch.arange(448, 512)])
        assert torch.equal(part.dequantize(), q.dequantize()[rows])
    from kiln.llm.calibrate import ActivationStats

    x = torch.randn(32, 512)
    for method in ("int4-awq", "w8a8"):  # INT4 groups of 128 stay whole (256 columns a rank); input scales cut
        q = quantize.quantize_weight(down, method, ActivationStats(x.abs().amax(0), x, 32))
        part = shard_quantized(cfg, "layers.0.down", q, lay)
        assert torch.equal(part.dequantize(), q.dequantize()[:, 256:])


def test_workers_read_an_hf_directory_tensor_by_tensor(mqa_model):
    """What a worker loads from an HF directory: the checkpoint's tensors, each read when asked for."""
    from kiln.llm.loader import load_hf_dir
    from kiln.llm.tp_workers import LazySafetensors

    _, tensors, _ = load_hf_dir(mqa_model)
    lazy = LazySafetensors(mqa_model)
    assert set(tensors) <= set(lazy)
    assert all(torch.equal(lazy[k], t) for k, t in tensors.items())


def test_step_inputs_round_trip():
    x = StepInputs([5, 6, 7], [0, 1, 9], [16, 17, 41], [0, 2, 3], [2, 10], [[1, 0], [2, 3]], [1, 2], 2, False)
    assert decode_step(encode_step(x)) == x


def test_worker_error_surfaces_on_rank_0(mqa_model):
    """A worker that cannot load its weights reports the error; rank 0 raises it as the KilnError it is and no
    worker process is left behind."""
    from kiln.llm.engine import load_model

    hf_config, tensors, tok, _ = load_model(mqa_model)
    with pytest.raises(KilnError) as e:
        LLMEngine(hf_config, tensors, tok, max_model_len=64, tensor_parallel_size=2, device="cpu",
                  source=str(mqa_model / "missing"))
    assert "missing" in str(e.value)
    import gc

    gc.collect()
    import subprocess

    # Only this process's children: other runs on the machine may have workers of their own.
    ps = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "stat,args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "kiln.llm.tp_workers" in line and not line.startswith("Z")]


def test_built_engine_with_tp(tmp_path, capsys):
    """`kiln llm build --tp 2` stamps each shard with its rank and world size; `kiln llm generate` then runs the
    engine on 2 ranks (its default), INT8 weights cut per rank, 2 KV heads split; tokens equal one rank's."""
    from kiln.cli import main

    model = make_tiny_llama(tmp_path / "m", heads=4, kv_heads=2)
    out = tmp_path / "m.kiln"
    assert main(["llm", "build", str(model), "--saveEngine", str(out), "--weights", "int8", "--dtype", "fp32",
                 "--device", "cpu", "--tp", "2"]) == 0
    from kiln.llm.engine_file import read_manifest

    m = read_manifest(out)
    assert m["build_config"]["tensor_parallel_size"] == 2
    shards = m["tensor_parallel"]["shards"]
    assert [(s["rank"], s["world_size"], s["kv_heads"]) for s in shards] == [(0, 2, [0, 1]), (1, 2, [1, 2])]
    capsys.readouterr()
    args = ["llm", "generate", str(out), "--prompt", PROMPTS[1], "--max-tokens", "8", "--ignore-eos", "--json",
            "--max-model-len", "64", "--device", "cpu"]
    assert main(args + ["--tp", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(args) == 0  # the engine's own size: 2
    two = json.loads(capsys.readouterr().out)
    assert one["token_ids"] == two["token_ids"] and len(two["token_ids"]) == 8
    assert main(["llm", "build", str(model), "--saveEngine", str(tmp_path / "bad.kiln"), "--device", "cpu",
                 "--tp", "3"]) == 2
    assert "num_attention_heads = 4" in " ".join(capsys.readouterr().err.split())
