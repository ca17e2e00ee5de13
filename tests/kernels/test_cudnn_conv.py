"""8-bit convolutions on cuDNN's graph API (kernels/cudnn_conv.py) against conv.py's quantized kernel, the
tested reference: on a Hopper GPU with cudnn-frontend installed; elsewhere only what `supports` refuses."""

import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import conv, cudnn_conv

from .test_tma_conv import _cl, _int8_layer, _node

GPU = (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
       and cudnn_conv.cudnn is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU and cudnn-frontend (pip install 'kiln[cudnn]')")
@pytest.mark.parametrize("qtype", ["int8", "fp8"])
@pytest.mark.parametrize("stride, output", [(1, "8-bit"), (2, "8-bit"), (1, "float16")])
def test_cudnn_8bit_conv_matches_the_pointer_kernel(qtype, stride, output):
    node = _node(3, (1, 1, 1, 1), "Relu", qtype=qtype, stride=stride)
    x, w, sx, sw, b = _int8_layer(3, qtype)
    x = _cl(torch.nn.functional.pad(x.float(), (0, 1, 0, 1)).to(x.dtype))  # 8 x 10: even for stride 2
    y_scale = torch.tensor(0.03, device="cuda") if output == "8-bit" else None
    assert cudnn_conv.supports(node, x, w, b, None, None, qtype, sw)
    for plan in range(cudnn_conv.PLANS):
        got = cudnn_conv.conv2d(node, x, w, b, sx, sw, y_scale, torch.float16, plan)
        want = conv.conv2d(node, x, w, b, None, config=conv.TileConfig(16, 16, 32, 4, 2), x_scale=sx, w_scale=sw,
                           y_scale=y_scale, out_dtype=torch.float16)
        assert got.shape == want.shape and got.dtype == want.dtype
        step = 1.0 if qtype == "int8" else 0.125 * want.float().abs().max()  # one 8-bit step at the top
        diff = got.float() - want.float()
        assert diff.abs().max() <= (step if y_scale is not None else 2e-3 * want.float().abs().max())
        if qtype == "int8" and y_scale is not None:  # rounded to nearest: no truncation's drift towards zero
            assert abs(float(diff.mean())) < 0.05 and float((diff != 0).float().mean()) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper GPU and cudnn-frontend (pip install 'kiln[cudnn]')")
@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_cudnn_8bit_output_saturates_as_the_kernels_do(qtype):
    """A calibrated range that clips: values past it become the type's largest, never NaN or wrapped."""
    node = _node(3, (1, 1, 1, 1), "", qtype=qtype)
    x, w, sx, sw, b = _int8_layer(5, qtype)
    tiny = torch.tensor(1e-4, device="cuda")
    got = cudnn_conv.conv2d(node, x, w, b, sx, sw, tiny, torch.float16, 0)
    want = conv.conv2d(node, x, w, b, None, config=conv.TileConfig(16, 16, 32, 4, 2), x_scale=sx, w_scale=sw,
                       y_scale=tiny, out_dtype=torch.float16)
    clipped = want.float().abs() >= (127 if qtype == "int8" else 448)
    assert clipped.float().mean() > 0.5 and not got.float().isnan().any()
    assert torch.equal(got.float()[clipped], want.float()[clipped])


def test_what_cudnn_8bit_conv_does_not_take_is_refused():
    node = _node(3, (1, 1, 1, 1), "Relu", qtype="int8")
    x, w, sx, sw, b = _int8_layer(1)
    cuda = x.is_cuda
    assert not cudnn_conv.supports(node, x.cpu(), w.cpu(), b, None, None, "int8", sw)  # the CPU: not offered
    if not GPU:
        return
    assert cuda and cudnn_conv.supports(node, x, w, b, None, None, "int8", sw)
    assert not cudnn_conv.supports(node, x, w, b, x, None, "int8", sw)  # a residual: Kiln's kernels add it faster
    assert not cudnn_conv.supports(node, x, w, b, None, sx, "int8", sw)  # a second 8-bit copy
    silu = Node("QConv", node.inputs, node.outputs, {**node.attrs, "activation": "Silu"}, domain="kiln")
    assert not cudnn_conv.supports(silu, x, w, b, None, None, "int8", sw)
    assert not cudnn_conv.supports(node, x.contiguous(), w, b, None, None, "int8", sw)  # NCHW x
