"""`kiln export triton`: the model repository, checked against the real Triton Inference Server.

The server test needs PyPI's nvidia-pytriton (it bundles tritonserver) and tritonclient; without them it is
skipped, and the config tests still run.
"""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.cli import main as kiln_main
from kiln.errors import ConfigError
from kiln.serve.triton_repo import export_triton, triton_config

from ..models import mlp
from .tritonserver import TritonServer, bundled_server, installed

CPU = dict(device="cpu", progress=False)


def build(path, profile, batch="N"):
    engine = kiln.build(mlp(batch=batch), kiln.BuildConfig(profiles=[kiln.Profile({"x": profile})], **CPU))
    engine.save(path)
    return path


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    return {
        "mlp": build(d / "mlp.kiln", ((1, 8), (4, 8), (16, 8))),
        "mlp_b2": build(d / "mlp_b2.kiln", ((2, 8), (2, 8), (2, 8))),  # batch exactly 2: Triton's 1 is padded
        "static": build(d / "static.kiln", ((3, 8), (3, 8), (3, 8)), batch=3),  # no dynamic axis at all
    }


def test_config_from_bindings_and_profile(engines):
    c = triton_config(engines["mlp"], "mlp", instances=2)
    assert (c.max_batch_size, c.preferred_batch_size, c.instance_kind, c.instances) == (16, 4, "KIND_CPU", 2)
    assert [(s.name, s.data_type, s.dims) for s in c.inputs] == [("x", "TYPE_FP32", [8])]
    assert [(s.name, s.data_type, s.dims) for s in c.outputs] == [("y", "TYPE_FP32", [4])]
    assert triton_config(engines["mlp"], "mlp", max_batch=8).max_batch_size == 8
    whole = triton_config(engines["mlp"], "mlp", max_batch=0)
    assert (whole.max_batch_size, whole.inputs[0].dims, whole.outputs[0].dims) == (0, [-1, 8], [-1, 4])
    static = triton_config(engines["static"], "static")
    assert (static.max_batch_size, static.inputs[0].dims, static.outputs[0].dims) == (0, [3, 8], [3, 4])
    assert "dynamic_batching" not in static.to_pbtxt()


def test_config_refuses_what_triton_cannot_do(engines):
    with pytest.raises(ConfigError, match="up to 16"):
        triton_config(engines["mlp"], "mlp", max_batch=32)
    with pytest.raises(ConfigError, match="no batch axis"):
        triton_config(engines["static"], "static", max_batch=4)
    with pytest.raises(ConfigError, match="--instances"):
        triton_config(engines["mlp"], "mlp", instances=0)


def test_config_pbtxt_parses_as_triton_model_config(engines, tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    folder = export_triton(engines["mlp"], tmp_path, name="m", instances=3)
    c = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert (c.name, c.backend, c.max_batch_size) == ("m", "python", 16)
    assert list(c.dynamic_batching.preferred_batch_size) == [4]
    assert c.instance_group[0].count == 3
    assert c.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert c.input[0].data_type == model_config_pb2.TYPE_FP32 and list(c.input[0].dims) == [8]
    assert (folder / "1" / "model.kiln").read_bytes() == engines["mlp"].read_bytes()


def test_cli_export_triton(engines, tmp_path, capsys):
    assert kiln_main(["export", "triton", str(engines["mlp"]), "--repo", str(tmp_path), "--name", "x1",
                      "--instances", "2", "--max-batch", "8"]) == 0
    text = (tmp_path / "x1" / "config.pbtxt").read_text()
    assert "max_batch_size: 8" in text and "count: 2" in text
    assert (tmp_path / "x1" / "1" / "model.py").is_file()
    assert kiln_main(["export", "triton", str(engines["mlp"]), "--repo", str(tmp_path), "--max-batch", "99"]) != 0
    assert "up to 16" in capsys.readouterr().err


needs_server = pytest.mark.skipif(
    bundled_server() is None or not installed("tritonclient"),
    reason="needs nvidia-pytriton (bundled tritonserver) and tritonclient[http,grpc]")


@needs_server
def test_triton_server_runs_the_exported_engines(engines, tmp_path):
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    repo = tmp_path / "repo"
    export_triton(engines["mlp"], repo, name="mlp", instances=2)
    export_triton(engines["mlp_b2"], repo, name="mlp_b2")
    bad = export_triton(engines["mlp"], repo, name="corrupt") / "1" / "model.kiln"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # kiln.load's integrity checks must refuse it
    bad.write_bytes(bytes(data))

    server = TritonServer(repo, tmp_path)
    try:
        http = thttp.InferenceServerClient(server.http_url, concurrency=16)
        server.wait_ready(http, ["mlp", "mlp_b2"])
        grpc = tgrpc.InferenceServerClient(server.grpc_url)
        direct = {n: kiln.load(engines[n], device="cpu").create_execution_context() for n in ("mlp", "mlp_b2")}
        rng = np.random.default_rng(0)

        def ask(client, mod, model, x):
            inp = mod.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            return client.infer(model, [inp]).as_numpy("y")

        # Concurrent HTTP requests of mixed batch sizes: the dynamic batcher merges them across two instances.
        xs = [rng.standard_normal((1 + i % 5, 8)).astype(np.float32) for i in range(24)]
        pending = []
        for x in xs:
            inp = thttp.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            pending.append(http.async_infer("mlp", [inp]))
        got = [p.get_result().as_numpy("y") for p in pending]
        for x, y in zip(xs, got):
            np.testing.assert_allclose(y, direct["mlp"].run({"x": x})["y"], rtol=1e-6, atol=1e-6)
        x = rng.standard_normal((5, 8)).astype(np.float32)
        np.testing.assert_allclose(ask(grpc, tgrpc, "mlp", x), direct["mlp"].run({"x": x})["y"], rtol=1e-6, atol=1e-6)
        one = rng.standard_normal((1, 8)).astype(np.float32)
        padded = direct["mlp_b2"].run({"x": np.concatenate([one, one])})["y"][:1]
        np.testing.assert_allclose(ask(grpc, tgrpc, "mlp_b2", one), padded, rtol=1e-6, atol=1e-6)

        with pytest.raises(Exception, match="batch-size must be <= 16"):
            ask(http, thttp, "mlp", np.zeros((17, 8), np.float32))
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["corrupt"]["state"] == "UNAVAILABLE"
        assert "EngineFileError" in index["corrupt"]["reason"]  # kiln.load refused it (Triton truncates why)
        assert ask(http, thttp, "mlp", x).shape == (5, 4)  # still serving
    finally:
        server.stop()
