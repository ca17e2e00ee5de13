"""ONNX's transformer ops (opset 23+): RotaryEmbedding.

These are the standard-domain forms that exporters emit for LLMs at opset 23; the fused kiln::Attention
of ops/fused.py is what Kiln's own passes produce from MatMul/Softmax chains.
"""

import torch

from .registry import register


def _check_rotary(node):
    if node.attr("rotary_embedding_dim", 0) % 2:
        return f"RotaryEmbedding rotary_embedding_dim={node.attr('rotary_embedding_dim')} must be even"
    return None


@register("RotaryEmbedding", check=_check_rotary, since=23)
def rotary_embedding(node, x, cos_cache, sin_cache, position_ids=None):
    """Rotates the first rotary_embedding_dim features of each head by the cached angles of its position."""
    if x.dim() == 4:  # (batch, heads, seq, head_size) -> (batch, seq, heads, head_size)
        t = x.transpose(1, 2)
    elif x.dim() == 3:
        heads = node.attr("num_heads", 0)
        if not heads:
            raise ValueError("RotaryEmbedding on a 3-D input needs the num_heads attribute")
        t = x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)
    else:
        raise ValueError(f"RotaryEmbedding takes a 3-D or 4-D input, got rank {x.dim()}")
    dim = node.attr("rotary_embedding_dim", 0) or t.shape[-1]
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids.long()], sin_cache[position_ids.long()]
    if cos_cache.shape[-1] != dim // 2 or sin_cache.shape[-1] != dim // 2:
        raise ValueError(f"RotaryEmbedding caches hold {cos_cache.shape[-1]} angles per position, "
                         f"the rotation needs {dim // 2}")
    cos, sin = cos_cache.unsqueeze(2).to(x.dtype), sin_cache.unsqueeze(2).to(x.dtype)  # (batch, seq, 1, dim/2)
    rot, keep = t[..., :dim], t[..., dim:]
    interleaved = bool(node.attr("interleaved", 0))
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rot = torch.stack((real, imag), dim=-1).flatten(-2) if interleaved else torch.cat((real, imag), dim=-1)
    out = torch.cat((rot, keep), dim=-1)
    return out.reshape(x.shape) if x.dim() == 3 else out.transpose(1, 2)
