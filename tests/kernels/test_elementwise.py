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


def test_other_broadcasts_are_left_to_the_reference():
    a = torch.randn(3, 5, 7)
    assert not elementwise.supports([a, torch.randn(3, 1, 7)])  # repeats inside, not along leading dims
    assert not elementwise.supports([a, torch.randn(5, 1)])
    assert not elementwise.supports([a, torch.randn(7).half()])  # mixed types


def test_source_is_straight_line_code():
    src = elementwise.source(PROGRAM, 2)
    assert "t5 = tl.maximum(t4, x0)" in src and "tl.store(out + offs, t5" in src
