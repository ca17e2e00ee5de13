"""Held-out accuracy of Kiln engines at every precision on real trained models.

1. The CNN trained on scikit-learn's digits (kiln.examples.digits; held-out split of
   360 images) built at FP32, FP16, BF16, INT8 and FP8 (post-training calibration on
   256 training images), and QAT models (INT8, INT4 weights) exported as Q/DQ ONNX and
   built by Kiln.
2. An MLP trained here on scikit-learn's breast-cancer data (30 features, 2 classes;
   held-out split of 114), exported with kiln.from_torch, at the same precisions.
Every number is the Kiln engine's top-1 on the held-out split.

    python bench/accuracy.py --out bench/results [--device cpu|cuda]
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


def breast_cancer_mlp(work: Path):
    """Train a 30-64-32-2 MLP in seconds; write its ONNX, held-out .npz and calibration .npz."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_te = ((x_tr - mean) / std).astype(np.float32), ((x_te - mean) / std).astype(np.float32)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    digits.fit(net, x_tr, y_tr.astype(np.int64), epochs=60, lr=3e-3)
    batch = torch.export.Dim("batch", min=1, max=1024)
    proto, _ = kiln.from_torch(net, (torch.from_numpy(x_tr[:4]),), dynamic_shapes=({0: batch},),
                               input_names=["features"], output_names=["logits"])
    import onnx

    onnx.save(proto, work / "cancer.onnx")
    np.savez(work / "cancer_test.npz", features=x_te, labels=y_te.astype(np.int64))
    np.savez(work / "cancer_calib.npz", features=x_tr[:256])
    return net, x_tr, y_tr.astype(np.int64), work / "cancer.onnx", work / "cancer_test.npz", work / "cancer_calib.npz"


def measure(rows, model_name, label, model, data, reference, prof, device, **build):
    engine = kiln.build(model, kiln.BuildConfig(device=device, progress=False, profiles=prof, **build))
    m = verify(engine, str(data), reference=str(reference), metrics=["top1"]).metrics[0]
    layers = sorted({n.precision for n in engine.graph.nodes if n.placement == "device"})
    rows.append((model_name, label, m.engine, m.reference, ", ".join(layers)))
    print(f"{model_name:8s} {label:36s} top-1 {m.engine:6.2f}%  (FP32 reference {m.reference:.2f}%)  {layers}", flush=True)


def qat_rows(rows, model_name, net, x_tr, y_tr, data, reference, prof, device, input_name, variants):
    for label, kw, epochs in variants:
        q = qat.prepare(copy.deepcopy(net), **kw)
        qat.calibrate(q, torch.from_numpy(x_tr[:256]))
        if epochs:
            digits.fit(q, x_tr, y_tr, epochs)
        model = qat.export_onnx(q, torch.from_numpy(x_tr[:4]), input_names=[input_name], output_names=["logits"])
        measure(rows, model_name, label, model, data, reference, prof, device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kiln-accuracy-"))
    rows = []
    ptq = [("FP32", {}), ("FP16", {"fp16": True}), ("BF16", {"bf16": True}),
           ("INT8 PTQ (entropy calibration)", {"int8": True}), ("FP8 E4M3 PTQ (entropy calibration)", {"fp8": True})]

    d = digits.prepare(work, seed=0, epochs=10, exporter="onnx")
    prof = [kiln.Profile({"image": ((1, 1, 8, 8), (64, 1, 8, 8), (360, 1, 8, 8))})]
    for label, kw in ptq:
        calib = {"calib": str(d.calib_path)} if kw.get("int8") or kw.get("fp8") else {}
        measure(rows, "digits", label, str(d.onnx_path), d.data_path, d.onnx_path, prof, a.device, **kw, **calib)
    x_tr, y_tr, _, _ = digits.load_split(0)
    qat_rows(rows, "digits", digits.train(0, epochs=10), x_tr, y_tr, d.data_path, d.onnx_path, prof, a.device,
             "image", [("INT8 QAT (W8A8, 2 epochs)", dict(bits=8, weight_bits=8), 2),
                       ("INT4-weight PTQ (W4A8, no training)", dict(bits=8, weight_bits=4), 0),
                       ("INT4-weight QAT (W4A8, 3 epochs)", dict(bits=8, weight_bits=4), 3)])

    net, cx, cy, c_onnx, c_test, c_calib = breast_cancer_mlp(work)
    prof = [kiln.Profile({"features": ((1, 30), (64, 30), (128, 30))})]
    for label, kw in ptq:
        calib = {"calib": str(c_calib)} if kw.get("int8") or kw.get("fp8") else {}
        measure(rows, "cancer", label, str(c_onnx), c_test, c_onnx, prof, a.device, **kw, **calib)
    qat_rows(rows, "cancer", net, cx, cy, c_test, c_onnx, prof, a.device, "features",
             [("INT8 QAT (W8A8, 5 epochs)", dict(bits=8, weight_bits=8), 5),
              ("INT4-weight PTQ (W4A8, no training)", dict(bits=8, weight_bits=4), 0),
              ("INT4-weight QAT (W4A8, 10 epochs)", dict(bits=8, weight_bits=4), 10)])

    lines = [
        "# Held-out accuracy per precision, Kiln engines", "",
        "- digits: CNN on scikit-learn's digits, 360 held-out images (kiln.examples.digits)",
        "- cancer: 30-64-32-2 MLP on scikit-learn's breast-cancer data, 114 held-out samples (trained here)",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat()}",
        f"- command: `python bench/accuracy.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- Kiln engines on the {a.device} target; torch {torch.__version__}",
        "- top-1 of the Kiln engine; the reference is onnxruntime on the FP32 ONNX model", "",
        "| model | build | engine top-1 | FP32 reference | drop (points) | device layer precisions |",
        "|---|---|---|---|---|---|",
    ]
    for model_name, label, eng, ref, layers in rows:
        lines.append(f"| {model_name} | {label} | {eng:.2f}% | {ref:.2f}% | {ref - eng:+.2f} | {layers} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"accuracy-{a.device}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
