"""INT8 QAT wins back what INT8 PTQ loses when rare outlier samples set the activation ranges.

The data is bench/accuracy.py's `synth` task (make_classification: 10 classes, 32 features; held-out
split of 1200) with 1% of the samples (60 of 6000, in both splits) recorded at 30x scale, as unnormalized
or mis-scaled records would be; every feature is then standardized with the training split's statistics.
The benchmark's small MLP (32-64-64-64-10) is trained on it to convergence. With MinMax calibration on
256 training samples (2-4 outliers among them), every layer's per-tensor INT8 input range is set by
the outliers: the first layer's amax is ~20-25 against a bulk whose 99.9th percentile of |x| is ~1.1,
so most inputs land on a handful of levels. QAT starts from those same MinMax scales and fine-tunes
weights and LSQ steps for 10 epochs (Adam 1e-3): the steps shrink (first layer amax to ~4-7), i.e. QAT
learns to clip the outliers. Clipping costs some of the ~10 outlier test samples (e.g. 9 of 10 right
-> 7 of 10 on seed 0), far less than the bulk gains.

Measured on seeds 0-4 (held-out top-1, %; PTQ and QAT are the fake-quantized torch module, UINT8 after
ReLUs, per-channel INT8 weights; Kiln's engine from the QAT Q/DQ export made identical predictions on
all five seeds):

    seed  FP32   PTQ minmax  QAT (from minmax)  FP32 fine-tuned (control)  PTQ entropy  PTQ pct 99.99
    0     72.42  68.33       71.92              72.67                      70.33        70.42
    1     71.83  68.83       70.25              71.50                      71.00        69.75
    2     74.08  68.42       73.58              73.33                      70.92        69.75
    3     71.00  68.42       70.92              71.67                      69.92        68.75
    4     75.08  71.75       75.17              75.00                      74.33        71.42

(Those were measured in November 2026. With scikit-learn 1.9.1, numpy 2.4.6 and torch 2.14.1, on 2026-12-01,
seed 0 gives FP32 70.00, PTQ 67.00, QAT 71.83, control 71.25: the control gained 1.25, QAT 4.83.)

PTQ loses 2.6-5.7 points; QAT wins back 1.4-5.2 of them (ending 0.1-1.6 below FP32, or 0.1 above on seed 4).
The control (the FP32 net fine-tuned with the same epochs and rate) moves -0.75 to +0.67, so extra training
does not explain the gain. QAT with the steps frozen at the MinMax values gains -0.33 to +2.92, so learning
the steps adds 1.3-3.8 points on every seed. Entropy calibration alone recovers 1.5-2.6 points, but QAT ends
above it on 4 of 5 seeds (seed 1: 70.25 vs 71.00); Percentile (99.99) recovers -0.3 to +2.1. QAT started
from entropy scales instead reaches 71.33 / 70.92 / 73.08 / 71.50 / 75.50. Kiln's own INT8 PTQ engine
(`kiln.build(int8=True, calib_method=...)`, symmetric signed activations also after ReLUs) loses more:
minmax 63.42 / 68.50 / 64.25 / 63.92 / 67.25, entropy 69.33 / 70.33 / 68.17 / 68.17 / 72.92 (on seeds 0 and
2 exactly what the fake-quantized module gives with every input quantizer signed). This test runs seed 0
(about 30 s on 2 CPU cores) and asserts with margin.
"""

import copy
import importlib.util
from pathlib import Path

import numpy as np
import torch

import kiln
from kiln.examples import digits
from kiln.quant import qat

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "accuracy.py"
SEED, OUTLIER_FRACTION, OUTLIER_SCALE = 0, 0.01, 30.0
QAT_EPOCHS, QAT_LR = 10, 1e-3


def _bench():
    """bench/accuracy.py as a module: the test uses the benchmark's data split, model and training recipe."""
    spec = importlib.util.spec_from_file_location("kiln_bench_accuracy", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _outlier_split(bench, seed: int):
    """The synth task with 1% of the samples scaled by 30 before the split and standardization."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=6000, n_features=bench.SYNTH_FEATURES, n_informative=24, n_redundant=8,
                               n_classes=bench.SYNTH_CLASSES, n_clusters_per_class=2, class_sep=1.0,
                               random_state=seed)
    x = x.astype(np.float32)
    rows = np.random.default_rng(seed).choice(len(x), int(round(OUTLIER_FRACTION * len(x))), replace=False)
    x[rows] *= OUTLIER_SCALE
    return bench.standardized_split(x, y, seed)


def _quantized(net, x_tr, y_tr, epochs: int):
    """W8A8 fake-quantized copy of net, input scales from MinMax calibration on 256 training samples
    (epochs=0: that is PTQ), then QAT."""
    q = qat.prepare(copy.deepcopy(net), bits=8, weight_bits=8, calib=torch.from_numpy(x_tr[:256]),
                    calib_method="minmax")
    return digits.fit(q, x_tr, y_tr, epochs, QAT_LR) if epochs else q.eval()


def test_int8_qat_recovers_what_minmax_ptq_loses_to_outlier_samples():
    bench = _bench()
    x_tr, y_tr, x_te, y_te = _outlier_split(bench, SEED)
    net = bench.small_mlp(x_tr, y_tr, seed=SEED, epochs=40)
    ptq = _quantized(net, x_tr, y_tr, 0)
    tuned = _quantized(net, x_tr, y_tr, QAT_EPOCHS)
    control = digits.fit(copy.deepcopy(net), x_tr, y_tr, QAT_EPOCHS, QAT_LR)
    acc = {k: digits.accuracy(m, x_te, y_te)
           for k, m in (("fp32", net), ("ptq", ptq), ("qat", tuned), ("control", control))}
    print("outlier synth held-out top-1:", {k: round(v, 2) for k, v in acc.items()})
    first = lambda q: float(q[0].input_quant.step().detach()) * q[0].input_quant.qrange[1]  # noqa: E731
    assert acc["ptq"] <= acc["fp32"] - 2.0  # seed 0: -4.08; the outliers' range costs INT8 PTQ accuracy...
    assert acc["qat"] >= acc["ptq"] + 2.0  # seed 0: +3.58; ...which QAT wins back,
    assert first(tuned) < 0.5 * first(ptq)  # by learning to clip (first layer amax 24.7 -> 7.1 on seed 0),
    # and not by extra training: the control gains far less (seed 0: +0.25, and +1.25 against QAT's +4.83 over
    # PTQ with scikit-learn 1.9.1, numpy 2.4.6, torch 2.14.1)
    assert acc["qat"] - acc["ptq"] >= acc["control"] - acc["fp32"] + 2.0
    # Kiln's engine from the Q/DQ export computes what the fake-quantized module does.
    model = qat.export_onnx(tuned, (torch.from_numpy(x_te[:2]),), input_names=["features"])
    f = bench.SYNTH_FEATURES
    prof = kiln.Profile({"features": ((1, f), (64, f), (len(x_te), f))})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof]))
    y = next(iter(engine.create_execution_context().run({"features": x_te}).values()))
    pred = np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y).argmax(1)
    with torch.inference_mode():
        want = tuned(torch.from_numpy(x_te)).argmax(1).numpy()
    assert int((pred != want).sum()) <= 2
    assert abs(100.0 * float((pred == y_te).mean()) - acc["qat"]) <= 0.25
