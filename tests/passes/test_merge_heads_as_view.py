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


class _CausalSelfAttention(torch.nn.Module):
    """GPT-2's attention: one QKV projection split into heads batch-first, SDPA, heads merged, projected."""

    def __init__(self, e=32, h=4):
        super().__init__()
        self.h, self.qkv, self.proj = h, torch.nn.Linear(e, 3 * e), torch.nn.Linear(e, e)

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = (t.view(b, s, self.h, e // self.h).transpose(1, 2) for t in self.qkv(x).split(e, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, e))


def test_gpt2_keys_transposed_for_attention_become_one_transpose_a_view():
    """The exporter's k^T as Reshape([-1, S, D]) -> Transpose -> Reshape([B, H, D, S]) merges batch and heads of a
    strided view of the projection (a copy); it becomes Transpose([0, 1, 3, 2]) of k."""
    torch.manual_seed(0)
    block = _CausalSelfAttention().eval()
    x = torch.randn(2, 6, 32)
    proto, _ = kiln.from_torch(block, (x,), opset=18)
    before = model_to_graph(proto)
    for p in (fold_constants, remove_noops, dead_code, gather_as_slice, split_heads_as_view, fuse_gemm, fuse_attention):
        p.run(before)
    (attn,) = [n for n in before.nodes if n.op_type == "Attention"]
    assert attn.attrs.get("k_transposed")
    after = copy.deepcopy(before)
    merge_heads_as_view.run(after)
    assert len(after.nodes) == len(before.nodes) - 2
    (attn,) = [n for n in after.nodes if n.op_type == "Attention"]
    keys = next(n for n in after.nodes if n.outputs[0] == attn.inputs[1])
    assert keys.op_type == "Transpose" and keys.attrs["perm"] == [0, 1, 3, 2] and len(keys.sources) == 3
    torch.testing.assert_close(run(after, {"x": x})[0], run(before, {"x": x})[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(run(after, {"x": x})[0], block(x), rtol=1e-4, atol=1e-4)


def test_keys_of_unknown_batch_keep_their_reshapes():
    """The same graph with the head split's batch written -1: the shapes no longer pin k to [B, H, S, D]."""
    torch.manual_seed(0)
    block = _CausalSelfAttention().eval()
    x = torch.randn(2, 6, 32)
    proto, _ = kiln.from_torch(block, (x,), opset=18)
    g = model_to_graph(proto)
    for p in (fold_constants, remove_noops, dead_code, gather_as_slice, split_heads_as_view, fuse_gemm, fuse_attention):
        p.run(g)
    split = {n.inputs[1] for n in g.nodes if n.op_type == "Reshape" and n.inputs[1] in g.initializers
             and g.initializers[n.inputs[1]].tolist()[1:] == [6, 4, 8]}  # [B, S, H, D], the heads' split
    assert split
    for name in split:
        g.initializers[name] = torch.tensor([-1, 6, 4, 8])
    count = len(g.nodes)
    merge_heads_as_view.run(g)
    assert len(g.nodes) == count
    torch.testing.assert_close(run(g, {"x": x})[0], block(x), rtol=1e-4, atol=1e-4)
