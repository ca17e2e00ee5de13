"""ResNet-50 (random weights) INT8/FP8 engines against onnxruntime on the CPU: the output error as a share of the
output range, the number bench/run.py checks on the GPU (tolerance 0.1), and which 8-bit links the build made (the
stem pool's 8-bit output, the stage shortcuts written in 8 bits, the 8-bit stem over patches). --without-shortcuts
builds as before the shortcut link, --float-stem without passes/stem_patches.py, for an A/B of their accuracy cost.

    python bench/resnet50_cpu_accuracy.py [--batch 8] [--without-shortcuts] [--float-stem]   (a minute per engine)
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
from bench.models import export_onnx, resnet50  # noqa: E402
from kiln.builder import quantized_io  # noqa: E402
from kiln.passes import stem_patches  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--without-shortcuts", action="store_true")
    ap.add_argument("--float-stem", action="store_true")
    a = ap.parse_args()
    import onnxruntime as ort

    if a.without_shortcuts:
        quantized_io._quantized_shortcuts = lambda graph: None
    if a.float_stem:
        stem_patches.run = lambda graph: None
    model, names, make = resnet50()
    g = torch.Generator().manual_seed(0)
    path = export_onnx(model, names, make(2, g), a.batch, Path(tempfile.mkdtemp()) / "resnet50.onnx")
    calib = [{k: v.numpy() for k, v in make(a.batch, g).items()} for _ in range(max(1, 128 // a.batch))]
    x = {k: v.numpy() for k, v in make(a.batch, g).items()}
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, x)[0]
    prof = [kiln.Profile({"x": ((a.batch, 3, 224, 224),) * 3})]
    print(f"# ResNet-50 batch {a.batch} on the CPU against onnxruntime; torch {torch.__version__}; "
          f"{'without' if a.without_shortcuts else 'with'} 8-bit shortcuts; "
          f"{'float' if a.float_stem else '8-bit'} stem")
    for qtype in ("int8", "fp8"):
        t0 = time.perf_counter()
        engine = kiln.build(path, kiln.BuildConfig(device="cpu", progress=False, profiles=prof, calib=calib,
                                                   **{qtype: True}))
        pools = sum(n.op_type == "MaxPool" and len(n.inputs) > 1 for n in engine.graph.nodes)
        shortcuts = sum(n.op_type == "QConv" and len(n.inputs) > 6 and n.inputs[6].endswith(".shortcut_scale")
                        for n in engine.graph.nodes)
        stem = any(n.op_type == "StemPatches" for n in engine.graph.nodes)
        got = next(iter(engine.create_execution_context().run(x).values()))
        err = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
        print(f"{qtype}: error {err:.3e} of the range; 8-bit pool outputs {pools}, 8-bit shortcuts {shortcuts}, "
              f"8-bit stem {'yes' if stem else 'no'}; build {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
