"""Kiln-LLM end to end on the GPU: a Llama-3-8B-shaped model with random BF16 weights made on the device
(nothing downloaded), against Hugging Face transformers' `generate` on the same weights in the same run, with
the HBM roofline.

Sections (--sections, comma-separated), each guarded so one failing still leaves the others' results, and
each bounded by its own time limit (--time-limit NAME=SECONDS; a run past it is cut and measured as far as it
got, "cut" in the table):
  correctness  a tiny Llama (tests/llm/tiny.py) on CUDA: Kiln's greedy tokens (Triton kernels, CUDA graphs)
               against transformers' generate on the same weights (FP32), also in every --variants entry.
  kiln         the 8B shape, BF16 weights and KV, 128 in / 256 out at batch 1 and 64: output tok/s, TTFT, TPOT,
               e2e p50/p99, decode step time, the roofline, host share of the step and its phases; each of
               --variants (decode-step variants, VARIANT_PARTS) on the same engine with the same prompts, its
               tokens compared with the first variant's.
  kilnasync    as kiln, with the variant "async" after the default (--variants adds others: VARIANT_PARTS).
  hf           transformers' generate, eager, same prompts (exactly --hf-output-len new tokens each).
  hfcompile    transformers' generate with its static cache, the forward under torch.compile (compile timed
               apart).
  fp8          FP8 weights (kiln.llm.quantize) and an FP8 KV cache with scales calibrated on random tokens
               (keys centred), as `kiln` at --quant-batches (default: --batches) in --quant-variants.
  saturated    ISL/OSL 128/128, FP8 weights + FP8 KV, --sat-prompts requests at once with max_num_seqs
               --sat-seqs (CUDA graphs up to it, the KV pool sized for it): output tok/s.
  long         ISL/OSL 1000/1000, FP8 weights + FP8 KV, --long-prompts requests, max_num_seqs --long-seqs.
  kvctx        FP8 KV against BF16 KV (BF16 weights both): one decode step of batch 64 at --ctx tokens of
               context, the captured graph timed with the KV blocks filled directly (no prefill); the KV
               blocks and sequences of that context the engine's sizing rule fits for each cache dtype.
  int4         INT4 weights (groups of 128) at batch 1, in --quant-variants.
  prefix       64 requests sharing a cached 1,024-token prefix: TTFT with and without prefix caching.
  sampler      one Sampler call at batch 64 over the vocabulary on the device (greedy, temperature, top-k/p,
               seeded, logprobs), the wait for the token ids included.
  host         the engine's host time per decode step at --host-batches with the forward replaced by a no-op
               (a tiny model on the CPU; the scheduler, preparation, buffer writes, argmax and bookkeeping).
Random weights make the text meaningless; the timing is what it is for any weights of this shape.

    python bench/llm.py --out DIR            (GPU; writes DIR/H200-llm.md and .json)
    python bench/llm.py --tiny --out DIR     (a tiny config, any device: checks the script itself)
    python bench/llm.py --sections saturated,long,kvctx --out DIR
    python bench/llm.py --sections kiln,hf --hf-batches 64 --variants default,async,graph_argmax+async --out DIR

The report ends with a table of issue 41's targets this run measured (best variant per row, named).
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from kiln.llm import benchmark as bm  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, torch_dtype="bfloat16")
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class SectionTimeout(Exception):
    pass


def section(results: dict, name: str, fn, *args, limit_s: float | None = None, partial: dict | None = None):
    """Runs one section; past limit_s (an alarm in the main thread) it stops with what it had measured: the
    error, beside what fn had put in `partial` (its output dict, where it takes one) by then."""
    log(f"--- {name}" + (f" (time limit {limit_s:.0f} s)" if limit_s else ""))

    def on_alarm(signum, frame):
        raise SectionTimeout(f"section {name} passed its time limit of {limit_s:.0f} s")

    old = None
    if limit_s and hasattr(signal, "SIGALRM"):
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        results[name] = fn(*args)
    except Exception as e:
        results[name] = {**(partial or {}), "error": f"{type(e).__name__}: {e}"}
        if not isinstance(e, SectionTimeout):
            traceback.print_exc()
    finally:
        if old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    log(f"{name}: {json.dumps(results[name], default=str)[:1500]}")
    return results[name]


class _NoTokenizer:
    """The random model has no tokenizer: prompts are token ids and the text is not looked at. A token decodes
    to one space, so the engine's incremental detokenizer moves on as it does with a real tokenizer (with no
    text at all it would re-slice every id since the start at each token)."""

    eos_token_ids: frozenset = frozenset()
    bos_token_id = None
    vocab_size = 0

    def decode(self, ids, skip_special_tokens=True):
        return " " * len(ids)

    def is_special(self, token_id):
        return False


def make_weights(cfg: dict, device, dtype):
    """transformers' LlamaForCausalLM with random weights on the device (the HF baseline) and its tensors
    (shared storage: Kiln's engine reads the same weights). Without transformers, random tensors alone."""
    try:
        import transformers

        conf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
        with torch.device(device):
            try:
                hf = transformers.LlamaForCausalLM._from_config(conf, dtype=dtype)
            except TypeError:  # transformers < 4.56 spells it torch_dtype
                hf = transformers.LlamaForCausalLM._from_config(conf, torch_dtype=dtype)
        hf = hf.to(dtype).eval()
        return hf, dict(hf.state_dict())
    except Exception as e:
        log(f"transformers model not built ({type(e).__name__}: {e}); random tensors without the HF baseline")
        from kiln.llm.config import ModelConfig
        from kiln.llm.model import expected_shapes

        g = torch.Generator(device=device).manual_seed(0)
        tensors = {}
        for name, shape in expected_shapes(ModelConfig.from_hf(cfg)).items():
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, device=device, dtype=dtype)
            else:
                tensors[name] = (torch.randn(shape, device=device, dtype=dtype, generator=g) * 0.02)
        return None, tensors


def correctness(device: str, variants=()) -> dict:
    """Tiny Llama: Kiln on `device` against transformers' generate (FP32), token for token, by default and in
    each decode variant."""
    from tests.llm.tiny import load_hf_reference, make_tiny_llama

    path = make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", heads=6, kv_heads=2, hidden=96)
    ref = load_hf_reference(path).to(device)
    from kiln.llm import LLM, SamplingParams

    llm = LLM(path, device=device, max_model_len=256, max_num_seqs=8, num_kv_blocks=256)
    prompts = ["Hello world", "The potter lit the fire and", "Once upon a time there was a small kiln", "0 1 2"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    equal, want = [], []
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids], device=device)
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(g[0, ids.shape[1]:].tolist())
        equal.append(want[-1] == o.outputs[0].token_ids)
    r = llm.llm_engine.runner
    out = {"prompts": len(prompts), "tokens_equal_to_hf": equal, "cuda_graphs": sorted(r.graphs),
           "cuda_graph_error": r.graph_error}
    # The decode variants bench/llm.py times, each against transformers' tokens too.
    for variant in variants:
        set_variant(llm.llm_engine, variant, 8)
        if r.graph_error:
            out[f"tokens_equal_to_hf_{variant}"] = f"capture failed: {r.graph_error}"
            continue
        got = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        out[f"tokens_equal_to_hf_{variant}"] = [o.outputs[0].token_ids == w for o, w in zip(got, want)]
    s = llm.llm_engine.stats()
    out["blocks_free_after"] = s["kv_blocks_free"] == s["kv_blocks_total"]
    del llm, ref
    gc.collect()
    return out


def make_engine(tensors, cfg, device, dtype_name, max_len, kv="auto", kv_scales=None, max_seq=64,
                num_kv_blocks=None, util=0.85, quantized_weights=None, quant=None, graphs=True) -> LLMEngine:
    return LLMEngine(cfg, tensors, _NoTokenizer(), dtype=dtype_name, device=device, kv_cache_dtype=kv,
                     max_num_seqs=max_seq, max_num_batched_tokens=8192, max_model_len=max_len,
                     num_kv_blocks=num_kv_blocks, gpu_memory_utilization=util,
                     quantization=None if quantized_weights else quant, kv_scales=kv_scales,
                     quantized_weights=quantized_weights, enforce_eager=not graphs)


def engine_facts(eng, setup_s: float, weights: str) -> dict:
    out = {"engine_setup_s": setup_s, "kv_blocks": eng.block_manager.num_blocks,
           "kv_cache_dtype": str(eng.kv_cache_dtype).removeprefix("torch."), "weights": weights,
           "kv_tokens_capacity": eng.block_manager.num_blocks * eng.block_manager.block_size,
           "max_num_seqs": eng.scheduler.max_num_seqs,
           "cuda_graphs": sorted(eng.runner.graphs), "cuda_graph_error": eng.runner.graph_error}
    bw = bm.copy_bandwidth(eng.device) if eng.device.type == "cuda" else None
    out["copy_bandwidth_GBs"] = bw / 1e9 if bw else None
    return out


def measure(eng, prompts, out_lens, batch: int, bw_GBs, time_limit_s=None) -> dict:
    """One timed run (all prompts at once) with host phases, the roofline at `batch` and the decode graph's
    GPU time (host share of the step = 1 - graph time / decode step wall time)."""
    timed = eng.device.type == "cuda" and bool(eng.runner.graphs)
    if timed:  # every decode graph the run replays, timed on the GPU
        eng.runner.graph_times = []
    with bm.HostPhases(eng) as phases:
        r = bm.run_requests(eng, prompts, out_lens, time_limit_s=time_limit_s)
    r["host_phases_us_per_step"] = phases.per_step(r["steps"], r["wall_s"])
    if timed:
        r["graph_ms_in_run_by_bucket"] = bm.graph_times_ms(eng)
        eng.runner.graph_times = None
    r["batch"], r["input_len"], r["output_len"] = batch, len(prompts[0]), max(out_lens)
    if bw_GBs:
        rf = bm.roofline(eng, batch, len(prompts[0]) + max(out_lens) / 2, bw_GBs * 1e9)
        r.update({k: rf[k] for k in ("weight_bytes", "kv_bytes_per_step", "roofline_step_ms", "roofline_tok_s")})
        r["roofline_fraction"] = r["output_tok_s"] / rf["roofline_tok_s"]
    if eng.device.type == "cuda" and eng.runner.graphs and eng.runner._bucket(batch):
        r["graph_replay_ms"] = bm.graph_replay_ms(eng, batch)
        # The decode steps that ran the whole batch (a saturated run's tail runs smaller batches).
        step_ms = r["decode_step_ms_by_batch"].get(batch) or r.get("decode_step_ms")
        if step_ms:
            r["host_fraction_of_step"] = 1 - r["graph_replay_ms"] / step_ms
            r["decode_step_ms_full_batch"] = step_ms
            in_run = r.get("graph_ms_in_run_by_bucket", {}).get(eng.runner._bucket(batch))
            if in_run:  # the same, from the graphs' GPU time during the run itself
                r["host_fraction_of_step_in_run"] = 1 - in_run / step_ms
    if r.get("graph_ms_in_run_by_bucket"):
        log(f"decode graphs' GPU time during the run, ms by bucket: "
            f"{ {b: round(v, 2) for b, v in r['graph_ms_in_run_by_bucket'].items()} }; decode step wall ms by "
            f"batch: { {b: round(v, 2) for b, v in r['decode_step_ms_by_batch'].items() if b % 32 == 0 or b < 8} }")
    log(f"{eng.model_name}, batch {batch}, {r['input_len']}/{r['output_len']}: {r['output_tok_s']:.1f} tok/s "
        f"({r['output_tokens']} tokens in {r['wall_s']:.1f} s{', cut' if r['cut'] else ''}), decode step "
        f"{r.get('decode_step_ms') or 0:.2f} ms, graph {r.get('graph_replay_ms') or 0:.2f} ms, host share "
        f"{100 * (r.get('host_fraction_of_step') or 0):.0f}%, TTFT p50 {r['ttft_ms_p50'] or 0:.0f} ms, TPOT p50 "
        f"{r['tpot_ms_p50'] or 0:.2f} ms; host phases us/step {r['host_phases_us_per_step']}")
    return r


def release() -> None:
    """After the last reference to an engine is dropped: its KV pool and graphs go back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# Decode-step variants a section can time on one engine, each against the default in the same run (a variant
# name joins these with "+"): async (LLMEngine.async_decode: plain-greedy decode steps queued before the last
# step's tokens reach the host), graph_argmax (the greedy token taken inside the decode graph by
# kernels/argmax.py), fused_attention (RoPE, the KV write and attention in one kernel: kernels/decode_attention.py),
# merged (that kernel's context slices merged by the last slice to finish, not by a second kernel), prefetch
# (8 MB of each next matrix asked into L2 before the small kernels between two GEMVs: kernels/l2_prefetch.py).
VARIANT_PARTS = ("default", "async", "graph_argmax", "fused_attention", "merged", "prefetch")
PREFETCH_BYTES = 8 << 20


def check_variants(names: list[str]) -> list[str]:
    for name in names:
        unknown = set(name.split("+")) - set(VARIANT_PARTS)
        if unknown:
            raise SystemExit(f"bench/llm.py: unknown variant part(s) {sorted(unknown)} in {name!r}; parts: "
                             f"{', '.join(VARIANT_PARTS)} (joined by '+')")
    return names


def set_variant(eng, name: str, max_seq: int) -> None:
    """Puts the engine in variant `name` (VARIANT_PARTS joined by '+'), capturing its decode graphs again where
    the step changes (on the CPU target the graphs' step functions over the static buffers stand in for them)."""
    from kiln.llm.runner import graph_buckets

    parts = set(name.split("+"))
    r, m = eng.runner, eng.runner.model
    eng.async_decode = "async" in parts
    step = ("graph_argmax" in parts, "fused_attention" in parts or "merged" in parts, "merged" in parts,
            PREFETCH_BYTES if "prefetch" in parts else 0)
    if step == (r.graph_argmax, m.fuse_decode_attention, m.decode_attention_merge, m.l2_prefetch_bytes) and r.graphs:
        return
    r.graph_argmax, m.fuse_decode_attention, m.decode_attention_merge, m.l2_prefetch_bytes = step
    if eng.device.type == "cuda":
        r.capture_graphs(max_seq)
    else:
        r.make_static_buffers(max_seq)
        r.graphs = {b: r.static_decode_step(b) for b in graph_buckets(max_seq)}


def kiln_runs(tensors, cfg, device, dtype_name, batches, in_len, out_len, kv="auto", quant=None,
              kv_scales=None, max_seq=64, num_kv_blocks=None, util=0.85, quantized_weights=None,
              variants=("default",), out: dict | None = None) -> dict:
    """Kiln at each batch (one engine), in each decode variant (keys batchN for the default, batchN_VARIANT for
    the others). Every variant runs the same prompts with the prefix cache emptied first (none finds its
    prefix cached), so its output tokens must equal the first variant's (tokens_equal_first)."""
    t = time.perf_counter()
    eng = make_engine(tensors, cfg, device, dtype_name, in_len + out_len + 16, kv, kv_scales, max_seq,
                      num_kv_blocks, util, quantized_weights, quant)
    eng.model_name = f"kiln {quant or dtype_name} kv={kv}"
    out = {} if out is None else out  # filled as it goes: a run cut at its time limit keeps what it measured
    out.update(engine_facts(eng, time.perf_counter() - t, quant or dtype_name))
    vocab = cfg["vocab_size"]
    try:
        for vi, variant in enumerate(variants):
            if variant != "default" or vi:
                t = time.perf_counter()
                set_variant(eng, variant, max_seq)
                out[f"setup_s_{variant}"] = time.perf_counter() - t
                if eng.runner.graph_error:
                    out[f"error_{variant}"] = eng.runner.graph_error
                    log(f"{variant}: graph capture failed: {eng.runner.graph_error}")
                    continue
            for b in batches:
                prompts = bm.random_prompts(vocab, [in_len] * b, seed=b)
                # Warm-up at the measured shapes (Triton specializes kernels on argument values, e.g. a
                # sequence count divisible by 16, so a smaller warm-up could leave a compile inside the first
                # timed prefill), with other prompts than the timed ones.
                eng.block_manager.reset_prefix_cache()
                bm.run_requests(eng, bm.random_prompts(vocab, [in_len] * b, seed=1000 + b), [2] * b)
                eng.block_manager.reset_prefix_cache()
                key = f"batch{b}" if variant == "default" else f"batch{b}_{variant}"
                out[key] = r = measure(eng, prompts, [out_len] * b, b, out["copy_bandwidth_GBs"])
                r["variant"] = variant
                first = out.get(f"batch{b}" if variants[0] == "default" else f"batch{b}_{variants[0]}")
                if vi and first:
                    r["tokens_equal_first"] = r["tokens_digest"] == first["tokens_digest"]
    finally:  # also when cut at the time limit: the next section needs the memory
        del eng
        release()
    return out


def saturated(tensors, cfg, device, dtype_name, in_len, out_len, seqs, n_prompts, limit_s, fp8) -> dict:
    """Throughput with the batch full: n_prompts requests submitted at once, max_num_seqs = seqs, FP8 weights
    and FP8 KV, the KV pool sized for seqs sequences at full length. Stops measuring before limit_s."""
    t0 = time.perf_counter()
    scales, weights = fp8()
    t = time.perf_counter()
    eng = make_engine(tensors, cfg, device, dtype_name, in_len + out_len + 16, "fp8", scales, seqs,
                      quantized_weights=weights, util=0.9)
    eng.model_name = "kiln fp8 weights + fp8 KV, saturated"
    out = engine_facts(eng, time.perf_counter() - t, "fp8")
    out["fp8_weights_and_scales_s"] = t - t0
    log(f"engine ready: {out}")
    vocab = cfg["vocab_size"]
    # Warm-up: prefill of up to 64k tokens (a full batch of short prompts) and a few decode steps, other prompts
    # than the timed ones.
    left = limit_s - (time.perf_counter() - t0)
    n_warm = min(seqs, max(64, 65536 // in_len))
    bm.run_requests(eng, bm.random_prompts(vocab, [in_len] * n_warm, seed=3000), [3] * n_warm,
                    time_limit_s=max(1.0, left * 0.25))
    out["warmup_s"] = time.perf_counter() - t0 - out["engine_setup_s"] - out["fp8_weights_and_scales_s"]
    left = limit_s - (time.perf_counter() - t0) - 6  # the graph timing and freeing after the run
    prompts = bm.random_prompts(vocab, [in_len] * n_prompts, seed=3001)
    out["run"] = measure(eng, prompts, [out_len] * n_prompts, seqs, out["copy_bandwidth_GBs"],
                         time_limit_s=max(1.0, left))
    del eng
    release()
    return out


def kv_context(tensors, cfg, device, dtype_name, ctx, batch, fp8, out: dict | None = None) -> dict:
    """FP8 KV against BF16 KV, BF16 weights both: the decode graph of `batch` sequences at ctx tokens each (the
    one graph captured). out: filled as it goes."""
    scales, _ = fp8(weights=False)
    out = {} if out is None else out
    blocks = batch * -(-ctx // 16) + batch
    for kv in ("auto", "fp8"):
        t = time.perf_counter()
        eng = make_engine(tensors, cfg, device, dtype_name, ctx + 16, kv, scales if kv == "fp8" else None,
                          batch, num_kv_blocks=blocks, graphs=False)
        if eng.device.type == "cuda":
            eng.runner.capture_graphs(batch, [batch])
        else:  # the CPU target (a script check): the graph's step function, run eagerly
            eng.runner.make_static_buffers(batch)
            eng.runner.graphs = {batch: eng.runner.static_decode_step(batch)}
        if kv == "auto":
            out["capacity"] = kv_capacity(eng, ctx)
            log(f"KV capacity beside this engine: {out['capacity']}")
        r = bm.decode_step_at_context(eng, batch, ctx)
        r["engine_setup_s"] = time.perf_counter() - t
        bw = bm.copy_bandwidth(eng.device) if eng.device.type == "cuda" else None
        r["roofline_step_ms"] = (r["weight_bytes"] + r["kv_bytes_per_step"]) / bw * 1000 if bw else None
        out.setdefault("runs", []).append(r)
        log(f"kv {r['kv_cache_dtype']} batch {batch} at {ctx} context: step {r['step_ms']:.2f} ms "
            f"({r['tok_s']:.0f} tok/s; roofline {_f(r['roofline_step_ms'], '.2f')} ms)")
        del eng
        release()
    base, f8 = out["runs"]
    out["fp8_speedup"] = base["step_ms"] / f8["step_ms"]
    out["batch"], out["context"] = batch, ctx
    return out


def kv_capacity(eng, ctx: int, utilization: float = 0.9) -> dict:
    """KV blocks a pool may take in the device memory free now by the engine's sizing rule (engine.
    kv_memory_budget, for this engine's batch and token budget), for a BF16 and an FP8 cache (the same memory for
    both), and the sequences of ctx tokens they hold. (The CPU target has no memory rule: its fixed pool.)"""
    from kiln.llm import engine as le

    bs = eng.block_manager.block_size
    per_seq = -(-ctx // bs)
    if eng.device.type == "cuda":
        budget = le.kv_memory_budget(eng.model, utilization, eng.scheduler.max_num_batched_tokens,
                                     eng.scheduler.max_num_seqs)[0]
    else:
        budget = eng.block_manager.num_blocks * le.kv_block_bytes(eng.model, eng.runner.kv_dtype, bs)
    out = {"budget_GB": budget / 1e9}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        blocks = max(0, budget) // le.kv_block_bytes(eng.model, dtype, bs)
        out[name] = {"blocks": blocks, "sequences": blocks // per_seq}
    out["context"], out["utilization"] = ctx, utilization
    out["fp8_over_bf16"] = out["fp8"]["sequences"] / max(1, out["bf16"]["sequences"])
    return out


def host_overhead(batches, out_len: int = 64) -> dict:
    """The engine's host time per decode step with the forward replaced by a no-op: a tiny model on the CPU whose
    decode "graphs" return fixed logits from the static buffers, so a step is the scheduler, input
    preparation, the host mirrors' writes, the argmax, the bookkeeping and the outputs, nothing else. Per
    batch, with per-step outputs (cumulative, what a stream needs) and without (final_only, offline)."""
    from kiln.llm.runner import graph_buckets

    cfg = dict(TINY, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=256)
    _, tensors = make_weights(cfg, "cpu", torch.float32)
    out = {}
    for b in batches:
        eng = LLMEngine(cfg, tensors, _NoTokenizer(), dtype="fp32", device="cpu", max_num_seqs=b,
                        max_num_batched_tokens=max(8192, 16 * b), max_model_len=16 + out_len + 16,
                        num_kv_blocks=b * (-(-(32 + out_len) // 16) + 1))
        r = eng.runner
        r.make_static_buffers(b)
        logits = torch.zeros(b, cfg["vocab_size"])
        logits[:, 7] = 1.0
        r.graphs = {n: (lambda n=n, fixed=logits: fixed[:n]) for n in graph_buckets(b)}
        prompts = bm.random_prompts(cfg["vocab_size"], [16] * b, seed=b)
        res = {}
        for kind in ("cumulative", "final_only"):
            bm.run_requests(eng, prompts, [4] * b, output_kind=kind)  # warm-up
            with bm.HostPhases(eng) as phases:
                run = bm.run_requests(eng, prompts, [out_len] * b, output_kind=kind)
            res[kind] = {"decode_step_us": run["decode_step_ms"] * 1000,
                         "phases_us": phases.per_step(run["steps"], run["wall_s"])}
            log(f"host overhead, batch {b}, {kind} outputs: {res[kind]['decode_step_us']:.0f} us a decode step; "
                f"phases {res[kind]['phases_us']}")
        out[f"batch{b}"] = res
        del eng, r
    return out


def sampler_cost(device: str, vocab: int, batch: int = 64, iters: int = 10) -> dict:
    """Wall time of one Sampler call on random logits [batch, vocab] on the device (the wait for the token ids
    included), per kind of request: greedy, temperature, top-k + top-p, seeded, logprobs."""
    from kiln.llm.sampling import Sampler, SamplingParams
    from kiln.llm.sequence import Sequence

    cases = {"greedy": {"temperature": 0}, "temperature 0.8": {"temperature": 0.8},
             "temperature 0.8, top-k 50, top-p 0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
             "seeded, temperature 0.8": {"temperature": 0.8, "seed": 1},
             "greedy, 5 logprobs": {"temperature": 0, "logprobs": 5}}
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, device=device, generator=g)
    sampler, out = Sampler(), {"batch": batch, "vocab": vocab}
    for name, kw in cases.items():
        seqs = [Sequence("r", i, [1, 2, 3], SamplingParams(**kw)) for i in range(batch)]
        sampler(logits, seqs)
        t = time.perf_counter()
        for _ in range(iters):
            sampler(logits, seqs)
        out[name] = (time.perf_counter() - t) / iters * 1000
        log(f"sampler, batch {batch}, vocab {vocab}, {name}: {out[name]:.2f} ms a call")
    return out


def prefix_caching(tensors, cfg, device, dtype_name, prefix_len=1024, suffix_len=32, n=64) -> dict:
    """64 requests sharing a prefix_len-token prefix (already cached by one earlier request), one output token
    each: TTFT with prefix caching on and off."""
    out = {}
    vocab = cfg["vocab_size"]
    prefix = bm.random_prompts(vocab, [prefix_len], seed=5)[0]
    prompts = [prefix + p for p in bm.random_prompts(vocab, [suffix_len] * n, seed=6)]
    other = bm.random_prompts(vocab, [prefix_len], seed=7)[0]
    warm = [other + p for p in bm.random_prompts(vocab, [suffix_len] * n, seed=8)]
    for caching in (True, False):
        eng = LLMEngine(cfg, tensors, _NoTokenizer(), dtype=dtype_name, device=device, max_num_seqs=n,
                        max_num_batched_tokens=8192, max_model_len=prefix_len + suffix_len + 16,
                        num_kv_blocks=(n + 2) * ((prefix_len + suffix_len) // 16 + 2),
                        enable_prefix_caching=caching, enforce_eager=True)
        # Warm-up: the same run over another prefix (the kernels meet this run's shapes before it is timed).
        bm.run_requests(eng, [other + [7] * suffix_len], [1])
        bm.run_requests(eng, warm, [1] * n)
        bm.run_requests(eng, [prefix + [7] * suffix_len], [1])  # the earlier request that fills the cache
        r = bm.run_requests(eng, prompts, [1] * n)
        s = eng.stats()
        out["on" if caching else "off"] = {"ttft_ms_p50": r["ttft_ms_p50"], "ttft_ms_p99": r["ttft_ms_p99"],
                                           "wall_s": r["wall_s"], "prefix_cache_hits": s["prefix_cache_hits"],
                                           "prefix_cache_queries": s["prefix_cache_queries"]}
        del eng
        gc.collect()
    out["ttft_p50_speedup"] = out["off"]["ttft_ms_p50"] / out["on"]["ttft_ms_p50"]
    out["prefix_len"], out["suffix_len"], out["requests"] = prefix_len, suffix_len, n
    return out


def hf_runs(hf, vocab, batches, in_len, out_len, static_compiled=False) -> dict:
    if hf is None:
        return {"error": "transformers model unavailable"}
    out = {}
    for b in batches:
        prompts = bm.random_prompts(vocab, [in_len] * b, seed=b)
        if not static_compiled:
            bm.hf_generate_baseline(hf, prompts[:1], 4, 1)  # warm-up
        out[f"batch{b}"] = r = bm.hf_generate_baseline(hf, prompts, out_len, b, static_compiled=static_compiled)
        log(f"hf {r['mode']} batch {b}: {r['output_tok_s']:.1f} tok/s, {r['step_ms']:.2f} ms a step"
            + (f" (compile {r['compile_s']:.1f} s)" if "compile_s" in r else ""))
    return out


def fp8_assets(tensors, cfg, device, dtype_name, weights: bool):
    """FP8 KV scales calibrated on random tokens (keys centred) or (weights) every decoder matrix in FP8 (per
    output channel), from a DecoderModel of the shared tensors."""
    from kiln.llm import quantize
    from kiln.llm.calibrate import calibrate_kv_scales
    from kiln.llm.config import ModelConfig
    from kiln.llm.engine import DTYPES
    from kiln.llm.model import DecoderModel

    model = DecoderModel(ModelConfig.from_hf(cfg), tensors, DTYPES[dtype_name], torch.device(device))
    if weights:
        out = {k: quantize.quantize_fp8(w) for k, w in quantize.linear_weights(model).items()}
    else:
        ids = bm.random_prompts(cfg["vocab_size"], [1024], seed=99)[0]
        out = calibrate_kv_scales(model, ids, "fp8", window=512, centre_keys=True)
    del model
    release()
    return out


def int4_weights(tensors, cfg, device, dtype_name) -> dict:
    """Every decoder matrix in kiln.llm.quantize's INT4 layout (groups of 128, asymmetric), without AWQ's scale
    search: random weights have no activation statistics to search on, and a step's time depends only on the
    format."""
    from kiln.llm import quantize
    from kiln.llm.config import ModelConfig
    from kiln.llm.engine import DTYPES
    from kiln.llm.model import DecoderModel

    model = DecoderModel(ModelConfig.from_hf(cfg), tensors, DTYPES[dtype_name], torch.device(device))
    out = {}
    for key, w in quantize.linear_weights(model).items():
        packed, scale, zero = quantize.quantize_int4(w)
        out[key] = quantize.QuantizedWeight(packed, method="int4-awq", scale=scale, in_features=w.shape[1],
                                            zero=zero)
    del model
    gc.collect()
    return out


def _f(v, fmt=".1f"):
    return "-" if v is None else format(v, fmt)


def _failed_row(label: str, error: str) -> str:
    """A row of the throughput table for a run that failed: its label and the error across the columns."""
    return f"| {label} | - | - | - | failed: {error} |||||||"


def _run_row(label: str, r: dict, hf_tok_s=None) -> str:
    vs = f"{r['output_tok_s'] / hf_tok_s:.1f}x" if hf_tok_s else "-"
    host = r.get("host_fraction_of_step")
    return (f"| {label} | {r['batch']} | {r['input_len']}/{r['output_len']} | {r['requests']}"
            f"{' (cut at ' + format(r['wall_s'], '.0f') + ' s, ' + str(r['finished']) + ' done)' if r.get('cut') else ''}"
            f" | {r['output_tok_s']:,.1f} | {_f(r['ttft_ms_p50'])} / {_f(r['ttft_ms_p99'])} | "
            f"{_f(r['tpot_ms_p50'], '.2f')} / {_f(r['tpot_ms_p99'], '.2f')} | "
            f"{_f(r.get('decode_step_ms_full_batch') or r.get('decode_step_ms'), '.2f')} | "
            f"{_f(r.get('graph_replay_ms'), '.2f')} | {_f(100 * host if host is not None else None, '.0f')}% | "
            f"{_f(r.get('roofline_tok_s'))} | {vs} |")


def _runs(res: dict, name: str) -> dict:
    """{key: run} of a section's timed batches (batchN, batchN_VARIANT), {} where it did not run."""
    sec = res.get(name)
    return {k: v for k, v in sec.items() if k.startswith("batch")} if isinstance(sec, dict) else {}


def _host_share(r: dict) -> float | None:
    """A run's host share of the full-batch decode step: from the graphs timed during the run where there, else
    from the replay after it."""
    v = r.get("host_fraction_of_step_in_run")
    return v if v is not None else r.get("host_fraction_of_step")


def variant_table(res: dict, labels: dict) -> list[str]:
    """Each decode variant against the default of the same engine and batch."""
    rows = []
    for name, label in labels.items():
        runs = _runs(res, name)
        for key, r in sorted(runs.items()):
            base = runs.get(key.split("_")[0])
            if r.get("variant", "default") == "default" or not base:
                continue
            hs = _host_share(r)
            graph = r.get("graph_ms_in_run_by_bucket", {})
            rows.append(f"| {label} | {r['batch']} | {r['variant']} | {r.get('tokens_equal_first')} | "
                        f"{r['output_tok_s']:,.1f} | "
                        f"{r['output_tok_s'] / base['output_tok_s']:.3f}x | "
                        f"{_f(r.get('decode_step_ms_full_batch') or r.get('decode_step_ms'), '.3f')} / "
                        f"{_f(base.get('decode_step_ms_full_batch') or base.get('decode_step_ms'), '.3f')} | "
                        f"{_f(graph.get(r['batch']) or (max(graph.values()) if graph else None), '.3f')} | "
                        f"{_f(100 * hs if hs is not None else None, '.1f')}% |")
    if not rows:
        return []
    head = ("| run | batch | variant | tokens equal to the first variant's | output tok/s | vs default | decode "
            "step ms (variant / default) | CUDA graph ms in the run | host share |")
    return ["## Decode variants against the default (same engine, same batch, same prompts, this run)", "", head,
            "|---|---|---|---|---|---|---|---|---|", *rows, ""]


def target_table(res: dict) -> list[str]:
    """Issue 41's targets that this run measured: the figure, the target and whether it is met. Where decode
    variants ran, a row's figure is the best variant's (named)."""

    def best(name, batch):
        runs = [r for k, r in _runs(res, name).items() if k.split("_")[0] == f"batch{batch}"]
        return max(runs, key=lambda r: r["output_tok_s"], default=None)

    rows = []

    def row(what, value, target, ok, how=""):
        rows.append(f"| {what} | {value} | {target} | {'met' if ok else 'NOT met'} | {how} |")

    def via(r):
        return "" if r.get("variant", "default") == "default" else f"variant {r['variant']}"

    b1 = best("kiln", 1)
    if b1:
        row("BF16, batch 1, 128/256: output tok/s", f"{b1['output_tok_s']:.1f}", ">= 240", b1["output_tok_s"] >= 240,
            via(b1))
        for name, label, goal in (("kiln_fp8", "FP8 weights", 1.7), ("kiln_int4", "INT4 weights", 2.5)):
            q = best(name, 1)
            if q:
                x = q["output_tok_s"] / b1["output_tok_s"]
                row(f"{label}, batch 1: vs BF16 (best of each)", f"{x:.2f}x ({q['output_tok_s']:.1f} tok/s)",
                    f">= {goal}x", x >= goal, via(q))
    b64 = best("kiln", 64)
    hf64 = (res.get("hf") or {}).get("batch64") if isinstance(res.get("hf"), dict) else None
    if b64 and hf64 and "output_tok_s" in hf64:
        x = b64["output_tok_s"] / hf64["output_tok_s"]
        row("BF16, batch 64, 128/256: vs HF generate (eager)", f"{x:.1f}x ({b64['output_tok_s']:,.0f} against "
            f"{hf64['output_tok_s']:,.0f} tok/s)", ">= 10x", x >= 10, via(b64))
    kv = res.get("kvctx")
    if isinstance(kv, dict) and kv.get("capacity"):
        x = kv["capacity"]["fp8_over_bf16"]
        row(f"FP8 KV: sequences of {kv['capacity']['context']} tokens in the same KV memory", f"{x:.2f}x", "2x",
            x >= 1.99)
    if isinstance(kv, dict) and kv.get("fp8_speedup"):
        row(f"FP8 KV: decode step, batch {kv['batch']} at {kv['context']} context", f"{kv['fp8_speedup']:.2f}x",
            ">= 1.4x", kv["fp8_speedup"] >= 1.4)
    for name, label in (("kiln", "BF16"), ("kiln_fp8", "FP8")):
        shares = [(r, _host_share(r)) for k, r in _runs(res, name).items() if r["batch"] == 64]
        shares = [(r, h) for r, h in shares if h is not None]
        if shares:
            r, h = min(shares, key=lambda t: t[1])
            row(f"{label}, batch 64: host share of a decode step", f"{100 * h:.1f}%", "<= 10%", h <= 0.10, via(r))
    pc = res.get("prefix_caching")
    if isinstance(pc, dict) and "ttft_p50_speedup" in pc:
        row(f"prefix caching, {pc['requests']} requests sharing {pc['prefix_len']} tokens: TTFT p50 off / on",
            f"{pc['ttft_p50_speedup']:.1f}x ({pc['off']['ttft_ms_p50']:.0f} / {pc['on']['ttft_ms_p50']:.0f} ms)",
            ">= 5x", pc["ttft_p50_speedup"] >= 5)
    if not rows:
        return []
    return ["## Issue 41 targets measured in this run", "", "| target | measured | goal | | how |",
            "|---|---|---|---|---|", *rows, ""]


def render(res: dict, args) -> str:
    env = res.get("env", {})
    lines = [f"# Kiln-LLM on {env.get('gpu', '?')}: Llama-3-8B shape, random BF16 weights"
             if not args.tiny else "# Kiln-LLM bench, tiny config (script check)", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}. "
             f"Command: `python bench/llm.py {' '.join(sys.argv[1:])}`.", ""]
    c = res.get("correctness")
    if c:
        lines += ["## Correctness (tiny Llama, 6 heads over 2 KV heads, FP32, on the device)", "",
                  f"- greedy tokens equal to transformers' generate: {c.get('tokens_equal_to_hf', c.get('error'))}",
                  f"- CUDA graphs captured at batch sizes {c.get('cuda_graphs')} (error: {c.get('cuda_graph_error')});"
                  f" all KV blocks free after: {c.get('blocks_free_after')}"]
        lines += [f"- decode variant {k.removeprefix('tokens_equal_to_hf_')}: greedy tokens equal to transformers': {v}"
                  for k, v in c.items() if k.startswith("tokens_equal_to_hf_")] + [""]
    hf = res.get("hf") if isinstance(res.get("hf"), dict) else {}
    lines += ["## Throughput and latency", "",
              "| run | batch (max_num_seqs) | ISL/OSL | requests | output tok/s | TTFT p50 / p99 ms | "
              "TPOT p50 / p99 ms | decode step ms (full batch) | CUDA graph ms | host share | roofline tok/s | vs HF eager |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    labels = {"kiln": "Kiln BF16 weights, BF16 KV", "kiln_fp8": "Kiln FP8 weights, FP8 KV",
              "kiln_int4": "Kiln INT4 weights, BF16 KV"}
    for name, label in labels.items():
        run = res.get(name)
        if not isinstance(run, dict):
            continue
        if "error" in run:
            lines.append(_failed_row(label, run["error"]))
        for key in sorted(k for k in run if k.startswith("batch")):
            variant = run[key].get("variant", "default")
            h = hf.get(key.split("_")[0], {})
            lines.append(_run_row(label + ("" if variant == "default" else f", {variant}"), run[key],
                                  h.get("output_tok_s")))
    for name, label in (("saturated", "Kiln FP8 weights + FP8 KV, saturated"),
                        ("long", "Kiln FP8 weights + FP8 KV, saturated, long")):
        run = res.get(name)
        if isinstance(run, dict):
            if "error" in run and "run" not in run:
                lines.append(_failed_row(f"{label} ({name})", run["error"]))
            elif "run" in run:
                lines.append(_run_row(label, run["run"]))
    for name in ("hf", "hf_compiled"):
        h = res.get(name)
        if not isinstance(h, dict):
            continue
        if "error" in h:
            lines.append(_failed_row(f"HF transformers generate ({name})", h["error"]))
            continue
        for key in sorted(k for k in h if k.startswith("batch")):
            r = h[key]
            extra = f" (compile {r['compile_s']:.0f} s, untimed)" if "compile_s" in r else ""
            lines.append(f"| HF generate, {r['mode']}{extra} | {r['batch']} | {args.input_len}/{r['output_len']} | "
                         f"{r['batch']} | {r['output_tok_s']:,.1f} | | {r['step_ms']:.2f} (mean step) | | | | | 1.0x |"
                         if r["mode"] == "eager" else
                         f"| HF generate, {r['mode']}{extra} | {r['batch']} | {args.input_len}/{r['output_len']} | "
                         f"{r['batch']} | {r['output_tok_s']:,.1f} | | {r['step_ms']:.2f} (mean step) | | | | | |")
    lines.append("")
    lines += variant_table(res, labels)
    kv = res.get("kvctx")
    if isinstance(kv, dict):
        lines += ["## FP8 KV against BF16 KV: one decode step at long context (BF16 weights both)", ""]
        if "error" in kv:
            lines.append(f"- failed: {kv['error']}")
        if kv.get("runs") or kv.get("capacity"):
            lines += ["| KV cache | batch | context | step ms (CUDA graph) | tok/s | KV GB a step | roofline step ms |",
                      "|---|---|---|---|---|---|---|"]
            for r in kv.get("runs", []):
                if r:
                    lines.append(f"| {r['kv_cache_dtype']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['tok_s']:,.0f} | "
                                 f"{r['kv_bytes_per_step'] / 1e9:.1f} | {_f(r['roofline_step_ms'], '.2f')} |")
            if kv.get("fp8_speedup"):
                lines.append(f"\nFP8 KV decode step {kv['fp8_speedup']:.2f}x faster than BF16 KV (target >= 1.4x).")
            cap = kv.get("capacity")
            if cap:
                lines.append(f"\nKV capacity (engine.kv_memory_budget at gpu_memory_utilization {cap['utilization']}: "
                             f"{cap['budget_GB']:.1f} GB free for a pool beside the BF16-KV engine of this section, the "
                             f"same bytes for both): BF16 {cap['bf16']['blocks']:,} "
                             f"blocks = {cap['bf16']['sequences']:,} sequences of {cap['context']} tokens; FP8 "
                             f"{cap['fp8']['blocks']:,} blocks = {cap['fp8']['sequences']:,} sequences "
                             f"({cap['fp8_over_bf16']:.2f}x; target 2x).")
        lines.append("")
    ho = res.get("host")
    if isinstance(ho, dict):
        lines += ["## Engine host time per decode step, forward replaced by a no-op (tiny model, this machine's CPU)",
                  ""]
        if "error" in ho:
            lines.append(f"- failed: {ho['error']}")
        else:
            lines += ["| batch | outputs | host us a decode step | launch path us | phases us a step |",
                      "|---|---|---|---|---|"]
            for key, r in ho.items():
                for kind, v in r.items():
                    lines.append(f"| {key.removeprefix('batch')} | {kind} | {v['decode_step_us']:.0f} | "
                                 f"{v['phases_us'].get('launch_path', 0):.0f} | {v['phases_us']} |")
        lines.append("")
    sm = res.get("sampler")
    if isinstance(sm, dict):
        lines += [f"Sampler call, batch {sm.get('batch')}, vocabulary {sm.get('vocab')} (ms, the wait for the tokens "
                  "included): " + ("; ".join(f"{k} {v:.2f}" for k, v in sm.items() if k not in ("batch", "vocab"))
                                   if "error" not in sm else sm["error"]), ""]
    lines += target_table(res)
    notes = []
    for name in ("kiln", "kiln_fp8", "kiln_int4", "saturated", "long"):
        run = res.get(name)
        if not isinstance(run, dict) or "error" in run and "run" not in run and not _runs(res, name):
            continue
        notes.append(f"- {name}: KV pool {run.get('kv_blocks')} blocks of 16 ({run.get('kv_tokens_capacity')} tokens, "
                     f"{run.get('kv_cache_dtype')}), max_num_seqs {run.get('max_num_seqs')}, CUDA graphs at "
                     f"{run.get('cuda_graphs')}, engine setup {_f(run.get('engine_setup_s'))} s, device-copy "
                     f"bandwidth {_f(run.get('copy_bandwidth_GBs'), '.0f')} GB/s")
        for key in sorted(k for k in run if k.startswith("batch") or k == "run"):
            r = run[key]
            v = "" if r.get("variant", "default") == "default" else f", {r['variant']}"
            notes.append(f"  - batch {r['batch']}{v}: host phases, us a step (collect = the wait for the GPU's tokens; "
                         f"launch_path = tokens on the host to the next step queued): {r.get('host_phases_us_per_step')}")
    pc = res.get("prefix_caching")
    if isinstance(pc, dict):
        if "error" in pc:
            notes.append(f"- prefix caching: {pc['error']}")
        else:
            notes.append(f"- prefix caching, {pc['requests']} requests sharing a cached {pc['prefix_len']}-token "
                         f"prefix (+{pc['suffix_len']} own tokens), one output token: TTFT p50 "
                         f"{pc['on']['ttft_ms_p50']:.1f} ms with caching, {pc['off']['ttft_ms_p50']:.1f} ms without "
                         f"({pc['ttft_p50_speedup']:.1f}x); hits {pc['on']['prefix_cache_hits']} of "
                         f"{pc['on']['prefix_cache_queries']} prompt tokens")
    lines += notes
    lines += ["", "Roofline: a decode step reads every weight once plus each sequence's K/V (average context "
              "= prompt + half the output); bound = batch / ((weight bytes + KV bytes) / bandwidth). "
              "TTFT/e2e are measured from submitting all requests at once; TPOT = (last - first token) / "
              "(tokens - 1); host share = 1 - (the decode batch's CUDA graph time) / (decode step wall time). "
              "A run cut at its time limit reports the output tokens made until then over that time.", ""]
    return "\n".join(lines)


LIMITS = {"host": 60, "sampler": 30, "correctness": 60, "kiln": 120, "kilnasync": 120, "hf": 60, "hfcompile": 90, "fp8": 120, "saturated": 60, "long": 60,
          "kvctx": 40, "int4": 60, "prefix": 60}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for H200-llm.md / .json")
    ap.add_argument("--tiny", action="store_true", help="tiny config (checks the script on any device)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--hf-output-len", type=int, default=None, help="new tokens for HF generate (default: --output-len)")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=None, help="default: --batches")
    ap.add_argument("--sat-len", type=int, default=128, help="saturated: ISL = OSL")
    ap.add_argument("--sat-seqs", type=int, default=512, help="saturated: max_num_seqs")
    ap.add_argument("--sat-prompts", type=int, default=1024, help="saturated: requests")
    ap.add_argument("--long-seqs", type=int, default=256, help="long (1000/1000): max_num_seqs")
    ap.add_argument("--long-prompts", type=int, default=256, help="long: requests")
    ap.add_argument("--long-len", type=int, default=1000, help="long: ISL (and OSL unless --long-out)")
    ap.add_argument("--long-out", type=int, default=None, help="long: OSL (default: --long-len)")
    ap.add_argument("--ctx", type=int, default=4096, help="kvctx: tokens of context per sequence")
    ap.add_argument("--ctx-batch", type=int, default=64, help="kvctx: batch")
    ap.add_argument("--host-batches", type=int, nargs="+", default=[64, 512], help="host: batches")
    ap.add_argument("--variants", default="default",
                    help="kiln: decode variants timed on the one engine, comma-separated, each parts of "
                         f"{'/'.join(VARIANT_PARTS)} joined by '+' (e.g. default,async,graph_argmax+async)")
    ap.add_argument("--quant-variants", default="default", help="fp8 and int4: decode variants, as --variants")
    ap.add_argument("--quant-batches", type=int, nargs="+", default=None, help="fp8: batches (default: --batches)")
    ap.add_argument("--time-limit", action="append", default=[], metavar="SECTION=SECONDS",
                    help=f"a section's time limit (repeatable; defaults {LIMITS})")
    ap.add_argument("--sections", default="correctness,kiln,hf,fp8,prefix",
                    help="comma-separated sections to run (default: correctness,kiln,hf,fp8,prefix; also "
                         "hfcompile, saturated, long, kvctx, int4)")
    args = ap.parse_args()
    args.variants = check_variants(args.variants.split(","))
    args.quant_variants = check_variants(args.quant_variants.split(","))
    limits = dict(LIMITS)
    for item in args.time_limit:
        name, _, v = item.partition("=")
        limits[name] = float(v)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TINY if args.tiny else LLAMA3_8B
    if args.tiny:
        args.output_len, args.input_len = min(args.output_len, 16), min(args.input_len, 16)
        args.batches = [b for b in args.batches if b <= 8] or [1, 4]
        args.sat_seqs, args.sat_prompts, args.sat_len = min(args.sat_seqs, 8), min(args.sat_prompts, 16), 16
        args.long_seqs, args.long_prompts, args.long_len = min(args.long_seqs, 4), min(args.long_prompts, 4), 24
        args.ctx, args.ctx_batch = min(args.ctx, 256), min(args.ctx_batch, 4)
    hf_out = args.hf_output_len or args.output_len
    hf_batches = args.hf_batches or args.batches
    dtype_name = "bf16" if device == "cuda" else "fp32"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    res: dict = {"env": {"device": device, "torch": torch.__version__, "argv": sys.argv[1:],
                         "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu"}}
    for mod in ("triton", "transformers"):
        try:
            res["env"][mod] = __import__(mod).__version__
        except Exception:
            res["env"][mod] = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "H200-llm.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "H200-llm.md").write_text(render(res, args))

    want = args.sections.split(",")
    unknown = sorted(set(want) - set(LIMITS))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {sorted(LIMITS)}")
    if "correctness" in want:
        checked = [v for v in dict.fromkeys(args.variants + args.quant_variants) if v != "default"]
        section(res, "correctness", correctness, device, checked, limit_s=limits["correctness"])
        save()
    hf = tensors = None
    if set(want) - {"correctness", "host", "sampler"}:
        log("making weights")
        hf, tensors = make_weights(cfg, device, dtype)
    kv_blocks = None if device == "cuda" else 256
    cache: dict = {}

    def fp8(weights: bool = True):
        """(FP8 KV scales, FP8 weights or None), each made on first use and shared by the FP8 sections."""
        for key in ("scales", "weights") if weights else ("scales",):
            if key not in cache:
                t = time.perf_counter()
                cache[key] = fp8_assets(tensors, cfg, device, dtype_name, key == "weights")
                log(f"FP8 {key} made in {time.perf_counter() - t:.1f} s")
        return cache["scales"], cache.get("weights")

    max_b = max(args.batches)
    for name in want:
        limit = limits[name]
        if name in ("kiln", "kilnasync"):
            variants = args.variants + (["async"] if name == "kilnasync" and "async" not in args.variants else [])
            part: dict = {}
            section(res, "kiln", kiln_runs, tensors, cfg, device, dtype_name, args.batches, args.input_len,
                    args.output_len, "auto", None, None, max_b, kv_blocks, 0.85, None, variants, part,
                    limit_s=limit, partial=part)
        elif name == "hf":
            section(res, "hf", hf_runs, hf, cfg["vocab_size"], hf_batches, args.input_len, hf_out, limit_s=limit)
        elif name == "hfcompile":
            section(res, "hf_compiled", hf_runs, hf, cfg["vocab_size"], hf_batches, args.input_len, hf_out, True,
                    limit_s=limit)
        elif name == "fp8":
            part = {}
            qb = args.quant_batches or args.batches
            section(res, "kiln_fp8", lambda part=part, qb=qb: kiln_runs(
                tensors, cfg, device, dtype_name, qb, args.input_len, args.output_len, "fp8", "fp8", fp8()[0],
                max(qb), kv_blocks, quantized_weights=fp8()[1], variants=args.quant_variants, out=part),
                limit_s=limit, partial=part)
        elif name == "saturated":
            section(res, "saturated", saturated, tensors, cfg, device, dtype_name, args.sat_len, args.sat_len,
                    args.sat_seqs, args.sat_prompts, limit, fp8, limit_s=limit + 10)
        elif name == "long":
            section(res, "long", saturated, tensors, cfg, device, dtype_name, args.long_len,
                    args.long_out or args.long_len,
                    args.long_seqs, args.long_prompts, limit, fp8, limit_s=limit + 10)
        elif name == "kvctx":
            part = {}
            section(res, "kvctx", kv_context, tensors, cfg, device, dtype_name, args.ctx, args.ctx_batch, fp8, part,
                    limit_s=limit, partial=part)
        elif name == "int4":  # batch 1 only: above GEMV_MAX_M rows INT4 still dequantizes its weights each step
            part = {}
            section(res, "kiln_int4", lambda part=part: kiln_runs(
                tensors, cfg, device, dtype_name, [1], args.input_len, args.output_len, "auto", "int4-awq", None,
                1, kv_blocks, quantized_weights=int4_weights(tensors, cfg, device, dtype_name),
                variants=args.quant_variants, out=part), limit_s=limit, partial=part)
        elif name == "sampler":
            section(res, "sampler", sampler_cost, device, cfg["vocab_size"], limit_s=limit)
        elif name == "host":
            section(res, "host", host_overhead, args.host_batches, limit_s=limit)
        elif name == "prefix":
            section(res, "prefix_caching", prefix_caching, tensors, cfg, device, dtype_name,
                    1024 if not args.tiny else 64, 32, 64 if not args.tiny else 8, limit_s=limit)
        save()
        if name in ("hf", "hfcompile") and not {"hf", "hfcompile"} & set(want[want.index(name) + 1:]):
            hf = None  # the HF model's own copies (not the shared weights) go
            release()
    log(f"done; wrote {out / 'H200-llm.md'}")
    print(render(res, args))


if __name__ == "__main__":
    main()
