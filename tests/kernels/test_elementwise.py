import os
import re
from pathlib import Path

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import elementwise
from kiln.ops.fused import elementwise as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROGRAM = ["Add t0 i0 i1", "Mul t1 t0 c0.5", "Erf t2 t1", "Relu t3 t2", "Div t4 t3 i1", "Max t5 t4 i0"]


@pytest.mark.parametrize("n", [1, 1000, 1025, 3001])  # around and across block boundaries
def test_generated_kernel_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g).to(DEV)
    b = (torch.rand(n, generator=g) + 0.5).to(DEV)
    node = Node("Elementwise", ["a", "b"], ["y"], {"program": PROGRAM}, domain="kiln")
    want = reference(node, a, b)
    got = elementwise.run(PROGRAM, [a, b], block=256)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_element_is_written():
    a = torch.randn(777).to(DEV)
    poisoned = torch.full_like(a, float("nan"))
    out = elementwise.run(["Neg t0 i0"], [a], block=128, out=poisoned)
    assert out.data_ptr() == poisoned.data_ptr()
    torch.testing.assert_close(out, -a)


@pytest.mark.parametrize("small", [(1, 5, 7), (5, 7), (7,), ()])
def test_inputs_with_the_outputs_trailing_shape_repeat(small):
    # BERT's embeddings: word + token type [B, S, H] + position [1, S, H]; biases and scalars too
    g = torch.Generator().manual_seed(len(small))
    a, b = torch.randn(3, 5, 7, generator=g).to(DEV), torch.randn(small, generator=g).to(DEV)
    program = ["Add t0 i0 i1", "Mul t1 t0 i1"]
    node = Node("Elementwise", ["a", "b"], ["y"], {"program": program}, domain="kiln")
    for inputs in ([a, b], [b, a]):
        assert elementwise.supports(inputs)
        poisoned = torch.full((3, 5, 7), float("nan"), device=DEV)
        got = elementwise.run(program, inputs, block=16, out=poisoned)
        torch.testing.assert_close(got, reference(node, *inputs), rtol=1e-5, atol=1e-5)


def test_broadcasts_inside_run_and_mixed_types_are_left_to_the_reference():
    a = torch.randn(3, 5, 7).to(DEV)
    program = ["Mul t0 i0 i1"]
    node = Node("Elementwise", ["a", "b"], ["y"], {"program": program}, domain="kiln")
    for b in (torch.randn(3, 1, 7), torch.randn(5, 1)):  # repeats inside, not along leading dims
        b = b.to(DEV)
        assert elementwise.supports([a, b])
        torch.testing.assert_close(elementwise.run(program, [a, b], block=16), reference(node, a, b))
    assert not elementwise.supports([a, torch.randn(7).half().to(DEV)])  # mixed types


def test_source_is_straight_line_code():
    src = elementwise.source(PROGRAM, 2)
    assert "t5 = tl.maximum(t4, x0)" in src and "tl.store(out + offs, t5" in src


# --- an engine's program is data: never code, never a file someone else wrote ------------------------------------
@pytest.mark.parametrize("program, why", [
    (["Add t0 i0 __import__('os').system('id')"], "reads \"__import__('os').system('id')\""),
    (["Mul t0 i0 c1.0+__import__('os').system('id')"], "reads \"c1.0+__import__('os').system('id')\""),
    (["Add t0 i0 c1.0);import os;os.system('id');(1"], "has 3 argument(s), Add takes 2"),
    (["Relu t0 i0\n    import os"], "has 6 argument(s)"),
    (["Relu t0 c1e999999"], "reads 'c1e999999'"),
    (["Relu t0 i0", "Exec t1 t0"], "uses op 'Exec'"),
    (["Relu t0 i3"], "reads 'i3'"),
    (["Relu t0 t0"], "reads 't0'"),
    (["Relu t1 i0"], "writes 't1', not t0"),
    (["Add t0 i0"], "has 1 argument(s), Add takes 2"),
    ([], "is not a list"),
    ("Relu t0 i0", "is not a list"),
    ([7], "line 0 is a int"),
])
def test_a_program_that_is_not_a_program_is_refused(program, why):
    from kiln.errors import EngineFileError

    with pytest.raises(EngineFileError, match=re.escape(why)):
        elementwise.source(program, 2)


def test_literals_are_parsed_and_printed_back():
    src = elementwise.source(["Mul t0 i0 c1e-05", "Max t1 t0 c-inf", "Add t2 t1 c+.5"], 1)
    assert "t0 = (x0 * 1e-05)" in src and 't1 = tl.maximum(t0, (-float("inf")))' in src and "(t1 + 0.5)" in src


def test_a_planted_kernel_file_is_never_imported(tmp_path, monkeypatch):
    """The old cache, $TMPDIR/kiln-kernels/elementwise_<hash>.py (and KILN_KERNEL_CACHE), is predictable and
    shared: a file planted there must not run."""
    import hashlib
    import tempfile

    program = ["Neg t0 i0", "Mul t1 t0 c3.0"]
    src = elementwise.source(program, 1)
    marker = tmp_path / "ran"
    payload = f"open({str(marker)!r}, 'w').write('planted code ran')\n" + src
    planted = []
    for folder in (Path(tempfile.gettempdir()) / "kiln-kernels", tmp_path / "cache"):
        folder.mkdir(exist_ok=True)
        for key in (hashlib.sha256(src.encode()).hexdigest()[:20], hashlib.sha256(src.encode()).hexdigest()):
            planted.append(folder / f"elementwise_{key}.py")
            planted[-1].write_text(payload)
    monkeypatch.setenv("KILN_KERNEL_CACHE", str(tmp_path / "cache"))
    a = torch.randn(100).to(DEV)
    try:
        torch.testing.assert_close(elementwise.run(program, [a]), -a * 3.0)
    finally:
        for p in planted:
            p.unlink()
    assert not marker.exists()
    folder = elementwise.kernel_folder()
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()


def test_a_kernel_source_changed_after_writing_is_not_imported(monkeypatch):
    program = ["Neg t0 i0", "Sub t1 t0 c0.25"]
    src = elementwise.source(program, 1)
    name = f"elementwise_{__import__('hashlib').sha256(src.encode()).hexdigest()}.py"
    path = elementwise.kernel_folder() / name
    path.write_text("raise SystemExit('tampered')\n")  # as if someone raced us into our own folder
    with pytest.raises(RuntimeError, match="does not hold the source it was written with"):
        elementwise.kernel_for(program, 1)
    path.unlink()


def test_an_engine_with_a_crafted_program_is_refused_at_load(tmp_path):
    """A .kiln whose Elementwise layer carries Python in its program is refused when loaded, naming the layer."""
    import onnx
    from onnx import TensorProto, helper

    import kiln
    from kiln.engine import serialize
    from kiln.errors import EngineFileError

    from ..engine.util import read_members, write_zip

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Exp", ["r"], ["y"], name="exp")],
        "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    assert [n.op_type for n in engine.graph.nodes] == ["Elementwise"]
    path = tmp_path / "e.kiln"
    engine.save(path)
    members = read_members(path)
    graph = onnx.load_from_string(members["graph.onnx"])
    attr = graph.graph.node[0].attribute[0]
    assert attr.name == "program"
    attr.strings[0] = b"Relu t0 (__import__('os').system('id'))"
    members["graph.onnx"] = graph.SerializeToString()
    write_zip(path, serialize.write_members(members))  # re-sealed: the checksums alone would not stop it
    with pytest.raises(EngineFileError, match=r"layer '.+': its program line 0 \(Relu\) reads"):
        kiln.load(path)
