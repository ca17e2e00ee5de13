"""Does cuDNN's graph API run ResNet-50's convolutions in FP8 (or INT8) faster than FP16 on this GPU, with the
epilogue an 8-bit Kiln layer needs (per-channel weight scale, bias, residual, ReLU, 8-bit output)? Each of
ResNet-50's batch-32 convolution shapes is built as a cuDNN graph through the cudnn-frontend Python package,
every execution plan cuDNN offers is timed the way Kiln's tactic timer times a candidate (ten calls in a CUDA
graph, median of ten replays), and the best is set against torch's FP16 channels-last convolution (cuDNN).

    python bench/cudnn_fp8_conv.py   (needs `pip install nvidia-cudnn-frontend`)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from kiln.tactics.timer import median_ms  # noqa: E402

# name, channels in, channels out, kernel, stride, input size (batch 32, NHWC)
SHAPES = [("layer1 3x3", 64, 64, 3, 1, 56), ("layer2 3x3", 128, 128, 3, 1, 28), ("layer3 3x3", 256, 256, 3, 1, 14),
          ("layer4 3x3", 512, 512, 3, 1, 7), ("layer2.0 3x3 s2", 128, 128, 3, 2, 56),
          ("layer1 1x1 64->256 +res", 64, 256, 1, 1, 56), ("layer1 1x1 256->64", 256, 64, 1, 1, 56),
          ("layer3 1x1 256->1024 +res", 256, 1024, 1, 1, 14)]
BATCH = 32
PLANS = 8  # at most this many of cuDNN's plans timed per graph


def nhwc(n, c, h, w):
    return [n, c, h, w], [c * h * w, 1, c * w, c]


def build(cudnn, handle, c, k, r, stride, hw, qtype, epilogue):
    """The graph and its tensors; epilogue: 'scales' (per-tensor descales, as NVIDIA's FP8 sample) or 'layer'
    (per-channel scale, bias, residual where the name says so, ReLU)."""
    dt = cudnn.data_type
    q = dt.FP8_E4M3 if qtype == "fp8" else dt.INT8
    g = cudnn.pygraph(io_data_type=dt.HALF, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                      handle=handle)
    pad = r // 2
    oh = (hw + 2 * pad - r) // stride + 1
    x = g.tensor(name="x", dim=nhwc(BATCH, c, hw, hw)[0], stride=nhwc(BATCH, c, hw, hw)[1], data_type=q)
    w = g.tensor(name="w", dim=nhwc(k, c, r, r)[0], stride=nhwc(k, c, r, r)[1], data_type=q)
    y = g.conv_fprop(image=x, weight=w, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                     compute_data_type=dt.INT32 if qtype == "int8" else dt.FLOAT)
    per = [1, k, 1, 1], [k, 1, k, k]
    one = [1, 1, 1, 1], [1, 1, 1, 1]
    ts = {"x": x, "w": w}
    if epilogue == "scales":
        ts["s"] = g.tensor(name="s", dim=one[0], stride=one[1], data_type=dt.FLOAT)
        y = g.mul(a=y, b=ts["s"])
    else:
        ts["s"] = g.tensor(name="s", dim=per[0], stride=per[1], data_type=dt.FLOAT)
        ts["b"] = g.tensor(name="b", dim=per[0], stride=per[1], data_type=dt.FLOAT)
        y = g.add(a=g.mul(a=y, b=ts["s"]), b=ts["b"])
        if epilogue == "layer+res":
            ts["z"] = g.tensor(name="z", dim=nhwc(BATCH, k, oh, oh)[0], stride=nhwc(BATCH, k, oh, oh)[1], data_type=q)
            ts["zs"] = g.tensor(name="zs", dim=one[0], stride=one[1], data_type=dt.FLOAT)
            y = g.add(a=y, b=g.mul(a=ts["z"], b=ts["zs"]))
        y = g.relu(input=y)
    ts["ys"] = g.tensor(name="ys", dim=one[0], stride=one[1], data_type=dt.FLOAT)
    y = g.mul(a=y, b=ts["ys"])
    y.set_output(True).set_data_type(q)
    ts["y"] = y
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    return g, ts, oh


def buffers(ts, c, k, r, hw, oh, qtype):
    q = torch.float8_e4m3fn if qtype == "fp8" else torch.int8
    rnd = lambda *s: (torch.randn(*s, device="cuda") * 2).to(q)  # noqa: E731
    out = {"x": rnd(BATCH, hw, hw, c), "w": rnd(k, r, r, c), "y": torch.empty(BATCH, oh, oh, k, device="cuda").to(q)}
    for name in ("s", "b", "zs", "ys"):
        if name in ts:
            out[name] = torch.full((ts[name].get_dim()[1],), 0.01, device="cuda")
    if "z" in ts:
        out["z"] = rnd(BATCH, oh, oh, k)
    return out


def main() -> int:
    import cudnn

    handle = cudnn.create_handle()
    print(f"# cuDNN {cudnn.backend_version_string()} graph API, 8-bit convolutions at ResNet-50 batch 32, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn-frontend {cudnn.__version__}\n")
    print("| shape | FP16 torch us | variant | plans (build) | best plan us | vs FP16 | best plan |")
    print("|---|---|---|---|---|---|---|")
    torch.backends.cudnn.benchmark = True
    for name, c, k, r, stride, hw in SHAPES:
        x16 = torch.randn(BATCH, c, hw, hw, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
        w16 = torch.randn(k, c, r, r, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
        conv16 = lambda: torch.nn.functional.conv2d(x16, w16, stride=stride, padding=r // 2)  # noqa: E731
        fp16_us = 1000 * median_ms(conv16)
        variants = [("fp8", "scales"), ("fp8", "layer+res" if "+res" in name else "layer"), ("int8", "layer")]
        for qtype, epilogue in variants:
            label = f"{qtype} {epilogue}"
            t0 = time.perf_counter()
            try:
                g, ts, oh = build(cudnn, handle, c, k, r, stride, hw, qtype, epilogue)
            except Exception as e:  # not supported: say why, in one line
                print(f"| {name} | {fp16_us:.1f} | {label} | - | not supported: {str(e).splitlines()[0][:150]} | | |")
                continue
            bufs = buffers(ts, c, k, r, hw, oh, qtype)
            pack = {ts[n]: t for n, t in bufs.items()}
            best = None
            build_s = time.perf_counter() - t0
            for i in range(min(PLANS, g.get_execution_plan_count())):
                ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), device="cuda", dtype=torch.uint8)

                def run(i=i, ws=ws):
                    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
                    g.execute_plan_at_index(pack, ws, i, handle=handle)

                try:
                    us = 1000 * median_ms(run)
                except Exception as e:
                    print(f"| {name} | {fp16_us:.1f} | {label} | plan {i} | failed: {str(e).splitlines()[0][:120]} |"
                          " | |")
                    continue
                if best is None or us < best[0]:
                    best = (us, g.get_plan_name_at_index(i))
            if best is not None:
                print(f"| {name} | {fp16_us:.1f} | {label} | {g.get_execution_plan_count()} ({build_s:.1f} s) | "
                      f"{best[0]:.1f} | {best[0] / fp16_us:.2f}x | `{best[1][:70]}` |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
