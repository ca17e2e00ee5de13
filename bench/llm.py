"""Kiln-LLM end to end on the GPU: a Llama-3-8B-shaped model with random BF16 weights made on the device
(nothing downloaded), 128 prompt tokens in and 256 out at batch 1 and 64, against Hugging Face transformers'
`generate` (eager, greedy) on the same weights in the same run, with the HBM roofline.

Sections, each guarded so one failing still leaves the others' results:
  correctness  a tiny Llama (tests/llm/tiny.py) on CUDA: Kiln's greedy tokens (Triton kernels, CUDA graphs)
               against transformers' generate on the same weights (FP32).
  kiln         the 8B shape, BF16 weights and KV: output tok/s, TTFT, TPOT, e2e p50/p99, decode step time,
               and the roofline (weight bytes + KV bytes a step over the measured device-copy bandwidth).
  hf           transformers' generate, eager, same prompts, same lengths (exactly 256 new tokens each).
  fp8          optional, time permitting: FP8 weights (kiln.llm.quantize) and an FP8 KV cache with scales
               calibrated on random tokens (keys centred).
  int4         on request (--sections ...,int4): INT4 weights (groups of 128) at batch 1.
Random weights make the text meaningless; the timing is what it is for any weights of this shape.

    python bench/llm.py --out DIR            (GPU; writes DIR/H200-llm.md and .json)
    python bench/llm.py --tiny --out DIR     (a tiny config, any device: checks the script itself)
    python bench/llm.py --sections kiln,fp8 --out DIR   (only Kiln's BF16 and FP8 runs: about a minute)
"""

from __future__ import annotations

import argparse
import gc
import json
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


def section(results: dict, name: str, fn, *args):
    log(f"--- {name}")
    try:
        results[name] = fn(*args)
    except Exception as e:
        results[name] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
    log(f"{name}: {json.dumps(results[name], default=str)[:1500]}")
    return results[name]


class _NoTokenizer:
    """The random model has no tokenizer: prompts are token ids and the text is not looked at."""

    eos_token_ids: set = set()
    bos_token_id = None
    vocab_size = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""

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


def correctness(device: str) -> dict:
    """Tiny Llama: Kiln on `device` against transformers' generate (FP32), token for token."""
    from tests.llm.tiny import load_hf_reference, make_tiny_llama

    path = make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", heads=6, kv_heads=2, hidden=96)
    ref = load_hf_reference(path).to(device)
    from kiln.llm import LLM, SamplingParams

    llm = LLM(path, device=device, max_model_len=256, max_num_seqs=8, num_kv_blocks=256)
    prompts = ["Hello world", "The potter lit the fire and", "Once upon a time there was a small kiln", "0 1 2"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    equal = []
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids], device=device)
        with torch.no_grad():
            g = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        equal.append(g[0, ids.shape[1]:].tolist() == o.outputs[0].token_ids)
    r = llm.llm_engine.runner
    s = llm.llm_engine.stats()
    del llm, ref
    gc.collect()
    return {"prompts": len(prompts), "tokens_equal_to_hf": equal, "cuda_graphs": sorted(r.graphs),
            "cuda_graph_error": r.graph_error, "blocks_free_after": s["kv_blocks_free"] == s["kv_blocks_total"]}


def kiln_runs(tensors, cfg, device, dtype_name, batches, in_len, out_len, kv="auto", quant=None,
              kv_scales=None, max_seq=64, num_kv_blocks=None, util=0.85, quantized_weights=None) -> dict:
    t = time.perf_counter()
    eng = LLMEngine(cfg, tensors, _NoTokenizer(), dtype=dtype_name, device=device, kv_cache_dtype=kv,
                    max_num_seqs=max_seq, max_num_batched_tokens=8192, max_model_len=in_len + out_len + 16,
                    num_kv_blocks=num_kv_blocks, gpu_memory_utilization=util,
                    quantization=None if quantized_weights else quant, kv_scales=kv_scales,
                    quantized_weights=quantized_weights)
    out = {"engine_setup_s": time.perf_counter() - t, "kv_blocks": eng.block_manager.num_blocks,
           "kv_cache_dtype": str(eng.kv_cache_dtype), "weights": quant or dtype_name,
           "kv_tokens_capacity": eng.block_manager.num_blocks * eng.block_manager.block_size,
           "cuda_graphs": sorted(eng.runner.graphs), "cuda_graph_error": eng.runner.graph_error}
    bw = bm.copy_bandwidth(eng.device) if eng.device.type == "cuda" else None
    out["copy_bandwidth_GBs"] = bw / 1e9 if bw else None
    vocab = cfg["vocab_size"]
    for b in batches:
        prompts = bm.random_prompts(vocab, [in_len] * b, seed=b)
        # Warm-up at the measured shapes (Triton specializes kernels on argument values, e.g. a sequence count
        # divisible by 16, so a smaller warm-up could leave a compile inside the first timed prefill), with other
        # prompts than the timed ones, which must not find their prefixes cached.
        bm.run_requests(eng, bm.random_prompts(vocab, [in_len] * b, seed=1000 + b), [2] * b)
        with HostPhases(eng) as phases:
            r = bm.run_requests(eng, prompts, [out_len] * b)
        r["host_phases_us_per_step"] = phases.per_step(r["steps"], r["wall_s"])
        if bw:
            rf = bm.roofline(eng, b, in_len + out_len / 2, bw)
            r.update({k: rf[k] for k in ("weight_bytes", "kv_bytes_per_step", "roofline_step_ms", "roofline_tok_s")})
            r["roofline_fraction"] = r["output_tok_s"] / rf["roofline_tok_s"]
            if r.get("decode_step_ms"):
                r["decode_step_fraction_of_roofline"] = rf["roofline_step_ms"] / r["decode_step_ms"]
        if eng.device.type == "cuda" and eng.runner.graphs:
            r["graph_replay_ms"] = replay_ms(eng, b)
            if r.get("decode_step_ms"):
                r["host_fraction_of_step"] = 1 - r["graph_replay_ms"] / r["decode_step_ms"]
        out[f"batch{b}"] = r
        log(f"kiln {quant or dtype_name} kv={kv} batch {b}: {r['output_tok_s']:.1f} tok/s, "
            f"decode step {r.get('decode_step_ms') or 0:.2f} ms, graph {r.get('graph_replay_ms') or 0:.2f} ms, "
            f"host share {100 * (r.get('host_fraction_of_step') or 0):.0f}%, roofline "
            f"{r.get('roofline_tok_s') or 0:.1f}; host phases us/step {r['host_phases_us_per_step']}")
    del eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


class HostPhases:
    """Wall time of a run's scheduler, input preparation, forward launch (replay: host-to-device copies and the
    graph launch) and sampler (argmax and the wait for the GPU) calls; the engine's own bookkeeping is the rest."""

    def __init__(self, eng):
        self.eng, self.totals = eng, {}
        self.targets = [(eng.scheduler, "schedule"), (eng.runner, "prepare"), (eng.runner, "run_inputs"),
                        (eng.runner, "sampler")]

    def __enter__(self):
        self.saved = []
        for obj, name in self.targets:
            fn = getattr(obj, name)
            self.saved.append((obj, name, vars(obj).get(name)))  # an instance attribute (the sampler) or None
            self.totals[name] = 0.0

            def timed(*a, _fn=fn, _name=name, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.totals[_name] += time.perf_counter() - t

            setattr(obj, name, timed)
        return self

    def __exit__(self, *exc):
        for obj, name, own in self.saved:
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)  # the class's method shows through again
        return False

    def per_step(self, steps: int, wall_s: float) -> dict:
        out = {k: round(v / steps * 1e6, 1) for k, v in self.totals.items()}
        out["engine_rest"] = round(wall_s / steps * 1e6 - sum(out.values()), 1)
        return out


def replay_ms(eng, b: int, iters: int = 20) -> float:
    """GPU time of one decode step's graph at batch b (static buffers as the last step left them)."""
    run = eng.runner.graphs[eng.runner._bucket(b)]
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def prefix_caching(tensors, cfg, device, dtype_name, prefix_len=1024, suffix_len=32, n=64) -> dict:
    """64 requests sharing a prefix_len-token prefix (already cached by one earlier request), one output token
    each: TTFT with prefix caching on and off."""
    out = {}
    vocab = cfg["vocab_size"]
    prefix = bm.random_prompts(vocab, [prefix_len], seed=5)[0]
    prompts = [prefix + p for p in bm.random_prompts(vocab, [suffix_len] * n, seed=6)]
    for caching in (True, False):
        eng = LLMEngine(cfg, tensors, _NoTokenizer(), dtype=dtype_name, device=device, max_num_seqs=n,
                        max_num_batched_tokens=8192, max_model_len=prefix_len + suffix_len + 16,
                        num_kv_blocks=(n + 2) * ((prefix_len + suffix_len) // 16 + 2),
                        enable_prefix_caching=caching, enforce_eager=True)
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


def hf_runs(hf, vocab, batches, in_len, out_len) -> dict:
    if hf is None:
        return {"error": "transformers model unavailable"}
    out = {}
    for b in batches:
        prompts = bm.random_prompts(vocab, [in_len] * b, seed=b)
        bm.hf_generate_baseline(hf, prompts[:1], 4, 1)  # warm-up
        out[f"batch{b}"] = r = bm.hf_generate_baseline(hf, prompts, out_len, b)
        log(f"hf batch {b}: {r['output_tok_s']:.1f} tok/s, {r['step_ms']:.2f} ms a step")
    return out


def fp8_kv_scales(tensors, cfg, device, dtype_name, vocab):
    from kiln.llm.calibrate import calibrate_kv_scales
    from kiln.llm.config import ModelConfig
    from kiln.llm.engine import DTYPES
    from kiln.llm.model import DecoderModel

    model = DecoderModel(ModelConfig.from_hf(cfg), tensors, DTYPES[dtype_name], torch.device(device))
    ids = bm.random_prompts(vocab, [1024], seed=99)[0]
    scales = calibrate_kv_scales(model, ids, "fp8", window=512, centre_keys=True)
    del model
    return scales


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


def render(res: dict, args) -> str:
    env = res.get("env", {})
    lines = [f"# Kiln-LLM on {env.get('gpu', '?')}: Llama-3-8B shape, random BF16 weights"
             if not args.tiny else "# Kiln-LLM bench, tiny config (script check)", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
             f"{args.input_len} prompt tokens in, {args.output_len} out (greedy, exactly that many). "
             "Command: `python bench/llm.py --out DIR`.", ""]
    c = res.get("correctness", {})
    lines += ["## Correctness (tiny Llama, 6 heads over 2 KV heads, FP32, on the device)", "",
              f"- greedy tokens equal to transformers' generate: {c.get('tokens_equal_to_hf', c.get('error'))}",
              f"- CUDA graphs captured at batch sizes {c.get('cuda_graphs')} (error: {c.get('cuda_graph_error')});"
              f" all KV blocks free after: {c.get('blocks_free_after')}", ""]
    hf = res.get("hf", {})
    lines += ["## Throughput and latency", "",
              "| run | batch | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | e2e p50 / p99 ms | "
              "decode step ms |"
              " roofline tok/s | % of roofline | vs HF |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    for name in ("kiln", "kiln_fp8", "kiln_int4"):
        run = res.get(name)
        if not isinstance(run, dict) or "error" in run:
            if run:
                lines.append(f"| {name} | - | failed: {run.get('error')} | | | | | | | |")
            continue
        for b in args.batches:
            r = run.get(f"batch{b}")
            if not r:
                continue
            h = hf.get(f"batch{b}", {}) if isinstance(hf, dict) else {}
            vs = f"{r['output_tok_s'] / h['output_tok_s']:.1f}x" if h.get("output_tok_s") else "-"
            label = f"Kiln {run['weights']} weights, KV {run['kv_cache_dtype'].replace('torch.', '')}"
            lines.append(
                f"| {label} | {b} | {r['output_tok_s']:.1f} | {f(r['ttft_ms_p50'])} / {f(r['ttft_ms_p99'])} | "
                f"{f(r['tpot_ms_p50'], '.2f')} / {f(r['tpot_ms_p99'], '.2f')} | {f(r['e2e_ms_p50'])} / "
                f"{f(r['e2e_ms_p99'])} | {f(r.get('decode_step_ms'), '.2f')} | {f(r.get('roofline_tok_s'))} | "
                f"{f(100 * r['roofline_fraction'] if r.get('roofline_fraction') else None)} | {vs} |")
    if isinstance(hf, dict):
        for b in args.batches:
            h = hf.get(f"batch{b}")
            if h:
                lines.append(f"| HF transformers generate (eager) | {b} | {h['output_tok_s']:.1f} | | "
                             f"{h['step_ms']:.2f} (mean step) | {h['wall_s'] * 1000:.0f} (whole batch) | | | | |")
        if "error" in hf:
            lines.append(f"| HF transformers generate | - | failed: {hf['error']} | | | | | | | |")
    k = res.get("kiln", {})
    if isinstance(k, dict) and "error" not in k:
        lines += ["", f"KV pool: {k.get('kv_blocks')} blocks of 16 tokens ({k.get('kv_tokens_capacity')} tokens) at "
                  f"gpu_memory_utilization 0.85 with the HF model also resident; device-copy bandwidth "
                  f"{f(k.get('copy_bandwidth_GBs'), '.0f')} GB/s (read + write of a 1 GiB copy). Engine setup "
                  f"(weights fused, KV allocated, CUDA graphs captured) {f(k.get('engine_setup_s'))} s."]
    for name in ("kiln", "kiln_fp8", "kiln_int4"):
        run = res.get(name)
        if isinstance(run, dict) and "error" not in run:
            for b in args.batches:
                r = run.get(f"batch{b}", {})
                if r.get("graph_replay_ms"):
                    lines.append(f"- {name} batch {b}: decode step {r['decode_step_ms']:.2f} ms wall, its CUDA graph "
                                 f"{r['graph_replay_ms']:.2f} ms on the GPU: host share "
                                 f"{100 * r['host_fraction_of_step']:.0f}% of the step; host phases, us a step "
                                 f"(sampler includes the wait for the GPU): {r.get('host_phases_us_per_step')}")
    pc = res.get("prefix_caching")
    if isinstance(pc, dict):
        if "error" in pc:
            lines.append(f"- prefix caching: {pc['error']}")
        else:
            lines.append(f"- prefix caching, {pc['requests']} requests sharing a cached {pc['prefix_len']}-token "
                         f"prefix (+{pc['suffix_len']} own tokens), one "
                         f"output token: TTFT p50 {pc['on']['ttft_ms_p50']:.1f} ms with caching, "
                         f"{pc['off']['ttft_ms_p50']:.1f} ms without ({pc['ttft_p50_speedup']:.1f}x); hits "
                         f"{pc['on']['prefix_cache_hits']} of {pc['on']['prefix_cache_queries']} prompt tokens")
    lines += ["", "Roofline: a decode step reads every weight once plus each sequence's K/V (average context "
              "= prompt + half the output); bound = batch / ((weight bytes + KV bytes) / bandwidth). "
              "TTFT/e2e are measured from submitting all requests at once; TPOT = (last - first token) / "
              "(tokens - 1).", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for H200-llm.md / .json")
    ap.add_argument("--tiny", action="store_true", help="tiny config (checks the script on any device)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--budget-s", type=float, default=210, help="skip optional sections past this time")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--sections", default="correctness,kiln,hf,fp8,prefix",
                    help="comma-separated sections to run (default: correctness,kiln,hf,fp8,prefix; also int4)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TINY if args.tiny else LLAMA3_8B
    if args.tiny:
        args.output_len, args.input_len = min(args.output_len, 16), min(args.input_len, 16)
        args.batches = [b for b in args.batches if b <= 8] or [1, 4]
    dtype_name = "bf16" if device == "cuda" else "fp32"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    res: dict = {"env": {"device": device, "torch": torch.__version__,
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

    want = set(args.sections.split(","))
    if "fp8" not in want:
        args.no_fp8 = True
    if "correctness" in want:
        section(res, "correctness", correctness, device)
        save()
    log("making weights")
    hf, tensors = make_weights(cfg, device, dtype)
    kv_blocks = None if device == "cuda" else 256
    if "kiln" in want:
        section(res, "kiln", kiln_runs, tensors, cfg, device, dtype_name, args.batches, args.input_len,
                args.output_len, "auto", None, None, max(args.batches), kv_blocks)
        save()
    if "hf" in want:
        section(res, "hf", hf_runs, hf, cfg["vocab_size"], args.batches, args.input_len, args.output_len)
        save()
    del hf
    if not args.no_fp8 and time.perf_counter() - T0 < args.budget_s - 40:
        def fp8_run():
            scales = fp8_kv_scales(tensors, cfg, device, dtype_name, cfg["vocab_size"])
            return kiln_runs(tensors, cfg, device, dtype_name, args.batches, args.input_len, args.output_len,
                             "fp8", "fp8", scales, max(args.batches), kv_blocks)

        section(res, "kiln_fp8", fp8_run)
    else:
        res["kiln_fp8"] = {"error": "skipped (time budget)"}
    save()
    if "int4" in want:  # batch 1 only: above GEMV_MAX_M rows INT4 still dequantizes its weights each step
        section(res, "kiln_int4", lambda: kiln_runs(
            tensors, cfg, device, dtype_name, [1], args.input_len, args.output_len, "auto", "int4-awq", None,
            max(args.batches), kv_blocks, quantized_weights=int4_weights(tensors, cfg, device, dtype_name)))
        save()
    if "prefix" in want and time.perf_counter() - T0 < args.budget_s - 25:
        prefix_len = 1024 if not args.tiny else 64
        section(res, "prefix_caching", prefix_caching, tensors, cfg, device, dtype_name, prefix_len)
    else:
        res["prefix_caching"] = {"error": "skipped (time budget)"}
    save()
    log(f"done; wrote {out / 'H200-llm.md'}")
    print(render(res, args))


if __name__ == "__main__":
    main()
