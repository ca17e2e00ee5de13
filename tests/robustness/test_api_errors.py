"""The same refusals through the Python API (kiln.build, kiln.backend): a KilnError naming the node or input,
never a KeyError or an allocator error from deep inside a build."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import backend
from kiln.errors import ConfigError, InputError, ModelError, ShapeError, UnsupportedError

from ..models import mlp

CPU = dict(device="cpu", progress=False)


def _missing_initializer():
    m = mlp()
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "w1"))
    return m


def _cycle():
    m = mlp()
    next(n for n in m.graph.node if n.name == "fc1").input[0] = "h2"
    return m


@pytest.mark.parametrize("make, match", [
    (_missing_initializer, r"node 'fc1' reads 'w1', which no node, graph input or initializer provides"),
    (_cycle, r"the graph has a cycle \(.*fc1.*\)"),
])
def test_build_and_backend_refuse_what_check_refuses(make, match):
    with pytest.raises(ModelError, match=match):
        kiln.build(make(), kiln.BuildConfig(shapes={"x": (2, 8)}, **CPU))
    with pytest.raises(ModelError, match=match):
        backend.prepare(make())
    assert not backend.is_compatible(make())


def test_duplicate_outputs_mixed_types_output_type_and_opset_are_refused_by_node():
    m = mlp()
    next(n for n in m.graph.node if n.name == "relu").output[0] = "h0"
    next(n for n in m.graph.node if n.name == "fc2").input[0] = "h0"
    with pytest.raises(ModelError, match="node 'relu' computes 'h0', which node 'fc1' already provides"):
        kiln.build(m, kiln.BuildConfig(shapes={"x": (2, 8)}, **CPU))
    m = mlp()
    m.graph.input.append(helper.make_tensor_value_info("k", TensorProto.INT64, ["N", 4]))
    next(n for n in m.graph.node if n.name == "fc2_bias").input[1] = "k"
    with pytest.raises(ModelError, match="node 'fc2_bias' has inconsistent element types"):
        kiln.build(m, kiln.BuildConfig(shapes={"x": (2, 8), "k": (2, 4)}, **CPU))
    m = mlp()
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(ModelError, match="node 'fc2_bias'.*float32 vs int64"):
        kiln.build(m, kiln.BuildConfig(shapes={"x": (2, 8)}, **CPU))
    with pytest.raises(UnsupportedError, match="operator set version 99"):
        kiln.build(mlp(opset=99), kiln.BuildConfig(shapes={"x": (2, 8)}, **CPU))


def test_a_profile_too_large_for_memory_is_refused_before_allocating():
    with pytest.raises(ConfigError, match=r"profile 0 cannot fit in memory.*input 'x' at 1099511627776x8"):
        kiln.build(mlp(), kiln.BuildConfig(shapes={"x": (2**40, 8)}, **CPU))
    with pytest.raises(ShapeError, match=r"input 'x' axis 0: .* dimension -3"):
        kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((-3, 8), (1, 8), (2, 8))})], **CPU))


def test_backend_refuses_surplus_positional_inputs_and_bounds_its_engines():
    rep = backend.prepare(mlp())
    x = np.ones((2, 8), np.float32)
    with pytest.raises(InputError, match=r"2 inputs were given by position, but the model has 1: \['x'\]"):
        rep.run([x, x])
    for batch in range(1, rep.max_engines + 4):
        rep.run([np.ones((batch, 8), np.float32)])
    assert len(rep._engines) == rep.max_engines
    assert (("x", (1, 8)),) not in rep._engines  # the least recently used went first
    assert (("x", (rep.max_engines + 3, 8)),) in rep._engines


def test_a_node_that_does_not_fit_its_schema_is_refused():
    m = mlp()
    next(n for n in m.graph.node if n.name == "relu").attribute.append(helper.make_attribute("foo", 3))
    with pytest.raises(ModelError, match=r"node 'relu' \(Relu\) has attribute\(s\) \['foo'\]"):
        kiln.build(m, kiln.BuildConfig(shapes={"x": (2, 8)}, **CPU))
    m = mlp()
    next(n for n in m.graph.node if n.name == "relu").input.append("b1")
    with pytest.raises(ModelError, match=r"node 'relu' \(Relu\) has 2 input\(s\); Relu at opset 14 takes 1"):
        kiln.build(m, kiln.BuildConfig(shapes={"x": (2, 8)}, **CPU))
