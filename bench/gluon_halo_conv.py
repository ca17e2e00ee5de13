"""Experiment: ResNet-50's 64-channel stride-1 convolutions in 8 bits (layer1's 3x3 and the 4x1 one the stem
becomes over its patches, passes/stem_patches.py) reading each input row once per filter column instead of once
per tap.

ws_conv (kernels/ws_conv.py) loads one [1, BH, BW, C] box per filter tap: a tile's input comes from L2 nine
times at a 3x3. With the filter resident (its `_rw` tiles) layer1 ran 17 us, against 19-20 with the filter
streamed (bench/results/H200-ws-gluon-conv-layer1-resident-1358.log), so L2 traffic matters there.

The two-row kernel (3x3 only): a tile is two output rows of 64 pixels; per filter column dx the loader brings one
[1, 4, 64, C] box (the two rows and their halo rows, shifted by dx), and the MMA warpgroup multiplies each output
row by the box's row r + dy, a 64-row slice of the reshaped box (a Gluon shared-memory slice must start at a
multiple of its own size, so two rows at an odd offset cannot be one left tile; one accumulator per output row
gets around it). Three boxes of 16 KB a tile instead of nine of 8 KB for ws_conv's 8x16 tile.

The strip kernel (any KH x KW): a program walks SEG output rows of one 64-pixel column block down the image, the
loader bringing each input row once per filter column as a [1, 1, 64, C] box into a ring, and the MMA warpgroup
computing output row j from the ring's boxes of input rows j .. j + KH - 1, handing a row's boxes back after their
last use. At layer1, (SEG + 2) * 3 boxes of 4 KB for SEG * 56 pixels: about 270 bytes of input per output pixel
at SEG = 8, against about 440 for the two-row tiles and 660 for ws_conv's 8x16 tiles (which also waste an eighth
of their pixels at W = 56). The filter stays resident in both kernels.

Epilogue and quantization as ws_conv's (x_scale * w_scale[oc], bias, ReLU in the clamp of the 8-bit output), so
the output must equal tma_conv's bit for bit.

    python bench/gluon_halo_conv.py [--fp8]        (GPU: both layers, each kernel against tma_conv's output, then
                                                    times beside tma_conv's and ws_conv's 64-channel tiles)
    python bench/gluon_halo_conv.py --compile-only (any machine: compiled for sm_90, INT8 and FP8)
"""

from __future__ import annotations

import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.gluon_conv import check_and_time, compile_and_report, layer_operands  # noqa: E402
from kiln.kernels.gemm import columns  # noqa: E402
from kiln.kernels.warp_specialized import (  # noqa: E402
    LOADER_REGS,
    MAXNREG,
    box_descriptor,
    box_layout,
    load_resident,
    quantize8,
    ring_barriers,
)

ROWS, WIDTH, STAGES = 2, 64, 3  # output rows a tile, pixels a row (one wgmma's M), ring stages (one box each)
SEG = 8  # the strip variant's output rows a segment


@gluon.jit
def _loader(x_desc, w_desc, a_bufs, w_res, ready, empty, w_ready, tiles, tiles_h, programs):
    """The filter once (load_resident), then per tile and filter column dx the box of the
    tile's rows and their halo, shifted by dx - 1 (zeros past the image: the padding)."""
    HALO: gl.constexpr = x_desc.block_type.shape[1]
    S: gl.constexpr = a_bufs.type.shape[0]
    load_resident(w_desc, w_res, w_ready)
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img = tile // tiles_h
        oh0 = (tile % tiles_h) * (HALO - 2)
        for dx in gl.static_range(3):
            s = it % S
            mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)  # a fresh barrier passes the first round
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [img, oh0 - 1, dx - 1, 0], ready.index(s), a_bufs.index(s))
            it += 1


@gluon.jit
def _requantize(acc, scale, bias, inv_ys, QUANT: gl.constexpr):
    """An output row's 8-bit values: the accumulator scaled (x_scale * w_scale[oc]), plus the bias, ReLU in the
    clamp (gemm.finish's arithmetic for these layers)."""
    return quantize8(acc.to(gl.float32) * scale[None, :] + bias[None, :], inv_ys, QUANT, True)


@gluon.jit
def _mma_epilogue(y_desc, a_bufs, w_res, ready, empty, w_ready, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles,
                  tiles_h, programs, QUANT: gl.constexpr, num_warps: gl.constexpr):
    W: gl.constexpr = y_desc.block_type.shape[2]
    N: gl.constexpr = y_desc.block_type.shape[3]
    S: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, N, 32])
    scale, bias = columns(gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout)), b_ptr, xs_ptr, ws_ptr, 1, True,
                          QUANT)
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    ACC: gl.constexpr = gl.int32 if QUANT == "int8" else gl.float32
    mbarrier.wait(w_ready, 0)
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img = tile // tiles_h
        oh0 = (tile % tiles_h) * 2
        acc0 = gl.zeros((W, N), dtype=ACC, layout=acc_layout)  # output row oh0
        acc1 = gl.zeros((W, N), dtype=ACC, layout=acc_layout)  # output row oh0 + 1
        for dx in gl.static_range(3):
            s = it % S
            mbarrier.wait(ready.index(s), (it // S) & 1)
            # [4 * W, C]: input rows oh0 - 1 .. oh0 + 2 shifted by dx - 1, a row's W pixels a W-row slice
            box = a_bufs.index(s).reshape([4 * W, a_bufs.type.shape[4]])
            for dy in gl.static_range(3):
                w = w_res.index(dy * 3 + dx).permute((1, 0))
                acc0 = warpgroup_mma(box.slice(dy * W, W), w, acc0, is_async=True)
                acc1 = warpgroup_mma(box.slice((dy + 1) * W, W), w, acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index(s))
            it += 1
        out0 = _requantize(acc0, scale, bias, inv_ys, QUANT)
        out1 = _requantize(acc1, scale, bias, inv_ys, QUANT)
        tma.store_wait(pendings=0)  # the last tile's store has read y_smem
        rows = y_smem.reshape([2 * W, N])
        rows.slice(0, W).store(out0)
        rows.slice(W, W).store(out1)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [img, oh0, 0, 0], y_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _halo_conv_kernel(x_desc, w_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, N, OH, programs,
                      QUANT: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    tiles_h = gl.cdiv(OH, 2)
    tiles = N * tiles_h
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_res = gl.allocate_shared_memory(w_desc.dtype, [9] + w_desc.block_type.shape, w_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready, empty = ring_barriers(STAGES)
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(w_ready, count=1)
    gl.warp_specialize([
        (_mma_epilogue, (y_desc, a_bufs, w_res, ready, empty, w_ready, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles,
                         tiles_h, programs, QUANT, num_warps)),
        (_loader, (x_desc, w_desc, a_bufs, w_res, ready, empty, w_ready, tiles, tiles_h, programs)),
    ], [1], [LOADER_REGS])


@gluon.jit
def _segment(seg, segs_h, blocks_w, SEG: gl.constexpr, W: gl.constexpr):
    """(image, first output row, first output column) of a segment: SEG rows of one W-pixel column block."""
    per_img = segs_h * blocks_w
    rest = seg % per_img
    return seg // per_img, (rest // blocks_w) * SEG, (rest % blocks_w) * W


@gluon.jit
def _strip_loader(x_desc, w_desc, a_bufs, w_res, ready, empty, w_ready, segments, segs_h, blocks_w, pad_h, pad_w,
                  programs, SEG: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr):
    """The filter once (load_resident: tap dy * KW + dx is K tile dy * KW + dx), then per segment its SEG + KH - 1 input
    rows (the halo's too), each once per filter column dx, shifted by dx - pad_w, in order: input row i's column dx
    at ring position i * KW + dx from the segment's start."""
    W: gl.constexpr = x_desc.block_type.shape[2]
    S: gl.constexpr = a_bufs.type.shape[0]
    load_resident(w_desc, w_res, w_ready)
    it = 0
    for seg in range(gl.program_id(0), segments, programs):
        img, oh0, ow0 = _segment(seg, segs_h, blocks_w, SEG, W)
        for i in range(SEG + KH - 1):
            for dx in gl.static_range(KW):
                s = it % S
                mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)  # a fresh barrier passes the first round
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [img, oh0 - pad_h + i, ow0 + dx - pad_w, 0], ready.index(s),
                                                a_bufs.index(s))
                it += 1


@gluon.jit
def _strip_row(a_bufs, ready, it, i, KW: gl.constexpr):
    """Wait for the ring's boxes of input row i (from the segment's start `it`)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    for dx in gl.static_range(KW):
        q = it + i * KW + dx
        mbarrier.wait(ready.index(q % S), (q // S) & 1)


@gluon.jit
def _strip_mma_epilogue(y_desc, a_bufs, w_res, ready, empty, w_ready, y_bufs, b_ptr, xs_ptr, ws_ptr, ys_ptr,
                        segments, segs_h, blocks_w, programs, QUANT: gl.constexpr, SEG: gl.constexpr,
                        KH: gl.constexpr, KW: gl.constexpr, num_warps: gl.constexpr):
    W: gl.constexpr = y_desc.block_type.shape[2]
    N: gl.constexpr = y_desc.block_type.shape[3]
    C: gl.constexpr = a_bufs.type.shape[4]
    S: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, N, 32])
    scale, bias = columns(gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout)), b_ptr, xs_ptr, ws_ptr, 1, True,
                          QUANT)
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    ACC: gl.constexpr = gl.int32 if QUANT == "int8" else gl.float32
    mbarrier.wait(w_ready, 0)
    it = 0
    stored = 0
    for seg in range(gl.program_id(0), segments, programs):
        img, oh0, ow0 = _segment(seg, segs_h, blocks_w, SEG, W)
        for i in gl.static_range(KH - 1):
            _strip_row(a_bufs, ready, it, i, KW)
        for j in range(SEG):  # output row oh0 + j from input rows j .. j + KH - 1 of the segment
            _strip_row(a_bufs, ready, it, j + KH - 1, KW)
            acc = gl.zeros((W, N), dtype=ACC, layout=acc_layout)
            for dy in gl.static_range(KH):
                for dx in gl.static_range(KW):
                    a = a_bufs.index((it + (j + dy) * KW + dx) % S).reshape([W, C])
                    acc = warpgroup_mma(a, w_res.index(dy * KW + dx).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            for dx in gl.static_range(KW):  # input row j's boxes had their last use
                mbarrier.arrive(empty.index((it + j * KW + dx) % S))
            out = _requantize(acc, scale, bias, inv_ys, QUANT)
            y = y_bufs.index(stored % 2)
            tma.store_wait(pendings=1)  # the store that last read this buffer is done
            y.reshape([W, N]).store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(y_desc, [img, oh0 + j, ow0, 0], y)
            stored += 1
        for i in gl.static_range(KH - 1):  # the last KH - 1 input rows' boxes
            for dx in gl.static_range(KW):
                mbarrier.arrive(empty.index((it + (SEG + i) * KW + dx) % S))
        it += (SEG + KH - 1) * KW
    tma.store_wait(pendings=0)


@gluon.jit
def _strip_conv_kernel(x_desc, w_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, N, OH, OW, pad_h, pad_w, programs,
                       QUANT: gl.constexpr, SEG: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
                       STAGES: gl.constexpr, num_warps: gl.constexpr):
    W: gl.constexpr = y_desc.block_type.shape[2]
    segs_h = gl.cdiv(OH, SEG)
    blocks_w = gl.cdiv(OW, W)
    segments = N * segs_h * blocks_w
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_res = gl.allocate_shared_memory(w_desc.dtype, [KH * KW] + w_desc.block_type.shape, w_desc.layout)
    y_bufs = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    ready, empty = ring_barriers(STAGES)
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(w_ready, count=1)
    gl.warp_specialize([
        (_strip_mma_epilogue, (y_desc, a_bufs, w_res, ready, empty, w_ready, y_bufs, b_ptr, xs_ptr, ws_ptr, ys_ptr,
                               segments, segs_h, blocks_w, programs, QUANT, SEG, KH, KW, num_warps)),
        (_strip_loader, (x_desc, w_desc, a_bufs, w_res, ready, empty, w_ready, segments, segs_h, blocks_w, pad_h,
                         pad_w, programs, SEG, KH, KW)),
    ], [1], [LOADER_REGS])


def ring_stages(kh: int, kw: int) -> int:
    """The strip kernel's ring: the KH input rows an output row reads and two rows ahead."""
    return (kh + 2) * kw


def _descriptors(t: str, c: int, n: int, in_rows: int, out_rows: int):
    """Signature types of the three descriptors (the compile-only run) for 8-bit type t."""
    return {"x_desc": f"tensordesc<{t}[1,{in_rows},{WIDTH},{c}],{box_layout(c, 4)!r}>",
            "w_desc": f"tensordesc<{t}[{n},{c}],{box_layout(c, 2)!r}>",
            "y_desc": f"tensordesc<{t}[1,{out_rows},{WIDTH},{n}],{box_layout(n, 4)!r}>"}


def compile_only() -> int:
    """Both kernels compiled for sm_90, INT8 and FP8, at 64 channels (the strip kernel for layer1's 3x3 and the
    stem's 4x1); 1 if one failed."""
    failed = 0
    scalars = {"b_ptr": "*fp16", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "ys_ptr": "*fp32", "N": "i32", "OH": "i32"}
    for qtype, t in (("int8", "i8"), ("fp8", "fp8e4nv")):
        sig = {**_descriptors(t, 64, 64, ROWS + 2, ROWS), **scalars, "programs": "i32",
               **{p: "constexpr" for p in ("QUANT", "STAGES", "num_warps")}}
        src = GluonASTSource(_halo_conv_kernel, sig, constexprs=dict(QUANT=qtype, STAGES=STAGES, num_warps=4))
        failed |= compile_and_report(src, f"halo conv {ROWS}x{WIDTH}x64 s{STAGES} {qtype}")
        for kh, kw in ((3, 3), (4, 1)):
            sig = {**_descriptors(t, 64, 64, 1, 1), **scalars, **{p: "i32" for p in ("OW", "pad_h", "pad_w")},
                   "programs": "i32", **{p: "constexpr" for p in ("QUANT", "SEG", "KH", "KW", "STAGES", "num_warps")}}
            cx = dict(QUANT=qtype, SEG=SEG, KH=kh, KW=kw, STAGES=ring_stages(kh, kw), num_warps=4)
            failed |= compile_and_report(GluonASTSource(_strip_conv_kernel, sig, constexprs=cx),
                                         f"strip conv {kh}x{kw} {SEG}x{WIDTH}x64 s{ring_stages(kh, kw)} {qtype}")
    return failed


def _launch_args(x8, w8, b, xs, ws, ys, in_rows: int, out_rows: int, out_w: int, out_h: int):
    """The descriptors and the output of an 8-bit NHWC-laid-out convolution over 64 channels."""
    import torch

    from kiln.kernels.tma_conv import filter_rows, nhwc

    N, C = x8.shape[:2]
    OC = w8.shape[0]
    assert C == OC == 64
    y = torch.empty((N, out_h, out_w, OC), dtype=x8.dtype, device=x8.device)

    descs = (box_descriptor(nhwc(x8), [1, in_rows, WIDTH, C]), box_descriptor(filter_rows(w8), [OC, C]),
             box_descriptor(y, [1, out_rows, WIDTH, OC]))
    return descs, (b, xs, ws.reshape(-1).contiguous(), ys), y, "int8" if x8.dtype == torch.int8 else "fp8"


def halo_conv(x8, w8, b, xs, ws, ys, per_sm: int = 2):
    """The two-row kernel on a 3x3, pad 1 layer over 8-bit x [N, 64, H, W <= 64]: the 8-bit output, as an
    NCHW-shaped view."""
    import triton

    from kiln.kernels.tma_gemm import programs as sm_count

    N, _, H, W = x8.shape
    assert W <= WIDTH and tuple(w8.shape[2:]) == (3, 3)
    descs, scalars, y, qtype = _launch_args(x8, w8, b, xs, ws, ys, ROWS + 2, ROWS, W, H)
    programs = min(N * triton.cdiv(H, ROWS), per_sm * sm_count(x8.device))
    _halo_conv_kernel[(programs,)](*descs, *scalars, N, H, programs, QUANT=qtype, STAGES=STAGES, num_warps=4,
                                   maxnreg=MAXNREG)
    return y.permute(0, 3, 1, 2)


def strip_conv(node, x8, w8, b, xs, ws, ys, per_sm: int = 2):
    """The strip kernel on a stride-1 KH x KW layer over 8-bit x [N, 64, H, W] (`node` gives its pads): the 8-bit
    output, as an NCHW-shaped view."""
    import triton

    from kiln.kernels.conv import geometry
    from kiln.kernels.tma_gemm import programs as sm_count

    strides, _, pads, (OH, OW) = geometry(node, x8, w8)
    assert strides == [1, 1]
    N, KH, KW = x8.shape[0], w8.shape[2], w8.shape[3]
    descs, scalars, y, qtype = _launch_args(x8, w8, b, xs, ws, ys, 1, 1, OW, OH)
    programs = min(N * triton.cdiv(OH, SEG) * triton.cdiv(OW, WIDTH), per_sm * sm_count(x8.device))
    _strip_conv_kernel[(programs,)](*descs, *scalars, N, OH, OW, pads[0], pads[1], programs, QUANT=qtype, SEG=SEG,
                                    KH=KH, KW=KW, STAGES=ring_stages(KH, KW), num_warps=4, maxnreg=MAXNREG)
    return y.permute(0, 3, 1, 2)


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    import torch
    import triton

    from bench.conv_sweep import node, parse_tile
    from kiln.kernels import tma_conv, ws_conv
    from kiln.tactics.timer import median_ms

    qtype = "fp8" if "--fp8" in sys.argv else "int8"
    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__, qtype)
    # (name, input H x W, kernel, pads, the tma_conv tile checked against: the INT8 engine's at layer1); the
    # stem's 4x1 is the stride-1 convolution passes/stem_patches.py makes of the 7x7 stride-2 stem, over 112 x 112
    # cell rows
    layers = [("layer1 3x3", (56, 56), (3, 3), [1, 1, 1, 1], "8x32x64x128_w4_s3"),
              ("stem 4x1 over the patches", (112, 112), (4, 1), [2, 0, 1, 0], "8x32x64x128_w4_s3")]
    for name, hw, kernel, pads, engine_tile in layers:
        x8, w8, b, xs, ws, ys = layer_operands(64, hw, kernel, qtype)
        layer, tile = node(3, 1, qtype), parse_tile(engine_tile)
        layer.attrs.update(kernel_shape=list(kernel), pads=pads)

        def theirs(layer=layer, tile=tile, x8=x8, w8=w8, b=b, ws=ws):
            return tma_conv.conv2d(layer, x8, w8, b, config=tile, x_scale=xs, w_scale=ws, y_scale=ys,
                                   out_dtype=torch.float16)

        want = theirs()
        print(f"\n## {name}: batch 32, {hw[0]}x{hw[1]}, 64 -> 64 channels, kernel {kernel[0]}x{kernel[1]}", flush=True)
        print(f"tma_conv {tile.name}: {1000 * median_ms(theirs, runs=20):.1f} us", flush=True)
        for cfg, _ in ws_conv.CONFIGS:
            if cfg.block_n == 64 and ws_conv.supports(layer, x8, w8, b, None, ys, None, cfg):
                check_and_time(f"ws_conv {cfg.name}",
                               lambda cfg=cfg, layer=layer, x8=x8, w8=w8, b=b, ws=ws:
                               ws_conv.conv2d(layer, x8, w8, b, cfg, xs, ws, ys), want, "tma_conv")
        for per_sm in (1, 2):
            if kernel == (3, 3):
                check_and_time(f"halo conv {ROWS}x{WIDTH}x64 s{STAGES} x{per_sm}",
                               lambda per_sm=per_sm, x8=x8, w8=w8, b=b, ws=ws: halo_conv(x8, w8, b, xs, ws, ys, per_sm),
                               want, "tma_conv")
            check_and_time(f"strip conv {SEG}x{WIDTH}x64 s{ring_stages(*kernel)} x{per_sm}",
                           lambda per_sm=per_sm, layer=layer, x8=x8, w8=w8, b=b, ws=ws:
                           strip_conv(layer, x8, w8, b, xs, ws, ys, per_sm), want, "tma_conv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
