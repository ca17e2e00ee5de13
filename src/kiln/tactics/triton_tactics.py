"""Triton tactics: generated kernels from src/kiln/kernels/, offered from optimization level 3."""

from __future__ import annotations

from . import tactic


def _skip_ln_ok(node, args) -> bool:
    from ..kernels import layernorm

    a, b, gamma = args[0], args[1], args[2]
    return a.is_cuda and layernorm.supports(a, b, gamma)


@tactic("SkipLayerNorm", "triton_fused_add_layernorm", _skip_ln_ok, level=3)
def triton_skip_layernorm(node, a, b, gamma, beta=None):
    from ..kernels import layernorm

    y, s = layernorm.skip_layernorm(a, b, gamma.to(a.dtype), beta.to(a.dtype) if beta is not None else None,
                                    node.attr("epsilon", 1e-5), write_sum=bool(node.outputs[1:] and node.outputs[1]))
    return y, s


def _elementwise_ok(node, args) -> bool:
    from ..kernels import elementwise

    return args[0].is_cuda and elementwise.supports(list(args))


@tactic("Elementwise", "triton_generated", _elementwise_ok, level=3)
def triton_elementwise(node, *inputs):
    from ..kernels import elementwise

    return elementwise.run(node.attr("program"), list(inputs))
