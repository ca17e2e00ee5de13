"""Code generation for kiln::Elementwise programs: one Triton kernel per program.

The program (see kiln.ops.fused) becomes straight-line Triton code computing in
FP32 over a flat index range. A program comes from an engine file, which is data
and never code: `parse` accepts only the closed set of op names, temporaries and
inputs by index, and numeric literals (parsed with float() and printed back), and
the source is generated from that parsed form alone. Triton compiles from a
function's source file, so the source is written to a folder this process
creates privately (mkdtemp: mode 0700, an unpredictable name), named by the
SHA-256 of its content, and checked to still hold that content before import:
no file another user or process planted is ever imported.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import math
import os
import re
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import torch

from ..errors import EngineFileError

_EXPR = {
    "Relu": "tl.maximum({0}, 0.0)", "Sigmoid": "tl.sigmoid({0})", "Tanh": "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",
    "Exp": "tl.exp({0})", "Log": "tl.log({0})", "Sqrt": "tl.sqrt({0})", "Neg": "(-{0})", "Abs": "tl.abs({0})",
    "Erf": "tl.math.erf({0})", "Reciprocal": "(1.0 / {0})",
    "Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})",
    "Max": "tl.maximum({0}, {1})", "Min": "tl.minimum({0}, {1})",
}
_ARITY = {op: 2 if "{1}" in e else 1 for op, e in _EXPR.items()}
_TEMP, _INPUT = re.compile(r"t(0|[1-9][0-9]{0,3})"), re.compile(r"i(0|[1-9][0-9]{0,3})")
_CONST = re.compile(r"c([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?|[-+]?inf|nan)")
MAX_LINES = 1024
_loaded: dict[str, object] = {}
_lock = threading.Lock()
_folder: Path | None = None


def parse(program, n_inputs: int, where: str = "an Elementwise layer") -> list[tuple[str, int, list]]:
    """The program as (op, temporary index, args), each arg ("t", k), ("i", k) or ("c", float); anything else
    (an unknown op, a token that is not a temporary, an input index or a number, a temporary used before it is
    computed) is refused with an EngineFileError naming `where`."""
    def bad(why: str) -> EngineFileError:
        return EngineFileError(f"{where}: its program {why}; an engine's programs are lists of 'OP tK ARGS' lines "
                               f"over {sorted(_EXPR)}. The engine file is damaged or was not written by Kiln: "
                               "rebuild it.")

    if not isinstance(program, (list, tuple)) or not program or len(program) > MAX_LINES:
        raise bad(f"is not a list of 1..{MAX_LINES} lines")
    out = []
    for n, line in enumerate(program):
        if not isinstance(line, str):
            raise bad(f"line {n} is a {type(line).__name__}, not text")
        op, *tokens = line.split(" ")
        if op not in _EXPR:
            raise bad(f"line {n} uses op {op[:40]!r}, which is not an elementwise op")
        if len(tokens) != 1 + _ARITY[op]:
            raise bad(f"line {n} ({op}) has {len(tokens) - 1} argument(s), {op} takes {_ARITY[op]}")
        dst = _TEMP.fullmatch(tokens[0])
        if dst is None or int(dst.group(1)) != n:
            raise bad(f"line {n} writes {tokens[0][:40]!r}, not t{n}")
        args = []
        for tok in tokens[1:]:
            if (m := _TEMP.fullmatch(tok)) and int(m.group(1)) < n:
                args.append(("t", int(m.group(1))))
            elif (m := _INPUT.fullmatch(tok)) and int(m.group(1)) < n_inputs:
                args.append(("i", int(m.group(1))))
            elif m := _CONST.fullmatch(tok):
                args.append(("c", float(m.group(1))))
            else:
                raise bad(f"line {n} ({op}) reads {tok[:40]!r}, which is neither an earlier temporary, one of its "
                          f"{n_inputs} inputs (i0..i{n_inputs - 1}) nor a number")
        out.append((op, n, args))
    return out


def _literal(value: float) -> str:
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '(-float("inf"))'
    return repr(value)  # repr of a float is a plain decimal literal: digits, '.', 'e', a sign


def source(program: list[str], n_inputs: int, repeats: tuple[bool, ...] = ()) -> str:
    """repeats[k]: input k repeats along the output (it has the output's trailing shape, like a
    position embedding or a bias), so element i of the output reads its element i mod size."""
    steps = parse(program, n_inputs)
    repeats = tuple(bool(r) for r in repeats) or (False,) * n_inputs
    if len(repeats) != n_inputs:
        raise ValueError(f"repeats has {len(repeats)} entries for {n_inputs} inputs")
    ins = ", ".join(f"i{k}" for k in range(n_inputs))
    sizes = "".join(f", n{k}" for k in range(n_inputs) if repeats[k])
    body = [f"    x{k} = tl.load(i{k} + {f'offs % n{k}' if repeats[k] else 'offs'}, mask=m).to(tl.float32)"
            for k in range(n_inputs)]
    names = {"t": "t{}", "i": "x{}"}
    for op, dst, args in steps:
        vals = [_literal(v) if kind == "c" else names[kind].format(v) for kind, v in args]
        body.append(f"    t{dst} = {_EXPR[op].format(*vals)}")
    return "\n".join([
        "import triton", "import triton.language as tl", "", "",
        "@triton.jit",
        f"def kernel({ins}, out, n{sizes}, BLOCK: tl.constexpr):",
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "    m = offs < n",
        *body,
        f"    tl.store(out + offs, t{steps[-1][1]}.to(out.dtype.element_ty), mask=m)", "",
    ])


def kernel_folder() -> Path:
    """This process's private folder for generated sources (created once, removed at exit)."""
    global _folder
    if _folder is None:
        _folder = Path(tempfile.mkdtemp(prefix="kiln-kernels-"))
        atexit.register(shutil.rmtree, _folder, True)
    return _folder


def _write_private(folder: Path, name: str, text: str) -> Path:
    """Write `text` to folder/name (a new file only we can write) and check, before it is imported, that the
    folder and file are ours, not writable by others, and that the file holds exactly `text`."""
    path = folder / name
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    for p in (folder, path):
        st = os.lstat(p)
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or stat.S_ISLNK(st.st_mode):
            raise RuntimeError(f"kernel source {p} is not private to this user; refusing to import it")
    if hashlib.sha256(path.read_bytes()).hexdigest() != name.removeprefix("elementwise_").removesuffix(".py"):
        raise RuntimeError(f"kernel source {path} does not hold the source it was written with; refusing to import it")
    return path


def kernel_for(program: list[str], n_inputs: int, repeats: tuple[bool, ...] = ()):
    src = source(program, n_inputs, repeats)
    key = hashlib.sha256(src.encode()).hexdigest()
    with _lock:
        if key not in _loaded:
            path = _write_private(kernel_folder(), f"elementwise_{key}.py", src)
            spec = importlib.util.spec_from_file_location(f"kiln_elementwise_{key[:20]}", path)
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
