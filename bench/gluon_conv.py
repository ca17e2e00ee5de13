"""Kiln's warp-specialized Gluon convolutions (kernels/ws_conv.py, and kernels/halo_conv.py where it applies: layer1)
against its Triton one (kernels/tma_conv.py) at ResNet-50's 8-bit convolutions, batch 32: each of ws_conv's tiles
checked for equality with tma_conv's output, and all timed.

Before ws_conv became a tactic this script held the experiment itself; its first GPU run
(bench/results/H200-gluon-conv-1214.log) found the warp-specialized kernel equal and 26-33% faster at layers 2-4.

    python bench/gluon_conv.py [--fp8] [LAYER..]   (GPU: every ws_conv tile against tma_conv's tile, INT8 or FP8;
                                                    LAYER: the layers whose names start so, e.g. layer1)
    python bench/gluon_conv.py --compile-only   (any machine: ws_conv's tiles compiled for sm_90, INT8 and FP8,
                                                 stride 1 and 2, and halo_conv's kernel; what
                                                 tests/kernels/test_gluon_compile.py runs)
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import halo_conv  # noqa: E402
from kiln.kernels.warp_specialized import MAXNREG, box_layout  # noqa: E402
from kiln.kernels.ws_conv import CONFIGS, _ws_conv_kernel  # noqa: E402

# (name, input size, channels in and out, kernel, stride, the tile the INT8 engine's tma_conv took there)
LAYERS = [("layer1 3x3", 56, 64, 3, 1, "8x32x64x128_w4_s3"), ("layer2 3x3", 28, 128, 3, 1, "8x8x128x128_w4_s4"),
          ("layer3 3x3", 14, 256, 3, 1, "8x8x128x128_w4_s4"), ("layer4 3x3", 7, 512, 3, 1, "8x8x128x128_w4_s4"),
          ("layer2.0 3x3 s2", 56, 128, 3, 2, "8x8x128x128_w4_s4"),
          ("layer3.0 3x3 s2", 28, 256, 3, 2, "8x8x128x128_w4_s4")]


def compile_and_report(src, name: str, box_view: bool = False) -> int:
    """Compile src for sm_90 with MAXNREG registers a thread and print what the compiler made of it (warp
    specialization, a wgmma kept in flight, with box_view the convolution's box read as a shared-memory view, shared
    memory, spills); 1 if it did not compile, else 0."""
    from bench.sm90_compile import spilled_bytes

    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})
    except Exception as e:
        print(f"Triton {triton.__version__}: {name} FAILED {type(e).__name__}: {str(e)[-600:]}")
        return 1
    ir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    box = f"; box read from shared memory: {'memdesc_reshape' in ir}" if box_view else ""
    print(f"Triton {triton.__version__}: {name} compiles for sm_90; warp-specialized: {'ttg.warp_specialize' in ir}; "
          f"wgmma kept in flight: {'pendings = 1' in ir}{box}; waits for the kernel before: "
          f"{'griddepcontrol.wait' in ptx}; codes packed in pairs: "
          f"{'cvt.pack.sat.s8.s32.b32' in ptx or 'e4m3x2.f32' in ptx}; "
          f"shared memory {kernel.metadata.shared} bytes; {spilled_bytes(kernel)} bytes spilled")
    return 0


def check_and_time(label: str, call, want, reference: str) -> None:
    """One variant: its output against the Triton kernel's (`want`), then its time; one line either way."""
    import torch

    from kiln.tactics.timer import median_ms
    from tests.kernels.util import codes

    try:
        got = call()
        off = (codes(got) - codes(want)).abs().max().item()
        t = 1000 * median_ms(call, runs=20)
        print(f"{label}: {t:.1f} us, equal to {reference}: {torch.equal(got, want)} (max difference {off} "
              "steps)", flush=True)
    except Exception as e:  # a variant that does not compile or run here
        print(f"{label}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)


def layer_operands(c: int, hw: tuple, kernel: tuple, qtype: str):
    """A batch-32 c -> c 8-bit convolution's operands on the GPU, the same for every run: x [32, c, *hw] and
    w [c, c, *kernel] (channels-last, INT8 or FP8 values), an FP16 bias, x_scale, per-channel w_scale, y_scale."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last
    if qtype == "int8":
        i8 = dict(device="cuda", generator=g, dtype=torch.int8)
        x8 = torch.randint(-128, 128, (32, c, *hw), **i8).to(memory_format=cl)
        w8 = torch.randint(-127, 128, (c, c, *kernel), **i8).to(memory_format=cl)
    else:
        f8 = torch.float8_e4m3fn
        x8 = (torch.randn(32, c, *hw, device="cuda", generator=g) * 8).to(f8).to(memory_format=cl)
        w8 = (torch.randn(c, c, *kernel, device="cuda", generator=g) * 8).to(f8).to(memory_format=cl)
    b = torch.randn(c, device="cuda", generator=g).half()
    xs, ys = torch.tensor(0.02, device="cuda"), torch.tensor(0.05, device="cuda")
    ws = torch.rand(c, device="cuda", generator=g) * 1e-3
    return x8, w8, b, xs, ws, ys


def compile_only() -> int:
    """Each of ws_conv's tiles compiled for sm_90, INT8 and FP8, stride 1 and 2, with as many input channels as
    the tile has output channels (layer1's 64 for the 64-wide ones: K tiles of 64); 1 if one failed."""
    failed = 0
    for cfg, _ in CONFIGS:
        bh, bw, bn, bk = cfg.block_h, cfg.block_w, cfg.block_n, min(cfg.block_k, cfg.block_n)
        for qtype, t in (("int8", "i8"), ("fp8", "fp8e4nv")):
            for stride in (1, 2):
                box = [1, bh, bw, bk] if stride == 1 else [1, bh, 1, bw, bk]
                sig = {"x_desc": f"tensordesc<{t}[{','.join(map(str, box))}],{box_layout(bk, len(box))!r}>",
                       "w_desc": f"tensordesc<{t}[{bn},{bk}],{box_layout(bk, 2)!r}>",
                       "y_desc": f"tensordesc<{t}[1,{bh},{bw},{bn}],{box_layout(bn, 4)!r}>",
                       "b_ptr": "*fp16", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "ys_ptr": "*fp32",
                       **{p: "i32" for p in ("N", "OH", "OW", "OC", "C", "KW", "k_tiles", "pad_h", "pad_w",
                                             "stride_ws", "programs")},
                       **{p: "constexpr" for p in ("STRIDE", "QUANT", "HAS_BIAS", "RELU", "STAGES", "W_TILES",
                                                   "num_warps")}}
                constexprs = dict(STRIDE=stride, QUANT=qtype, HAS_BIAS=True, RELU=True, STAGES=cfg.stages,
                                  W_TILES=9 if cfg.resident_weights else 0, num_warps=4)
                src = GluonASTSource(_ws_conv_kernel, sig, constexprs=constexprs)
                failed |= compile_and_report(src, f"ws_conv {cfg.name} {qtype} stride {stride}", box_view=True)
    for qtype, t in (("int8", "i8"), ("fp8", "fp8e4nv")):
        rows, width, c = halo_conv.ROWS, halo_conv.WIDTH, halo_conv.CHANNELS
        sig = {"x_desc": f"tensordesc<{t}[1,{rows + 2},{width},{c}],{box_layout(c, 4)!r}>",
               "w_desc": f"tensordesc<{t}[{c},{c}],{box_layout(c, 2)!r}>",
               "y_desc": f"tensordesc<{t}[1,{rows},{width},{c}],{box_layout(c, 4)!r}>",
               "b_ptr": "*fp16", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "ys_ptr": "*fp32",
               **{p: "i32" for p in ("N", "OH", "stride_ws", "programs")},
               **{p: "constexpr" for p in ("QUANT", "HAS_BIAS", "RELU", "STAGES", "num_warps")}}
        constexprs = dict(QUANT=qtype, HAS_BIAS=True, RELU=True, STAGES=halo_conv.STAGES, num_warps=4)
        src = GluonASTSource(halo_conv._halo_conv_kernel, sig, constexprs=constexprs)
        failed |= compile_and_report(src, f"halo_conv {qtype}", box_view=True)
    return failed


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    import torch

    from bench.conv_sweep import node, parse_tile
    from kiln.kernels import tma_conv, ws_conv
    from kiln.tactics.timer import median_ms

    qtype = "fp8" if "--fp8" in sys.argv else "int8"
    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__, qtype)
    chosen = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name, hw, c, k, stride, engine_tile in LAYERS:
        if chosen and not any(name.startswith(a) for a in chosen):
            continue
        x8, w8, b, xs, ws, ys = layer_operands(c, (hw, hw), (k, k), qtype)
        layer, theirs_tile = node(k, stride, qtype), parse_tile(engine_tile)

        def theirs():
            return tma_conv.conv2d(layer, x8, w8, b, config=theirs_tile, x_scale=xs, w_scale=ws, y_scale=ys,
                                   out_dtype=torch.float16)

        want = theirs()
        print(f"\n## {name}: batch 32, {hw}x{hw}, {c} -> {c} channels, stride {stride}", flush=True)
        print(f"tma_conv {theirs_tile.name}: {1000 * median_ms(theirs, runs=20):.1f} us", flush=True)
        for cfg, _ in ws_conv.CONFIGS:
            if not ws_conv.supports(layer, x8, w8, b, None, ys, None, cfg):
                continue
            check_and_time(f"ws_conv {cfg.name}", lambda cfg=cfg: ws_conv.conv2d(layer, x8, w8, b, cfg, xs, ws, ys),
                           want, "tma_conv")
        if halo_conv.supports(layer, x8, w8, b, None, ys, None):  # FP8: taps summed in another order
            check_and_time("halo_conv", lambda: halo_conv.conv2d(layer, x8, w8, b, xs, ws, ys), want, "tma_conv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
