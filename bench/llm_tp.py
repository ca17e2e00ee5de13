"""Tensor-parallel decode on one multi-GPU host: Kiln's LLM engine at TP=1,2,4,8 on Llama-3 shapes.

    python bench/llm_tp.py --shape llama3-8b --tp 1,2 --batch-size 1 --input-len 128 --output-len 128
    python bench/llm_tp.py --shape llama3-70b --weights fp8 --tp 4,8 --batch-size 256 --num-prompts 512 \\
        --input-len 1000 --output-len 1000 --json $OUT/tp70b.json

The model has a real architecture and random weights (no download): the first run writes it as a Hugging Face
directory under --model-dir (bf16 safetensors: about 16 GB for llama3-8b, 141 GB for llama3-70b) and later runs
reuse it. Each TP size starts a fresh engine: rank 0 is this process, ranks 1..N-1 are its worker processes (one
per GPU, NCCL between them); `torchrun` is not needed. Every figure printed is measured in this run: output
tokens per second, TTFT, TPOT and the decode step time, and for several sizes the speed-up over the smallest.
Targets (issue 45): llama3-8b TP=2 batch-1 decode >= 1.6x TP=1; llama3-70b FP8 TP=4/TP=8 throughput at 128/128
and 1000/1000 beside TensorRT-LLM's published Llama-3.3-70B FP8 figures on one H200 (3,803 and 2,909 output
tok/s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2),  # a smoke test of the script itself
}
SHARD_BYTES = 5 * 2**30


def write_random_model(out: Path, shape: str, max_positions: int) -> Path:
    """A Llama-3-shaped HF directory with random bf16 weights (std 0.02, norms 1) and a small BPE tokenizer."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.llm.tiny import write_tokenizer

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, head_dim=128,
               max_position_embeddings=max_positions, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
               hidden_act="silu", **s)
    if shape == "tiny":
        cfg.update(vocab_size=1024, head_dim=32)
    from kiln.llm.config import ModelConfig
    from kiln.llm.model import expected_shapes

    shapes = expected_shapes(ModelConfig.from_hf(cfg))
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, files = {}, {}, 0, []

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name))
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shp in shapes.items():
        t = torch.ones(shp) if len(shp) == 1 else torch.randn(shp, generator=gen) * 0.02
        shard[name] = t.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_tokenizer(out, 512)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def run_one(model: Path, tp: int, a) -> dict:
    from kiln.llm import benchmark as bm
    from kiln.llm.engine import LLMEngine

    started = time.perf_counter()
    engine = LLMEngine.from_model(str(model), tensor_parallel_size=tp, max_num_seqs=a.batch_size,
                                  max_model_len=a.input_len + a.output_len + 16, quantization=a.weights,
                                  kv_cache_dtype="auto", enforce_eager=a.enforce_eager,
                                  gpu_memory_utilization=a.gpu_memory_utilization)
    load_s = time.perf_counter() - started
    try:
        vocab = engine.model_config.vocab_size
        prompts = bm.random_prompts(vocab, [a.input_len] * a.num_prompts)
        bm.run_requests(engine, prompts[:2], [8, 8])  # warm-up
        r = bm.run_requests(engine, prompts, [a.output_len] * a.num_prompts)
        r.update(tp=tp, load_s=round(load_s, 1), kv_blocks=engine.block_manager.num_blocks,
                 cuda_graphs=sorted(engine.runner.graphs), cuda_graph_error=engine.runner.graph_error)
        return r
    finally:
        engine.shutdown()


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the random model lives (default "
                    "/tmp/kiln-<shape>-random)")
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes to run, one after another")
    ap.add_argument("--weights", default="none", choices=["none", "fp8", "int8"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None, help="requests (default: the batch size)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the all-reduces run eagerly)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    a.num_prompts = a.num_prompts or a.batch_size
    sizes = [int(x) for x in a.tp.split(",")]
    if torch.cuda.is_available() and max(sizes) > torch.cuda.device_count():
        ap.error(f"--tp {max(sizes)} needs {max(sizes)} GPUs; {torch.cuda.device_count()} visible.")
    model = write_random_model(a.model_dir or Path(f"/tmp/kiln-{a.shape}-random"), a.shape,
                               max(8192, a.input_len + a.output_len + 16))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = []
    for tp in sizes:
        r = run_one(model, tp, a)
        results.append(r)
        print(f"{a.shape} weights {a.weights} TP={tp} on {gpu}: batch {a.batch_size}, {a.num_prompts} prompts "
              f"{a.input_len}/{a.output_len}: {r['output_tok_s']:.1f} output tok/s, TTFT p50 {_ms(r['ttft_ms_p50'])}, "
              f"TPOT p50 {_ms(r['tpot_ms_p50'])}, decode step {_ms(r['decode_step_ms'])}, "
              f"CUDA graphs {r['cuda_graphs'] or 'none'} (loaded in {r['load_s']} s)", flush=True)
    base = results[0]
    for r in results[1:]:
        r[f"speedup_vs_tp{base['tp']}"] = r["output_tok_s"] / base["output_tok_s"]
        print(f"  TP={r['tp']} / TP={base['tp']}: {r['output_tok_s'] / base['output_tok_s']:.2f}x output tok/s")
    if a.json:
        a.json.write_text(json.dumps({"shape": a.shape, "gpu": gpu, "weights": a.weights, "batch_size": a.batch_size,
                                      "input_len": a.input_len, "output_len": a.output_len, "runs": results},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
