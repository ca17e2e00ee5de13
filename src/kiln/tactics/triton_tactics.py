"""Triton tactics: generated kernels from src/kiln/kernels/, offered from optimization level 3."""

from __future__ import annotations

import torch

from . import tactic


def _skip_ln_ok(node, args) -> bool:
    from ..kernels import layernorm

    a, b, gamma = args[0], args[1], args[2]
    c = args[5] if len(args) > 5 else None
    if c is not None:  # a third addend: broadcast to a's shape, read where it lies
        try:
            c = c.expand(a.shape)
        except RuntimeError:
            return False
    return a.is_cuda and layernorm.supports(a, a if b is None else b, gamma) and (
        c is None or layernorm.supports(a, c, gamma))


def triton_skip_layernorm(node, a, b, gamma, beta=None, q_scale=None, c=None, launch=None):
    from ..kernels import layernorm
    from ..ops.fused import writes_fp32

    return layernorm.skip_layernorm(a, b, gamma.to(a.dtype), beta.to(a.dtype) if beta is not None else None,
                                    node.attr("epsilon", 1e-5), write_sum=bool(node.outputs[1:] and node.outputs[1]),
                                    q_scale=q_scale, qtype=node.attr("qtype", "int8"),
                                    y_dtype=torch.float32 if writes_fp32(node) else None,
                                    launch=launch or layernorm.LAUNCHES[0],
                                    c=None if c is None else c.expand(a.shape))


def gemm_ln_ok(node, args) -> bool:
    """GemmSkipLayerNorm's operands as the Triton norm takes them: the GEMM's rows [.., N] and the skip alike."""
    from ..kernels import layernorm

    x, w, bias, skip, gamma = args[:5]
    return (x.is_cuda and x.dim() >= 2 and x.dtype == w.dtype == skip.dtype and w.dim() == 2
            and (bias is None or bias.dtype == x.dtype) and skip.shape == (*x.shape[:-1], w.shape[1])
            and layernorm.supports(skip, skip, gamma))


def cublaslt_then_triton_layernorm(node, x, w, bias, skip, gamma, beta=None, launch=None):
    """The two layers as they were before joining: cuBLASLt GEMM + bias, then the fused add + norm kernel."""
    from .library import gemm_without_activation

    return triton_skip_layernorm(node, gemm_without_activation(node, x, w, bias), skip, gamma, beta, launch=launch)


def _layernorm_ok(node, args) -> bool:
    from ..kernels import layernorm

    x, gamma = args[0], args[1]
    last_axis = node.attr("axis", -1) in (-1, x.dim() - 1)
    return (x.is_cuda and last_axis and not any(node.outputs[1:]) and node.attr("stash_type", 1) == 1
            and layernorm.supports(x, x, gamma))


def triton_layernorm(node, x, gamma, beta=None, launch=None):
    from ..kernels import layernorm

    return layernorm.layernorm(x, gamma.to(x.dtype), beta.to(x.dtype) if beta is not None else None,
                               node.attr("epsilon", 1e-5), launch=launch or layernorm.LAUNCHES[0])


def _norm_tactics():
    """The three norm tactics once per launch shape of the kernel (kernels/layernorm.py LAUNCHES): which is fastest
    depends on the rows' count and width and on the outputs written. The first keeps the plain name."""
    from ..kernels.layernorm import LAUNCHES

    for i, launch in enumerate(LAUNCHES):
        suffix = f"_{launch.name}" if i else ""
        for op, name, applies, run, domain in [
                ("SkipLayerNorm", "triton_fused_add_layernorm", _skip_ln_ok, triton_skip_layernorm, "kiln"),
                ("GemmSkipLayerNorm", "cublaslt_then_triton_layernorm", gemm_ln_ok, cublaslt_then_triton_layernorm,
                 "kiln"),
                ("LayerNormalization", "triton_layernorm", _layernorm_ok, triton_layernorm, "")]:
            tactic(op, name + suffix, _offered(launch, op, applies), domain=domain, level=3)(
                (lambda run, launch: lambda *args: run(*args, launch=launch))(run, launch))


def _offered(launch, op: str, applies):
    """applies, for the launches that suit the rows' width (a filling launch only for narrow rows)."""
    def offered(node, args) -> bool:
        rows = args[3] if op == "GemmSkipLayerNorm" else args[0]  # the GEMM's skip is shaped like its output
        return (isinstance(rows, torch.Tensor) and rows.dim() > 0 and launch.offered(rows.shape[-1])
                and applies(node, args))

    return offered


try:
    import triton  # noqa: F401
except ImportError:  # no Triton here: these tactics are not offered
    pass
else:
    _norm_tactics()


def _rms_norm_ok(node, args) -> bool:
    from ..kernels import layernorm

    skip = args[2] if len(args) > 2 and args[2] is not None else args[0]
    return len(args) > 1 and args[1] is not None and args[0].is_cuda and layernorm.supports(args[0], skip, args[1])


@tactic("RMSNorm", "triton_rms_norm", _rms_norm_ok, level=3)
def triton_rms_norm(node, x, gamma, skip=None):
    """RMSNorm(x [+ skip]): with the residual skip, (the norm, x + skip or None) in the same pass."""
    from ..kernels import layernorm

    if skip is None:
        return layernorm.rms_norm(x, gamma.to(x.dtype), node.attr("epsilon", 1e-6))
    return layernorm.skip_layernorm(x, skip, gamma.to(x.dtype), None, node.attr("epsilon", 1e-6),
                                    write_sum=bool(node.outputs[1:] and node.outputs[1]), rms=True)


def _softmax_ok(node, args) -> bool:
    from ..kernels import softmax

    x = args[0]
    last_axis = node.opset >= 13 and node.attr("axis", -1) in (-1, x.dim() - 1)
    return x.is_cuda and last_axis and softmax.supports(x)


@tactic("Softmax", "triton_softmax", _softmax_ok, domain="", level=3)
def triton_softmax(node, x):
    from ..kernels import softmax

    return softmax.softmax(x)


def _elementwise_ok(node, args) -> bool:
    from ..kernels import elementwise

    return args[0].is_cuda and elementwise.supports(list(args))


@tactic("Elementwise", "triton_generated", _elementwise_ok, level=3)
def triton_elementwise(node, *inputs):
    from ..kernels import elementwise

    return elementwise.run(node.attr("program"), list(inputs))


def _max_pool_ok(node, args) -> bool:
    from ..kernels import pool

    return args[0].is_cuda and pool.supports(node, args[0])


@tactic("MaxPool", "triton_max_pool_nhwc", _max_pool_ok, domain="", level=3)
def triton_max_pool(node, x, y_scale=None):
    from ..kernels import pool

    return pool.max_pool2d(node, x, y_scale, node.attr("qtype", "int8"))


def _stem_patches_ok(node, args) -> bool:
    from ..kernels import stem_patches

    return args[0].is_cuda and stem_patches.supports(node, args[0])


@tactic("StemPatches", "triton_stem_patches", _stem_patches_ok, level=3)
def triton_stem_patches(node, x, y_scale=None):
    from ..kernels import stem_patches

    return stem_patches.stem_patches(node, x, y_scale, node.attr("qtype", "int8"))


def _gather_rows_ok(node, args) -> bool:
    from ..kernels import gather_rows

    table, indices = args[0], args[1]
    return (table.is_cuda and node.attr("axis", 0) in (0, -table.dim())
            and gather_rows.supports(table, indices))


@tactic("Gather", "triton_gather_rows", _gather_rows_ok, domain="", level=3)
def triton_gather_rows(node, table, indices):
    from ..kernels import gather_rows

    return gather_rows.gather_rows(table, indices)


def _int4_ok(node, args) -> bool:
    x = args[0]
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _int4_tactic(config):
    def run(node, x, packed, scales, b=None):
        from ..kernels.int4_gemm import int4_gemm

        return int4_gemm(x, packed, scales, None, node.attr("group_size"), bias=b, config=config)

    return run


def _register_int4() -> None:
    from ..kernels.int4_gemm import CONFIGS

    for cfg in CONFIGS:
        tactic("Int4Gemm", f"triton_{cfg.name}", _int4_ok, level=3)(_int4_tactic(cfg))


_register_int4()


def _one_scale_and_int8_zero_point(node, args) -> bool:
    """A QuantizeLinear/DequantizeLinear with one FP32 scale and one int8 zero point, not blocked."""
    scale, zp = args[1], args[2] if len(args) > 2 else None
    return (scale.numel() == 1 and scale.dtype == torch.float32 and zp is not None and zp.dtype == torch.int8
            and zp.numel() == 1 and not node.attr("block_size", 0))


def _quantize_linear_ok(node, args) -> bool:
    """ONNX QuantizeLinear of a float tensor to int8 (a Q/DQ model's asymmetric activation)."""
    x = args[0]
    return (x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and _one_scale_and_int8_zero_point(node, args) and node.attr("saturate", 1)
            and not node.attr("precision", 0) and node.attr("output_dtype", 0) in (0, 3))  # 3: TensorProto.INT8


@tactic("QuantizeLinear", "triton_quantize_linear", _quantize_linear_ok, domain="", level=3)
def triton_quantize_linear(node, x, scale, zero_point=None):
    from ..kernels import rescale

    return rescale.quantize_linear(x, scale, zero_point)


def _dequantize_linear_ok(node, args) -> bool:
    """ONNX DequantizeLinear of int8 to FP32."""
    q = args[0]
    return (q.is_cuda and q.dtype == torch.int8 and _one_scale_and_int8_zero_point(node, args)
            and node.attr("output_dtype", 0) in (0, 1))  # 1: TensorProto.FLOAT


@tactic("DequantizeLinear", "triton_dequantize_linear", _dequantize_linear_ok, domain="", level=3)
def triton_dequantize_linear(node, q, scale, zero_point=None):
    from ..kernels import rescale

    return rescale.dequantize_linear(q, scale, zero_point)


def _rotary_ok(node, args) -> bool:
    """kiln::Rotary over the last axis, its upper slice reaching the end (the kernel's rotate_half)."""
    from ..kernels import rotary

    x, cos, sin = args[:3]
    last = x.dim() - 1
    return (x.is_cuda and node.attr("axis", -1) % x.dim() == last and node.attr("concat_axis", -1) % x.dim() == last
            and node.attr("end") >= x.shape[-1] and rotary.supports(x, cos, sin, node.attr("split")))


@tactic("Rotary", "triton_rotary", _rotary_ok, level=3)
def triton_rotary(node, x, cos, sin):
    from ..kernels import rotary

    return rotary.rotary(x, cos, sin, node.attr("split"))


def _concat_channels_ok(node, args) -> bool:
    """Concat along the channels (axis 1) of channels-last images (kernels/concat.py): a C2f block's halves."""
    from ..kernels import concat

    xs = [a for a in args if a is not None]
    return (len(xs) == len(args) and all(isinstance(x, torch.Tensor) and x.is_cuda for x in xs)
            and xs and node.attr("axis", 1) % max(1, xs[0].dim()) == 1 and concat.supports(xs))


@tactic("Concat", "triton_concat_channels_last", _concat_channels_ok, domain="", level=3)
def triton_concat_channels_last(node, *xs):
    from ..kernels import concat

    return concat.concat_channels(list(xs))
