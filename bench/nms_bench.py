"""Time NonMaxSuppression on the zoo's detector postprocess (bench/zoo_models.py nms_postprocess: 2000 boxes,
80 classes, at most 20 per class) and check its selection against onnxruntime.

    python bench/nms_bench.py [--device cuda|cpu] [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import zoo_models  # noqa: E402

import kiln  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    spec = zoo_models.by_name(["nms_postprocess"])[0].make("real", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = kiln.build(spec.onnx_path, kiln.BuildConfig(device=a.device, progress=False))
    dev = engine.target.device
    ctx = engine.create_execution_context()
    feeds = {k: torch.from_numpy(v).to(dev) for k, v in spec.feeds.items()}
    got = ctx.run(feeds)
    import onnxruntime as ort

    sess = ort.InferenceSession(spec.onnx_path, providers=["CPUExecutionProvider"])
    want = sess.run(None, spec.feeds)
    same = np.array_equal(got["sel"].cpu().numpy(), want[0])

    def timed(fn) -> float:
        times = []
        for _ in range(a.calls):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    kiln_ms = timed(lambda: ctx.run(feeds))
    ort_ms = timed(lambda: sess.run(None, spec.feeds))
    print(f"nms_postprocess on {engine.target.describe()}: {got['sel'].shape[0]} boxes selected, same as "
          f"onnxruntime: {same}; Kiln {kiln_ms:.2f} ms (median of {a.calls}, whole engine), onnxruntime CPU "
          f"{ort_ms:.2f} ms")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
