"""kernels/rotary.py against kiln.ops.rotary's reference: small shapes (TRITON_INTERPRET=1 without a GPU)."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import rotary as kernel
from kiln.ops.rotary import rotary as reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BIG = 2**63 - 1


def _node(split):
    return Node("Rotary", ["x", "cos", "sin"], ["y"], {"split": split, "end": BIG, "axis": -1, "concat_axis": -1},
                domain="kiln")


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_q_as_the_transposed_projection_with_per_batch_angles(dtype):
    """q [batch, heads, seq, dim] as a view of the projection's [batch, seq, heads * dim] rows; cos/sin
    [batch, 1, seq, dim] (position ids per sequence)."""
    q = _rand(2, 5, 3 * 16, dtype=dtype).view(2, 5, 3, 16).transpose(1, 2)
    cos, sin = _rand(2, 1, 5, 16, seed=1, dtype=dtype), _rand(2, 1, 5, 16, seed=2, dtype=dtype)
    y = kernel.rotary(q, cos, sin, 8)
    assert y.is_contiguous() and y.dtype == dtype and y.shape == q.shape
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y, reference(_node(8), q, cos, sin), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape,split", [((7, 10), 5), ((3, 6, 12), 5), ((4, 24), 16)])  # ragged blocks; any split
def test_lower_ranks_shared_angles_and_splits_off_the_middle(shape, split):
    x = _rand(*shape)
    cos, sin = _rand(shape[-1], seed=1), _rand(*shape[:-1], 1, seed=2)  # one per column; one per row
    assert kernel.supports(x, cos, sin, split)
    torch.testing.assert_close(kernel.rotary(x, cos, sin, split), reference(_node(split), x, cos, sin),
                               atol=1e-5, rtol=1e-5)


def test_declines_what_it_does_not_compute():
    x = _rand(2, 8)
    assert not kernel.supports(x, _rand(3, 2, 8), _rand(8), 4)  # cos would widen the output
    assert not kernel.supports(x, _rand(8).half(), _rand(8).half(), 4)  # mixed types
    assert not kernel.supports(x, _rand(8), _rand(8), 8)  # nothing to rotate


@pytest.mark.gpu
def test_llama_q_and_k_at_batch_32_on_cuda():
    """llama_lm's real shapes: q [32, 16, 128, 64] and k [32, 4, 128, 64] as views of their projections, the
    angles [1, 1, 128, 64] (static positions), FP16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cos, sin = _rand(1, 1, 128, 64, seed=1, dtype=torch.float16), _rand(1, 1, 128, 64, seed=2, dtype=torch.float16)
    for heads in (16, 4):
        x = _rand(32, 128, heads * 64, seed=heads, dtype=torch.float16).view(32, 128, heads, 64).transpose(1, 2)
        y = kernel.rotary(x, cos, sin, 32)
        want = reference(_node(32), x.float(), cos.float(), sin.float())
        torch.testing.assert_close(y.float(), want, atol=1e-2, rtol=1e-2)
