"""One batch-1 decode step of the Llama-3-8B shape on the GPU: its CUDA graph's time with and without the decode
fusions, and where the time goes kernel by kernel.

The model is kiln.llm.model.DecoderModel over random weights made on the device (BF16; FP8 per output channel;
INT4 groups of 128 without AWQ's search, which does not change the kernels), the LM head in BF16, the matrices
wrapped as the engine wraps them (quantize.use_decode_gemv). One sequence of --ctx tokens decodes its next
token over a paged cache (BF16 KV, or FP8 KV with scales and a key offset as bench/llm.py's FP8 run has); the
step (forward, LM head, argmax) is captured in a CUDA graph with max_seq_len = --max-len, as the engine's graphs
are (its max_model_len), and replayed.

Variants: "unfused" (RoPE, the cache write and attention apart, the attention in one pass), "rope_cache"
(kernels/rope_cache.py, then attention), "fused" (RoPE, the cache write and attention in
kernels/decode_attention.py, with the engine's context slices for --max-len), "fused_1_slice" and
"fused_3_slices" (one pass; 3 slices and the merge kernel), "fused_3_merged" (3 slices merged in the attention
kernel by the last to finish), "fused_act_down" (fused, and SiLU(gate) * up inside the down projection's GEMV),
"fused_prefetch_8mb" / "_24mb" (fused, and that much of each next matrix asked into L2 before the small kernels
between two GEMVs: kernels/l2_prefetch.py), "fused_argmax" (fused, the greedy token by kernels/argmax.py instead of
torch.argmax).
Their logits are compared with the unfused step's: equal bit for bit where the context is sliced alike (the
unfused attention takes the engine's slices too).
`--profile` lists one fused replay's kernels (torch.profiler) summed by name: what the step's time is made of.

    python bench/decode_step.py [--weights bf16,fp8,int4] [--ctx 256] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.llm import quantize
from kiln.llm.attention import AttentionMetadata, LayerCache
from kiln.llm.config import ModelConfig
from kiln.llm.model import DecoderModel, expected_shapes

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False, torch_dtype="bfloat16")
VARIANTS = ("unfused", "rope_cache", "fused", "fused_1_slice", "fused_3_slices", "fused_3_merged", "fused_act_down",
            "fused_prefetch_8mb", "fused_prefetch_24mb", "fused_argmax")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:5.1f}s] {msg}", flush=True)


def make_model(cfg: ModelConfig, weights: str, dev) -> DecoderModel:
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            tensors[name] = 1 + 0.1 * torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
        else:
            tensors[name] = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    model = DecoderModel(cfg, tensors, torch.bfloat16, dev)
    del tensors
    if weights == "fp8":
        quantize.quantize_model(model, "fp8")
    elif weights == "int4":
        for key, w in quantize.linear_weights(model).items():
            packed, scale, zero = quantize.quantize_int4(w)
            quantize.set_linear_weight(model, key, quantize.QuantizedWeight(
                packed, method="int4-awq", scale=scale, in_features=w.shape[1], zero=zero))
    torch.cuda.empty_cache()
    chosen = quantize.use_decode_gemv(model)
    log(f"{weights} model made; BF16 GEMV rows by matrix: { {k: v for k, v in chosen.items() if 'layers.0.' in k or k == 'lm_head'} }")
    return model


def make_step(model: DecoderModel, weights: str, ctx: int, max_len: int, dev):
    """The captured-graph's step function and its static inputs: one sequence at position ctx."""
    cfg = model.cfg
    bs = 16
    blocks = -(-max_len // bs)
    fp8_kv = weights == "fp8"
    kv_dtype = torch.float8_e4m3fn if fp8_kv else torch.bfloat16
    shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    g = torch.Generator(device=dev).manual_seed(1)
    caches = []
    for _ in range(cfg.num_layers):
        k = torch.randn(shape, device=dev, generator=g).to(kv_dtype)
        v = torch.randn(shape, device=dev, generator=g).to(kv_dtype)
        if fp8_kv:
            ones = torch.full((cfg.num_kv_heads,), 0.01, device=dev)
            caches.append(LayerCache(k, v, ones, ones.clone(), torch.zeros(cfg.num_kv_heads, cfg.head_dim, device=dev)))
        else:
            caches.append(LayerCache(k, v))
    md = AttentionMetadata(torch.tensor([ctx], device=dev), torch.tensor([0, 1], dtype=torch.int32, device=dev),
                           torch.tensor([ctx + 1], dtype=torch.int32, device=dev),
                           torch.arange(blocks, dtype=torch.int32, device=dev)[None], 1, max_len)
    ids = torch.tensor([min(1234, cfg.vocab_size - 1)], device=dev)
    pos = torch.tensor([ctx], device=dev)

    def step():
        logits = model.compute_logits(model.forward(ids, pos, md, caches))
        if getattr(model, "bench_argmax", False):
            from kiln.kernels.argmax import argmax_rows

            return logits, argmax_rows(logits)
        return logits, logits.argmax(dim=-1)

    return step


def graph_of(step):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles and picks tiles outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def replay_ms(graph, iters: int = 30) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def profile(graph, label: str, top: int = 20) -> None:
    """Kernels of one replay summed by name (GPU microseconds a step, launches a step). A kernel launched as a
    programmatic dependent starts before the one it follows has ended and waits: its time includes that wait."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    reps = 3
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in p.events():
        us = e.time_range.elapsed_us() if e.device_type == torch.autograd.DeviceType.CUDA else 0
        if us > 0:
            r = rows.setdefault(e.name[:70], [0, 0.0])
            r[0] += 1
            r[1] += us
    total = sum(v[1] for v in rows.values()) / reps
    n = sum(v[0] for v in rows.values()) / reps
    log(f"{label} profile: {n:.0f} kernels, {total:.0f} us of kernel time a step (gaps not counted)")
    for name, (cnt, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {us / reps:8.1f} us  {cnt / reps:5.0f}x  {name}", flush=True)


def attention_splits(cfg: ModelConfig, ctx: int, dev, splits=(1, 2, 3, 4)) -> None:
    """The decode attention kernel alone at batch 1 (32 layers' caches one after another in a CUDA graph), for
    context slices of 1 (the engine's choice at max_seq_len 400) to 4 with the merge kernel."""
    from kiln.kernels import paged_attention as pa

    bs, layers = 16, 32
    blocks = -(-(ctx + 1) // bs)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    lens = torch.tensor([ctx + 1], dtype=torch.int32, device=dev)
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        caches = [(torch.randn(shape, device=dev).to(kv), torch.randn(shape, device=dev).to(kv)) for _ in range(layers)]
        sc = torch.full((cfg.num_kv_heads,), 0.01, device=dev) if kv != torch.bfloat16 else None
        cells = []
        want = None
        for n in splits:
            def run(n=n):
                return [pa.paged_attention(q, k, v, qsl, lens, table, 1, 400, 0.088, k_scale=sc, v_scale=sc,
                                           num_splits=n) for k, v in caches]
            out = run()[0]
            want = out if want is None else want
            graph, _ = graph_of(run)
            us = replay_ms(graph, 10) * 1000 / layers
            cells.append(f"{n} slice{'s' if n > 1 else ''} {us:.2f} us (max diff {(out.float() - want.float()).abs().max():.1e})")
            del graph
        log(f"decode attention, batch 1, {ctx + 1} keys, {str(kv).removeprefix('torch.')} KV, a layer: " + "; ".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="bf16,fp8,int4")
    ap.add_argument("--ctx", type=int, default=256, help="tokens already in the cache (the step writes one more)")
    ap.add_argument("--max-len", type=int, default=400, help="the graphs' max_seq_len (bench/llm.py's engine: 400)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated, of " + ", ".join(VARIANTS) + " (default: all "
                    "for the first --weights, unfused, fused, fused_act_down and fused_prefetch_8mb for the others)")
    ap.add_argument("--attention", action="store_true", help="also time the decode attention kernel by context slices")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    log(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    cfg = ModelConfig.from_hf(dict(LLAMA3_8B, num_hidden_layers=a.layers))
    for weights in a.weights.split(","):
        try:
            model = make_model(cfg, weights, dev)
            step = make_step(model, weights, a.ctx, a.max_len, dev)
            results = {}
            if a.variants:
                variants = ("unfused",) + tuple(v for v in a.variants.split(",") if v != "unfused")
            elif weights == a.weights.split(",")[0]:
                variants = VARIANTS
            else:
                variants = ("unfused", "fused", "fused_act_down", "fused_prefetch_8mb")
            for variant in variants:
                model.fuse_rope_cache = variant != "unfused"
                model.fuse_decode_attention = variant.startswith("fused")
                model.decode_attention_splits = {"fused_1_slice": 1, "fused_3_slices": 3, "fused_3_merged": 3}.get(variant)
                model.decode_attention_merge = variant == "fused_3_merged"
                model.fuse_act_down = variant == "fused_act_down"
                model.l2_prefetch_bytes = {"fused_prefetch_8mb": 8 << 20, "fused_prefetch_24mb": 24 << 20}.get(variant, 0)
                model.bench_argmax = variant == "fused_argmax"
                graph, out = graph_of(step)
                ms = replay_ms(graph)
                results[variant] = (ms, out[0].clone(), int(out[1]))
                log(f"{weights} {variant}: graph {ms * 1000:.0f} us a step ({1000 / ms:.1f} tok/s at batch 1), "
                    f"token {int(out[1])}")
                if a.profile and variant in ("unfused", "fused"):
                    profile(graph, f"{weights} {variant}")
                del graph
            if weights == "int4":  # what choose_int4_config timed at M = 1 for each projection (it picks the fastest)
                from kiln.kernels import fp8_gemv as fg

                for name in ("qkv", "o", "gate_up", "down"):
                    w = model.layers[0][name]
                    n, k = w.out_features, w.in_features
                    timed = sorted((us, c.name) for c, us in fg.tile_timings(n, k, torch.bfloat16, dev, "int4").items())
                    log(f"int4 {name} tiles timed: " + "; ".join(f"{nm} {us:.1f} us" for us, nm in timed))
            base = results["unfused"]
            for variant in variants[1:]:
                r = results[variant]
                same = torch.equal(base[1], r[1])
                log(f"{weights}: {variant} {r[0] * 1000:.0f} us against unfused {base[0] * 1000:.0f} us "
                    f"({(base[0] - r[0]) * 1000:.0f} us saved); logits equal to unfused bit for bit: {same}"
                    + ("" if same else f" (max diff {(base[1] - r[1]).abs().max():.3g})"))
        except Exception as e:  # noqa: BLE001 - the next weights still run
            import traceback

            traceback.print_exc()
            log(f"{weights}: FAILED {type(e).__name__}: {e}")
        model = step = None
        torch.cuda.empty_cache()
        if a.attention and weights == a.weights.split(",")[0]:
            try:
                attention_splits(cfg, a.ctx, dev)
            except Exception as e:  # noqa: BLE001
                log(f"attention: FAILED {type(e).__name__}: {e}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
