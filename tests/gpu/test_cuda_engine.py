"""GPU engines: CUDA-graph replay, arena, precision, the GPU stamp. Skipped without CUDA."""


import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln.errors import EngineFileError, InputError, ShapeError
from kiln.models import DEFAULT_PROFILE, tiny_cnn

from ..engine.test_quantized_io import _SelfAttention, _stem_pool
from ..engine.test_streams import _Stage
from ..engine.util import rewrite_manifest
from ..models import mlp, mlp_reference, reshape_by_shape, residual_blocks
from ..passes.test_ort_quantized_import import _Reader, ort_reference

pytestmark = pytest.mark.gpu


def _cfg(**kw):
    # "obey": these tests check the quantized layers themselves, which a faster float tactic would replace
    return kiln.BuildConfig(device="cuda", progress=False, **{"precision_constraints": "obey", **kw})


def test_cuda_graph_replay_matches_cpu_engine_at_every_shape():
    model = tiny_cnn()
    prof = [kiln.Profile(dict(DEFAULT_PROFILE))]
    gpu = kiln.build(model, _cfg(profiles=prof))
    cpu = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof))
    assert gpu.capturable
    g_ctx, c_ctx = gpu.create_execution_context(), cpu.create_execution_context()
    assert g_ctx.uses_cuda_graphs
    for batch in (1, 5, 32, 5):  # shape 5 twice: the second run replays the captured graph
        x = torch.randn(batch, 3, 32, 32)
        got = g_ctx.run({"image": x.cuda()})["probs"]
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), c_ctx.run({"image": x})["probs"], rtol=1e-4, atol=1e-5)
    assert len(g_ctx._captured) == 3
    assert all(c.pool_bytes >= 0 for c in g_ctx._captured.values())
    assert gpu.arena_bytes[0] > 0


def test_inputs_fed_again_from_the_same_buffers_get_a_graph_that_reads_them_in_place():
    from kiln.engine.context import BOUND_GRAPHS

    model, prof = tiny_cnn(), [kiln.Profile(dict(DEFAULT_PROFILE))]
    ctx = kiln.build(model, _cfg(profiles=prof)).create_execution_context()
    cpu = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=prof)).create_execution_context()
    buffers = [torch.randn(4, 3, 32, 32, device="cuda") for _ in range(BOUND_GRAPHS + 2)]
    for step in range(4):
        for x in buffers:
            x.normal_()  # new values in the same buffer, as a serving loop refills its input
            got = ctx.run({"image": x})["probs"]
            torch.testing.assert_close(got.cpu(), cpu.run({"image": x.cpu()})["probs"], rtol=1e-4, atol=1e-5)
    (cap,) = ctx._captured.values()
    assert len(cap.bound) == BOUND_GRAPHS and all(g is not None for g in cap.bound.values())
    assert set(cap.bound) <= {(x.data_ptr(),) for x in buffers}
    strided = torch.randn(4, 3, 32, 64, device="cuda")[..., ::2]  # never bound: copied into the graph's buffer
    for _ in range(3):
        torch.testing.assert_close(ctx.run({"image": strided})["probs"].cpu(),
                                   cpu.run({"image": strided.cpu()})["probs"], rtol=1e-4, atol=1e-5)
    assert len(cap.bound) == BOUND_GRAPHS and not ctx.capture_failures


def test_replay_reads_new_inputs_each_time():
    eng = kiln.build(mlp(), _cfg(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})]))
    ctx = eng.create_execution_context()
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
        np.testing.assert_allclose(ctx.run({"x": x})["y"], mlp_reference(mlp(), x), rtol=1e-4, atol=1e-4)


def test_host_shape_arithmetic_is_outside_the_graph():
    eng = kiln.build(reshape_by_shape(), _cfg(profiles=[kiln.Profile({"x": ((1, 3, 4), (2, 3, 4), (8, 3, 4))})]))
    ctx = eng.create_execution_context()
    for n in (1, 8, 3):
        x = torch.randn(n, 3, 4, device="cuda")
        torch.testing.assert_close(ctx.run({"x": x})["y"], torch.relu(x.reshape(n, 12)))


@pytest.mark.parametrize("prec", ["fp16", "bf16", "tf32"])
def test_reduced_precision_engines_stay_close(prec):
    model = tiny_cnn()
    prof = [kiln.Profile(dict(DEFAULT_PROFILE))]
    ref = kiln.build(model, _cfg(profiles=prof)).create_execution_context()
    low = kiln.build(model, _cfg(profiles=prof, **{prec: True})).create_execution_context()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    tol = {"fp16": 1e-2, "bf16": 3e-2, "tf32": 1e-2}[prec]
    torch.testing.assert_close(low.run({"image": x})["probs"], ref.run({"image": x})["probs"], rtol=tol, atol=tol)


def test_the_rgb_stem_runs_over_four_channels_in_fp16_and_stays_right():
    from ..engine.test_layout import _rgb_stem

    model, prof = _rgb_stem(32), [kiln.Profile({"image": ((8, 3, 16, 16),) * 3})]
    fp16 = kiln.build(model, _cfg(profiles=prof, fp16=True))
    assert len(fp16.padded_channels) == 1  # the 32-filter stem reads the image; the second convolution does not
    w = fp16.weights_on_target()[fp16.padded_channels[0]]
    assert w.shape[1] == 4 and w.is_contiguous(memory_format=torch.channels_last)
    ref = kiln.build(model, _cfg(profiles=prof)).create_execution_context()
    x = torch.randn(8, 3, 16, 16, device="cuda")
    torch.testing.assert_close(fp16.create_execution_context().run({"image": x})["y"],
                               ref.run({"image": x})["y"], rtol=1e-2, atol=1e-2)


def test_engine_is_stamped_with_this_gpu_and_refused_elsewhere(tmp_path):
    eng = kiln.build(mlp(), _cfg(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})]))
    path = tmp_path / "mlp.kiln"
    eng.save(path)
    loaded = kiln.load(path)
    assert loaded.target.kind == "cuda" and loaded.target.name == torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    assert loaded.target.capability == f"{major}.{minor}"

    def other_gpu(m):
        m["target"]["capability"] = "7.5"
        m["versions"]["torch"] = "1.0.0"

    rewrite_manifest(path, other_gpu)
    with pytest.raises(EngineFileError, match="compute capability 7.5"):
        kiln.load(path)


def test_tactics_are_timed_checked_and_cached(tmp_path):
    cache = tmp_path / "timing.json"
    model = tiny_cnn()
    prof = [kiln.Profile(dict(DEFAULT_PROFILE))]
    first = kiln.build(model, _cfg(profiles=prof, fp16=True, timing_cache=str(cache)))
    assert first.tactics, "fused layers should have had candidates timed"
    for t in first.tactics:
        assert t["chosen"] in t["timings"] and all(ms > 0 for ms in t["timings"].values())
    assert cache.exists() and first.build_config["timing_cache"]["misses"] > 0
    again = kiln.build(model, _cfg(profiles=prof, fp16=True, timing_cache=str(cache)))
    assert again.build_config["timing_cache"]["hits"] > 0 and again.build_config["timing_cache"]["misses"] == 0
    assert [n.tactic for n in again.graph.nodes] == [n.tactic for n in first.graph.nodes]
    x = torch.randn(8, 3, 32, 32, device="cuda")
    ref = kiln.build(model, _cfg(profiles=prof, optimization_level=0)).create_execution_context()
    torch.testing.assert_close(again.create_execution_context().run({"image": x})["probs"],
                               ref.run({"image": x})["probs"], rtol=1e-2, atol=1e-2)


def test_a_cache_from_a_lower_level_still_gets_the_extra_tactics_timed_and_exclusions_hold(tmp_path):
    cache = str(tmp_path / "timing.json")
    model, prof = tiny_cnn(), [kiln.Profile(dict(DEFAULT_PROFILE))]
    low = kiln.build(model, _cfg(profiles=prof, fp16=True, timing_cache=cache, optimization_level=2))
    assert not any(n.startswith("triton_") for t in low.tactics for n in t["timings"])
    high = kiln.build(model, _cfg(profiles=prof, fp16=True, timing_cache=cache, optimization_level=4))
    # timed now, not hidden by the level-2 cache entries
    assert any(n.startswith("triton_") for t in high.tactics for n in t["timings"])
    lib = {n for t in low.tactics for n in t["timings"]}
    assert lib <= {n for t in high.tactics for n in t["timings"]}  # the level-2 timings were reused
    none = kiln.build(model, _cfg(profiles=prof, fp16=True, timing_cache=cache, optimization_level=4,
                                  exclude_tactics=("triton_*",)))
    assert not any(n.startswith("triton_") for t in none.tactics for n in t["timings"])
    assert any("--excludeTactics (triton_*)" in why for t in none.tactics for why in t["excluded"].values())
    assert none.build_config["timing_cache"]["misses"] == 0


def test_workspace_cap_excludes_and_reports_tactics():
    from onnx import TensorProto, helper, numpy_helper

    # softmax(q k^T * s) v: the math/unfused attention tactics need [B, H, S, S] of scratch memory.
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s0"]), helper.make_node("Mul", ["s0", "scale"], ["s1"]),
             helper.make_node("Softmax", ["s1"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    shapes = {"q": [2, 4, 64, 32], "kt": [2, 4, 32, 64], "v": [2, 4, 64, 32]}
    g = helper.make_graph(nodes, "attn",
                          [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in shapes.items()],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 64, 32])],
                          [numpy_helper.from_array(np.float32(32 ** -0.5), "scale")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    eng = kiln.build(model, _cfg(fp16=True, workspace_bytes=1024))
    excluded = {name: why for t in eng.tactics for name, why in t["excluded"].items()}
    assert "workspace" in excluded.get("sdpa_math", "") and "sdpa_math" not in {t["chosen"] for t in eng.tactics}


def test_int8_layer_runs_on_the_gpu_like_the_cpu_reference():
    calib = [{"x": np.random.default_rng(i).standard_normal((32, 8)).astype(np.float32)} for i in range(8)]
    prof = [kiln.Profile({"x": ((1, 8), (32, 8), (64, 8))})]
    gpu = kiln.build(mlp(), _cfg(profiles=prof, int8=True, calib=calib))
    cpu = kiln.build(mlp(), kiln.BuildConfig(device="cpu", progress=False, profiles=prof, int8=True, calib=calib))
    x = torch.randn(32, 8)
    torch.testing.assert_close(gpu.create_execution_context().run({"x": x.cuda()})["y"].cpu(),
                               cpu.create_execution_context().run({"x": x})["y"], rtol=1e-3, atol=1e-3)


def test_a_default_int8_build_keeps_only_the_layers_float_does_not_beat_and_says_which():
    """precision constraints "none" (the default): the INT8 and FP16 builds are both timed, each quantized group
    that timed slower than its float layers is rebuilt in FP16, and the engine still matches the CPU reference."""
    model = residual_blocks(3, channels=64, in_channels=16)
    rng = np.random.default_rng(7)
    calib = [{"x": rng.standard_normal((8, 16, 16, 16)).astype(np.float32)} for _ in range(32)]
    prof = [kiln.Profile({"x": ((8, 16, 16, 16),) * 3})]
    eng = kiln.build(model, _cfg(profiles=prof, int8=True, fp16=True, calib=calib, precision_constraints="none"))
    report = next(f for f in eng.findings if f.get("kind") == "precision-by-speed")
    from kiln.quant.speed import CLASSES

    trials = report.get("trials", [])  # one rebuild per class of like groups tried, at most CLASSES
    assert report["engines_built"] == 2 + len(trials) and len(trials) <= CLASSES
    assert len(report["kept_in_float"]) + len(report["tried_in_float"]) == sum(t["groups"] for t in trials)
    for kept in report["kept_in_float"]:
        assert kept["float_us"] < kept["quantized_us"] * (1 - report["margin"])
    kept = {a for k in report["kept_in_float"] for a in k["layers"]}
    for n in eng.graph.nodes:  # the layers the report kept in float are float, and say why; no other moved
        if kept & set(n.sources or [n.name]):
            assert n.precision == "float16" and n.note.startswith("kept in float16"), (n.name, n.note)
        elif n.op_type == "Conv" or n.op_type == "FusedConv":
            assert not n.note.startswith("kept in"), (n.name, n.note)
    x = rng.standard_normal((8, 16, 16, 16)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = eng.create_execution_context().run({"x": torch.from_numpy(x).cuda()})["o3"].float().cpu().numpy()
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max(), report


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_the_stem_pool_and_the_shortcut_run_in_8_bits_on_the_gpu_and_match_onnxruntime(qtype):
    """ResNet's stem pool writes the first block's 8-bit input (the pool kernel's quantized store) and the
    downsampling shortcut travels in 8 bits at its calibrated maximum, on the GPU's kernels."""
    if qtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs Ada or Hopper")
    model = _stem_pool(c=64, size=32)
    rng = np.random.default_rng(8)
    calib = [{"x": rng.standard_normal((8, 3, 32, 32)).astype(np.float32)} for _ in range(16)]
    prof = [kiln.Profile({"x": ((8, 3, 32, 32),) * 3})]
    eng = kiln.build(model, _cfg(profiles=prof, fp16=True, calib=calib, **{qtype: True}))
    pool = next(n for n in eng.graph.nodes if n.op_type == "MaxPool")
    assert len(pool.inputs) == 2 and pool.attrs["qtype"] == qtype  # (tests/kernels/test_pool.py: the kernel alone)
    assert any(n.op_type == "QConv" and len(n.inputs) > 6 and n.inputs[6].endswith(".shortcut_scale")
               for n in eng.graph.nodes)
    x = rng.standard_normal((8, 3, 32, 32)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = eng.create_execution_context().run({"x": torch.from_numpy(x).cuda()})["out"].float().cpu().numpy()
    assert np.abs(got - ref).max() <= (0.05 if qtype == "int8" else 0.1) * np.abs(ref).max()


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_the_8_bit_stem_over_patches_runs_on_the_gpu_and_matches_onnxruntime(qtype):
    """passes/stem_patches.py on the GPU's kernels: the patches kernel quantizes the image, the 7x7 stride-2 stem
    runs as an 8-bit 4x1 convolution and writes 8-bit values for the pool, which reads them as they are."""
    if qtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs Ada or Hopper")
    model = _stem_pool(c=64, size=64, stride=2)
    rng = np.random.default_rng(9)
    calib = [{"x": rng.standard_normal((8, 3, 64, 64)).astype(np.float32)} for _ in range(16)]
    prof = [kiln.Profile({"x": ((8, 3, 64, 64),) * 3})]
    eng = kiln.build(model, _cfg(profiles=prof, fp16=True, calib=calib, **{qtype: True}))
    patches = next(n for n in eng.graph.nodes if n.op_type == "StemPatches")
    pool = next(n for n in eng.graph.nodes if n.op_type == "MaxPool")
    assert patches.tactic == "triton_stem_patches" and patches.attrs["qtype"] == qtype
    assert pool.attrs.get("x_quantized") == 1 and pool.tactic == "triton_max_pool_nhwc"
    x = rng.standard_normal((8, 3, 64, 64)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = eng.create_execution_context().run({"x": torch.from_numpy(x).cuda()})["out"].float().cpu().numpy()
    assert np.abs(got - ref).max() <= (0.05 if qtype == "int8" else 0.1) * np.abs(ref).max()


def test_int8_residual_blocks_carry_8_bit_residuals_and_match_onnxruntime():
    """Three ResNet blocks of 64 channels: the middle block reads its residual and writes its output in 8 bits
    (builder/quantized_io.py; entropy calibration, so at a scale widened to the calibrated maximum), on the GPU's
    8-bit kernels; the engine stays within 5% of onnxruntime's range."""

    model = residual_blocks(3, channels=64, in_channels=16)
    rng = np.random.default_rng(7)
    calib = [{"x": rng.standard_normal((8, 16, 16, 16)).astype(np.float32)} for _ in range(32)]
    prof = [kiln.Profile({"x": ((8, 16, 16, 16),) * 3})]
    eng = kiln.build(model, _cfg(profiles=prof, int8=True, fp16=True, calib=calib))
    middle = next(n for n in eng.graph.nodes if n.op_type == "QConv" and n.inputs[0] == "p2")
    assert middle.inputs[5].startswith("o1.") and middle.inputs[8] and middle.inputs[6], middle.tactic
    assert middle.outputs == ["o2.int8"]
    assert all(str(eng.graph.initializers[middle.inputs[i]].dtype) == "torch.float32" for i in (6, 8))
    x = rng.standard_normal((8, 16, 16, 16)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = eng.create_execution_context().run({"x": torch.from_numpy(x).cuda()})["o3"].float().cpu().numpy()
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()


def _x_plus_ones_of_its_shape():
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["ones"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("Add", ["x", "ones"], ["y"])]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_host_values_used_as_data_follow_the_input_shape():
    """ConstantOfShape(Shape(x)) is computed on the host per shape and uploaded: never reused stale."""
    eng = kiln.build(_x_plus_ones_of_its_shape(), _cfg(profiles=[kiln.Profile({"x": ((1, 4), (2, 4), (8, 4))})]))
    for graphs in (False, True):
        ctx = eng.create_execution_context(cuda_graphs=graphs)
        for n in (2, 5, 2, 8):
            x = torch.randn(n, 4, device="cuda")
            torch.testing.assert_close(ctx.run({"x": x})["y"], x + 1)


def test_host_values_are_uploaded_in_the_layers_precision():
    """An FP32 host value read by an FP16 layer is cast once on upload, not by a kernel in every replay."""
    eng = kiln.build(_x_plus_ones_of_its_shape(), _cfg(fp16=True, profiles=[kiln.Profile({"x": ((4, 4),) * 3})]))
    ctx = eng.create_execution_context()
    x = torch.randn(4, 4, device="cuda")
    torch.testing.assert_close(ctx.run({"x": x})["y"], x + 1, rtol=1e-3, atol=1e-3)
    uploads = next(iter(ctx._captured.values())).uploads
    assert uploads[("ones", torch.float16)].dtype == torch.float16 and "ones" not in uploads


def test_a_host_value_that_is_also_an_output_is_captured():
    """'ones' is an engine output and is read by an FP16 layer (which gets its cast copy): its own
    device copy is made by the warm-up, so the capture holds no host-to-device copy."""
    from onnx import TensorProto, helper

    model = _x_plus_ones_of_its_shape()
    model.graph.output.append(helper.make_tensor_value_info("ones", TensorProto.FLOAT, ["N", 4]))
    eng = kiln.build(model, _cfg(fp16=True, profiles=[kiln.Profile({"x": ((4, 4),) * 3})]))
    ctx = eng.create_execution_context()
    for _ in range(2):  # capture, then replay
        x = torch.randn(4, 4, device="cuda")
        out = ctx.run({"x": x})
        torch.testing.assert_close(out["y"], x + 1, rtol=1e-3, atol=1e-3)
        assert out["ones"].dtype == torch.float32 and bool((out["ones"] == 1).all())
    assert ctx.uses_cuda_graphs and not ctx.capture_failures and len(ctx._captured) == 1


def test_int8_pointwise_convolutions_are_timed_on_channels_last_inputs():
    """The builder's timing run computes QConv by its float64 reference, which cuDNN returns NCHW; the layers
    after it must still see the channels-last activations the engine's tactics write, or the 1x1-as-GEMM
    tactics (which need them) are never offered."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n)
             for n, s in [("w0", (32, 3, 3, 3)), ("w1", (64, 32, 1, 1))]]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv3x3", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1x1"),
             helper.make_node("Relu", ["c1"], ["y"], name="relu1")]
    g = helper.make_graph(nodes, "pointwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64, 16, 16])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    calib = [{"x": rng.standard_normal((8, 3, 16, 16)).astype(np.float32)} for _ in range(16)]
    prof = [kiln.Profile({"x": ((1, 3, 16, 16), (8, 3, 16, 16), (8, 3, 16, 16))})]
    eng = kiln.build(model, _cfg(profiles=prof, int8=True, fp16=True, calib=calib))
    pointwise = [t for t in eng.tactics if t["op"] == "QConv" and "conv1x1" in t["layer"]]
    # the 1x1-as-GEMM families (pointer, TMA, warp-specialized); the pointer ones only where neither of the others
    # times correctly (tactic_selection.SUPERSEDED)
    gemm_1x1 = ("triton_qconv1x1_", "triton_tma_qconv1x1_", "gluon_ws_qconv1x1_")
    assert pointwise and any(name.startswith(gemm_1x1) for name in pointwise[0]["timings"]), pointwise


def _out_projection():
    """BERT-base's attention out-projection and residual LayerNorm: y = LayerNorm(x @ w + b + r), x and r
    [B, 128, 768]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.05).astype(np.float32), n)
             for n, s in [("w", (768, 768)), ("b", (768,)), ("g", (768,)), ("beta", (768,))]]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["lin"]),
             helper.make_node("Add", ["lin", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "beta"], ["y"], axis=-1, epsilon=1e-12)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", 128, 768]) for n in ("x", "r", "y")]
    return helper.make_model(helper.make_graph(nodes, "out_proj", io[:2], io[2:], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_gemm_and_skip_layernorm_tactics_are_timed_and_right():
    """BERT's out-projection at batch 1 (M = 128 rows): GemmSkipLayerNorm offers cuBLASLt + the norm kernel and
    split-K GEMMs whose slices the norm kernel sums; every candidate is checked against the reference."""
    model = _out_projection()
    prof = kiln.Profile({"x": ((1, 128, 768),) * 3, "r": ((1, 128, 768),) * 3})
    eng = kiln.build(model, _cfg(fp16=True, profiles=[prof]))
    assert [n.op_type for n in eng.graph.nodes] == ["GemmSkipLayerNorm"]
    timed = eng.tactics[0]
    assert {"cublaslt_then_triton_layernorm", "triton_splitk_s4_64x64x64_w4_s4"} <= set(timed["timings"]), timed
    assert not timed["excluded"], timed["excluded"]
    x, r = torch.randn(1, 128, 768, device="cuda"), torch.randn(1, 128, 768, device="cuda")
    ref = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof])).create_execution_context()
    torch.testing.assert_close(eng.create_execution_context().run({"x": x, "r": r})["y"].float().cpu(),
                               ref.run({"x": x.cpu(), "r": r.cpu()})["y"], rtol=2e-2, atol=2e-2)


def test_two_profiles_run_their_own_tactics_and_stay_right():
    """BERT's out-projection with a batch-1 profile (split-K offered) and a batch-8 one (M = 1024: not offered)."""
    model = _out_projection()
    profs = [kiln.Profile({k: ((b, 128, 768),) * 3 for k in ("x", "r")}) for b in (1, 8)]
    eng = kiln.build(model, _cfg(fp16=True, profiles=profs))
    node, timed = eng.graph.nodes[0], eng.tactics[0]
    assert node.tactic in timed["timings"] and not node.tactic.startswith("triton_splitk_")  # timed in both
    assert all(t in timed["timings"] for t in node.profile_tactics)
    ref = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=profs)).create_execution_context()
    for p, batch in enumerate((1, 8)):
        x, r = torch.randn(batch, 128, 768, device="cuda"), torch.randn(batch, 128, 768, device="cuda")
        ref.set_optimization_profile(p)
        got = eng.create_execution_context(profile=p).run({"x": x, "r": r})["y"].float().cpu()
        torch.testing.assert_close(got, ref.run({"x": x.cpu(), "r": r.cpu()})["y"], rtol=2e-2, atol=2e-2)


def test_a_branch_on_the_auxiliary_stream_gives_the_same_results():
    """A ResNet stage's downsample convolution is captured on the auxiliary stream, beside conv1-conv2."""

    torch.manual_seed(0)
    proto, _ = kiln.from_torch(_Stage().eval(), (torch.randn(4, 8, 16, 16),), opset=18,
                               dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4)},))
    name = proto.graph.input[0].name
    prof = [kiln.Profile({name: ((1, 8, 16, 16), (4, 8, 16, 16), (4, 8, 16, 16))})]
    ctxs = [kiln.build(proto, _cfg(fp16=True, profiles=prof, max_aux_streams=n)).create_execution_context()
            for n in (1, 0)]
    assert len(ctxs[0]._branches) == 1 and not ctxs[1]._branches
    for batch in (4, 2, 4, 4):  # capture, then replays with new inputs
        x = torch.randn(batch, 8, 16, 16, device="cuda")
        aux, single = (next(iter(c.run({name: x}).values())) for c in ctxs)
        torch.testing.assert_close(aux, single)
    assert all(c.uses_cuda_graphs and not c.capture_failures for c in ctxs)


def test_repeat_calls_skip_the_checks_but_new_inputs_are_still_checked():
    """The replay's fast path: a device-tensor signature seen before skips the input checks; any other shape
    or dtype goes through them and is refused as before."""
    ctx = kiln.build(tiny_cnn(), _cfg(profiles=[kiln.Profile(dict(DEFAULT_PROFILE))])).create_execution_context()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    first = ctx.run({"image": x})["probs"]
    assert len(ctx._checked) == 1
    torch.testing.assert_close(ctx.run({"image": x})["probs"], first)
    with pytest.raises(ShapeError, match="outside optimization profile"):
        ctx.run({"image": torch.randn(64, 3, 32, 32, device="cuda")})
    with pytest.raises(InputError, match="float16"):
        ctx.run({"image": x.half()})


@pytest.mark.parametrize("fp16", [False, True])
def test_onnxruntimes_default_quantized_blocks_run_int8_on_the_gpu_and_match_onnxruntime(tmp_path, fp16):
    """Asymmetric int8 activations (zero points) from onnxruntime's quantize_static: the kept QuantizeLinear
    (its Triton tactic), the zero-point Pads and the QConvs reading codes, on the GPU's kernels."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    src, dst = tmp_path / "blocks.onnx", tmp_path / "blocks_qdq.onnx"
    onnx.save(residual_blocks(2, channels=32), src)
    quantize_static(str(src), str(dst), _Reader((2, 4, 8, 8), seed=2, n=16), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    x = np.random.default_rng(3).standard_normal((2, 4, 8, 8)).astype(np.float32)
    ref = ort_reference(dst, {"x": x})
    prof = [kiln.Profile({"x": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 8, 8))})]
    eng = kiln.build(str(dst), _cfg(profiles=prof, fp16=fp16))
    assert sum(n.op_type == "QConv" for n in eng.graph.nodes) == 5
    got = eng.create_execution_context().run({"x": torch.from_numpy(x).cuda()})["o2"].float().cpu().numpy()
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()  # an int8 code's rounding flips, at most


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_an_attention_writes_its_projections_8_bit_input_on_the_gpu(qtype):
    """BERT-shaped attention in an 8-bit FP16 engine: the flash kernel (or an SDPA tactic) quantizes its result
    for the output projection (builder/quantized_io.py), FP8 engines also read q, k and v as FP8 codes (the flash
    kernel only), and the engine stays within 5% (INT8) or 10% (FP8, three
    mantissa bits: 6.3% in a CPU build) of onnxruntime's range."""

    if qtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs Ada or Hopper")
    torch.manual_seed(0)
    model, _ = kiln.from_torch(_SelfAttention(width=128, heads=2).eval(), (torch.randn(4, 64, 128),), opset=18)
    name = model.graph.input[0].name
    rng = np.random.default_rng(0)
    calib = [{name: rng.standard_normal((4, 64, 128)).astype(np.float32)} for _ in range(32)]
    eng = kiln.build(model, _cfg(fp16=True, calib=calib, **{qtype: True}))
    attention = next(n for n in eng.graph.nodes if n.op_type == "Attention")
    assert attention.inputs[4] and attention.attrs["qtype"] == qtype, attention.tactic
    if qtype == "fp8":  # q, k, v arrive as the merged projection's FP8 codes; the flash kernel reads them
        assert attention.inputs[5], attention.inputs
        timed = next(t for t in eng.tactics if t["op"] == "Attention")
        assert any(n.startswith("triton_flash") for n in timed["timings"]), (timed["timings"], timed["excluded"])
    x = rng.standard_normal((4, 64, 128)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    out = eng.create_execution_context().run({name: torch.from_numpy(x).cuda()})[eng.outputs[0].name]
    assert np.abs(out.float().cpu().numpy() - ref).max() <= (0.05 if qtype == "int8" else 0.1) * np.abs(ref).max()
