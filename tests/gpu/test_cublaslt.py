"""cuBLASLt's FP8 and FP16/BF16 GEMMs with their epilogues (kiln/kernels/cublaslt.py): right against the exact
reference, in a CUDA graph, and timed inside real FP8 and FP16 builds."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln.kernels import cublaslt
from kiln.kernels.rescale import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs Ada or Hopper")]


def _operands(m=200, k=256, n=384, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(k, n, device="cuda", generator=g) / k ** 0.5
    sx, sw = torch.tensor(4.0 / 448, device="cuda"), (w.abs().max() / 448).reshape(1)
    x8 = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
    w8 = (w / sw).clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous().t()  # K-major, as engines store it
    return x8, w8, sx, sw, torch.randn(n, device="cuda", generator=g)


def _assert_close(y, ref):
    """Float outputs within 1% of the range; FP8 outputs within one E4M3 step plus that."""
    diff = (y.float() - ref.float()).abs()
    bound = 1e-2 * ref.float().abs().max()
    if ref.dtype == torch.float8_e4m3fn:
        bound = bound + torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2.0 ** -6))) - 3)
    assert bool((diff <= bound).all()), f"max error {float(diff.max()):.3g}"


@pytest.mark.parametrize("act", ["", "Relu", "GeluErf"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("out", ["float16", "bfloat16", "fp8"])
def test_fp8_gemm_applies_scales_bias_activation_and_the_output_scale_in_one_call(act, with_bias, out):
    x8, w8, sx, sw, b = _operands()
    out_dtype = torch.bfloat16 if out == "bfloat16" else torch.float16
    bias = b.to(out_dtype) if with_bias else None
    y_scale = torch.tensor(0.02, device="cuda") if out == "fp8" else None
    spec = cublaslt.spec_of(x8, w8, with_bias, act, y_scale is not None, out_dtype)
    assert cublaslt.supported(spec, x8.device)
    y = cublaslt.fp8_gemm(x8, w8, sx, sw, bias, act, y_scale, out_dtype)
    acc = x8.double() @ w8.double()
    ref = reference(acc, sx, sw, bias, act, (), y_scale, "fp8", out_dtype)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    _assert_close(y, ref)


def test_every_heuristic_choice_the_tactics_offer_is_right():
    x8, w8, sx, sw, b = _operands()
    y_scale = torch.tensor(0.02, device="cuda")
    spec = cublaslt.spec_of(x8, w8, True, "GeluErf", True, torch.float16)
    ref = reference(x8.double() @ w8.double(), sx, sw, b.half(), "GeluErf", (), y_scale, "fp8", torch.float16)
    for cap in (cublaslt.MAX_WORKSPACE, 0):
        algos = [a for a in range(cublaslt.ALGOS) if cublaslt.supported(spec, x8.device, a, cap)]
        assert len(algos) > 1
        for a in algos:
            _assert_close(cublaslt.fp8_gemm(x8, w8, sx, sw, b.half(), "GeluErf", y_scale, torch.float16, a, cap), ref)


def test_fp8_gemm_replays_in_a_cuda_graph_with_new_inputs():
    x8, w8, sx, sw, b = _operands()
    y_scale = torch.tensor(0.02, device="cuda")
    cublaslt.fp8_gemm(x8, w8, sx, sw, b.half(), "GeluErf", y_scale)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cublaslt.fp8_gemm(x8, w8, sx, sw, b.half(), "GeluErf", y_scale)
    x8.copy_(_operands(seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.float(), cublaslt.fp8_gemm(x8, w8, sx, sw, b.half(), "GeluErf", y_scale).float())


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(128, 512), torch.nn.Linear(512, 128)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_an_fp8_build_times_the_epilogue_tactic_and_matches_onnxruntime():
    """A transformer's FFN in an FP8 engine: its GELU GEMM (which re-quantizes for the next GEMM) and its last
    GEMM both have cuBLASLt's epilogue tactics (with and without scratch) timed, so applicable and numerically
    right."""
    torch.manual_seed(0)
    model, _ = kiln.from_torch(_Mlp().eval(), (torch.randn(64, 128),), opset=18)
    name = model.graph.input[0].name
    rng = np.random.default_rng(0)
    calib = [{name: rng.standard_normal((64, 128)).astype(np.float32)} for _ in range(16)]
    eng = kiln.build(model, kiln.BuildConfig(device="cuda", progress=False, fp16=True, fp8=True, calib=calib,
                                             optimization_level=4, precision_constraints="obey"))
    layers = [t for t in eng.tactics if t["op"] == "QGemm"]
    assert len(layers) == 2
    # up: GELU and an FP8 output for down; down: FP16 out. Without scratch cuBLASLt may have no kernel for so small
    # a GEMM; where it has one, that tactic is timed too.
    f16, f8 = torch.float16, torch.float8_e4m3fn
    specs = [cublaslt.Spec(64, 512, 128, f8, f16, "GeluErf"), cublaslt.Spec(64, 128, 512, f16, f16, "")]
    for t, spec in zip(layers, specs):
        assert "cublaslt_fp8_epilogue" in t["timings"], (t["layer"], sorted(t["timings"]), t["excluded"])
        offered = cublaslt.supported(spec, torch.device("cuda"), 0, 0)
        assert ("cublaslt_fp8_epilogue_no_workspace" in t["timings"]) == offered, (t["layer"], sorted(t["timings"]))
    x = rng.standard_normal((64, 128)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    out = eng.create_execution_context().run({name: torch.from_numpy(x).cuda()})[eng.outputs[0].name]
    assert np.abs(out.float().cpu().numpy() - ref).max() <= 0.1 * np.abs(ref).max()


def _pointwise_convs():
    """x -> 1x1 conv + ReLU -> 1x1 conv + ReLU -> 3x3 conv: the second reads the first's channels-last output."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32), n)
             for n, s in [("wa", (64, 32, 1, 1)), ("wb", (64, 64, 1, 1)), ("bb", (64,)), ("wc", (32, 64, 3, 3))]]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a"), helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("Conv", ["ra", "wb", "bb"], ["b"], name="conv_b"),
             helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Conv", ["rb", "wc"], ["y"], name="conv_c", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "pointwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32, 16, 16])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)  # onnxruntime reads <= 13


def test_an_fp8_build_times_the_epilogue_tactic_for_a_1x1_convolution_and_matches_onnxruntime():
    """A 1x1 convolution over channels-last pixels, with bias, ReLU and an FP8 output for the next convolution, is
    the same cuBLASLt GEMM."""
    model = _pointwise_convs()
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((8, 32, 16, 16)).astype(np.float32)} for _ in range(8)]
    eng = kiln.build(model, kiln.BuildConfig(device="cuda", progress=False, fp16=True, fp8=True, calib=calib,
                                             precision_constraints="obey"))
    conv_b = next(t for t in eng.tactics if "conv_b" in t["layer"] and t["op"] == "QConv")
    assert "cublaslt_fp8_epilogue" in conv_b["timings"], (sorted(conv_b["timings"]), conv_b["excluded"])
    x = rng.standard_normal((8, 32, 16, 16)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = eng.create_execution_context().run({"x": torch.from_numpy(x).cuda()})["y"]
    assert np.abs(out.float().cpu().numpy() - ref).max() <= 0.1 * np.abs(ref).max()


# --- FP16/BF16 GEMMs on kernels that need no scratch ------------------------------------------------------
def _float_operands(dtype, k_major, m=200, k=256, n=384):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).to(dtype)
    return x, (w.t().contiguous().t() if k_major else w), torch.randn(n, device="cuda", generator=g).to(dtype)


@pytest.mark.parametrize("act", ["", "Relu", "GeluTanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_major", [False, True])
def test_the_float_gemm_applies_bias_and_activation_in_one_call(act, dtype, k_major):
    from kiln.ops.fused import activation

    x, w, b = _float_operands(dtype, k_major)
    spec = cublaslt.spec_of(x, w, True, act, False, dtype)
    assert spec.k_major == k_major and cublaslt.supported(spec, x.device, workspace_cap=0)
    y = cublaslt.gemm(x, w, b, act)
    ref = activation(act, x.double() @ w.double() + b.double(), [])
    assert y.dtype == dtype and y.shape == ref.shape
    _assert_close(y, ref)


def test_every_float_choice_without_scratch_is_right_and_launches_no_memset():
    """BERT-base's FFN1 at batch 32: with a workspace allowed, cuBLASLt's kernels for it clear a buffer before each
    call; none of the choices needing no scratch may."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 768, device="cuda", generator=g).half()
    w = (torch.randn(768, 3072, device="cuda", generator=g) / 768 ** 0.5).half()
    b = torch.randn(3072, device="cuda", generator=g).half()
    ref = torch.nn.functional.gelu(x.float() @ w.float() + b.float(), approximate="tanh")
    spec = cublaslt.spec_of(x, w, True, "GeluErf", False, torch.float16)
    algos = [a for a in range(cublaslt.ALGOS) if cublaslt.supported(spec, x.device, a, 0)]
    assert len(algos) > 1
    for a in algos:
        _assert_close(cublaslt.gemm(x, w, b, "GeluErf", a), ref)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cublaslt.gemm(x, w, b, "GeluErf", a)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert names and not any("Memset" in n for n in names), (a, names)


def test_an_fp16_build_times_the_float_epilogue_tactic_and_matches_onnxruntime():
    torch.manual_seed(0)
    model, _ = kiln.from_torch(_Mlp().eval(), (torch.randn(64, 128),), opset=18)
    name = model.graph.input[0].name
    eng = kiln.build(model, kiln.BuildConfig(device="cuda", progress=False, fp16=True, optimization_level=4))
    layers = [t for t in eng.tactics if t["op"] == "FusedGemm"]
    assert len(layers) == 2
    for t in layers:
        assert "cublaslt_epilogue_no_workspace" in t["timings"], (t["layer"], sorted(t["timings"]), t["excluded"])
    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    out = eng.create_execution_context().run({name: torch.from_numpy(x).cuda()})[eng.outputs[0].name]
    assert np.abs(out.float().cpu().numpy() - ref).max() <= 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("inputs", ["fp8", "float16"])
def test_the_nvmath_bindings_offer_the_same_choices_and_compute_the_same_bits(inputs):
    """kiln[nvmath]'s bindings call the functions the ctypes ones do: same heuristic choices, equal outputs."""
    pytest.importorskip("nvmath.bindings.cublasLt")
    x8, w8, sx, sw, b = _operands()
    if inputs == "fp8":
        spec = cublaslt.spec_of(x8, w8, True, "GeluErf", False, torch.float16)
        run = lambda plan: cublaslt.fp8_gemm(x8, w8, sx, sw, b, "GeluErf", plan=plan)
    else:
        x, w = x8.half(), w8.half().contiguous()
        spec = cublaslt.spec_of(x, w, True, "Relu", False, torch.float16)
        run = lambda plan: cublaslt.gemm(x, w, b.half(), "Relu", plan=plan)
    device = torch.device("cuda")
    plans = {name: cublaslt.choices(spec, device, 4, 0, cublaslt.bindings(name)) for name in ("ctypes", "nvmath")}
    assert len(plans["ctypes"]) == len(plans["nvmath"]) > 0
    for a, b_ in zip(plans["ctypes"], plans["nvmath"]):
        assert a.workspace == b_.workspace
        assert torch.equal(run(a), run(b_))
