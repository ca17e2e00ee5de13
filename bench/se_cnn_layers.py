"""The layers of MobileNetV3-Small and EfficientNet-B0 at batch 32, FP16, channels-last, by candidate: every tactic the
builder offers the layer at the default level (those whose applies() takes it) beside the reference, as the
builder's selector times them (kiln.tactics.timer.median_ms: CUDA-graph replays), us. Each candidate's output is
checked against the reference (max abs error over the output's max abs value). Layers: the RGB stems (the
32-filter one over the zero-padded 4-channel image, as the engine runs it), depthwise convolutions with their activation, the
squeeze-excite pools and fully connected 1x1 convolutions.

    python bench/se_cnn_layers.py [--batch 32] [--only stem,dw,pool,fc]        (GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.ir.graph import Node
from kiln.ops.registry import lookup
from kiln.tactics import candidates, load_all
from kiln.tactics.timer import median_ms

# (kind, name, C, H, OC, kernel, stride, activation)
LAYERS = [
    ("stem", "mnv3s stem 3->16 3x3 s2 HardSwish", 3, 224, 16, 3, 2, "HardSwish"),
    ("stem", "effb0 stem 3(4)->32 3x3 s2 Silu", 4, 224, 32, 3, 2, "Silu"),
    ("dw", "mnv3s dw 16@112 3x3 s2 Relu", 16, 112, 16, 3, 2, "Relu"),
    ("dw", "mnv3s dw 576@7 5x5 HardSwish", 576, 7, 576, 5, 1, "HardSwish"),
    ("dw", "effb0 dw 144@56 3x3 Silu", 144, 56, 144, 3, 1, "Silu"),
    ("dw", "effb0 dw 672@14 5x5 Silu", 672, 14, 672, 5, 1, "Silu"),
    ("pool", "effb0 SE pool 32@112", 32, 112, 0, 0, 0, ""),
    ("pool", "effb0 SE pool 1152@7", 1152, 7, 0, 0, 0, ""),
    ("fc", "effb0 SE fc1 96->4 Silu", 96, 1, 4, 1, 1, "Silu"),
    ("fc", "effb0 SE fc2 48->1152 Sigmoid", 48, 1, 1152, 1, 1, "Sigmoid"),
]


def _channels_last_weight(t: torch.Tensor) -> torch.Tensor:
    """As engine.weights_on_target stores a convolution's weight on a GPU."""
    _, c, h, w = t.shape
    return torch.empty_strided(t.shape, (c * h * w, 1, w * c, c), dtype=t.dtype, device=t.device).copy_(t)


def _layer(kind, c, h, oc, k, stride, act, batch):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, c, h, h, device="cuda", generator=g).half().contiguous(memory_format=torch.channels_last)
    if kind == "pool":
        node = Node("ReduceMean", ["x", "axes"], ["y"], {"keepdims": 1}, opset=18)
        return node, [x, torch.tensor([2, 3])]
    if kind == "fc":  # a pooled map: [N, C, 1, 1], as the ReduceMean before it writes it
        x = torch.randn(batch, c, 1, 1, device="cuda", generator=g).half()
    group = c if kind == "dw" else 1
    cin = 1 if kind == "dw" else c
    w = _channels_last_weight((torch.randn(oc, cin, k, k, device="cuda", generator=g) * 0.3).half())
    if kind == "stem" and c == 4:
        w[:, 3] = 0  # the zero fourth channel of builder/layout.py's padded stem (32 filters or more)
    b = torch.randn(oc, device="cuda", generator=g).half()
    node = Node("FusedConv", ["x", "w", "b"], ["y"],
                {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [k // 2] * 4, "group": group,
                 "activation": act, "activation_params": []}, domain="kiln")
    return node, [x, w, b]


def _error(out, ref) -> float:
    out = out[0] if isinstance(out, tuple) else out
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _compile_ahead(layers) -> None:
    """The layers' Triton candidates' first calls (their compiles) in threads, as the builder compiles ahead:
    compiles run outside the GIL, side by side."""
    from concurrent.futures import ThreadPoolExecutor

    def first_call(node, args, t):
        with torch.cuda.stream(torch.cuda.Stream()), contextlib.suppress(Exception):  # failures: reported when timed
            t.fn(node, *args)

    jobs = [(node, args, t) for _, node, args in layers for t in candidates(node)
            if t.level <= 3 and t.name.startswith("triton_") and t.applies(node, args)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: first_call(*j), jobs))
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", default="stem,dw,pool,fc")
    a = ap.parse_args()
    load_all()
    kinds = set(a.only.split(","))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {a.batch}, FP16, us per call")
    layers = []
    for kind, name, c, h, oc, k, stride, act in LAYERS:
        if kind in kinds:
            node, args = _layer(kind, c, h, oc, k, stride, act, a.batch)
            node.precision = "float16"
            layers.append((name, node, args))
    for name, node, args in layers:
        _compile_ahead([(name, node, args)])
        ref_fn = lookup(node.op_type, node.domain).impl
        ref = ref_fn(node, *args)
        times = {"reference": median_ms(lambda f=ref_fn, n=node, a=args: f(n, *a)) * 1e3}
        errors = {}
        for t in candidates(node):
            if t.level > 3 or not t.applies(node, args):
                continue
            try:
                errors[t.name] = _error(t.fn(node, *args), ref)
                times[t.name] = median_ms(lambda f=t.fn, n=node, a=args: f(n, *a)) * 1e3
            except Exception as e:  # noqa: BLE001  (reported, the others still timed)
                print(f"  {t.name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        best = min(times, key=times.get)
        print(f"{name}: best {best} {times[best]:.1f} us, reference {times['reference']:.1f} us")
        for n, us in sorted(times.items(), key=lambda kv: kv[1]):
            err = f"  err {errors[n]:.1e}" if n in errors else ""
            print(f"    {us:8.1f}  {n}{err}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
