import copy

import torch

import kiln
from kiln.ir.from_onnx import model_to_graph
from kiln.passes import (
    dead_code,
    fold_constants,
    fuse_attention,
    fuse_gemm,
    gather_as_slice,
    merge_heads_as_view,
    remove_noops,
    split_heads_as_view,
)

from .util import run


class _EncoderBlock(torch.nn.Module):
    """ViT's attention block: nn.MultiheadAttention, which torch exports sequence-first inside."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        y = self.norm(x)
        return x + self.attn(y, y, y, need_weights=False)[0]


def test_vit_attention_output_is_merged_batch_major():
    torch.manual_seed(0)
    vit = _EncoderBlock().eval()
    x = torch.randn(3, 5, 16)
    proto, _ = kiln.from_torch(vit, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=4)},), opset=18)
    before = model_to_graph(proto)
    for p in (fold_constants, remove_noops, dead_code, gather_as_slice, split_heads_as_view, fuse_gemm, fuse_attention):
        p.run(before)
    after = copy.deepcopy(before)
    merge_heads_as_view.run(after)
    assert len(after.nodes) == len(before.nodes) - 1  # the Transpose back to batch-major is gone
    merge = next(n for n in after.nodes if n.op_type == "Transpose" and n.inputs[0] == next(
        a for a in after.nodes if a.op_type == "Attention").outputs[0])
    assert merge.attrs["perm"] == [0, 2, 1, 3]  # a view of what SDPA writes
    torch.testing.assert_close(run(after, {"x": x})[0], run(before, {"x": x})[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(run(after, {"x": x})[0], vit(x), rtol=1e-4, atol=1e-4)
