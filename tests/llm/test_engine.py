"""LLMEngine / LLM on the CPU target: greedy tokens equal transformers' generate, a request's greedy output
independent of its batch (other requests, chunked prefill, preemption), prefix caching, stops, streaming,
aborts, bad input, and no KV block leaked in any of those."""

import pytest
import torch

from kiln.errors import ConfigError, InputError
from kiln.llm import LLM, SamplingParams
from tests.llm.tiny import load_hf_reference

PROMPTS = ["Hello world", "The potter lit the fire and", "Once upon a time there was a small kiln at the edge",
           "0 1 2 3 4 5"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def no_leak(llm):
    s = llm.llm_engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == s["num_waiting"] == 0


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama):
    """transformers' greedy continuation of each prompt (12 tokens, no EOS stop)."""
    llm = LLM(tiny_llama, max_model_len=256)
    ref = load_hf_reference(tiny_llama)
    out = {}
    for p in PROMPTS:
        ids = llm.tokenizer.encode(p)
        with torch.no_grad():
            g = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out[p] = g[0, len(ids):].tolist()
    return out


def test_greedy_equals_transformers_generate(tiny_llama, reference_tokens):
    llm = LLM(tiny_llama, max_model_len=256)
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert o.outputs[0].token_ids == reference_tokens[p]
        assert o.outputs[0].finish_reason == "length" and o.finished
        assert o.outputs[0].text == llm.tokenizer.decode(reference_tokens[p])
    no_leak(llm)


@pytest.mark.parametrize("engine_kw", [
    {"max_num_batched_tokens": 5},  # prompts split into chunks of at most 5 tokens, mixed with decodes
    {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 48},  # 48 slots for 4 sequences: preemption
    {"max_num_seqs": 1},  # one at a time
])
def test_greedy_output_independent_of_batch(tiny_llama, reference_tokens, engine_kw):
    llm = LLM(tiny_llama, **{"max_model_len": 256, **engine_kw})
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == reference_tokens[p]
    if "num_kv_blocks" in engine_kw:
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    no_leak(llm)


def test_gqa9_greedy_matches_transformers(tiny_gqa9):
    llm = LLM(tiny_gqa9, max_model_len=128, max_num_batched_tokens=7)
    ref = load_hf_reference(tiny_gqa9)
    out = llm.generate(PROMPTS[:2], GREEDY)
    for p, o in zip(PROMPTS[:2], out):
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.outputs[0].token_ids == g[0, ids.shape[1]:].tolist()


def test_prefix_cache_hits_and_same_tokens(tiny_llama, reference_tokens):
    llm = LLM(tiny_llama, max_model_len=256, block_size=4)
    p = PROMPTS[2]
    first = llm.generate([p], GREEDY)[0]
    second = llm.generate([p], GREEDY)[0]
    s = llm.llm_engine.stats()
    n = len(first.prompt_token_ids)
    assert s["prefix_cache_hits"] == (n - 1) // 4 * 4 and s["prefix_cache_queries"] == 2 * n
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference_tokens[p]
    no_leak(llm)


def test_n_completions_share_the_prompt_and_seeds_reproduce(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256, block_size=4)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([PROMPTS[2]], params)[0]
    stats = llm.llm_engine.stats()
    assert stats["prefix_cache_hits"] > 0  # siblings took the first completion's prompt blocks
    assert [c.index for c in a.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in a.outputs}) > 1
    b = llm.generate([PROMPTS[2], PROMPTS[0]], [params, SamplingParams(max_tokens=5, temperature=0.8)])[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    no_leak(llm)


def test_stop_strings_tokens_and_eos(tiny_llama, reference_tokens):
    llm = LLM(tiny_llama, max_model_len=256)
    p = PROMPTS[1]
    full = llm.tokenizer.decode(reference_tokens[p])
    stop = full[5:8]
    o = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop and o.text == full[:full.index(stop)]
    t = reference_tokens[p][3]
    o = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[t],
                                         ignore_eos=True))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == t
    assert o.token_ids == reference_tokens[p][:reference_tokens[p].index(t) + 1]
    # EOS ends a request unless ignore_eos: make the model's 2nd greedy token the EOS.
    llm.tokenizer.eos_token_ids = {reference_tokens[p][1]}
    o = llm.generate([p], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == reference_tokens[p][:2]
    o = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert o.token_ids == reference_tokens[p]
    no_leak(llm)


def test_stream_abort_and_logprobs(tiny_llama, reference_tokens):
    llm = LLM(tiny_llama, max_model_len=256)
    p = PROMPTS[0]
    seen = [o.outputs[0].token_ids for o in llm.stream(p, GREEDY)]
    assert seen[-1] == reference_tokens[p] and [len(s) for s in seen] == list(range(1, 13))
    gen = llm.stream(p, GREEDY)
    next(gen)
    next(gen)
    gen.close()  # a client that goes away: its blocks return
    no_leak(llm)
    eng = llm.llm_engine
    eng.add_request("x", p, SamplingParams(max_tokens=50, temperature=0, logprobs=3))
    eng.step()
    eng.step()
    assert eng.stats()["kv_blocks_free"] < eng.stats()["kv_blocks_total"]
    eng.abort_request("x")
    no_leak(llm)
    o = llm.generate([p], SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))[0].outputs[0]
    assert len(o.logprobs) == 3 and all(len(lp) in (2, 3) for lp in o.logprobs)
    assert all(lp[t] == max(lp.values()) for lp, t in zip(o.logprobs, o.token_ids))  # greedy = most likely
    assert o.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(o.logprobs, o.token_ids)))


def test_bad_inputs_leak_nothing(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=64)
    eng = llm.llm_engine
    with pytest.raises(InputError, match="prompt is empty"):
        llm.generate([""])
    with pytest.raises(InputError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10_000]])
    with pytest.raises(InputError, match="max_model_len"):
        llm.generate([list(range(5, 70))])
    with pytest.raises(InputError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InputError, match="unknown sampling parameter.*'beam_width'"):
        SamplingParams.from_dict({"max_tokens": 4, "beam_width": 2})
    with pytest.raises(InputError, match="top_p"):
        SamplingParams(top_p=0)
    # A batch whose third prompt is bad: the good ones already added are aborted, nothing stays queued.
    with pytest.raises(InputError):
        llm.generate(["Hello", "world", ""])
    assert not eng.has_unfinished_requests()
    no_leak(llm)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' needs calibrated"):
        LLM(tiny_llama, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        LLM(tiny_llama, num_kv_blocks=2, max_model_len=64)


def test_chat_template(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=128)
    out = llm.chat([{"role": "user", "content": "what is a kiln?"}], SamplingParams(max_tokens=4, temperature=0))
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False).endswith("<|assistant|>\n")


def test_decode_steps_from_static_buffers(tiny_llama, reference_tokens):
    """The CUDA-graph path's padded static buffers (bucket sizes 1, 2, 4), run eagerly on the CPU: batches of
    3 and 2 sit in buckets of 4 and 2 with rows that write nowhere; tokens stay those of transformers."""
    from kiln.llm.runner import graph_buckets

    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=4)
    runner = llm.llm_engine.runner
    runner.make_static_buffers(4)
    runner.graphs = {b: runner.static_decode_step(b) for b in graph_buckets(4)}
    lens = [12, 4, 12, 7]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    for p, n, o in zip(PROMPTS, lens, llm.generate(PROMPTS, params)):
        assert o.outputs[0].token_ids == reference_tokens[p][:n]
    no_leak(llm)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_8bit_kv_cache_with_calibrated_scales(tiny_llama, kv):
    """8-bit caches take scales calibrated on text (per KV head for INT8, one per layer for FP8); the first
    token's distribution stays close to the float cache's."""
    from pathlib import Path

    text = Path(__file__).parent / "data" / "hamlet_act1.txt"
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=0, ignore_eos=True)
    ref = LLM(tiny_llama, max_model_len=256).generate(PROMPTS, params)
    llm = LLM(tiny_llama, max_model_len=256, kv_cache_dtype=kv, kv_calib=str(text))
    eng = llm.llm_engine
    assert eng.runner.caches[0].k.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    k_scale = eng.kv_scales[0][0]
    assert k_scale.shape == (2,) and (k_scale > 0).all() and not torch.allclose(k_scale, torch.ones(2))
    assert (k_scale[0] == k_scale[1]) == (kv == "fp8")
    for a, b in zip(llm.generate(PROMPTS, params), ref):
        (ta, la), = a.outputs[0].logprobs[0].items()
        (tb, lb), = b.outputs[0].logprobs[0].items()
        assert ta == tb and la == pytest.approx(lb, abs=0.05)
    no_leak(llm)
