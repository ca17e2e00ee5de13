"""Property-based fuzzing (hypothesis) of the ONNX loader and checker, the builder's pre-flight, and the engine
loader: whatever the mutation, the result is a clean outcome (a report, an engine, or a KilnError), never another
exception. Bounded: a fixed number of examples, each with a deadline."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import kiln
from kiln.engine import serialize
from kiln.errors import KilnError
from kiln.frontend.check import check_model

from ..models import mlp

SETTINGS = settings(max_examples=40, deadline=10_000, derandomize=True,  # deadline: CI runners are busy
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
OPS = ["Relu", "Add", "MatMul", "Gemm", "Reshape", "Transpose", "Conv", "If", "Foo", "Softmax", "Cast", ""]
NAMES = ["x", "y", "w1", "b1", "h0", "h1", "h2", "h3", "", "ghost"]
TYPES = [TensorProto.FLOAT, TensorProto.INT64, TensorProto.FLOAT16, TensorProto.STRING, TensorProto.UNDEFINED,
         TensorProto.BOOL, TensorProto.COMPLEX64, 99]


def _mutate(m: onnx.ModelProto, data, step: int) -> None:
    g = m.graph
    kind = data.draw(st.integers(0, 11), label=f"mutation {step}")
    if kind == 0 and g.node:
        n = g.node[data.draw(st.integers(0, len(g.node) - 1))]
        n.op_type = data.draw(st.sampled_from(OPS))
    elif kind == 1 and g.node:
        n = g.node[data.draw(st.integers(0, len(g.node) - 1))]
        if n.input:
            n.input[data.draw(st.integers(0, len(n.input) - 1))] = data.draw(st.sampled_from(NAMES))
    elif kind == 2 and g.node:
        n = g.node[data.draw(st.integers(0, len(g.node) - 1))]
        n.output[0] = data.draw(st.sampled_from(NAMES))
    elif kind == 3 and g.initializer:
        del g.initializer[data.draw(st.integers(0, len(g.initializer) - 1))]
    elif kind == 4:
        vi = data.draw(st.sampled_from([g.input[0], g.output[0]]))
        vi.type.tensor_type.elem_type = data.draw(st.sampled_from(TYPES))
    elif kind == 5:
        dims = g.input[0].type.tensor_type.shape.dim
        if dims:
            d = dims[data.draw(st.integers(0, len(dims) - 1))]
            d.dim_value = data.draw(st.sampled_from([-3, 0, 1, 7, 2**40]))
    elif kind == 6:
        m.opset_import[0].version = data.draw(st.sampled_from([0, 1, 6, 13, 17, 21, 99]))
    elif kind == 7 and len(g.node) > 1:
        i, j = data.draw(st.integers(0, len(g.node) - 1)), data.draw(st.integers(0, len(g.node) - 1))
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(g.node[i])
        b.CopyFrom(g.node[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
    elif kind == 8 and g.node:
        n = g.node[data.draw(st.integers(0, len(g.node) - 1))]
        n.attribute.append(helper.make_attribute(data.draw(st.sampled_from(["perm", "axis", "alpha", "to", "foo"])),
                                                 data.draw(st.sampled_from([1, -7, 2.5, "s", [0, 9]]))))
    elif kind == 9 and g.initializer:
        t = g.initializer[data.draw(st.integers(0, len(g.initializer) - 1))]
        t.raw_data = t.raw_data[:data.draw(st.integers(0, max(0, len(t.raw_data))))]
    elif kind == 10 and g.initializer:
        t = g.initializer[data.draw(st.integers(0, len(g.initializer) - 1))]
        shape = data.draw(st.lists(st.integers(-2, 40), min_size=0, max_size=3))
        del t.dims[:]
        t.dims.extend(shape)
    elif kind == 11:
        g.node.append(helper.make_node(data.draw(st.sampled_from(OPS)) or "Relu",
                                       [data.draw(st.sampled_from(NAMES))], [data.draw(st.sampled_from(NAMES))],
                                       name="fuzz"))


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 3))
def test_mutated_models_are_checked_and_built_cleanly(data, steps):
    m = mlp()
    for k in range(steps):
        _mutate(m, data, k)
    try:
        check_model(m)
    except KilnError:
        pass
    try:
        kiln.build(m, kiln.BuildConfig(device="cpu", progress=False, shapes={"x": (2, 8)}))
    except KilnError:
        pass


@pytest.fixture(scope="module")
def engine_members(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "e.kiln"
    kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})], device="cpu",
                                       progress=False)).save(path)
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats(allow_nan=False)
                           | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=6)


def _set_path(obj, path: list, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _paths(obj, prefix=()):
    yield list(prefix)
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, (*prefix, i))


@SETTINGS
@given(data=st.data())
def test_resealed_manifest_mutations_load_or_are_refused(engine_members, tmp_path_factory, data):
    """Any value at any place in an otherwise valid (re-sealed) manifest: loaded, or an EngineFileError."""
    m = json.loads(engine_members["manifest.json"])
    paths = [p for p in _paths(m) if p]
    where = data.draw(st.sampled_from(paths))
    _set_path(m, where, data.draw(JSON_VALUES))
    members = serialize.write_members(dict(engine_members, **{"manifest.json": json.dumps(m).encode()}))
    path = tmp_path_factory.mktemp("m") / "e.kiln"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
    for read in (kiln.load, serialize.read_manifest):
        try:
            read(path)
        except KilnError:
            pass


@SETTINGS
@given(data=st.data())
def test_byte_flips_anywhere_in_an_engine_are_refused(engine_members, tmp_path_factory, data):
    """A flipped byte anywhere in the file: the engine is refused (a checksum, the zip's CRC or its structure)."""
    with_sums = tmp_path_factory.mktemp("f") / "e.kiln"
    with zipfile.ZipFile(with_sums, "w") as z:
        for n, d in engine_members.items():
            z.writestr(n, d)
    raw = bytearray(with_sums.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    with_sums.write_bytes(bytes(raw))
    try:
        kiln.load(with_sums)
    except KilnError:
        return
    # A flip the format does not read (zip comment, extra field, a local header's timestamp) may load.
    with zipfile.ZipFile(with_sums) as z:
        assert all(z.read(n) == engine_members[n] for n in serialize.MEMBERS)


def test_a_valid_model_still_builds():
    """The fuzzer's base model is buildable: the properties above are not vacuous."""
    x = np.ones((2, 8), np.float32)
    e = kiln.build(mlp(), kiln.BuildConfig(device="cpu", progress=False, shapes={"x": (2, 8)}))
    assert e.create_execution_context().run({"x": x})["y"].shape == (2, 4)
