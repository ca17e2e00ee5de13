"""One 8-bit Kiln kernel at one ResNet-50 batch-32 layer, called four times, for Nsight Compute to read the hardware
counters of the fourth call (what holds the layer: memory, L2, issue, or waiting on the Tensor Cores or the copy
engine). The layers and tiles are the ones an INT8 engine ran (bench/results/H200-quant-1055-resnet50.md).

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
        --section WarpStateStats -k regex:_tma -s 3 -c 1 python bench/ncu_layers.py LAYER      (GPU)
    scripts/ncu-layers          (every layer here, one ncu run each, logs under $OUT)

LAYER: layer1-conv3 (1x1 64->256, 8-bit residual and output), layer1-conv3-ws (the same on ws_gemm's 128x128 tile,
which both 8-bit engines took, bench/results/H200-quant-1519-resnet50-timed-first.md), layer1-3x3,
layer2-3x3, layer4-3x3; bert-attention (BERT-base batch 32's FP8 flash attention).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.conv_sweep import node  # noqa: E402
from bench.tma_sweep import engine_operands  # noqa: E402
from kiln.kernels import tma_conv, tma_gemm  # noqa: E402
from kiln.kernels.gemm import TileConfig  # noqa: E402
from kiln.kernels.tma_conv import PatchConfig  # noqa: E402

# name: (input H = W, channels in, channels out, the tile the engine took)
CONVS = {"layer1-3x3": (56, 64, 64, PatchConfig(8, 32, 64, 128, 4, 3)),
         "layer2-3x3": (28, 128, 128, PatchConfig(8, 8, 128, 128, 4, 4)),
         "layer4-3x3": (7, 512, 512, PatchConfig(8, 8, 128, 128, 4, 4))}


def attention_call():
    """BERT-base batch 32's FP8 attention (q, k, v as FP8 codes of one fused projection, FP8 output) on attention.py's
    kernel at the FP8 engine's tile."""
    from bench.attention_sweep import operands
    from kiln.kernels import attention

    q, k, v, mask = operands(32, 128, 12, 64, True)
    scale = torch.tensor(max(t.abs().max().item() for t in (q, k, v)) / 448, device="cuda")
    q8, k8, v8 = ((t.float() / scale).to(attention.FP8) for t in (q, k, v))
    kw = dict(qkv_scale=scale, y_scale=torch.tensor(0.01, device="cuda"), qtype="fp8")
    return lambda: attention.flash_attention(q8, k8, v8, mask, config=attention.FlashConfig(128, 32, 4, 3), **kw)


def layer(name: str):
    """The kernel call of `name`, its operands made on the GPU."""
    if name == "bert-attention":
        return attention_call()
    if name == "layer1-conv3":
        x8, w8, b, kw, _ = engine_operands(100352, 64, 256, True, "int8", False)
        return lambda: tma_gemm.gemm(x8, w8, b, "Relu", config=TileConfig(128, 128, 64, 4, 3), **kw)
    if name == "layer1-conv3-ws":
        from kiln.kernels import ws_gemm

        cl = torch.channels_last
        x8 = torch.randint(-128, 128, (32, 64, 56, 56), dtype=torch.int8, device="cuda").to(memory_format=cl)
        z8 = torch.randint(-128, 128, (32, 256, 56, 56), dtype=torch.int8, device="cuda").to(memory_format=cl)
        w8 = torch.randint(-127, 128, (256, 64, 1, 1), dtype=torch.int8, device="cuda").to(memory_format=cl)
        one = node(1, 1, "int8")
        one.attrs["pads"] = [0] * 4
        s, ws = torch.tensor(0.05, device="cuda"), torch.rand(256, device="cuda") * 1e-3
        b = torch.randn(256, device="cuda").half()
        cfg = ws_gemm.WsGemmConfig(128, 128, 2, 2)
        return lambda: ws_gemm.matmul8(one, x8, w8, b, z8, cfg, s, ws, s, s)
    hw, c, oc, tile = CONVS[name]
    cl = torch.channels_last
    x8 = torch.randint(-128, 128, (32, c, hw, hw), dtype=torch.int8, device="cuda").to(memory_format=cl)
    w8 = torch.randint(-127, 128, (oc, c, 3, 3), dtype=torch.int8, device="cuda").to(memory_format=cl)
    b = torch.randn(oc, device="cuda").half()
    kw = dict(x_scale=torch.tensor(0.02, device="cuda"), w_scale=torch.rand(oc, device="cuda") * 1e-3,
              y_scale=torch.tensor(0.05, device="cuda"), out_dtype=torch.float16)
    return lambda: tma_conv.conv2d(node(3, 1, "int8"), x8, w8, b, config=tile, **kw)


def main() -> int:
    call = layer(sys.argv[1])
    for _ in range(4):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
