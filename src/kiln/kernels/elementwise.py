"""Code generation for kiln::Elementwise programs: one Triton kernel per program.

The program (see kiln.ops.fused) becomes straight-line Triton code computing in
FP32 over a flat index range; the source is written to a cache folder and
imported, because Triton compiles from a function's source file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

import torch

from ..ops.fused import parse_program

_EXPR = {
    "Relu": "tl.maximum({0}, 0.0)", "Sigmoid": "tl.sigmoid({0})", "Tanh": "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",
    "Exp": "tl.exp({0})", "Log": "tl.log({0})", "Sqrt": "tl.sqrt({0})", "Neg": "(-{0})", "Abs": "tl.abs({0})",
    "Erf": "tl.math.erf({0})", "Reciprocal": "(1.0 / {0})",
    "Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})",
    "Max": "tl.maximum({0}, {1})", "Min": "tl.minimum({0}, {1})",
}
_loaded: dict[str, object] = {}


def source(program: list[str], n_inputs: int, repeats: tuple[bool, ...] = ()) -> str:
    """repeats[k]: input k repeats along the output (it has the output's trailing shape, like a
    position embedding or a bias), so element i of the output reads its element i mod size."""
    repeats = repeats or (False,) * n_inputs
    ins = ", ".join(f"i{k}" for k in range(n_inputs))
    sizes = "".join(f", n{k}" for k in range(n_inputs) if repeats[k])
    body = [f"    x{k} = tl.load(i{k} + {f'offs % n{k}' if repeats[k] else 'offs'}, mask=m).to(tl.float32)"
            for k in range(n_inputs)]
    last = None
    for op, dst, args in parse_program(program):
        vals = [f"x{a[1:]}" if a.startswith("i") else (a if a.startswith("t") else f"{float(a[1:])!r}") for a in args]
        body.append(f"    {dst} = {_EXPR[op].format(*vals)}")
        last = dst
    return "\n".join([
        "import triton", "import triton.language as tl", "", "",
        "@triton.jit",
        f"def kernel({ins}, out, n{sizes}, BLOCK: tl.constexpr):",
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "    m = offs < n",
        *body,
        f"    tl.store(out + offs, {last}.to(out.dtype.element_ty), mask=m)", "",
    ])


def kernel_for(program: list[str], n_inputs: int, repeats: tuple[bool, ...] = ()):
    src = source(program, n_inputs, repeats)
    key = hashlib.sha256(src.encode()).hexdigest()[:20]
    if key not in _loaded:
        folder = Path(os.environ.get("KILN_KERNEL_CACHE", Path(tempfile.gettempdir()) / "kiln-kernels"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"elementwise_{key}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(src)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"kiln_elementwise_{key}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[key] = module.kernel
    return _loaded[key]


def _out_shape(inputs: list[torch.Tensor]):
    try:
        return torch.broadcast_shapes(*(x.shape for x in inputs))
    except RuntimeError:
        return None


def _repeats(x: torch.Tensor, shape) -> bool:
    """x has `shape`'s trailing dims (after leading 1s): it repeats along the output's leading dims."""
    dims = list(x.shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    return x.shape != shape and tuple(dims) == tuple(shape[len(shape) - len(dims):])


def supports(inputs: list[torch.Tensor]) -> bool:
    first, shape = inputs[0], _out_shape(inputs)
    return shape is not None and all(
        x.dtype == first.dtype and x.is_contiguous() and x.numel() > 0 and (x.shape == shape or _repeats(x, shape))
        for x in inputs) and first.dtype in (torch.float32, torch.float16, torch.bfloat16)


def run(program: list[str], inputs: list[torch.Tensor], block: int = 1024, out: torch.Tensor | None = None):
    shape = _out_shape(inputs)
    out = torch.empty(shape, dtype=inputs[0].dtype, device=inputs[0].device) if out is None else out
    n = out.numel()
    repeats = tuple(x.shape != shape for x in inputs)
    sizes = [x.numel() for x, r in zip(inputs, repeats) if r]
    kernel_for(program, len(inputs), repeats)[(triton_cdiv(n, block),)](*inputs, out, n, *sizes, BLOCK=block)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
