"""kiln::ViewChain against the same Reshapes and Transposes run one at a time, on inputs of any strides."""

import pytest
import torch

from kiln.errors import EngineFileError
from kiln.ir.graph import Node
from kiln.ops.view_chain import one_by_one as reference
from kiln.ops.view_chain import parse, plan, view_chain

# MobileViT-XXS's unfold of a [B, C, H, W] map into 2x2 patches and its fold back (B=2, C=8, H=W=4)
UNFOLD = ["R:32,2,2,2", "T:0,2,1,3", "R:2,8,4,4", "T:0,3,2,1", "R:8,4,8"]
FOLD = ["R:2,4,4,8", "T:0,3,2,1", "R:32,2,2,2", "T:0,2,1,3", "R:2,8,4,4"]


def one_by_one(x, steps):
    """The op's reference: the ops one at a time."""
    return reference(_node(steps), x)


def _node(steps, channels_last=0):
    return Node("ViewChain", ["x"], ["y"], {"steps": steps, "channels_last": channels_last}, domain="kiln")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
@pytest.mark.parametrize("steps, shape", [(UNFOLD, (2, 8, 4, 4)), (FOLD, (8, 4, 8))])
def test_mobilevit_unfold_and_fold(steps, shape, layout):
    x = torch.randn(*shape)
    if layout == "channels_last" and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    if layout == "sliced":  # a strided view: every other element of a wider tensor
        x = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    got = view_chain(_node(steps), x)
    torch.testing.assert_close(got, one_by_one(x, steps), atol=0, rtol=0)


def test_the_chain_copies_once_into_the_layout_a_convolution_reads():
    x = torch.randn(8, 4, 8)
    got = view_chain(_node(FOLD, channels_last=1), x)  # on the CPU: contiguous, as the ops one at a time give
    assert got.is_contiguous()
    torch.testing.assert_close(got, one_by_one(x, FOLD), atol=0, rtol=0)


def test_a_chain_of_views_stays_a_view():
    x = torch.randn(2, 3, 4, 5)
    steps = ["R:6,4,5", "T:0,2,1", "T:0,2,1", "R:0,20", "R:2,-1"]
    got = view_chain(_node(steps), x)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, one_by_one(x, steps), atol=0, rtol=0)


def test_size_one_axes_and_minus_one():
    x = torch.randn(1, 6, 1, 4).permute(0, 3, 2, 1)  # [1, 4, 1, 6]
    steps = ["R:2,-1,3", "T:2,0,1", "R:3,1,8", "T:1,2,0", "R:-1"]
    torch.testing.assert_close(view_chain(_node(steps), x), one_by_one(x, steps), atol=0, rtol=0)


def test_uneven_split_runs_one_op_at_a_time():
    x = torch.randn(6, 10)
    steps = ["T:1,0", "R:4,15", "T:1,0", "R:60"]  # 10 x 6 regrouped as 4 x 15 splits no atom evenly
    assert plan(list(x.shape), list(x.stride()), parse(steps)) is None
    torch.testing.assert_close(view_chain(_node(steps), x), one_by_one(x, steps), atol=0, rtol=0)


@pytest.mark.parametrize("bad", [["X:1"], ["T:a"], "R:1,2", [3]])
def test_steps_are_data(bad):
    with pytest.raises(EngineFileError):
        parse(bad)


@pytest.mark.gpu
def test_fold_into_channels_last_on_the_gpu():
    x = torch.randn(8, 4, 8, device="cuda").half()
    node = _node(FOLD, channels_last=1)
    got = view_chain(node, x)
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, one_by_one(x, FOLD), atol=0, rtol=0)
    seq = view_chain(_node(UNFOLD), got)  # and back, from the channels-last map a convolution would write
    torch.testing.assert_close(seq, x, atol=0, rtol=0)
