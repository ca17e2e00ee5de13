"""A layer whose fastest tactic differs between optimization profiles runs each profile's own, after a save and
load too; engines saved before per-profile tactics still load."""

import torch

import kiln

from ..models import mlp, mlp_reference
from .util import rewrite_manifest

PROFILES = [kiln.Profile({"x": ((1, 8), (2, 8), (4, 8))}), kiln.Profile({"x": ((8, 8), (16, 8), (32, 8))})]


def _recording_tactics(monkeypatch) -> list:
    """Two CPU tactics for FusedGemm, registered by name only (so no build picks them), that log each run."""
    from kiln import tactics
    from kiln.ops.fused import fused_gemm

    tactics.load_all()
    ran = []

    def logging(name):
        def fn(node, *args):
            ran.append(name)
            return fused_gemm(node, *args)
        return fn

    for name in ("small_batch", "large_batch"):
        monkeypatch.setitem(tactics._BY_NAME, ("kiln", "FusedGemm", name),
                            tactics.Tactic(name, logging(name), lambda n, a: True))
    return ran


def _want(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(mlp_reference(mlp(), x.numpy())).float()


def _engine(tmp_path):
    engine = kiln.build(mlp(), kiln.BuildConfig(device="cpu", progress=False, profiles=PROFILES))
    first = engine.graph.nodes[0]
    assert first.op_type == "FusedGemm"
    first.profile_tactics, first.tactic = ["small_batch", "large_batch"], "large_batch"  # as the selector sets them
    path = tmp_path / "mlp.kiln"
    engine.save(str(path))
    return path


def test_each_profile_runs_its_own_tactic_after_a_round_trip(monkeypatch, tmp_path):
    ran = _recording_tactics(monkeypatch)
    engine = kiln.load(str(_engine(tmp_path)))
    assert engine.graph.nodes[0].profile_tactics == ["small_batch", "large_batch"]
    x_small, x_large = torch.randn(2, 8), torch.randn(16, 8)
    ctx = engine.create_execution_context(profile=0)
    torch.testing.assert_close(ctx.run({"x": x_small})["y"], _want(x_small), rtol=1e-4, atol=1e-4)
    assert ran == ["small_batch"]
    ctx.set_optimization_profile(1)
    torch.testing.assert_close(ctx.run({"x": x_large})["y"], _want(x_large), rtol=1e-4, atol=1e-4)
    assert ran == ["small_batch", "large_batch"]
    from kiln.tools.inspect import inspect_engine

    layer = inspect_engine(engine, measure=False).layers[0]
    assert layer.tactic_text == "p0 small_batch | p1 large_batch"
    assert layer.to_trt()["TacticPerProfile"] == ["small_batch", "large_batch"]


def test_an_engine_saved_before_per_profile_tactics_loads(monkeypatch, tmp_path):
    ran = _recording_tactics(monkeypatch)
    path = _engine(tmp_path)

    def drop_field(m):
        for layer in m["layers"]:
            del layer["profile_tactics"]

    rewrite_manifest(path, drop_field)
    engine = kiln.load(str(path))
    assert engine.graph.nodes[0].profile_tactics == [] and engine.graph.nodes[0].tactic_for(0) == "large_batch"
    engine.create_execution_context(profile=0).run({"x": torch.randn(2, 8)})
    assert ran == ["large_batch"]
