"""QAT recovers what INT4-weight PTQ loses: bench/accuracy.py's `synth` setting, on a shorter training run.

The small MLP on make_classification (held-out split of 1200) loses held-out top-1 when
its weights are rounded to per-channel INT4 with no training (PTQ); a few epochs of
QAT fine-tuning win part of it back, and Kiln's engine built from the QAT model's Q/DQ
export makes the same decisions. On seeds 0-5 this instance measured PTQ -1.75 to
-3.33 points and QAT +0.83 to +2.17 points over PTQ; the assertions leave margin.
"""

import importlib.util
from pathlib import Path

import numpy as np
import torch

import kiln
from kiln.examples import digits
from kiln.quant import qat

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "accuracy.py"


def _bench():
    """bench/accuracy.py as a module: the test checks the benchmark's own data, model and QAT recipe."""
    spec = importlib.util.spec_from_file_location("kiln_bench_accuracy", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_int4_qat_recovers_what_ptq_loses():
    bench = _bench()
    x_tr, y_tr, x_te, y_te = bench.synth_split(0)
    net = bench.small_mlp(x_tr, y_tr, seed=0, epochs=20)  # half the benchmark's training, same recipe
    w4 = dict(bits=8, weight_bits=4)
    ptq = bench.qat_model(net, x_tr, y_tr, w4, epochs=0)
    tuned = bench.qat_model(net, x_tr, y_tr, w4, epochs=5, lr=bench.SYNTH_QAT_LR)
    acc = {k: digits.accuracy(m, x_te, y_te) for k, m in (("fp32", net), ("ptq", ptq), ("qat", tuned))}
    print("synth held-out top-1:", {k: round(v, 2) for k, v in acc.items()})
    assert acc["ptq"] <= acc["fp32"] - 1.0  # the setting really loses accuracy to INT4 rounding...
    assert acc["qat"] >= acc["ptq"] + 0.5  # ...and fine-tuning through the fake quantizers wins some back
    # Kiln's engine from the Q/DQ export computes what the fake-quantized module does.
    model = qat.export_onnx(tuned, (torch.from_numpy(x_te[:2]),), input_names=["features"])
    prof = kiln.Profile({"features": ((1, 32), (64, 32), (len(x_te), 32))})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof]))
    y = next(iter(engine.create_execution_context().run({"features": x_te}).values()))
    kiln_acc = 100.0 * float((np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y).argmax(1) == y_te).mean())
    assert abs(kiln_acc - acc["qat"]) <= 0.5
