"""The TMA convolution (kiln/kernels/tma_conv.py) against cuDNN and conv.py's pointer kernel, each
configuration alone, at ResNet-50's batch-32 3x3 convolutions and stride-2 downsamples (bias + ReLU), FP16,
INT8 and FP8.

Times are kiln.tactics.timer.median_ms (CUDA-graph replays, as the builder's selector times tactics), us.
8-bit layers read 8-bit x and write the next layer's 8-bit input, as in an INT8 engine; their outputs are
compared with conv.py's (the same integer sums and epilogue), FP16 ones with cuDNN's.

    python bench/conv_sweep.py [--batch 32] [--quantized-only] [LAYER...] > bench/results/H200-conv-sweep.log  (GPU)
    python bench/conv_sweep.py --quantized-only --tiles 8x32x64x128_w4_s4,... layer1    (these 8-bit tiles instead)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.ir.graph import Node  # noqa: E402
from kiln.kernels import conv, tma_conv  # noqa: E402
from kiln.kernels.tma_conv import PatchConfig  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

F16 = [PatchConfig(8, 16, 64, 64, 4, 4), PatchConfig(8, 16, 128, 64, 8, 3), PatchConfig(8, 8, 128, 64, 4, 4),
       PatchConfig(16, 8, 128, 64, 8, 4), PatchConfig(8, 16, 256, 64, 8, 3), PatchConfig(1, 64, 128, 64, 4, 4)]
Q8 = [PatchConfig(8, 16, 64, 128, 4, 4), PatchConfig(8, 16, 128, 128, 8, 3), PatchConfig(16, 8, 128, 128, 8, 3),
      PatchConfig(8, 8, 128, 128, 4, 4), PatchConfig(8, 16, 128, 128, 4, 4), PatchConfig(16, 16, 128, 128, 8, 3),
      PatchConfig(8, 8, 64, 128, 4, 5), PatchConfig(8, 16, 64, 128, 4, 2), PatchConfig(8, 8, 64, 128, 4, 3)]
POINTER = [t for t, level in conv.QUANT_CONFIGS if level == 3]
# (name, input H = W, input channels, output channels, kernel, stride)
SHAPES = [("layer1 3x3", 56, 64, 64, 3, 1), ("layer2 3x3", 28, 128, 128, 3, 1), ("layer3 3x3", 14, 256, 256, 3, 1),
          ("layer4 3x3", 7, 512, 512, 3, 1), ("layer2.0 3x3 stride 2", 56, 128, 128, 3, 2),
          ("layer3.0 3x3 stride 2", 28, 256, 256, 3, 2), ("layer4.0 3x3 stride 2", 14, 512, 512, 3, 2),
          ("layer2.0 downsample", 56, 256, 512, 1, 2), ("layer3.0 downsample", 28, 512, 1024, 1, 2),
          ("layer4.0 downsample", 14, 1024, 2048, 1, 2)]


def us(fn) -> str:
    try:
        return f"{median_ms(fn, runs=20) * 1000:.1f}"
    except Exception as e:  # a configuration that does not compile or run here
        return f"fail {type(e).__name__}: {str(e)[:200]}"


def node(k, stride, qtype=""):
    p = k // 2
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [p] * 4, "dilations": [1, 1], "group": 1,
             "activation": "Relu", "activation_params": []}
    if qtype:
        attrs.update(qtype=qtype, x_quantized=1, float_type="float16")
    return Node("QConv" if qtype else "FusedConv", ["x", "w", "b"], ["y"], attrs, domain="kiln")


def parse_tile(name: str) -> PatchConfig:
    """A PatchConfig from its name, e.g. 8x32x64x128_w4_s4."""
    dims, warps, stages = name.split("_")
    return PatchConfig(*(int(d) for d in dims.split("x")), int(warps[1:]), int(stages[1:]))


def sweep(batch, hw, c, oc, k, stride, flops, float16=True, q8=Q8):
    def tops(t):
        try:
            return f"{float(t):8.1f} us {flops / float(t) / 1e6:6.0f} TOPS"
        except ValueError:
            return t

    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(batch, c, hw, hw, device="cuda").half().to(memory_format=cl)
    w = (torch.randn(oc, c, k, k, device="cuda") / (k * k * c) ** 0.5).half().to(memory_format=cl)
    b = torch.randn(oc, device="cuda").half()
    n16 = node(k, stride)
    geo = dict(stride=stride, padding=k // 2)
    ref = F.relu(F.conv2d(x, w, b, **geo))
    rows = [f"cudnn conv2d + relu  {tops(us(lambda: F.relu_(F.conv2d(x, w, b, **geo))))}"]
    for cfg in F16 if float16 else []:
        if not tma_conv.supports(n16, x, w, b, None, cfg):
            rows.append(f"tma fp16 {cfg.name} not supported")
            continue
        t = us(lambda cfg=cfg: tma_conv.conv2d(n16, x, w, b, config=cfg))
        err = (tma_conv.conv2d(n16, x, w, b, config=cfg).float() - ref.float()).abs().max().item()
        rows.append(f"tma fp16 {cfg.name}  {tops(t)}  (err vs cuDNN {err:.1e})")
    for qtype, dt, qmax in (("int8", torch.int8, 127.0), ("fp8", torch.float8_e4m3fn, 448.0)):
        sx = torch.tensor(4.0 / qmax, device="cuda")
        sw = w.float().abs().amax((1, 2, 3)) / qmax if qtype == "int8" else (w.float().abs().amax() / qmax).reshape(1)
        ys = torch.tensor(4.0 / qmax, device="cuda")

        def q(t, s):
            t = (t.float() / s).clamp(-qmax, qmax)
            return (t.round() if qtype == "int8" else t).to(dt)

        x8 = q(x, sx).to(memory_format=cl)
        w8 = q(w, sw.reshape(-1, 1, 1, 1)).to(memory_format=cl)
        n8 = node(k, stride, qtype)
        kw = dict(x_scale=sx, w_scale=sw, y_scale=ys, out_dtype=torch.float16)
        want = conv.conv2d(n8, x8, w8, b, config=POINTER[0], **kw)
        for cfg in POINTER:
            t = us(lambda cfg=cfg: conv.conv2d(n8, x8, w8, b, config=cfg, **kw))
            rows.append(f"conv.py {qtype} {cfg.name}  {tops(t)}")
        for cfg in q8:
            if not tma_conv.supports(n8, x8, w8, b, None, cfg, qtype):
                rows.append(f"tma {qtype} {cfg.name} not supported")
                continue
            for per_sm in (1, 2, 3) if cfg.num_warps == 4 else (1,):  # 4-warp programs may share an SM
                run = dict(kw, config=cfg, programs_per_sm=per_sm)
                t = us(lambda run=run: tma_conv.conv2d(n8, x8, w8, b, **run))
                try:
                    got = tma_conv.conv2d(n8, x8, w8, b, **run)
                    same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                except Exception as e:
                    same = f"fail {type(e).__name__}"
                rows.append(f"tma {qtype} {cfg.name} x{per_sm}/SM  {tops(t)}  (equal to conv.py: {same})")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--quantized-only", action="store_true", help="skip the 16-bit TMA tiles")
    p.add_argument("--tiles", default="", help="comma-separated 8-bit tiles to time instead of the usual ones")
    p.add_argument("layers", nargs="*", help="only the layers whose names start so, e.g. layer1")
    args = p.parse_args()
    q8 = [parse_tile(t) for t in args.tiles.split(",")] if args.tiles else Q8
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, hw, c, oc, k, stride in SHAPES:
        if args.layers and not any(name.startswith(o) for o in args.layers):
            continue
        out = hw // stride
        flops = 2 * args.batch * out * out * c * oc * k * k
        print(f"\n## {name}: batch {args.batch}, {hw}x{hw}, {c} -> {oc} channels, {k}x{k} stride {stride}, "
              f"{flops / 1e9:.1f} GFLOP", flush=True)
        print("\n".join(sweep(args.batch, hw, c, oc, k, stride, flops, not args.quantized_only, q8)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
