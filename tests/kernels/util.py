"""Helpers the kernel tests share."""

import torch


def poisoned(fn):
    """fn() with every buffer it allocates through torch.empty filled first (NaN, or -77 for integer buffers):
    an element the kernel leaves unwritten shows in its result."""
    real = torch.empty

    def filled(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(-77)

    try:
        torch.empty = filled
        return fn()
    finally:
        torch.empty = real


def codes(t: torch.Tensor) -> torch.Tensor:
    """8-bit values as ordered integers, neighbours one apart: INT8 as they are, FP8 E4M3 by sign and magnitude."""
    if t.dtype == torch.int8:
        return t.int()
    bits = t.view(torch.uint8).int()
    return torch.where(bits >= 128, -(bits & 127), bits & 127)


def assert_same_codes_but_ties(got: torch.Tensor, want: torch.Tensor, rare: float = 1e-3) -> None:
    """got equals want's 8-bit codes but where the two kernels' FP32 arithmetic, rounded in another order (the Gluon
    epilogues fold 1 / y_scale into their column vectors), lands a value on the other side of a rounding tie: one
    step apart, and at most a `rare` fraction of the codes."""
    assert got.shape == want.shape and got.dtype == want.dtype
    off = (codes(got) - codes(want)).abs()
    assert int(off.max()) <= 1 and int((off > 0).sum()) <= rare * off.numel(), (int(off.max()), int((off > 0).sum()))
