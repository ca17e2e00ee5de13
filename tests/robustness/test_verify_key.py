"""--verifyKey on the commands that load an engine accepts the engine signed with that key (the refusals are
corpus cases: an unsigned engine, one signed with another key)."""

from __future__ import annotations

import kiln
from kiln.engine import serialize

from ..models import mlp
from .corpus import Case
from .test_corpus import run_forked


def test_an_engine_signed_with_the_key_is_accepted(tmp_path):
    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(mlp().SerializeToString())
    engine = kiln.build(mlp(), kiln.BuildConfig(shapes={"x": (2, 8)}, device="cpu", progress=False))
    key = tmp_path / "deploy.key"
    key.write_text("c" * 64 + "\n")
    signed = tmp_path / "signed.kiln"
    serialize.save(engine, signed, sign_key=key.read_bytes().strip())
    work = tmp_path / "work"
    work.mkdir()
    cases = [Case("compare", ["compare", str(onnx_path), str(signed), "--device=cpu", f"--verifyKey={key}"], ()),
             Case("export", ["export", "triton", str(signed), f"--repo={work / 'repo'}", f"--verify-key={key}"], ()),
             Case("inspect", ["inspect", str(signed), "--no-run", f"--verifyKey={key}"], ())]
    for case, code, text, _, _ in run_forked(cases, work):
        assert code == 0, f"{case.id}: {text[-2000:]}"
    assert (work / "repo" / "signed" / "1" / "model.kiln").read_bytes() == signed.read_bytes()
