"""Kiln's warp-specialized Gluon 1x1 convolution (kernels/ws_gemm.py) against its Triton TMA GEMM (kernels/tma_gemm.py)
at ResNet-50's 8-bit 1x1 layers, batch 32: each of ws_gemm's tiles checked for equality with tma_gemm's output
(with the tile the INT8 engine took there), and both timed.

Before ws_gemm became a tactic this script held the experiment itself; its first GPU run
(bench/results/H200-gluon-gemm-1214.log) found it equal to tma_gemm and 4-15% faster at its best tile.

    python bench/gluon_gemm.py [--fp8]          (GPU: every ws_gemm tile against tma_gemm, INT8 or FP8)
    python bench/gluon_gemm.py --bert           (GPU: tiles at BERT-base's batch-32 FP8 GEMMs with an FP8 output,
                                                 QKV and FFN1 with its GELU, against cuBLASLt's choices)
    python bench/gluon_gemm.py --compile-only   (any machine: ws_gemm's tiles compiled for sm_90, INT8 and FP8,
                                                 with a residual and ReLU and with a GELU;
                                                 tests/kernels/test_gluon_compile.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.gluon_conv import check_and_time, compile_and_report  # noqa: E402
from kiln.kernels.warp_specialized import box_layout  # noqa: E402
from kiln.kernels.ws_gemm import CONFIGS, _ws_gemm_kernel, block_k_for  # noqa: E402

# (name, image size, K, N, 8-bit residual, the tile the INT8 engine's tma_gemm took: (block_m, block_n, block_k,
# warps, stages))
LAYERS = [("layer1 conv3 64->256 +res", 56, 64, 256, True, (128, 128, 64, 4, 3)),
          ("layer1 downsample 64->256", 56, 64, 256, False, (128, 128, 64, 4, 3)),
          ("layer1 conv1 256->64", 56, 256, 64, False, (128, 64, 128, 4, 4)),
          ("layer2 conv3 128->512 +res", 28, 128, 512, True, (64, 128, 128, 4, 2)),
          ("layer2 conv1 512->128", 28, 512, 128, False, (64, 128, 128, 4, 2)),
          ("layer3 conv3 256->1024 +res", 14, 256, 1024, True, (64, 128, 128, 4, 2)),
          ("layer4 conv3 512->2048 +res", 7, 512, 2048, True, (64, 128, 128, 4, 2))]


def compile_only() -> int:
    """Each of ws_gemm's tiles compiled for sm_90 at K = 64 and 256, INT8 and FP8, with a residual and ReLU and with
    a GELU (no residual); 1 if one failed."""
    failed = 0
    for cfg, _ in CONFIGS:
        bm, bn = cfg.block_m, cfg.block_n
        for bk in (block_k_for(64), block_k_for(256)):
            for qtype, t in (("int8", "i8"), ("fp8", "fp8e4nv")):
                for has_z, act in ((True, "Relu"), (False, "GeluErf")):
                    sig = {"x_desc": f"tensordesc<{t}[{bm},{bk}],{box_layout(bk, 2)!r}>",
                           "w_desc": f"tensordesc<{t}[{bn},{bk}],{box_layout(bk, 2)!r}>",
                           "z_desc": f"tensordesc<{t}[{bm},{bn}],{box_layout(bn, 2)!r}>",
                           "y_desc": f"tensordesc<{t}[{bm},{bn}],{box_layout(bn, 2)!r}>",
                           "b_ptr": "*fp16", **{p: "*fp32" for p in ("xs_ptr", "ws_ptr", "ys_ptr", "zs_ptr")},
                           **{p: "i32" for p in ("M", "N", "K", "stride_ws", "programs")},
                           **{p: "constexpr" for p in ("QUANT", "HAS_BIAS", "HAS_Z", "ACT", "STAGES", "num_warps")}}
                    constexprs = dict(QUANT=qtype, HAS_BIAS=True, HAS_Z=has_z, ACT=act, STAGES=cfg.stages,
                                      num_warps=4)
                    src = GluonASTSource(_ws_gemm_kernel, sig, constexprs=constexprs)
                    label = f"ws_gemm {cfg.name} K tile {bk} {qtype} {act}{' +res' * has_z}"
                    failed |= compile_and_report(src, label)
    return failed


# Tiles tried at BERT's GEMMs: the tactics' and others (block_m, block_n, stages, programs an SM)
# (64x256 needs 154 registers a thread, above MAXNREG: H200-gluon-gemm-bert-1805.log)
BERT_TILES = [(128, 128, 2, 2), (128, 128, 3, 2), (128, 64, 3, 2), (128, 64, 4, 2), (128, 64, 4, 3), (64, 128, 4, 3)]


def bert() -> int:
    """ws_gemm's tiles at BERT-base's batch-32 FP8 GEMMs whose output is FP8 (QKV, FFN1 with erf GELU, one weight
    scale), against cuBLASLt's heuristic choices with the same epilogue (cublaslt.fp8_gemm, no scratch): times, and
    how far ws_gemm's output is from cuBLASLt's first choice (in codes; FP8 codes near a rounding tie differ)."""
    import torch
    import triton

    from kiln.ir.graph import Node
    from kiln.kernels import cublaslt, ws_gemm
    from kiln.tactics.timer import median_ms
    from tests.kernels.util import codes

    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__)
    fp8 = torch.float8_e4m3fn
    for name, K, N, act in (("qkv", 768, 2304, ""), ("ffn1", 768, 3072, "GeluErf")):
        M = 4096
        g = torch.Generator(device="cuda").manual_seed(0)
        # x ~ N(0, 1) and w ~ N(0, 1 / K) at 4 sigma = 448, so y ~ N(0, 1) too
        x8 = (torch.randn(M, K, device="cuda", generator=g) * 112).clamp(-448, 448).to(fp8)
        w8 = (torch.randn(N, K, device="cuda", generator=g) * 112).clamp(-448, 448).to(fp8).t()  # [K, N], K-major
        b = (torch.randn(N, device="cuda", generator=g) * 0.5).half()
        xs, ws, ys = (torch.tensor(v, device="cuda") for v in (4 / 448, 4 / 448 / K ** 0.5, 4 / 448))
        layer = Node("QGemm", [], [], {"qtype": "fp8", "activation": act}, domain="kiln")
        print(f"\n## {name}: M {M}, K {K}, N {N}, activation {act or 'none'}, FP8 output", flush=True)
        want = None
        for algo in range(8):
            try:
                call = (lambda algo=algo: cublaslt.fp8_gemm(x8, w8, xs, ws, b, act, ys, torch.float16, algo, 0))
                y = call()
                want = y if want is None else want
                print(f"cuBLASLt choice {algo}: {1000 * median_ms(call, runs=20):.1f} us", flush=True)
            except cublaslt.CublasLtError as e:
                print(f"cuBLASLt choice {algo}: {e}", flush=True)
        for bm, bn, stages, per_sm in BERT_TILES:
            cfg = ws_gemm.WsGemmConfig(bm, bn, stages, per_sm)
            try:
                call = (lambda cfg=cfg: ws_gemm.matmul8(layer, x8, w8, b, None, cfg, xs, ws, ys))
                got = call()
                off = (got.float() - want.float()).abs()
                steps = (codes(got) - codes(want)).abs()
                print(f"ws_gemm {cfg.name}: {1000 * median_ms(call, runs=20):.1f} us; against cuBLASLt: "
                      f"{(steps > 0).float().mean().item():.2%} of codes differ, at most {steps.max().item()} codes, "
                      f"{off.max().item():.3g} in value", flush=True)
            except Exception as e:  # a tile that does not fit or compile here
                print(f"ws_gemm {cfg.name}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 0


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    if "--bert" in sys.argv:
        return bert()
    import torch
    import triton

    from bench.conv_sweep import node
    from kiln.kernels import tma_gemm, ws_gemm
    from kiln.kernels.conv import pixel_rows
    from kiln.kernels.gemm import TileConfig
    from kiln.tactics.timer import median_ms

    qtype = "fp8" if "--fp8" in sys.argv else "int8"
    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__, qtype)
    cl, dt = torch.channels_last, torch.int8 if qtype == "int8" else torch.float8_e4m3fn
    for name, hw, K, N, with_z, engine_tile in LAYERS:
        g = torch.Generator(device="cuda").manual_seed(0)

        def codes(*shape):  # random 8-bit values; FP8 ones from integers, as random bytes would hold NaNs
            v = torch.randint(-127, 128, shape, device="cuda", generator=g).float()
            return (v if qtype == "int8" else v / 32).to(dt).to(memory_format=cl)

        x8, w8, z8 = codes(32, K, hw, hw), codes(N, K, 1, 1), codes(32, N, hw, hw) if with_z else None
        b = torch.randn(N, device="cuda", generator=g).half()
        xs, ys, zs = (torch.tensor(v, device="cuda") for v in (0.02, 0.05, 0.05))
        ws = torch.rand(N, device="cuda", generator=g) * 1e-3
        layer, tile = node(1, 1, qtype), TileConfig(*engine_tile)
        rows_z = pixel_rows(z8) if with_z else None

        def theirs():
            return tma_gemm.gemm(pixel_rows(x8), w8.reshape(N, K).t(), b, "Relu", config=tile, qtype=qtype,
                                 x_scale=xs, w_scale=ws, y_scale=ys, z=rows_z, z_scale=zs if with_z else None)

        want = theirs()
        print(f"\n## {name}: batch 32, {hw}x{hw}, M {32 * hw * hw}, K {K}, N {N}", flush=True)
        print(f"tma_gemm {tile.name}: {1000 * median_ms(theirs, runs=20):.1f} us", flush=True)
        for cfg, _ in ws_gemm.CONFIGS:
            if not ws_gemm.supports(layer, x8, w8, b, z8, ys, None, zs, cfg):
                continue
            check_and_time(f"ws_gemm {cfg.name}", lambda cfg=cfg: pixel_rows(
                ws_gemm.matmul8(layer, x8, w8, b, z8, cfg, xs, ws, ys, zs)), want, "tma_gemm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
