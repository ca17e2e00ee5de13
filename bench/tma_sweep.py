"""The TMA GEMM (kiln/kernels/tma_gemm.py) against cuBLAS(Lt) and gemm.py, each configuration alone, at
BERT-base's and ResNet-50's batch-32 GEMM shapes (plus BERT's batch-1 FFN1), FP16, INT8 and FP8.

`--int8-engine` instead times ResNet-50's 1x1 convolutions as an INT8 engine runs them: 8-bit x, 8-bit output
and, for a block's last convolution, an 8-bit residual, with each candidate's bandwidth against the bytes
it must move (8-bit x, residual and output; the weights), to show how far these memory-bound layers are from
their floor.

Times are kiln.tactics.timer.median_ms (CUDA-graph replays, as the builder's selector times tactics), us;
8-bit operands are quantized as a calibrated engine holds them (per-channel INT8 / per-tensor FP8 weights,
K-major). The INT8/FP8 TMA outputs are compared with gemm.py's (the same integer sums and epilogue).

    python bench/tma_sweep.py [SHAPE NAME PREFIX...] > bench/results/H200-tma-sweep.log        (GPU)
    python bench/tma_sweep.py --int8-engine [layer1 ...] > bench/results/H200-int8-1x1-sweep.log
    python bench/tma_sweep.py --latency [layer1 ...] > bench/results/H200-int8-1x1-latency.log
    python bench/tma_sweep.py --cold [bert ...] > bench/results/H200-int8-cold-l2.log
    python bench/tma_sweep.py --one-k [layer1 ...] > bench/results/H200-int8-one-k.log

`--latency` times the small-K 8-bit tiles of `--int8-engine` at one to four programs per SM: how much of these
layers' distance from their floor is latency that more programs hide. Its log H200-int8-1x1-latency.log also
has a residual loaded by pointer loads issued before the K loop ("z early", a tma_gemm.gemm option since removed:
slower everywhere, 2-10x with 4-stage pipelines).

`--one-k` times ResNet-50's 8-bit 1x1 layers whose K fits one tile (K = 64 and 128), each of the builder's 8-bit
tiles with the kernel's nested loop (tiles, then K; the residual waited for tile by tile) and with its single loop
over tiles (tma_gemm.gemm's single_loop: every load, the residual's too, issued tiles ahead), at two and three
stages too, and checks the outputs are equal.

`--cold` times every 8-bit TMA tile the builder offers on the BERT and ResNet-50 shapes three ways: with the
same operands every call, so they stay in L2 ("warm", as the builder times float layers); after
an L2Reset keeping x (weights from memory, x from L2: as the builder times 8-bit layers now and an engine runs
them, tactics/timer.py); and after a read of twice L2's size (every operand from memory).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.ir.graph import Node  # noqa: E402
from kiln.kernels import gemm, tma_gemm  # noqa: E402
from kiln.kernels.gemm import TileConfig  # noqa: E402
from kiln.tactics.library import fp8_scaled_mm  # noqa: E402
from kiln.tactics.timer import L2Reset, median_ms  # noqa: E402

F16 = [TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 8, 4), TileConfig(128, 128, 64, 4, 4),
       TileConfig(64, 128, 64, 4, 4), TileConfig(256, 128, 64, 8, 3), TileConfig(128, 64, 64, 4, 4)]
Q8 = [TileConfig(128, 256, 128, 8, 3), TileConfig(128, 128, 128, 8, 4), TileConfig(128, 128, 128, 4, 4),
      TileConfig(64, 128, 128, 4, 4), TileConfig(256, 128, 128, 8, 3), TileConfig(128, 64, 128, 4, 4)]
POINTER = gemm.TileConfig(128, 128, 64, 8, 3)  # gemm.py's level-3 8-bit tile
# (name, M, K, N, activation)
SHAPES = [("bert qkv", 4096, 768, 2304, ""), ("bert ffn1", 4096, 768, 3072, "GeluErf"),
          ("bert ffn2", 4096, 3072, 768, ""), ("bert b1 ffn1", 128, 768, 3072, "GeluErf"),
          ("r50 l1 1x1 64->256", 100352, 64, 256, ""), ("r50 l1 1x1 256->64", 100352, 256, 64, "Relu"),
          ("r50 l2 1x1 512->128", 25088, 512, 128, "Relu"), ("r50 l3 1x1 256->1024", 6272, 256, 1024, ""),
          ("r50 l4 1x1 2048->512", 1568, 2048, 512, "Relu")]


def us(fn) -> str:
    try:
        return f"{median_ms(fn, runs=20) * 1000:.1f}"
    except Exception as e:  # a configuration that does not compile or run here
        return f"fail {type(e).__name__}: {str(e)[:150]}"


def sweep_float(M, K, N, act):
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = torch.randn(K, N, device="cuda", dtype=torch.float16) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    ref = gemm.reference(x, w, b, act).float()
    rows = [f"cublas addmm {us(lambda: torch.addmm(b, x, w))}"]
    for c in F16:
        err = (tma_gemm.gemm(x, w, b, act, config=c).float() - ref).abs().max().item()
        rows.append(f"tma {c.name} {us(lambda c=c: tma_gemm.gemm(x, w, b, act, config=c))} (err {err:.1e})")
    return x, w, b, rows


def sweep_8bit(x, w, b, act, qtype):
    wdtype, qmax = (torch.int8, 127.0) if qtype == "int8" else (torch.float8_e4m3fn, 448.0)
    sw = w.float().abs().amax(0) / qmax if qtype == "int8" else (w.float().abs().amax() / qmax).reshape(1)
    sx = torch.tensor(4.0 / qmax, device="cuda")

    def q(t):
        t = t.clamp(-qmax, qmax)
        return (t.round() if qtype == "int8" else t).to(wdtype)

    x8, w8 = q(x.float() / sx), q(w.float() / sw).t().contiguous().t()  # K-major weights
    kw = dict(qtype=qtype, x_scale=sx, w_scale=sw, out_dtype=torch.float16)
    ref = gemm.gemm(x8, w8, b, act, config=POINTER, **kw).float()
    rows = [f"gemm.py {POINTER.name} {us(lambda: gemm.gemm(x8, w8, b, act, config=POINTER, **kw))}"]
    if qtype == "fp8":
        node = Node("QGemm", [], [], {"qtype": qtype, "x_quantized": 1, "float_type": "float16"}, domain="kiln")
        rows.append(f"cublaslt scaled_mm (bias only) {us(lambda: fp8_scaled_mm(node, x8, w8, sx, sw, b))}")
    for c in Q8:
        err = (tma_gemm.gemm(x8, w8, b, act, config=c, **kw).float() - ref).abs().max().item()
        t = us(lambda c=c: tma_gemm.gemm(x8, w8, b, act, config=c, **kw))
        rows.append(f"tma {c.name} {t} (err vs gemm.py {err:.1e})")
    return rows


# ResNet-50's batch-32 1x1 convolutions in an INT8 engine: (name, M, K, N, 8-bit residual)
INT8_ENGINE_SHAPES = [("layer1.0 conv1 64->64", 100352, 64, 64, False),  # the block after the stem's pool
                      ("layer1 conv1 256->64", 100352, 256, 64, False),
                      ("layer1 conv3 64->256", 100352, 64, 256, True),
                      ("layer2 conv1 512->128", 25088, 512, 128, False),
                      ("layer2 conv3 128->512", 25088, 128, 512, True),
                      ("layer3 conv1 1024->256", 6272, 1024, 256, False),
                      ("layer3 conv3 256->1024", 6272, 256, 1024, True),
                      ("layer4 conv1 2048->512", 1568, 2048, 512, False),
                      ("layer4 conv3 512->2048", 1568, 512, 2048, True)]


# 8-bit tiles with K slices of 64 (ResNet's K = 64 layers read half a 128-wide slice as zeros) and short pipelines,
# whose small shared memory lets two programs share an SM
Q8_K64 = [TileConfig(128, 256, 64, 8, 2), TileConfig(128, 128, 64, 4, 2), TileConfig(128, 128, 64, 8, 2),
          TileConfig(64, 256, 64, 4, 2), TileConfig(64, 128, 64, 4, 2), TileConfig(128, 128, 64, 4, 4)]


LATENCY_TILES = [TileConfig(128, 128, 64, 4, 2), TileConfig(128, 128, 64, 4, 4), TileConfig(64, 128, 64, 4, 2),
                 TileConfig(64, 256, 64, 4, 2), TileConfig(128, 64, 128, 4, 4), TileConfig(64, 128, 128, 4, 2),
                 TileConfig(64, 64, 128, 4, 2),
                 # 64-wide K and N tiles: layer1.0's 64 -> 64 took 128x64x128, half its K tile zeros
                 TileConfig(128, 64, 64, 4, 3), TileConfig(64, 64, 64, 4, 2)]


def engine_operands(M, K, N, with_z, qtype, copy):
    """8-bit x, K-major w, bias and the gemm keywords of one 1x1 layer as an 8-bit engine runs it, and the bytes
    it must move."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x8 = torch.randint(-128, 128, (M, K), device="cuda", generator=g, dtype=torch.int8)
    w8 = torch.randint(-127, 128, (N, K), device="cuda", generator=g, dtype=torch.int8)
    z8 = torch.randint(-128, 128, (M, N), device="cuda", generator=g, dtype=torch.int8) if with_z else None
    if qtype == "fp8":  # random bytes would hold NaNs as E4M3
        x8, w8 = (x8.float() / 32).to(torch.float8_e4m3fn), (w8.float() / 32).to(torch.float8_e4m3fn)
        z8 = (z8.float() / 32).to(torch.float8_e4m3fn) if with_z else None
    w8 = w8.t()  # K-major [K, N]
    b = torch.randn(N, device="cuda").half()
    w_scale = torch.rand(N if qtype == "int8" else 1, device="cuda") * 1e-3
    kw = dict(qtype=qtype, x_scale=torch.tensor(0.02, device="cuda"), w_scale=w_scale,
              y_scale=torch.tensor(0.05, device="cuda"), z=z8,
              z_scale=torch.tensor(0.05, device="cuda") if with_z else None,
              q_scale=torch.tensor(0.03, device="cuda") if copy else None)
    moved = M * K + K * N + M * N * (1 + with_z + copy)  # bytes: x, w, output(s), residual
    return x8, w8, b, kw, moved


def rate(t, moved):
    try:
        return f"{float(t):7.1f} us {moved / float(t) / 1e3:6.0f} GB/s"
    except ValueError:
        return t


def sweep_int8_engine(M, K, N, with_z, qtype="int8", copy=False):
    """Every 8-bit candidate on one 1x1 layer as the engine runs it, with GB/s against its bytes: 8-bit x,
    output (and residual), with `copy` a second 8-bit output at another scale (a clipped block output's copy)."""
    x8, w8, b, kw, moved = engine_operands(M, K, N, with_z, qtype, copy)
    rows = [f"bytes {moved / 1e6:.1f} MB, floor at 4.3 TB/s {moved / 4.3e6:.1f} us"]
    for c in [POINTER] + [t for t, _ in gemm.QUANT_CONFIGS]:
        rows.append(f"gemm.py {c.name} {rate(us(lambda c=c: gemm.gemm(x8, w8, b, 'Relu', config=c, **kw)), moved)}")
    for c in Q8 + Q8_K64:
        for per_sm in (1, 2):
            t = us(lambda c=c, p=per_sm: tma_gemm.gemm(x8, w8, b, 'Relu', config=c, programs_per_sm=p, **kw))
            rows.append(f"tma {c.name} x{per_sm}/SM {rate(t, moved)}")
    return rows


def sweep_latency(M, K, N, with_z, qtype="int8"):
    """The small-K tiles at 1-4 programs per SM."""
    x8, w8, b, kw, moved = engine_operands(M, K, N, with_z, qtype, False)
    ref = tma_gemm.gemm(x8, w8, b, 'Relu', config=LATENCY_TILES[0], **kw)
    rows = [f"bytes {moved / 1e6:.1f} MB, floor at 4.3 TB/s {moved / 4.3e6:.1f} us"]
    for c in LATENCY_TILES:
        for per_sm in (1, 2, 3, 4):
            run = dict(kw, config=c, programs_per_sm=per_sm)
            same = torch.equal(tma_gemm.gemm(x8, w8, b, 'Relu', **run), ref)
            t = us(lambda run=run: tma_gemm.gemm(x8, w8, b, 'Relu', **run))
            rows.append(f"tma {c.name} x{per_sm}/SM {rate(t, moved)}{'' if same else ' DIFFERS'}")
    return rows


# (name, M, K, N, 8-bit residual): the layers whose K fits one 8-bit tile (BLOCK_K 64 or 128)
ONE_K_SHAPES = [("layer1 conv3 64->256", 100352, 64, 256, True), ("layer1 downsample 64->256", 100352, 64, 256, False),
                ("layer2 conv3 128->512", 25088, 128, 512, True)]


def sweep_one_k(M, K, N, with_z, qtype):
    """Each of the builder's 8-bit tiles whose BLOCK_K holds K, nested loop against single loop, at the default
    programs per SM (tma_gemm.resident_programs, which counts the single loop's prefetched residual tiles)."""
    x8, w8, b, kw, moved = engine_operands(M, K, N, with_z, qtype, False)
    rows = [f"bytes {moved / 1e6:.1f} MB, floor at 4.3 TB/s {moved / 4.3e6:.1f} us"]
    tiles = {t for t, _ in tma_gemm.QUANT_CONFIGS if t.block_k >= K}
    tiles |= {replace(t, num_stages=s) for t in set(tiles) for s in (2, 3)}
    for c in sorted(tiles, key=lambda t: t.name):
        times, outs = {}, {}
        for one_k in (False, True):
            times[one_k] = us(lambda c=c, k=one_k: tma_gemm.gemm(x8, w8, b, 'Relu', config=c, single_loop=k, **kw))
            try:
                outs[one_k] = tma_gemm.gemm(x8, w8, b, 'Relu', config=c, single_loop=one_k, **kw)
            except Exception:  # a configuration that does not compile or run here (its time says why)
                outs[one_k] = None
        same = outs[False] is not None and outs[True] is not None and torch.equal(outs[False], outs[True])
        single = tma_gemm.one_loop(c, K, 1, 1 if with_z else 0)
        rows.append(f"tma {c.name} nested {rate(times[False], moved)} | "
                    f"{'one loop' if single else 'nested (prefetch does not fit)'} {rate(times[True], moved)}"
                    f"{'' if same else ' DIFFERS'}")
    return rows


def sweep_cold(M, K, N, act):
    """Each 8-bit tile timed warm (the same operands every call, so they stay in L2), after an L2Reset keeping x
    (as the builder times 8-bit layers) and after a read of twice L2's size: time(read + GEMM) - time(read)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x8 = torch.randint(-128, 128, (M, K), device="cuda", generator=g, dtype=torch.int8)
    w8 = torch.randint(-127, 128, (N, K), device="cuda", generator=g, dtype=torch.int8).t()  # K-major
    b = torch.randn(N, device="cuda").half()
    kw = dict(qtype="int8", x_scale=torch.tensor(0.02, device="cuda"),
              w_scale=torch.rand(N, device="cuda") * 1e-3, out_dtype=torch.float16)
    read, reset = L2Reset(x8.device), L2Reset(x8.device).keeping([x8])  # a clean read of twice L2's size
    read_us = float(us(read))
    rows = [f"reading twice L2's size alone: {read_us:.1f} us"]
    for c in [t for t, _ in tma_gemm.QUANT_CONFIGS]:
        def gemm_(c=c):
            return tma_gemm.gemm(x8, w8, b, act, config=c, **kw)

        def after_read(c=c):
            read()
            return gemm_(c)

        warm, both = us(gemm_), us(after_read)
        try:
            builder = median_ms(gemm_, runs=20, before=reset) * 1000
            cold = float(both) - read_us
            rows.append(f"tma {c.name} warm {float(warm):.1f} us, weights out of L2 {builder:.1f} us, cold "
                        f"{cold:.1f} us ({cold / float(warm):.2f}x)")
        except Exception:  # a configuration that does not compile or run here
            rows.append(f"tma {c.name} warm {warm}, after the read {both}")
    return rows


def chosen(shapes, flag: str | None = None) -> list:
    """The shapes whose names start with one of the command line's words (e.g. layer1, "bert ffn1"); all
    without any."""
    only = [a for a in sys.argv[1:] if a != flag]
    return [s for s in shapes if not only or any(s[0].startswith(o) for o in only)]


def main() -> int:
    flag = next((f for f in ("--cold", "--latency", "--int8-engine", "--one-k") if f in sys.argv), None)
    if flag:
        print(torch.cuda.get_device_name(), torch.__version__)
    if flag == "--cold":
        for name, M, K, N, act in chosen(SHAPES, flag):
            print(f"\n## {name} {M}x{K}x{N} {act} int8, fp16 output", flush=True)
            print("\n".join(sweep_cold(M, K, N, act)), flush=True)
    elif flag == "--latency":
        for name, M, K, N, with_z in chosen(INT8_ENGINE_SHAPES, flag):
            print(f"\n## {name}: M {M}, K {K}, N {N}, int8{', 8-bit residual' if with_z else ''}", flush=True)
            print("\n".join(sweep_latency(M, K, N, with_z)), flush=True)
    elif flag == "--one-k":
        for name, M, K, N, with_z in chosen(ONE_K_SHAPES, flag):
            for qtype in ("int8", "fp8"):
                print(f"\n## {name}: M {M}, K {K}, N {N}, {qtype}{', 8-bit residual' if with_z else ''}", flush=True)
                print("\n".join(sweep_one_k(M, K, N, with_z, qtype)), flush=True)
    elif flag == "--int8-engine":
        for name, M, K, N, with_z in chosen(INT8_ENGINE_SHAPES, flag):
            for qtype, copy in [("int8", False)] + [("int8", True), ("fp8", True)] * with_z:
                what = f"{qtype}{', 8-bit residual' if with_z else ''}{' and copy' if copy else ''}"
                print(f"\n## {name}: M {M}, K {K}, N {N}, {what}", flush=True)
                print("\n".join(sweep_int8_engine(M, K, N, with_z, qtype, copy)), flush=True)
    else:
        for name, M, K, N, act in chosen(SHAPES):
            torch.manual_seed(0)
            x, w, b, rows = sweep_float(M, K, N, act)
            print(f"\n## {name} {M}x{K}x{N} {act} fp16\n" + "\n".join(rows))
            for qtype in ("int8", "fp8"):
                print(f"## {name} {qtype}\n" + "\n".join(sweep_8bit(x, w, b, act, qtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
