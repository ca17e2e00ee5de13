"""The engine file: round trip, atomic writes, and refusal of bad or foreign files."""

import zipfile

import numpy as np
import pytest

import kiln
from kiln import fileio
from kiln.engine import serialize
from kiln.errors import EngineFileError

from ..models import mlp, mlp_reference
from .util import rewrite_manifest

CPU = dict(device="cpu", progress=False)


@pytest.fixture(scope="module")
def engine():
    return kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})], **CPU))


def test_round_trip_keeps_results_and_stamp(engine, tmp_path):
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    loaded = kiln.load(path)
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    y = loaded.create_execution_context().run({"x": x})["y"]
    np.testing.assert_allclose(y, mlp_reference(mlp(), x), rtol=1e-5, atol=1e-5)
    m = serialize.read_manifest(path)
    assert m["target"]["kind"] == "cpu"
    assert {"kiln", "torch", "triton", "cuda", "onnx"} <= set(m["versions"])
    assert m["profiles"][0]["x"] == {"min": [1, 8], "opt": [4, 8], "max": [16, 8]}
    assert [b["name"] for b in m["bindings"]] == ["x", "y"]
    with zipfile.ZipFile(path) as z:  # no pickle anywhere: only JSON, ONNX and safetensors
        assert sorted(z.namelist()) == ["checksums.json", "graph.onnx", "manifest.json", "weights.safetensors"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())


def test_save_is_atomic(engine, tmp_path, monkeypatch):
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", boom)
    with pytest.raises(EngineFileError, match=r"cannot write '.*mlp.kiln': disk full"):
        engine.save(path)
    assert path.read_bytes() == before  # the old engine is intact
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.kiln"]  # no temp file left behind


def test_truncated_file_is_refused(engine, tmp_path):
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineFileError, match="truncated, corrupted"):
        kiln.load(path)


def test_corrupted_weights_fail_checksum(engine, tmp_path):
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    w = bytearray(members["weights.safetensors"])
    w[-1] ^= 0xFF
    members["weights.safetensors"] = bytes(w)
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
    with pytest.raises(EngineFileError, match="checksum of weights.safetensors does not match"):
        kiln.load(path)


def test_foreign_files_are_refused(tmp_path):
    onnx_file = tmp_path / "model.onnx"
    onnx_file.write_bytes(mlp().SerializeToString())
    with pytest.raises(EngineFileError, match="not a Kiln engine"):
        kiln.load(onnx_file)
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(EngineFileError, match="no manifest.json"):
        kiln.load(other_zip)
    with pytest.raises(EngineFileError, match="does not exist"):
        kiln.load(tmp_path / "missing.kiln")


def test_engine_for_another_gpu_is_refused(engine, tmp_path):
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    rewrite_manifest(path, lambda m: m.update(target={"kind": "cuda", "name": "NVIDIA A100-SXM4-80GB",
                                                      "capability": "8.0"}))
    with pytest.raises(EngineFileError, match=r"built for NVIDIA A100-SXM4-80GB \(compute capability 8.0\)"):
        kiln.load(path)


def test_engine_from_another_format_version_is_refused(engine, tmp_path):
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    rewrite_manifest(path, lambda m: m.update(format_version=99))
    with pytest.raises(EngineFileError, match="format 99"):
        kiln.load(path)


def test_engine_whose_tactic_this_installation_lacks_is_refused(engine, tmp_path):
    """A layer built to run a tactic from an optional package (cuDNN's graph API, say) that is not installed
    here must not fall back to the reference kernel without a word."""
    path = tmp_path / "mlp.kiln"
    engine.save(path)
    rewrite_manifest(path, lambda m: m["layers"][0].update(tactic="cudnn_graph_plan7"))
    with pytest.raises(EngineFileError, match=r"layer '.+' \(.+\) was built to run tactic 'cudnn_graph_plan7'.*"
                                              r"pip install 'kiln\[cudnn\]'"):
        kiln.load(path)


def test_save_into_missing_folder_is_a_clear_error(engine, tmp_path):
    with pytest.raises(EngineFileError, match="does not exist"):
        engine.save(tmp_path / "nope" / "mlp.kiln")


def test_a_loaded_engine_finds_its_tactics_in_a_fresh_process(tmp_path):
    """Tactics register lazily: a process that only loads an engine must still find the chosen ones
    (not fall back to reference kernels without a word). Loading registers them, to check every layer's."""
    import subprocess
    import sys

    eng = kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})], **CPU))
    eng.graph.nodes[0].tactic = "cublaslt_bias"  # a GPU tactic name, as a GPU build would record
    eng.save(tmp_path / "t.kiln")
    code = ("import kiln, torch; from kiln import tactics; e = kiln.load(%r); n = e.graph.nodes[0]; "
            "loaded = len(tactics._BY_NAME) > 0; "
            "tactics.implementation(n, [torch.zeros(2, 8), torch.zeros(8, 16), torch.zeros(16)]); "
            "print(n.tactic, loaded, (n.domain, n.op_type, n.tactic) in tactics._BY_NAME)") % str(tmp_path / "t.kiln")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["cublaslt_bias", "True", "True"], p.stderr[-2000:]
