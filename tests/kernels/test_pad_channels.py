"""The stem input's cast into channels-last with a zero channel appended (kernels/pad_channels.py)."""

import pytest
import torch

from kiln.kernels import pad_channels

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_pad_channels_matches_the_reference(layout, dtype):
    x = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(0)).to(DEV)  # 70 pixels: a ragged block
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # every other column of a wider image
        x = torch.randn(2, 3, 7, 10, generator=torch.Generator().manual_seed(0)).to(DEV)[..., ::2]
    out = torch.full((2, 4, 7, 5), 12345.0, dtype=dtype, device=DEV).contiguous(memory_format=torch.channels_last)
    got = pad_channels.pad_channels(x, 4, dtype, block=32, out=out)  # poisoned: every element must be written
    want = pad_channels.reference(x, 4, dtype)
    assert got.is_contiguous(memory_format=torch.channels_last) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got[:, 3] == 0).all()
    torch.testing.assert_close(got[:, :3], x.to(dtype), atol=0, rtol=0)
