"""What a cold build compiles: superseded candidates pruned below level 4 (tactic_selection.SUPERSEDED), and the
JIT candidates compiled ahead of the timing run (builder/compile_ahead.py, which needs a GPU: its GPU test is
tests/gpu/test_compile_ahead.py; here a recording pool stands in for its threads and streams)."""

import onnx
import torch
from onnx import TensorProto, helper

from kiln import BuildConfig
from kiln.builder import builder, tactic_selection
from kiln.builder.tactic_selection import superseded


def test_pointer_kernels_are_fallbacks_where_a_tma_or_gluon_kernel_applies():
    conv3x3 = ["gluon_ws_qconv_8x8x128x128_s4_x2", "gluon_halo_qconv3x3", "triton_tma_qconv_8x16x64x128_w4_s4",
               "triton_qconv_128x128x64_w8_s3", "cudnn_graph_plan0", "dequantized_conv"]
    out = superseded(conv3x3, 3)
    assert sorted(out) == ["triton_qconv_128x128x64_w8_s3", "triton_tma_qconv_8x16x64x128_w4_s4"]
    assert out["triton_tma_qconv_8x16x64x128_w4_s4"] == ("gluon_ws_qconv_", "gluon_halo_")
    # a 1x1 convolution: the TMA 1x1 tiles stay beside the Gluon ones (they won some ResNet-50 layers)
    conv1x1 = ["gluon_ws_qconv1x1_128x64_s3_x2", "triton_tma_qconv1x1_64x128x128_w4_s4",
               "triton_qconv1x1_128x128x64_w8_s3"]
    assert list(superseded(conv1x1, 3)) == ["triton_qconv1x1_128x128x64_w8_s3"]
    # where nothing better applies (an older GPU, an odd shape) the pointer kernels are the 8-bit kernels
    assert superseded(["triton_qgemm_128x128x64_w8_s3", "cublaslt_int8"], 3) == {}
    assert superseded(["triton_qgemm_128x128x64_w8_s3", "triton_tma_qgemm_128x128x64_w4_s4"], 3)
    assert superseded(conv3x3, 4) == {}  # level 4 and up time everything


def _rig(monkeypatch, names, broken=()):
    """Real tactics for ONNX Relu named `names` (those in `broken` raise), a clock for the timer (CUDA events
    need a GPU) and a log of the calls."""
    from kiln import tactics
    from kiln.tactics import Tactic

    events = []

    def relu_as(name):
        def fn(node, x):
            events.append(("call", name))
            if name in broken:
                raise RuntimeError("this GPU cannot run it")
            return torch.relu(x)
        return fn

    def clock(fn, **kw):
        events.append(("time", None))
        fn()
        return 1.0 if events[-1][0] == "call" else 2.0  # the reference (no tactic called) is slower

    monkeypatch.setitem(tactics._TACTICS, ("", "Relu"), [Tactic(n, relu_as(n), lambda n, a: True) for n in names])
    monkeypatch.setattr(tactic_selection, "median_ms", clock)
    monkeypatch.setattr(tactic_selection, "synchronizes", lambda fn: False)
    return events


def test_a_superseded_candidate_is_timed_only_where_its_superseders_fail(monkeypatch):
    names = ("triton_tma_qgemm_a", "triton_qgemm_b")
    events = _rig(monkeypatch, names)
    engine, config = _relu_engine()
    report = builder._select_tactics(engine, engine.profiles, config, lambda msg: None)
    assert ("call", "triton_qgemm_b") not in events
    assert "superseded" in report[0]["excluded"]["triton_qgemm_b"] and report[0]["chosen"] == "triton_tma_qgemm_a"
    assert engine.build_config["tactic_selection"]["superseded"] == 1

    events = _rig(monkeypatch, names, broken=("triton_tma_qgemm_a",))
    engine, config = _relu_engine()
    report = builder._select_tactics(engine, engine.profiles, config, lambda msg: None)
    assert ("call", "triton_qgemm_b") in events and report[0]["chosen"] == "triton_qgemm_b"
    assert report[0]["excluded"]["triton_tma_qgemm_a"].startswith("failed")


def _relu_engine():
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    graph = helper.make_graph([node], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    config = BuildConfig(device="cpu", progress=False, validate=False)
    return builder.build_engine(onnx.load_from_string(model.SerializeToString()), config), config


def _pool(monkeypatch, events):
    """compile_ahead.CompileAhead's contract, kept in the calling thread: each queued candidate called once."""
    from kiln.builder import compile_ahead

    class Pool:
        def __init__(self, threads, device):
            self.calls = self.failed = 0
            events.append(("pool", threads))

        def submit(self, key, node, args, todo, held, family):
            events.append(("submit", [t.name for t in todo]))
            assert "Relu" in family and held == args  # the input is an activation, not a weight
            for t in todo:
                t.fn(node, *args)
                self.calls += 1

        def finish(self, progress=None):
            events.append(("finish", None))

    monkeypatch.setattr(compile_ahead, "CompileAhead", Pool)


def test_jit_candidates_are_compiled_ahead_and_all_before_the_first_timing(monkeypatch):
    events = _rig(monkeypatch, ("triton_a", "gluon_b", "library_c", "triton_tma_qgemm_d", "triton_qgemm_e"))
    _pool(monkeypatch, events)
    monkeypatch.setenv("KILN_PARALLEL_COMPILE", "4")
    engine, config = _relu_engine()
    builder._select_tactics(engine, engine.profiles, config, lambda msg: events.append(("step", msg)))
    kinds = [k for k, _ in events]
    assert ("pool", 4) in events and ("step", "compiling tactics: 4 threads") in events
    # the library tactic has no compile to make ahead; the superseded one waits for its superseder's timing
    assert ("submit", ["triton_a", "gluon_b", "triton_tma_qgemm_d"]) in events
    assert kinds.index("finish") < kinds.index("time")  # no compiling thread runs while anything is timed
    stats = engine.build_config["tactic_selection"]
    assert stats["compile_threads"] == 4 and stats["compiled_ahead"] == 3 and stats["layers_measured"] == 1
    assert stats["candidates_measured"] == 4 and stats["superseded"] == 1 and stats["timing_s"] >= 0.0
    assert engine.build_config["build_phases"]  # the build's own phases are untouched

    # serial (0 threads): no pool, each candidate compiles on its first call in the timing loop
    events.clear()
    monkeypatch.setenv("KILN_PARALLEL_COMPILE", "0")
    engine, config = _relu_engine()
    builder._select_tactics(engine, engine.profiles, config, lambda msg: None)
    assert "pool" not in [k for k, _ in events] and "compile_threads" not in engine.build_config["tactic_selection"]


def test_a_layer_the_timing_cache_has_is_not_compiled_ahead(monkeypatch, tmp_path):
    events = _rig(monkeypatch, ("triton_a",))
    _pool(monkeypatch, events)
    monkeypatch.setenv("KILN_PARALLEL_COMPILE", "4")
    for _ in range(2):
        engine, config = _relu_engine()
        config.timing_cache = str(tmp_path / "timing.json")
        builder._select_tactics(engine, engine.profiles, config, lambda msg: None)
    assert [names for kind, names in events if kind == "submit"] == [["triton_a"], []]
    assert engine.build_config["tactic_selection"]["layers_from_cache"] == 1


def test_compile_threads_come_from_the_environment_else_the_default(monkeypatch):
    import os

    monkeypatch.setenv("KILN_PARALLEL_COMPILE", "3")
    assert tactic_selection.compile_threads() == 3
    monkeypatch.delenv("KILN_PARALLEL_COMPILE")
    monkeypatch.setattr(tactic_selection, "COMPILE_THREADS", None)
    assert tactic_selection.compile_threads() == min(tactic_selection.MAX_COMPILE_THREADS, os.cpu_count() or 1)
    assert tactic_selection.compile_threads("cpu") == 0  # nothing to compile ahead for a CPU target
    monkeypatch.setattr(tactic_selection, "COMPILE_THREADS", 0)
    assert tactic_selection.compile_threads() == 0
