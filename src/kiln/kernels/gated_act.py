"""The gated activation of a SwiGLU / GeGLU MLP, act(gate) * up, as one Triton function that both the standalone
kernel (kiln.llm.fused_ops.act_and_mul) and the decode GEMVs' input loads (kernels/fp8_gemv.py with act=...)
call, so the two give the same bits.

ACT "silu": gate / (1 + exp(-gate)); "gelu_tanh": the tanh approximation (Gemma's gelu_pytorch_tanh), tanh
through exp. FP32 arithmetic; the caller rounds the result to the activations' type.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def kernel_act(hidden_act: str) -> str | None:
    """The ACT name for a model's hidden_act, or None where no fused form exists (exact-erf GELU)."""
    return ACTS.get(hidden_act)


@triton.jit
def act_mul(g, u, ACT: tl.constexpr):
    """act(g) * u in FP32 (g and u of any float type)."""
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if ACT == "gelu_tanh":
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    return a * u
