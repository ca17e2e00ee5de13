import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import softmax
from kiln.ops.activation import softmax as op_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 7), (5, 33), (2, 3, 100)])  # not multiples of the block
def test_softmax_matches_reference(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])).to(DEV) * 4
    x[..., 0, :2] = float("-inf")  # masked entries in one row
    torch.testing.assert_close(softmax.softmax(x), softmax.reference(x), atol=1e-6, rtol=1e-5)


def test_fp16_rows_and_every_element_written():
    x = torch.randn(6, 50).to(DEV).half()
    real = torch.empty_like
    try:  # poison the output the kernel allocates: any unwritten element stays NaN
        torch.empty_like = lambda t, **kw: torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)
        y = softmax.softmax(x)
    finally:
        torch.empty_like = real
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y, softmax.reference(x), atol=1e-3, rtol=1e-3)


def test_fully_masked_row_is_nan_like_the_reference():
    x = torch.randn(3, 9).to(DEV)
    x[1] = float("-inf")
    y = softmax.softmax(x)
    assert y[1].isnan().all() and softmax.reference(x)[1].isnan().all() and torch.isfinite(y[[0, 2]]).all()


def test_softmax_tactic_matches_the_op_and_refuses_other_axes():
    from kiln.tactics import _TACTICS, triton_tactics  # noqa: F401  (registers)

    tactic = next(t for t in _TACTICS[("", "Softmax")] if t.name == "triton_softmax")
    x = torch.randn(4, 3, 20).to(DEV)
    node = Node("Softmax", ["x"], ["y"], {}, opset=13)
    assert tactic.applies(node, [x]) == x.is_cuda  # CPU tensors are refused
    torch.testing.assert_close(tactic.fn(node, x), op_reference(node, x), atol=1e-6, rtol=1e-5)
    for other in (Node("Softmax", ["x"], ["y"], {"axis": 1}, opset=13), Node("Softmax", ["x"], ["y"], {}, opset=11)):
        assert not tactic.applies(other, [x])
    assert not softmax.supports(x.transpose(0, 1))  # rows must be contiguous
