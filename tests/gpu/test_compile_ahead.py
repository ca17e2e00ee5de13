"""Compiling tactics ahead in threads (builder/compile_ahead.py) on the GPU: the same candidates are timed, dropped
and chosen from as in a build that compiles each on its first call, and the engine is right."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln

pytestmark = pytest.mark.gpu


def _convs():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
             for n, s in [("w0", (64, 64, 3, 3)), ("w1", (64, 64, 1, 1)), ("b1", (64,))]]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv3x3", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1x1"),
             helper.make_node("Add", ["c1", "r0"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    g = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64, 16, 16])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_ahead_builds_time_what_a_serial_build_times(monkeypatch):
    model = _convs()
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((8, 64, 16, 16)).astype(np.float32)} for _ in range(8)]
    cfg = {"device": "cuda", "progress": False, "precision_constraints": "obey", "fp16": True, "int8": True,
           "calib": calib}
    monkeypatch.setenv("KILN_PARALLEL_COMPILE", "4")
    ahead = kiln.build(model, kiln.BuildConfig(**cfg))
    stats = ahead.build_config["tactic_selection"]
    assert stats["compile_threads"] == 4 and stats["compiled_ahead"] > 0, stats
    monkeypatch.setenv("KILN_PARALLEL_COMPILE", "0")
    serial = kiln.build(model, kiln.BuildConfig(**cfg))
    assert "compile_threads" not in serial.build_config["tactic_selection"]

    def offered(engine):
        return {t["layer"]: (sorted(t["timings"]), sorted(n for n, why in t["excluded"].items()
                                                          if why.startswith(("failed", "numerically"))))
                for t in engine.tactics}

    assert offered(ahead) == offered(serial)
    x = torch.randn(8, 64, 16, 16)
    ref = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False)).create_execution_context().run({"x": x})
    out = ahead.create_execution_context().run({"x": x.cuda()})
    torch.testing.assert_close(out["y"].float().cpu(), ref["y"], rtol=0.25, atol=0.25)
