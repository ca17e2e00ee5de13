"""ResNet-50's stem convolution (7x7, stride 2, pad 3, 3 -> 64 channels, bias + ReLU, FP16 channels-last) by
candidate, alone: which way of running a 3-channel convolution a tactic should offer.

At batch 1 cuDNN's heuristic picks a 13.8 us kernel for it (16 TFLOP/s; bench/results/H200-trace-resnet50-b1.md),
the largest kernel of the engine. Candidates: cuDNN as is; cuDNN with the channels zero-padded to 4 or 8 (the
input cast could write the padding for free); im2col (one gather copy) then cuBLASLt with its bias+ReLU epilogue,
K = 147 or padded to 160; Kiln's Triton implicit-GEMM convolution (flat K walk) at several tiles; the 8-bit
stem of passes/stem_patches.py (the patches from the FP32 image, then the 4x1 8-bit TMA convolution per tile).
Times are kiln.tactics.timer.median_ms (CUDA-graph replays, as the builder times tactics), us.

    python bench/stem_conv.py [--patches-only] > bench/results/H200-stem-conv.log        (GPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.ir.graph import Node  # noqa: E402
from kiln.kernels import conv  # noqa: E402
from kiln.kernels.gemm import TileConfig  # noqa: E402
from kiln.kernels.tma_conv import PatchConfig  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

# Tiles for the 8-bit stem's 4x1 convolution over 64 channels (K = 4 x 64, N = 64): short K loops, one N tile
STEM_TILES = [PatchConfig(8, 32, 64, 64, 4, 2), PatchConfig(8, 32, 64, 64, 4, 4), PatchConfig(16, 16, 64, 64, 4, 3),
              PatchConfig(16, 32, 64, 64, 8, 3), PatchConfig(4, 64, 64, 64, 4, 3), PatchConfig(8, 64, 64, 64, 8, 3),
              PatchConfig(8, 16, 64, 64, 4, 4)]
TRITON = [TileConfig(128, 64, 64, 4, 3), TileConfig(128, 64, 32, 4, 4), TileConfig(64, 64, 64, 4, 4),
          TileConfig(64, 64, 32, 4, 4), TileConfig(256, 64, 32, 8, 3), TileConfig(128, 64, 16, 4, 4),
          TileConfig(64, 64, 16, 4, 4), TileConfig(32, 64, 64, 4, 4)]


def us(fn) -> str:
    try:
        return f"{median_ms(fn, runs=20) * 1000:.1f}"
    except Exception as e:  # a candidate that does not compile or run here
        return f"fail {type(e).__name__}: {str(e)[:150]}"


def im2col_gemm(x, w, b, k_pad: int):
    """Patches gathered by one copy (into a zero-padded [M, k_pad] buffer when k_pad > K), then addmm+ReLU."""
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, 3, 3, 3, 3))  # NHWC, spatially padded
    oh, ow = (h + 6 - kh) // 2 + 1, (wd + 6 - kw) // 2 + 1
    s = xp.stride()
    patches = xp.as_strided((n, oh, ow, kh, kw, c), (s[0], 2 * s[1], 2 * s[2], s[1], s[2], s[3]))
    k = kh * kw * c
    w2 = w.permute(0, 2, 3, 1).reshape(oc, k)
    if k_pad > k:
        rows = torch.zeros(n * oh * ow, k_pad, dtype=x.dtype, device=x.device)
        rows[:, :k].view(n, oh, ow, kh, kw, c).copy_(patches)
        w2 = F.pad(w2, (0, k_pad - k))
    else:
        rows = patches.reshape(n * oh * ow, k)
    return torch._addmm_activation(b, rows, w2.t(), use_gelu=False)


def main() -> None:
    patches_only = "--patches-only" in sys.argv[1:]  # batch 32's 8-bit stem rows alone
    dev = "cuda"
    print(f"# ResNet-50 stem convolution candidates, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    node = Node("FusedConv", ["x", "w", "b"], ["y"], {"strides": [2, 2], "pads": [3, 3, 3, 3],
                                                     "activation": "Relu"}, domain="kiln")
    g = torch.Generator(device=dev).manual_seed(0)
    for batch in (32,) if patches_only else (1, 32):
        x = torch.randn(batch, 3, 224, 224, device=dev, generator=g).half().contiguous(
            memory_format=torch.channels_last)
        w = (torch.randn(64, 3, 7, 7, device=dev, generator=g) / 12).half().contiguous(
            memory_format=torch.channels_last)
        b = torch.randn(64, device=dev, generator=g).half()
        ref = F.relu(F.conv2d(x.float(), w.float(), b.float(), 2, 3))
        print(f"\n## batch {batch}")

        def row(name, fn):
            y = fn()
            y = y if y.dim() == 4 else y.view(batch, 112, 112, 64).permute(0, 3, 1, 2)  # im2col's [M, OC] rows
            err = (y.float() - ref).abs().max().item()
            print(f"{name}: {us(fn)} (err {err:.1e})", flush=True)

        if patches_only:
            patches_rows(x, w, b, ref)
            continue
        row("cudnn C=3", lambda: torch.cudnn_convolution_relu(x, w, b, [2, 2], [3, 3], [1, 1], 1))
        for c in (4, 8):
            xc = F.pad(x.permute(0, 2, 3, 1), (0, c - 3)).permute(0, 3, 1, 2)  # channels-last, zero channels
            wc = F.pad(w.permute(0, 2, 3, 1), (0, c - 3)).permute(0, 3, 1, 2)
            row(f"cudnn C={c} (padded outside the timing)",
                lambda xc=xc, wc=wc: torch.cudnn_convolution_relu(xc, wc, b, [2, 2], [3, 3], [1, 1], 1))
        for k_pad in (147, 160):
            row(f"im2col K={k_pad} + addmm relu", lambda k_pad=k_pad: im2col_gemm(x, w, b, k_pad))
        for cfg in TRITON:
            row(f"triton flat {cfg.name}", lambda cfg=cfg: conv.conv2d(node, x, w, b, config=cfg))
        if batch > 1:
            patches_rows(x, w, b, ref)


def patches_rows(x, w, b, ref) -> None:
    """passes/stem_patches.py's form: the FP32 NCHW image (as engines get it) -> stem patches -> a stride-1 4x1
    convolution over 64 channels: the patches (FP16, INT8, FP8, and per block of pixels), the 4x1 convolution per
    tile (cuDNN for FP16), and the 8-bit max pool after it per launch shape."""
    from kiln.kernels import pool as pool_kernel
    from kiln.kernels import stem_patches, tma_conv
    from kiln.passes.insert_qdq import quantize_weight, quantize_weight_fp8
    from kiln.passes.stem_patches import geometry, patch_weights

    image = x.float().contiguous()  # FP32 NCHW
    conv_node = Node("Conv", ["x", "w"], ["y"], {"strides": [2, 2], "pads": [3, 3, 3, 3]})
    geo = geometry(conv_node, tuple(image.shape), w)
    pn = Node("StemPatches", ["x"], ["p"], {"channels": 4, "first": geo["first"], "columns": geo["columns"],
                                           "width": geo["width"]}, domain="kiln")
    wp = patch_weights(w.float().cpu(), geo).to(x.device)
    amax = image.abs().max()
    p16 = stem_patches.stem_patches(pn, image.half())
    w16 = wp.half().contiguous(memory_format=torch.channels_last)
    print(f"stem patches FP16: {us(lambda: stem_patches.stem_patches(pn, image.half()))}")
    # symmetric padding 2: one output row more than the stem's (cuDNN takes no asymmetric padding)
    print(f"FP16 4x1 over patches, cuDNN: "
          f"{us(lambda: torch.cudnn_convolution_relu(p16, w16, b, [1, 1], [2, 0], [1, 1], 1))}", flush=True)
    for qtype, qmax in (("int8", 127.0), ("fp8", 448.0)):
        xs = (amax / qmax).reshape(())
        wq, ws = quantize_weight(wp, 0) if qtype == "int8" else quantize_weight_fp8(wp)
        wq = wq.contiguous(memory_format=torch.channels_last)
        ws = ws.to(x.device).float().reshape(-1).expand(64).contiguous()
        ys = (ref.abs().max() / qmax).reshape(())
        qn = Node("QConv", ["p", "w"], ["y"], {"kernel_shape": [geo["rows"], 1], "strides": [1, 1], "pads": geo["pads"],
                                              "dilations": [1, 1], "group": 1, "activation": "Relu",
                                              "activation_params": [], "qtype": qtype}, domain="kiln")
        p = stem_patches.stem_patches(pn, image, xs, qtype)
        print(f"stem patches {qtype}: {us(lambda p=p: stem_patches.stem_patches(pn, image, xs, qtype))}")
        offered = [(cfg, f"level {level}", None) for cfg, level in tma_conv.QUANT_CONFIGS]
        for cfg, per_sm in [(c, n) for c in STEM_TILES for n in (1, 2, 3)]:
            offered.append((cfg, f"{per_sm} per SM, not offered", per_sm))
        for cfg, what, per_sm in offered:
            if not tma_conv.supports(qn, p, wq, b, None, cfg, qtype):
                continue

            def run(cfg=cfg, p=p, per_sm=per_sm):
                return tma_conv.conv2d(qn, p, wq, b, config=cfg, x_scale=xs, w_scale=ws, y_scale=ys,
                                       out_dtype=torch.float16, programs_per_sm=per_sm)
            err = (run().float() * ys - ref).abs().max().item()
            print(f"{qtype} 4x1 over patches, TMA {cfg.name} ({what}): {us(run)} (err {err:.1e} of "
                  f"{ref.abs().max().item():.1f})", flush=True)
        for block_p in (16, 32, 64, 128, 256):
            print(f"stem patches {qtype}, {block_p} pixels a program: "
                  f"{us(lambda bp=block_p: stem_patches.stem_patches(pn, image, xs, qtype, block_p=bp))}")
        pool = Node("MaxPool", ["y", "s"], ["p"], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                                  "qtype": qtype, "x_quantized": 1})
        y8 = run()
        for block_p, block_c in ((32, 64), (64, 64), (128, 64), (256, 64), (64, 32)):
            print(f"max pool over the 8-bit stem output, {block_p}x{block_c}: "
                  f"{us(lambda bp=block_p, bc=block_c: pool_kernel.max_pool2d(pool, y8, ys, qtype, bp, bc))}")


if __name__ == "__main__":
    main()
