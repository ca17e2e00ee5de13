"""load_onnx: paths, bytes and ModelProtos; every bad input is a ModelError naming the file or tensor."""

import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.errors import KilnError, ModelError
from kiln.frontend import load_onnx
from kiln.frontend.onnx_loader import read_model
from kiln.ir.from_onnx import model_to_graph

from .helpers import mlp, save_external, set_location


def _weights(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_loads_path_bytes_and_proto(tmp_path):
    m = mlp()
    path = tmp_path / "mlp.onnx"
    onnx.save_model(m, str(path))
    for source in (path, str(path), path.read_bytes(), m):
        got = load_onnx(source)
        assert isinstance(got, onnx.ModelProto)
        assert [n.name for n in got.graph.node] == ["mm", "bias", "relu"]


def test_missing_file_names_it(tmp_path):
    onnx.save_model(mlp(), str(tmp_path / "real.onnx"))
    with pytest.raises(ModelError, match="does not exist") as e:
        load_onnx(tmp_path / "typo.onnx")
    assert "typo.onnx" in str(e.value) and "real.onnx" in str(e.value)  # names the file, lists neighbours


def test_folder_is_not_a_model(tmp_path):
    with pytest.raises(ModelError, match="is a folder"):
        load_onnx(tmp_path)


@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_truncated_protobuf(tmp_path, cut):
    data = mlp().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ModelError) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "cut.onnx" in msg and "not a valid ONNX model" in msg


def test_not_onnx_at_all(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file\n")
    with pytest.raises(ModelError, match=r"notes\.onnx.*not a valid ONNX model"):
        load_onnx(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelError, match=r"empty\.onnx.*empty"):
        load_onnx(path)


def test_model_without_graph(tmp_path):
    m = onnx.ModelProto(ir_version=8)
    m.opset_import.add().version = 17
    path = tmp_path / "nograph.onnx"
    path.write_bytes(m.SerializeToString())
    with pytest.raises(ModelError, match=r"nograph\.onnx.*has no graph"):
        load_onnx(path)
    with pytest.raises(ModelError, match="has no graph"):
        load_onnx(m)


def test_bad_bytes_and_wrong_type():
    with pytest.raises(ModelError, match="model bytes is not a valid ONNX model"):
        load_onnx(b"\x00\x01garbage")
    with pytest.raises(ModelError, match="cannot load a model from a int"):
        load_onnx(42)


# --------------------------------------------------------------------------- external data


def test_external_data_is_loaded(tmp_path):
    m = mlp()
    want = _weights(m)
    path = save_external(m, tmp_path)
    assert (tmp_path / "model.data").exists()
    got = load_onnx(path)
    for t in got.graph.initializer:
        assert t.data_location == onnx.TensorProto.DEFAULT and not t.external_data
    for k, v in _weights(got).items():
        np.testing.assert_array_equal(v, want[k])
    graph = model_to_graph(got)  # what the builder does next
    assert graph.initializers["w"].shape == (64, 64)


def test_external_data_validated_but_not_read(tmp_path):
    path = save_external(mlp(), tmp_path)
    loaded = read_model(path, load_external_data=False)
    assert loaded.has_external_data and {r.where for r in loaded.external} == {"initializer 'w'", "initializer 'b'"}
    w = next(t for t in loaded.model.graph.initializer if t.name == "w")
    assert w.data_location == onnx.TensorProto.EXTERNAL and not w.raw_data


def test_external_data_for_bytes_and_proto_needs_base_dir(tmp_path):
    path = save_external(mlp(), tmp_path)
    skeleton = onnx.load(str(path), load_external_data=False)
    with pytest.raises(ModelError, match=r"initializer 'w'.*external file 'model.data'.*given in memory"):
        load_onnx(skeleton.SerializeToString())
    got = load_onnx(skeleton, base_dir=tmp_path)  # loaded into the proto in place
    assert got is skeleton and _weights(got)["w"].shape == (64, 64)


def test_external_location_absolute_is_refused(tmp_path):
    path = save_external(mlp(), tmp_path)
    set_location(path, "w", location=str(tmp_path / "model.data"))
    with pytest.raises(ModelError) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "initializer 'w'" in msg and str(tmp_path / "model.data") in msg and "absolute path" in msg


def test_external_location_dotdot_is_refused(tmp_path):
    inner = tmp_path / "model"
    inner.mkdir()
    path = save_external(mlp(), inner)
    (inner / "model.data").rename(tmp_path / "model.data")
    set_location(path, "w", location="../model.data")
    with pytest.raises(ModelError, match=r"initializer 'w'.*'\.\./model\.data'.*'\.\.'"):
        load_onnx(path)


def test_external_symlink_outside_is_refused(tmp_path):
    inner = tmp_path / "model"
    inner.mkdir()
    path = save_external(mlp(), inner)
    (inner / "model.data").rename(tmp_path / "secret.data")
    os.symlink(tmp_path / "secret.data", inner / "model.data")
    with pytest.raises(ModelError) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "initializer 'w'" in msg and "model.data" in msg and "outside the model's folder" in msg


def test_external_symlink_inside_is_refused_like_onnx(tmp_path):
    path = save_external(mlp(), tmp_path, location="real.data")
    os.symlink(tmp_path / "real.data", tmp_path / "link.data")
    set_location(path, "w", location="link.data")
    with pytest.raises(ModelError, match=r"initializer 'w'.*link\.data.*symbolic link"):
        load_onnx(path)


def test_external_hard_link_is_refused_like_onnx(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    inner = tmp_path / "model"
    inner.mkdir()
    path = save_external(mlp(), inner)
    os.link(inner / "model.data", outside / "copy.data")
    with pytest.raises(ModelError, match=r"initializer '[wb]'.*model\.data.*2 hard links"):
        load_onnx(path)


def test_external_symlinked_subfolder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    inner = tmp_path / "model"
    inner.mkdir()
    path = save_external(mlp(), inner)
    (inner / "model.data").rename(outside / "model.data")
    os.symlink(outside, inner / "weights")
    set_location(path, "w", location="weights/model.data")
    set_location(path, "b", location="weights/model.data")
    with pytest.raises(ModelError, match=r"initializer '[wb]'.*symbolic link.*outside the model's folder"):
        load_onnx(path)


def test_external_file_missing_names_tensor(tmp_path):
    path = save_external(mlp(), tmp_path)
    (tmp_path / "model.data").unlink()
    with pytest.raises(ModelError) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "initializer 'w'" in msg and "model.data" in msg and "does not exist" in msg


def test_external_offset_beyond_end(tmp_path):
    path = save_external(mlp(), tmp_path)
    size = (tmp_path / "model.data").stat().st_size
    set_location(path, "b", offset=size + 100)
    with pytest.raises(ModelError, match=rf"initializer 'b'.*offset {size + 100}.*holds only {size} bytes"):
        load_onnx(path)


def test_external_length_beyond_end(tmp_path):
    path = save_external(mlp(), tmp_path)
    size = (tmp_path / "model.data").stat().st_size
    set_location(path, "w", offset=0, length=size + 4)
    with pytest.raises(ModelError, match=rf"initializer 'w'.*holds only {size} bytes"):
        load_onnx(path)


def test_external_data_truncated_without_length(tmp_path):
    path = save_external(mlp(), tmp_path, location="w.data")
    set_location(path, "w", offset=None, length=None)
    data = (tmp_path / "w.data").read_bytes()
    (tmp_path / "w.data").write_bytes(data[:1000])
    set_location(path, "b", location="b.data", offset=None, length=None)
    (tmp_path / "b.data").write_bytes(np.zeros(64, np.float32).tobytes())
    with pytest.raises(ModelError, match=r"initializer 'w'.*\[64, 64\].*16384 bytes.*1000 bytes long"):
        load_onnx(path)


def test_external_bad_offset_field(tmp_path):
    path = save_external(mlp(), tmp_path)
    set_location(path, "w", offset="-3")
    with pytest.raises(ModelError, match=r"initializer 'w'.*offset '-3'"):
        load_onnx(path)


def test_errors_are_kiln_errors():
    assert issubclass(ModelError, KilnError)


def test_builder_reads_external_data_through_the_loader(tmp_path):
    import kiln
    from kiln.ops import lookup

    missing = [op for op in ("MatMul", "Add", "Relu") if lookup(op) is None]
    if missing:
        pytest.skip(f"ops not registered yet: {', '.join(missing)}")
    m = mlp()
    w = _weights(m)
    path = save_external(m, tmp_path)  # (moves m's weights out)
    engine = kiln.build(path, kiln.BuildConfig(device="cpu", progress=False,
                                               profiles=[kiln.Profile({"x": ((1, 64), (2, 64), (4, 64))})]))
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    got = engine.create_execution_context().run({"x": x})["y"]
    np.testing.assert_allclose(got, np.maximum(x @ w["w"] + w["b"], 0), rtol=1e-5, atol=1e-5)
