"""BERT-base (random weights) FP8 engine against onnxruntime on the CPU: the output error as a share of the output
range, the number bench/run.py checks on the GPU (tolerance 0.1), and how many GEMMs hand their norm FP8 codes
(engine/quantized_io._fp8_norm_inputs). --without-fp8-norm-inputs builds as before that link, for an A/B of its
accuracy cost.

    python bench/bert_cpu_accuracy.py [--batch 2] [--calib-batches 16] [--without-fp8-norm-inputs]   (minutes)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import kiln  # noqa: E402
from bench.models import bert_base, export_onnx  # noqa: E402
from kiln.engine import quantized_io  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--calib-batches", type=int, default=16)
    ap.add_argument("--without-fp8-norm-inputs", action="store_true")
    a = ap.parse_args()
    import onnxruntime as ort

    if a.without_fp8_norm_inputs:
        quantized_io._fp8_norm_inputs = lambda graph: None
    model, names, make = bert_base()
    g = torch.Generator().manual_seed(0)
    path = export_onnx(model, names, make(2, g), a.batch, Path(tempfile.mkdtemp()) / "bert-base.onnx")
    calib = [{k: v.numpy() for k, v in make(a.batch, g).items()} for _ in range(a.calib_batches)]
    feeds = [{k: v.numpy() for k, v in make(a.batch, g).items()} for _ in range(3)]
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    refs = [session.run(None, x)[0] for x in feeds]
    prof = [kiln.Profile({k: ((a.batch, 128),) * 3 for k in names})]
    print(f"# BERT-base batch {a.batch} on the CPU against onnxruntime; torch {torch.__version__}; "
          f"{a.calib_batches} calibration batches; {'without' if a.without_fp8_norm_inputs else 'with'} FP8 norm "
          "inputs")
    t0 = time.perf_counter()
    engine = kiln.build(path, kiln.BuildConfig(device="cpu", progress=False, profiles=prof, calib=calib, fp8=True))
    linked = sum(n.op_type == "SkipLayerNorm" and len(n.inputs) > 6 and bool(n.inputs[6]) for n in engine.graph.nodes)
    ctx = engine.create_execution_context()
    errs, rels = [], []
    for x, ref in zip(feeds, refs):
        got = next(iter(ctx.run(x).values()))
        errs.append(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))
        rels.append(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    print(f"fp8: error {max(errs):.3e} of the range (worst of {len(feeds)} batches), rel L2 {np.mean(rels):.3e}; "
          f"norms reading FP8 codes {linked}; build {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
