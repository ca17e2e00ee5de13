"""Execution context: profiles, shape checks, input validation, several profiles, precision."""

import numpy as np
import pytest
import torch

import kiln
from kiln.engine.context import NonFiniteInputWarning
from kiln.errors import ConfigError, InputError, ShapeError

from ..models import mlp, mlp_reference, reshape_by_shape

CPU = dict(device="cpu", progress=False)


def _build(model, *profiles, **kw):
    return kiln.build(model, kiln.BuildConfig(profiles=[kiln.Profile(p) for p in profiles], **CPU, **kw))


def test_dynamic_batch_inside_profile_runs():
    eng = _build(mlp(), {"x": ((1, 8), (4, 8), (16, 8))})
    ctx = eng.create_execution_context()
    for n in (1, 7, 16):
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        np.testing.assert_allclose(ctx.run({"x": x})["y"], mlp_reference(mlp(), x), rtol=1e-5, atol=1e-5)


def test_shape_outside_profile_names_input_axis_value_and_range():
    ctx = _build(mlp(), {"x": ((1, 8), (4, 8), (16, 8))}).create_execution_context()
    with pytest.raises(ShapeError, match=r"input 'x' axis 0 is 17, outside optimization profile 0's range \[1, 16\]"):
        ctx.run({"x": np.zeros((17, 8), np.float32)})
    with pytest.raises(ShapeError, match=r"input 'x' axis 1 is 9, but the engine was built for exactly 8"):
        ctx.set_input_shape("x", (2, 9))


def test_wrong_rank_dtype_and_names_are_clear():
    ctx = _build(mlp(), {"x": ((1, 8), (4, 8), (16, 8))}).create_execution_context()
    with pytest.raises(ShapeError, match="input 'x' has rank 3"):
        ctx.run({"x": np.zeros((1, 2, 8), np.float32)})
    with pytest.raises(InputError, match="input 'x' is float64 but the engine expects float32"):
        ctx.run({"x": np.zeros((2, 8))})
    with pytest.raises(InputError, match=r"unknown input\(s\) \['image'\]"):
        ctx.run({"image": np.zeros((2, 8), np.float32)})
    with pytest.raises(InputError, match=r"missing input\(s\) \['x'\]"):
        ctx.run({})


def test_nan_input_warns():
    ctx = _build(mlp(), {"x": ((1, 8), (4, 8), (16, 8))}).create_execution_context()
    x = np.zeros((2, 8), np.float32)
    x[0, 0] = np.nan
    with pytest.warns(NonFiniteInputWarning, match="input 'x' contains NaN"):
        ctx.run({"x": x})


def test_several_profiles_and_profile_choice():
    eng = _build(mlp(), {"x": ((1, 8), (1, 8), (4, 8))}, {"x": ((8, 8), (16, 8), (32, 8))})
    assert eng.num_optimization_profiles == 2
    ctx = eng.create_execution_context()
    with pytest.raises(ShapeError, match="profile 0's range"):
        ctx.run({"x": np.zeros((20, 8), np.float32)})
    ctx.set_optimization_profile(1)
    x = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    np.testing.assert_allclose(ctx.run({"x": x})["y"], mlp_reference(mlp(), x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match="profile 2 does not exist"):
        ctx.set_optimization_profile(2)


def test_bad_profiles_are_config_errors():
    with pytest.raises(ConfigError, match="names input"):
        _build(mlp(), {"image": ((1, 8), (1, 8), (1, 8))})
    with pytest.raises(ConfigError, match="min <= opt <= max"):
        _build(mlp(), {"x": ((4, 8), (2, 8), (8, 8))})
    with pytest.raises(ConfigError, match="axis 1 is fixed at 8"):
        _build(mlp(), {"x": ((1, 4), (1, 8), (1, 8))})


def test_dynamic_axis_without_profile_warns_and_builds_batch_1():
    with pytest.warns(UserWarning, match="input 'x' has dynamic axes"):
        eng = kiln.build(mlp(), kiln.BuildConfig(**CPU))
    assert eng.get_profile_shape(0, "x") == ((1, 8), (1, 8), (1, 8))


def test_shape_arithmetic_runs_on_host():
    eng = _build(reshape_by_shape(), {"x": ((1, 3, 4), (2, 3, 4), (8, 3, 4))})
    placement = {n.name: n.placement for n in eng.graph.nodes}
    assert placement["shape"] == placement["concat"] == "host"
    assert placement["reshape"] == placement["relu"] == "device"
    assert eng.capturable
    ctx = eng.create_execution_context()
    for n in (1, 5, 8):
        x = torch.randn(n, 3, 4)
        torch.testing.assert_close(ctx.run({"x": x})["y"], torch.relu(x.reshape(n, 12)))


def test_fp16_engine_casts_layers_and_weights_and_keeps_io_types():
    eng = _build(mlp(), {"x": ((1, 8), (4, 8), (16, 8))}, fp16=True)
    assert {n.precision for n in eng.graph.nodes} == {"float16"}
    assert eng.graph.initializers["w1"].dtype == torch.float16
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    y = eng.create_execution_context().run({"x": x})["y"]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, mlp_reference(mlp(), x), rtol=2e-2, atol=2e-2)


def test_fp16_weights_saturate_instead_of_overflowing():
    from kiln.engine.interpreter import saturating_cast

    w = torch.tensor([np.finfo(np.float32).min, -1e5, 3.0, 1e5, float("-inf"), float("nan")])
    got = saturating_cast(w, torch.float16)
    assert got[:4].tolist() == [-65504.0, -65504.0, 3.0, 65504.0]  # an exporter's "masked" value stays finite
    assert got[4] == float("-inf") and torch.isnan(got[5])  # true infinities and NaN are the model's own


def test_torch_inputs_give_torch_outputs_and_lists_work():
    ctx = _build(mlp(), {"x": ((1, 8), (4, 8), (16, 8))}).create_execution_context()
    x = torch.randn(3, 8)
    out = ctx.run([x])
    assert isinstance(out["y"], torch.Tensor) and out["y"].shape == (3, 4)
    with pytest.raises(InputError, match="takes 1 inputs"):
        ctx.run([x, x])
