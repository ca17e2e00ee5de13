"""Hand tests for cast.py and the element types in ir/dtypes.py: float8 rounding and
saturation edges, narrow types, Cast-1's string target, FP16 builds."""

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.errors import KilnError, UnsupportedError
from kiln.ir import dtypes
from kiln.ops.cast import cast_to


def _model(nodes, inputs, outputs, opset=21):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(k, t, s) for k, t, s in inputs],
        [helper.make_tensor_value_info(k, t, s) for k, t, s in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return list(engine.create_execution_context().run(feeds).values())


def _cast_model(to, shape, src=TensorProto.FLOAT, opset=21, **attrs):
    node = helper.make_node("Cast", ["x"], ["y"], to=to, **attrs)
    return _model([node], [("x", src, shape)], [("y", to, shape)], opset)


# Values around every float8 format's overflow bound, subnormals and specials.
_EDGES = np.array([0.0, -0.0, 1e-9, -3e-3, 0.3, 1.0625, 239.9, 240, 247.9, 248, 250, 448, 463.9, 464, 465,
                   480, 57344, 61439, 61440, 1e6, -1e6, np.inf, -np.inf, np.nan], dtype=np.float32)
_F8 = {
    TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FNUZ: ml_dtypes.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2FNUZ: ml_dtypes.float8_e5m2fnuz,
}


@pytest.mark.parametrize("to", list(_F8))
def test_float8_no_saturate_matches_ieee_rounding(to):
    """saturate=0: overflow follows round-to-nearest-even (NaN, or Inf for E5M2), as ml_dtypes does."""
    got = cast_to(torch.from_numpy(_EDGES), to, saturate=False).float().numpy()
    want = _EDGES.astype(_F8[to]).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN matches NaN
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


@pytest.mark.parametrize("to", list(_F8))
def test_float8_saturate_clamps_to_largest_finite(to):
    got = cast_to(torch.from_numpy(_EDGES), to).float().numpy()
    big = float(ml_dtypes.finfo(_F8[to]).max)
    want = np.clip(_EDGES, -big, big).astype(_F8[to]).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[-1]) and got[-3] == big and got[-2] == -big


def test_float8_from_double_rounds_once():
    # 1 + 2**-4 + 2**-30 rounds up in E4M3FN only if nothing rounds it to float32 first.
    x = torch.tensor([1 + 2**-4 + 2**-30, -(1 + 2**-4 + 2**-30), 2**-9 * 0.5000001], dtype=torch.float64)
    assert cast_to(x, TensorProto.FLOAT8E4M3FN).float().tolist() == [1.125, -1.125, 2**-9]
    big = np.random.default_rng(2).standard_normal(5000) * 100
    got = cast_to(torch.from_numpy(big), TensorProto.FLOAT8E5M2).float().numpy()
    np.testing.assert_array_equal(got, big.astype(ml_dtypes.float8_e5m2).astype(np.float32))


def test_float4_rounding_nearest_even_and_saturation():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0, 100.0, -np.inf, np.nan], dtype=np.float32)
    got = cast_to(torch.from_numpy(x), TensorProto.FLOAT4E2M1)
    assert got.dtype == torch.float8_e4m3fn  # the carrier
    np.testing.assert_array_equal(got.float().numpy(), [0, 1, 1, 2, 2, 4, 4, 6, -4, 6, -6, 0])


@pytest.mark.parametrize("to, np_type", [(TensorProto.FLOAT6E2M3, ml_dtypes.float6_e2m3fn),
                                         (TensorProto.FLOAT6E3M2, ml_dtypes.float6_e3m2fn),
                                         (TensorProto.FLOAT4E2M1, ml_dtypes.float4_e2m1fn)])
def test_small_floats_match_ml_dtypes(to, np_type):
    x = np.random.default_rng(1).standard_normal(2000).astype(np.float32) * 8
    got = cast_to(torch.from_numpy(x), to).float().numpy()
    np.testing.assert_array_equal(got, x.astype(np_type).astype(np.float32))


def test_narrow_integers_wrap_like_integer_narrowing():
    x = torch.arange(-20, 20)
    assert cast_to(x, TensorProto.INT4).tolist() == [((v + 8) % 16) - 8 for v in range(-20, 20)]
    assert cast_to(x, TensorProto.UINT4).tolist() == [v % 16 for v in range(-20, 20)]
    assert cast_to(x, TensorProto.INT2).tolist() == [((v + 2) % 4) - 2 for v in range(-20, 20)]
    assert cast_to(x.float(), TensorProto.UINT2).dtype == torch.uint8


@pytest.mark.parametrize("to", [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT2, TensorProto.UINT2])
def test_float_to_narrow_integer_truncates_and_zeroes_out_of_range(to):
    """Float -> int4/int2 truncates toward zero; out of range (undefined in the spec) gives 0, as
    ONNX's reference evaluator does (integer sources wrap instead, test above)."""
    from onnx.reference import ReferenceEvaluator

    x = np.array([-9, -8.5, -8, -2.7, -1.5, -0.5, 0.5, 1.9, 2.5, 3.99, 7.9, 8, 15.5, 16, 300, np.nan], np.float32)
    model = _cast_model(to, [x.size])
    (got,) = _run(model, {"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert got.astype(np.int64).tolist() == want.astype(np.int64).tolist()


def test_e8m0_round_modes():
    x = torch.tensor([0.75, 1.0, 1.5, 3.0, 2.0**127 * 1.5])
    assert cast_to(x, TensorProto.FLOAT8E8M0, round_mode="up").float().tolist() == [1.0, 1.0, 2.0, 4.0, 2.0**127]
    assert cast_to(x, TensorProto.FLOAT8E8M0, round_mode="down").float().tolist() == [0.5, 1.0, 1.0, 2.0, 2.0**127]
    nearest = cast_to(x, TensorProto.FLOAT8E8M0, saturate=False, round_mode="nearest").float()
    assert nearest[:4].tolist() == [1.0, 1.0, 2.0, 4.0] and torch.isnan(nearest[4])  # overflow without saturate
    inf = cast_to(torch.tensor([float("inf")]), TensorProto.FLOAT8E8M0).float().item()
    assert inf == 2.0**127  # saturate: Inf -> the largest value


def test_unsigned_bool_and_wrapping_casts_through_the_engine():
    cases = [
        (TensorProto.FLOAT, TensorProto.UINT16, np.array([0.0, 3.7, 65535.0], np.float32), [0, 3, 65535]),
        (TensorProto.FLOAT, TensorProto.BOOL, np.array([-1.5, 0.0, 1e-30], np.float32), [True, False, True]),
        (TensorProto.INT32, TensorProto.INT8, np.array([200, -129, 5], np.int32), [-56, 127, 5]),
        (TensorProto.UINT64, TensorProto.FLOAT, np.array([0, 7, 2**63 + 2**40], np.uint64), [0, 7, 2**63 + 2**40]),
        (TensorProto.UINT32, TensorProto.INT64, np.array([0, 2**32 - 1, 5], np.uint32), [0, 2**32 - 1, 5]),
    ]
    for src, to, x, want in cases:
        (y,) = _run(_cast_model(to, [3], src=src), {"x": x})
        assert y.dtype == helper.tensor_dtype_to_np_dtype(to) and y.tolist() == want


def test_cast_opset1_string_target():
    node = helper.make_node("Cast", ["x"], ["y"], to="INT32")
    (y,) = _run(_model([node], [("x", TensorProto.FLOAT, [3])], [("y", TensorProto.INT32, [3])], opset=1),
                {"x": np.array([1.9, -2.9, 3.0], np.float32)})
    assert y.dtype == np.int32 and y.tolist() == [1, -2, 3]


def test_string_and_complex_targets_are_reported():
    for to in (TensorProto.STRING, TensorProto.COMPLEX64):
        nodes = [helper.make_node("Cast", ["x"], ["s"], to=to, name="to_exotic"),
                 helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]
        model = _model(nodes, [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])])
        with pytest.raises(UnsupportedError, match="to_exotic.*casting to"):
            kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_cast_keeps_requested_type_in_low_precision_build(flag):
    """Cast to FLOAT/DOUBLE stays FP32/FP64 in an FP16 build; its input is not rounded to FP16 first."""
    x = np.array([1 + 2**-20, 70000.0, -3.25], dtype=np.float32)
    nodes = [helper.make_node("Cast", ["x"], ["d"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT)]
    model = _model(nodes, [("x", TensorProto.FLOAT, [3])],
                   [("d", TensorProto.DOUBLE, [3]), ("h", TensorProto.FLOAT16, [3]), ("f", TensorProto.FLOAT, [3])])
    d, h, f = _run(model, {"x": x}, **{flag: True})
    assert d.dtype == np.float64 and d.tolist() == x.astype(np.float64).tolist()
    assert h.dtype == np.float16 and np.isinf(h[1])  # 70000 overflows FP16, as the model asks
    assert f.dtype == np.float32 and f.tolist() == x.tolist()


@pytest.mark.filterwarnings("ignore:input 'x' contains NaN or Inf")
def test_castlike_follows_second_input_type():
    node = helper.make_node("CastLike", ["x", "like"], ["y"], saturate=0)
    model = _model([node], [("x", TensorProto.FLOAT, [3]), ("like", TensorProto.FLOAT8E5M2, [1])],
                   [("y", TensorProto.FLOAT8E5M2, [3])])
    like = np.zeros(1, dtype=ml_dtypes.float8_e5m2)
    (y,) = _run(model, {"x": np.array([1.0, 1e6, -np.inf], np.float32), "like": like})
    assert y.tolist() == [1.0, np.inf, -np.inf]  # saturate=0 keeps E5M2's infinities


def test_castlike_to_narrow_type_is_pinned_to_cast():
    node = helper.make_node("CastLike", ["x", "like"], ["y"])
    model = _model([node], [("x", TensorProto.FLOAT, [4]), ("like", TensorProto.INT4, [1])],
                   [("y", TensorProto.INT4, [4])])
    pinned = dtypes.pin_narrow_types(model)
    assert pinned is not model and model.graph.node[0].op_type == "CastLike"  # the input is left alone
    (n,) = pinned.graph.node
    assert n.op_type == "Cast" and list(n.input) == ["x"]
    assert helper.get_attribute_value(n.attribute[0]) == TensorProto.INT4
    (y,) = _run(pinned, {"x": np.array([7, 8, -9, 15], np.float32), "like": np.zeros(1, ml_dtypes.int4)})
    assert y.tolist() == [7, 0, 0, 0]  # float out of int4's range: 0, as ONNX's reference gives


def test_pin_leaves_models_without_narrow_types_alone():
    model = _cast_model(TensorProto.FLOAT16, [2])
    assert dtypes.pin_narrow_types(model) is model


def test_narrow_initializers_and_inputs_load_into_carriers():
    w = helper.make_tensor("w", TensorProto.INT4, [5], [-8, -1, 0, 3, 7])
    f4 = helper.make_tensor("f4", TensorProto.FLOAT4E2M1, [3], [0.5, -6.0, 3.0])
    for t, dtype, values in [(w, torch.int8, [-8, -1, 0, 3, 7]), (f4, torch.float8_e4m3fn, [0.5, -6.0, 3.0])]:
        got = dtypes.to_torch(onnx.numpy_helper.to_array(t))
        assert got.dtype == dtype and got.float().tolist() == values
    assert dtypes.onnx_to_torch(TensorProto.UINT2) == torch.uint8
    assert dtypes.torch_to_onnx(torch.int8) == TensorProto.INT8  # the carrier maps back to its own type


def test_float8_arrays_round_trip():
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bfloat16"):
        a = np.array([0.5, 2.0, 448.0], dtype=np.float32).astype(getattr(ml_dtypes, name))
        t = dtypes.to_torch(a)
        assert dtypes.name_of(t.dtype) == name
        np.testing.assert_array_equal(dtypes.to_numpy(t), a.astype(np.float32))


@pytest.mark.parametrize("src, to, x", [
    (TensorProto.FLOAT, TensorProto.INT32, np.array([1.0, -0.0, np.inf, np.nan], np.float32)),
    (TensorProto.INT8, TensorProto.UINT8, np.array([-1, 0, 127, -128], np.int8)),
    (TensorProto.FLOAT16, TensorProto.UINT16, np.array([1.0, -2.5, 65504], np.float16)),
])
def test_bitcast_keeps_the_bits(src, to, x):
    node = helper.make_node("BitCast", ["x"], ["y"], to=to)
    model = _model([node], [("x", src, list(x.shape))], [("y", to, list(x.shape))], opset=26)
    (y,) = _run(model, {"x": x})
    np.testing.assert_array_equal(y, x.view(helper.tensor_dtype_to_np_dtype(to)))


def test_bitcast_width_mismatch_and_sub_byte_target_are_refused():
    node = helper.make_node("BitCast", ["x"], ["y"], to=TensorProto.INT4, name="to_int4")
    model = _model([node], [("x", TensorProto.UINT8, [2])], [("y", TensorProto.INT4, [2])], opset=26)
    with pytest.raises(UnsupportedError, match="to_int4.*sub-byte"):
        _run(model, {"x": np.zeros(2, np.uint8)})
    node = helper.make_node("BitCast", ["x"], ["y"], to=TensorProto.INT64)
    model = _model([node], [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.INT64, [2])], opset=26)
    with pytest.raises(KilnError, match="BitCast_0.*widths must match"):
        _run(model, {"x": np.zeros(2, np.float32)})
