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
    real = torch.empty_like
    try:
        torch.empty_like = lambda t, **kw: torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)
        out = elementwise.run(["Neg t0 i0"], [a], block=128)
    finally:
        torch.empty_like = real
    torch.testing.assert_close(out, -a)


def test_source_is_straight_line_code():
    src = elementwise.source(PROGRAM, 2)
    assert "t5 = tl.maximum(t4, x0)" in src and "tl.store(out + offs, t5" in src
