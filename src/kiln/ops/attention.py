"""ONNX's transformer ops (opset 23+): Attention, RotaryEmbedding and LinearAttention.

These are the standard-domain forms that exporters emit for LLMs at opset 23; the fused kiln::Attention
of ops/fused.py is what Kiln's own passes produce from MatMul/Softmax chains.
"""

import math

import torch

from ..ir import dtypes
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


# ------------------------------------------------------------------------------------------- Attention


def _check_attention(node):
    mode = node.attr("qk_matmul_output_mode", 0)
    if mode not in (0, 1, 2, 3):
        return f"Attention qk_matmul_output_mode={mode} is not one of 0, 1, 2, 3"
    precision = node.attr("softmax_precision")
    if precision is not None and precision not in (1, 10, 11, 16):
        return f"Attention softmax_precision={precision} is not FLOAT, FLOAT16, DOUBLE or BFLOAT16"
    return None


def _heads(x, heads):
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def _attention_bias(node, q_len, kv_len, mask, past_len, nonpad, dtype, device):
    """The additive bias (-inf where a key is not attended), broadcastable to the scores:
    mask (boolean or additive, padded with -inf to kv_len), causal frontier, sliding window, padding."""
    bias = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    if mask is not None:
        if mask.shape[-1] < kv_len:
            fill = False if mask.dtype == torch.bool else -math.inf
            mask = torch.nn.functional.pad(mask, (0, kv_len - mask.shape[-1]), value=fill)
        bias = bias + (torch.where(mask, 0.0, -math.inf).to(dtype) if mask.dtype == torch.bool else mask.to(dtype))
    # Keys are visible to query i up to i + offset: the keys that precede the query block (bottom-right aligned).
    if nonpad is not None and past_len == 0:
        offset = (nonpad.to(torch.int64) - q_len).reshape(-1, 1, 1, 1)  # per batch
    else:
        offset = past_len  # a Python int: a host tensor copied to the GPU would break CUDA-graph capture
    diff = torch.arange(q_len, device=device).reshape(-1, 1) + offset - torch.arange(kv_len, device=device)
    allowed = torch.ones_like(diff, dtype=torch.bool)
    if node.attr("is_causal", 0):
        allowed &= diff >= 0
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    if nonpad is not None:
        allowed = allowed & (torch.arange(kv_len, device=device) < nonpad.to(torch.int64).reshape(-1, 1, 1, 1))
    return bias.masked_fill(~allowed, -math.inf)


@register("Attention", check=_check_attention, since=23, saturating_inputs=(3,))
def onnx_attention(node, q, k, v, mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
    """softmax(softcap(q k^T * scale) + bias) v over heads, with GQA, KV-cache concatenation and the
    optional QK output; a query row that attends no key gives zeros."""
    three_d = q.dim() == 3
    if three_d:
        q_heads, kv_heads = node.attr("q_num_heads", 0), node.attr("kv_num_heads", 0)
        if not q_heads or not kv_heads:
            raise ValueError("Attention on 3-D inputs needs the q_num_heads and kv_num_heads attributes")
        q, k, v = _heads(q, q_heads), _heads(k, kv_heads), _heads(v, kv_heads)
    if past_key is not None:
        k, v = torch.cat((past_key, k), dim=2), torch.cat((past_value, v), dim=2)
    present_k, present_v = k, v
    out_dtype = q.dtype
    work = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype  # accumulate in FP32
    if q.shape[1] != k.shape[1]:  # grouped-query attention: each KV head serves consecutive query heads
        reps = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    scale = node.attr("scale", 1.0 / math.sqrt(q.shape[-1]))
    past_len = 0 if past_key is None else past_key.shape[2]
    bias = _attention_bias(node, q.shape[2], k.shape[2], mask, past_len, nonpad_kv_seqlen, work, q.device)
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    softcap = node.attr("softcap", 0.0)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mode = node.attr("qk_matmul_output_mode", 0)
    qk = scores
    logits = scores + bias
    if mode == 2:
        qk = logits
    precision = node.attr("softmax_precision")
    if precision is not None:
        logits = logits.to(dtypes.onnx_to_torch(precision))
    empty = torch.isneginf(bias.amax(dim=-1, keepdim=True))  # rows that attend no key
    probs = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0).to(work)
    if mode == 3:
        qk = probs
    y = torch.matmul(probs, v.to(work)).to(out_dtype)
    if three_d:
        y = y.transpose(1, 2).flatten(2)
    return y, present_k, present_v, qk.to(out_dtype)


# ------------------------------------------------------------------------------------- LinearAttention

_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


def _check_linear_attention(node):
    rule = node.attr("update_rule", "gated_delta")
    if rule not in _UPDATE_RULES:
        return f"LinearAttention update_rule '{rule}' is not one of {', '.join(_UPDATE_RULES)}"
    given = [len(node.inputs) > i and bool(node.inputs[i]) for i in (4, 5)]
    if given != [rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")]:
        return (f"LinearAttention update_rule '{rule}' needs {'a' if 'gated' in rule else 'no'} decay input and "
                f"{'a' if 'delta' in rule else 'no'} beta input")
    q_heads, kv_heads = node.attr("q_num_heads", 0), node.attr("kv_num_heads", 0)
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads:
        return f"LinearAttention q_num_heads={q_heads} must be a positive multiple of kv_num_heads={kv_heads}"
    return None


@register("LinearAttention", check=_check_linear_attention, since=27)
def linear_attention(node, q, k, v, past_state=None, decay=None, beta=None):
    """The recurrent form of linear attention (Gated DeltaNet, RetNet, Mamba-2 style): a (d_k, d_v) state per
    KV head, decayed by exp(decay), corrected by the delta rule with beta, written with k v^T and read by q;
    accumulated in FP32. Returns the outputs and the final state."""
    rule = node.attr("update_rule", "gated_delta")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")  # inputs checked to match
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    batch, steps = q.shape[:2]
    q4, k4, v4 = (_heads(t.float(), h) for t, h in ((q, q_heads), (k, kv_heads), (v, kv_heads)))
    d_k, d_v = k4.shape[-1], v4.shape[-1]
    if decay is not None:  # one rate per head, or one per head and key feature
        g = _heads(decay.float(), kv_heads)
    if beta is not None:
        beta4 = _heads(beta.float(), beta.shape[-1])  # (batch, kv_heads or 1, steps, 1)
    state = (past_state.float() if past_state is not None
             else q4.new_zeros(batch, kv_heads, d_k, d_v))
    scale = node.attr("scale", 0.0) or 1.0 / math.sqrt(d_k)
    group = q_heads // kv_heads
    out = []
    for t in range(steps):
        k_t, v_t = k4[:, :, t], v4[:, :, t]
        if gated:
            state = state * torch.exp(g[:, :, t]).unsqueeze(-1)
        if delta:
            v_t = beta4[:, :, t] * (v_t - torch.einsum("bhdm,bhd->bhm", state, k_t))
        state = state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        read = state.repeat_interleave(group, dim=1) if group > 1 else state
        out.append(scale * torch.einsum("bhd,bhdm->bhm", q4[:, :, t], read))
    y = torch.stack(out, dim=2).transpose(1, 2).reshape(batch, steps, q_heads * d_v).to(q.dtype)
    return y, state.to(past_state.dtype if past_state is not None else q.dtype)
