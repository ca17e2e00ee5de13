"""Held-out accuracy of Kiln engines at every precision on a real trained model.

The CNN trained on scikit-learn's digits (kiln.examples.digits; held-out split of
360 images) built at FP32, FP16, BF16, INT8 and FP8 (post-training calibration on
256 training images), and QAT models (INT8, INT4 weights) exported as Q/DQ ONNX and
built by Kiln. Every number is the Kiln engine's top-1 on the held-out split.

    python bench/accuracy_digits.py --out bench/results [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import kiln  # noqa: E402
from kiln.examples import digits  # noqa: E402
from kiln.quant import qat  # noqa: E402
from kiln.tools.verify import verify  # noqa: E402


def finetune(net: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, lr: float = 1e-3) -> nn.Module:
    """A user's plain training loop: Adam on weights and learned quantization scales."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(xs), generator=g)
        for i in range(0, len(xs), 64):
            idx = order[i:i + 64]
            loss = nn.functional.cross_entropy(net(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kiln-digits-"))
    d = digits.prepare(work, seed=0, epochs=10, exporter="onnx")
    data, onnx_path = str(d.data_path), str(d.onnx_path)
    prof = [kiln.Profile({"image": ((1, 1, 8, 8), (64, 1, 8, 8), (360, 1, 8, 8))})]
    rows = []

    def measure(label, model, **build):
        engine = kiln.build(model, kiln.BuildConfig(device=a.device, progress=False, profiles=prof, **build))
        res = verify(engine, data, reference=onnx_path, metrics=["top1"])
        m = res.metrics[0]
        layers = sorted({n.precision for n in engine.graph.nodes if n.placement == "device"})
        rows.append((label, m.engine, m.reference, ", ".join(layers)))
        print(f"{label:34s} top-1 {m.engine:6.2f}%  (FP32 reference {m.reference:.2f}%)  layers: {layers}", flush=True)

    calib = str(d.calib_path)
    measure("FP32", onnx_path)
    measure("FP16", onnx_path, fp16=True)
    measure("BF16", onnx_path, bf16=True)
    measure("INT8 PTQ (entropy calibration)", onnx_path, int8=True, calib=calib)
    measure("FP8 E4M3 PTQ (entropy calibration)", onnx_path, fp8=True, calib=calib)

    x_tr, y_tr, _, _ = digits.load_split(0)
    net = digits.train(0, epochs=10)
    for label, kw, epochs in [("INT8 QAT (W8A8, 2 epochs)", dict(bits=8, weight_bits=8), 2),
                              ("INT4-weight PTQ (W4A8, no training)", dict(bits=8, weight_bits=4), 0),
                              ("INT4-weight QAT (W4A8, 3 epochs)", dict(bits=8, weight_bits=4), 3)]:
        q = qat.prepare(copy.deepcopy(net), **kw)
        qat.calibrate(q, torch.from_numpy(x_tr[:256]))
        if epochs:
            finetune(q, x_tr, y_tr, epochs)
        model = qat.export_onnx(q, torch.from_numpy(x_tr[:4]), input_names=["image"], output_names=["logits"])
        measure(label, model)

    lines = [
        "# Held-out accuracy per precision: digits CNN (scikit-learn digits, 360 held-out images)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat()}",
        f"- command: `python bench/accuracy_digits.py {' '.join(argv or sys.argv[1:])}`",
        f"- Kiln engines on {kiln.BuildConfig(device=a.device).device} target; torch {torch.__version__}",
        "- top-1 of the Kiln engine; the reference is onnxruntime on the FP32 ONNX model", "",
        "| build | engine top-1 | FP32 reference | drop (points) | device layer precisions |", "|---|---|---|---|---|",
    ]
    for label, eng, ref, layers in rows:
        lines.append(f"| {label} | {eng:.2f}% | {ref:.2f}% | {ref - eng:+.2f} | {layers} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"digits-accuracy-{a.device}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
