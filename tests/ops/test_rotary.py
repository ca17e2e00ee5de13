"""kiln::Rotary's reference against HF transformers' own apply_rotary_pos_emb (Llama's rotate_half RoPE)."""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kiln.ir.graph import Node
from kiln.ops.rotary import rotary

BIG = 2**63 - 1


def _angles(batch, seq, dim, seed):
    """cos/sin [batch, seq, dim] as Llama's rotary embedding computes them for some positions."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 512, (batch, seq), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([pos[..., None] * inv, pos[..., None] * inv], dim=-1)
    return emb.cos(), emb.sin()


def test_matches_hf_llama_rope_on_q_and_k_of_different_head_counts():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g)
    k = torch.randn(2, 2, 5, 16, generator=g)  # grouped-query attention: fewer key heads
    cos, sin = _angles(2, 5, 16, seed=1)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    node = Node("Rotary", ["x", "cos", "sin"], ["y"], {"split": 8, "end": BIG, "axis": 3, "concat_axis": -1},
                domain="kiln")
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # as the exporter writes them: [batch, 1, seq, dim]
    torch.testing.assert_close(rotary(node, q, c, s), want_q)
    torch.testing.assert_close(rotary(node, k, c, s), want_k)


def test_fp16_in_fp16_out():
    q = torch.randn(1, 2, 3, 8).half()
    cos, sin = (t.unsqueeze(1).half() for t in _angles(1, 3, 8, seed=2))
    node = Node("Rotary", ["x", "cos", "sin"], ["y"], {"split": 4, "end": BIG, "axis": -1, "concat_axis": -1},
                domain="kiln")
    y = rotary(node, q, cos, sin)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), apply_rotary_pos_emb(q.float(), q.float(), cos.squeeze(1).float(),
                                                               sin.squeeze(1).float())[0], atol=4e-3, rtol=4e-3)
