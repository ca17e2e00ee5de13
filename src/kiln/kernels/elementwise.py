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


def source(program: list[str], n_inputs: int) -> str:
    ins = ", ".join(f"i{k}" for k in range(n_inputs))
    body = [f"    x{k} = tl.load(i{k} + offs, mask=m).to(tl.float32)" for k in range(n_inputs)]
    last = None
    for op, dst, args in parse_program(program):
        vals = [f"x{a[1:]}" if a.startswith("i") else (a if a.startswith("t") else f"{float(a[1:])!r}") for a in args]
        body.append(f"    {dst} = {_EXPR[op].format(*vals)}")
        last = dst
    return "\n".join([
        "import triton", "import triton.language as tl", "", "",
        "@triton.jit",
        f"def kernel({ins}, out, n, BLOCK: tl.constexpr):",
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "    m = offs < n",
        *body,
        f"    tl.store(out + offs, {last}.to(out.dtype.element_ty), mask=m)", "",
    ])


def kernel_for(program: list[str], n_inputs: int):
    src = source(program, n_inputs)
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


def supports(inputs: list[torch.Tensor]) -> bool:
    first = inputs[0]
    return all(x.shape == first.shape and x.dtype == first.dtype and x.is_contiguous() for x in inputs) \
        and first.dtype in (torch.float32, torch.float16, torch.bfloat16) and first.numel() > 0


def run(program: list[str], inputs: list[torch.Tensor], block: int = 1024) -> torch.Tensor:
    out = torch.empty_like(inputs[0])
    n = out.numel()
    kernel_for(program, len(inputs))[(triton_cdiv(n, block),)](*inputs, out, n, BLOCK=block)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
