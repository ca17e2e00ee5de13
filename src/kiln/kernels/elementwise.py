"""Code generation for kiln::Elementwise programs: one Triton kernel per program and input layout.

The program (see kiln.ops.fused) becomes straight-line Triton code computing in
FP32. A program comes from an engine file, which is data and never code: `parse`
accepts only the closed set of op names, temporaries and inputs by index, and
numeric literals (parsed with float() and printed back; an op's ONNX attributes
travel as such literals, and Pow's exponent must be one), and the source is
generated from that parsed form and a Layout of small integers alone. Triton
compiles from a function's source file, so the source is written to a folder this
process creates privately (mkdtemp: mode 0700, an unpredictable name), named by the
SHA-256 of its content, and checked to still hold that content before import: no
file another user or process planted is ever imported.

Inputs may be strided views and may broadcast anywhere (a squeeze-excite scale [N, C, 1, 1] against a
channels-last [N, C, H, W]). The output takes the memory format of its largest input; every input's strides,
broadcast to the output's shape, are read in the output's physical order and the dims all tensors can merge
are merged (`plan`). A flat layout runs a 1-D kernel over the output's memory; any other runs over
[rows, inner] tiles, the innermost merged dim across a tile, so the index arithmetic (integer division by
the dims' sizes) is paid once per row, not once per element.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import math
import os
import re
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import EngineFileError

# Each op's Triton expression over its arguments {0}, {1}, ...; Pow is written by _pow (its exponent is a literal).
_GELU_TANH = "(0.5 * {0} * (2.0 * tl.sigmoid(1.5957691216057308 * ({0} + 0.044715 * {0} * {0} * {0}))))"
_EXPR = {
    "Relu": "tl.maximum({0}, 0.0)", "Sigmoid": "tl.sigmoid({0})", "Tanh": "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",
    "Exp": "tl.exp({0})", "Log": "tl.log({0})", "Sqrt": "tl.sqrt({0})", "Neg": "(-{0})", "Abs": "tl.abs({0})",
    "Erf": "tl.math.erf({0})", "Reciprocal": "(1.0 / {0})",
    "HardSwish": "({0} * tl.minimum(tl.maximum({0} + 3.0, 0.0), 6.0) / 6.0)",
    "Softplus": "(tl.maximum({0}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({0}))))",
    "Gelu": "(0.5 * {0} * (1.0 + tl.math.erf({0} * 0.7071067811865476)))", "GeluTanh": _GELU_TANH,
    "Sign": "tl.where({0} > 0.0, 1.0, tl.where({0} < 0.0, -1.0, {0}))",
    "Floor": "tl.floor({0})", "Ceil": "tl.ceil({0})",
    "Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})",
    "Max": "tl.maximum({0}, {1})", "Min": "tl.minimum({0}, {1})", "Pow": None,
    "Where": "tl.where({0} != 0.0, {1}, {2})",
    # ONNX attributes as literal arguments after the tensor: HardSigmoid alpha beta, LeakyRelu alpha, Elu alpha;
    # Clip's bounds are its inputs 1 and 2 (opset 11 and later)
    "HardSigmoid": "tl.minimum(tl.maximum({0} * {1} + {2}, 0.0), 1.0)",
    "LeakyRelu": "tl.where({0} > 0.0, {0}, {0} * {1})", "Elu": "tl.where({0} > 0.0, {0}, {1} * (tl.exp({0}) - 1.0))",
    "Clip": "tl.minimum(tl.maximum({0}, {1}), {2})",
}
_ARITY = {op: max(int(k) for k in re.findall(r"\{(\d)\}", e)) + 1 for op, e in _EXPR.items() if e} | {"Pow": 2}
# Arguments that must be literals: attributes, and Pow's exponent (its code depends on the value)
_LITERAL_ARGS = {"HardSigmoid": (1, 2), "LeakyRelu": (1,), "Elu": (1,), "Pow": (1,)}
_TEMP, _INPUT = re.compile(r"t(0|[1-9][0-9]{0,3})"), re.compile(r"i(0|[1-9][0-9]{0,3})")
_CONST = re.compile(r"c([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?|[-+]?inf|nan)")
MAX_LINES = 1024
MAX_RANK = 6  # merged dims a generated kernel indexes; a layout of more runs the reference
_loaded: dict[str, object] = {}
_lock = threading.Lock()
_folder: Path | None = None


def parse(program, n_inputs: int, where: str = "an Elementwise layer") -> list[tuple[str, int, list]]:
    """The program as (op, temporary index, args), each arg ("t", k), ("i", k) or ("c", float); anything else
    (an unknown op, a token that is not a temporary, an input index or a number, a temporary used before it is
    computed, a tensor where an op takes a literal) is refused with an EngineFileError naming `where`."""
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
        for pos, tok in enumerate(tokens[1:]):
            if (m := _TEMP.fullmatch(tok)) and int(m.group(1)) < n:
                args.append(("t", int(m.group(1))))
            elif (m := _INPUT.fullmatch(tok)) and int(m.group(1)) < n_inputs:
                args.append(("i", int(m.group(1))))
            elif m := _CONST.fullmatch(tok):
                args.append(("c", float(m.group(1))))
            else:
                raise bad(f"line {n} ({op}) reads {tok[:40]!r}, which is neither an earlier temporary, one of its "
                          f"{n_inputs} inputs (i0..i{n_inputs - 1}) nor a number")
            if pos in _LITERAL_ARGS.get(op, ()) and args[-1][0] != "c":
                raise bad(f"line {n} ({op}) reads {tok[:40]!r} as its argument {pos}, which must be a number")
        out.append((op, n, args))
    return out


def _literal(value: float) -> str:
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '(-float("inf"))'
    return repr(value)  # repr of a float is a plain decimal literal: digits, '.', 'e', a sign


def _pow(x: str, e: float) -> str:
    """x ** e for a literal e: integers by multiplication (a negative base stays exact), halves by square roots,
    any other exponent through exp2/log2 (NaN for a negative base, as torch.pow gives)."""
    if math.isfinite(e) and e == int(e) and abs(e) <= 16:
        k, terms, square = abs(int(e)), [], x
        while k:
            if k & 1:
                terms.append(square)
            k >>= 1
            square = f"({square} * {square})" if k else square
        value = " * ".join(terms) if terms else "1.0"
        return f"(tl.zeros_like({x}) + 1.0)" if not terms else f"(1.0 / ({value}))" if e < 0 else f"({value})"
    if e in (0.5, -0.5):
        return f"tl.sqrt({x})" if e > 0 else f"(1.0 / tl.sqrt({x}))"
    return f"tl.exp2({_literal(e)} * tl.log2({x}))"


@dataclass(frozen=True)
class Layout:
    """How a kernel indexes its inputs. sizes: the output's merged dims, outermost first, in its memory order
    (one dim: the 1-D kernel); patterns[k][d]: input k's stride along dim d as "0" (broadcast), "1", or "s"
    (any other, passed at launch), or all of it "=" (input k lies in memory as the output does); wide: 64-bit
    offsets (some tensor spans 2**31 elements or more)."""

    rank: int
    patterns: tuple[str, ...]
    wide: bool = False


FLAT = None  # source()'s layout for inputs laid out as the output: the 1-D kernel


def _flat(n_inputs: int) -> Layout:
    return Layout(1, ("=",) * n_inputs)


def _check_layout(layout: Layout, n_inputs: int) -> None:
    ok = (isinstance(layout, Layout) and isinstance(layout.rank, int) and 1 <= layout.rank <= MAX_RANK
          and len(layout.patterns) == n_inputs
          and all(p == "=" or (len(p) == layout.rank and set(p) <= {"0", "1", "s"}) for p in layout.patterns))
    if not ok:
        raise ValueError(f"{layout!r} is not a layout of {n_inputs} inputs of at most {MAX_RANK} dims")


def source(program: list[str], n_inputs: int, layout: Layout | None = FLAT) -> str:
    """The kernel's Python source: kernel(i0.., out, n, sizes of the inner merged dims, the "s" strides, tile
    sizes), generated from the parsed program and the checked layout alone."""
    steps = parse(program, n_inputs)
    layout = layout or _flat(n_inputs)
    _check_layout(layout, n_inputs)
    rank, pats = layout.rank, layout.patterns
    ins = ", ".join(f"i{k}" for k in range(n_inputs))
    # launch arguments: the inner dims' sizes, then each "s" stride
    sizes = [f"n{d}" for d in range(1, rank)]
    strides = [f"s{k}_{d}" for k, p in enumerate(pats) if p != "=" for d in range(rank) if p[d] == "s"]
    params = "".join(f", {a}" for a in sizes + strides)
    wide = ".to(tl.int64)" if layout.wide else ""
    if rank == 1:
        head = [f"    offs = tl.program_id(0){wide} * BLOCK + tl.arange(0, BLOCK)", "    m = offs < n"]
        dims, out_at = {0: "offs"}, "offs"
    else:
        # a tile of ROWS rows (the outer dims) by COLS elements of the innermost dim
        head = ["    col_tiles = tl.cdiv(n" + str(rank - 1) + ", COLS)",
                f"    pid = tl.program_id(0){wide}",
                "    rows = (pid // col_tiles) * ROWS + tl.arange(0, ROWS)",
                "    cols = (pid % col_tiles) * COLS + tl.arange(0, COLS)",
                f"    m = (rows < n // n{rank - 1})[:, None] & (cols < n{rank - 1})[None, :]"]
        used = {d for p in pats if p != "=" for d in range(rank - 1) if p[d] != "0"}
        dims = {rank - 1: "cols[None, :]"}
        if used:
            head.append("    r = rows")
            for d in range(rank - 2, min(used) - 1, -1):
                if d == 0:
                    head.append("    d0 = r")
                else:
                    head.append(f"    d{d} = r % n{d}")
                    if d > min(used):
                        head.append(f"    r = r // n{d}")
                dims[d] = f"d{d}[:, None]"
        out_at = f"rows[:, None] * n{rank - 1} + cols[None, :]"
        head.append(f"    o = {out_at}")
        out_at = "o"

    def offset(k: int) -> str:
        if pats[k] == "=":
            return out_at
        terms = [dims[d] if c == "1" else f"{dims[d]} * s{k}_{d}" for d, c in enumerate(pats[k]) if c != "0"]
        return " + ".join(terms) if terms else "0"

    body = []
    for k in range(n_inputs):
        if offset(k) == "0":  # broadcast along every dim: one value
            body.append(f"    x{k} = tl.load(i{k}).to(tl.float32)")
        else:
            body.append(f"    x{k} = tl.load(i{k} + {offset(k)}, mask=m).to(tl.float32)")
    names = {"t": "t{}", "i": "x{}"}
    varies = {("i", k) for k in range(n_inputs) if offset(k) != "0"}  # values that differ across the tile
    for op, dst, args in steps:
        if any(a in varies for a in args):
            varies.add(("t", dst))
        vals = [_literal(v) if kind == "c" else names[kind].format(v) for kind, v in args]
        body.append(f"    t{dst} = {_pow(vals[0], args[1][1]) if op == 'Pow' else _EXPR[op].format(*vals)}")
    last = f"t{steps[-1][1]}"
    if ("t", steps[-1][1]) not in varies:  # every input read is one value: fill the tile with the result
        last = f"(tl.full({'[BLOCK]' if rank == 1 else '[ROWS, COLS]'}, 0.0, tl.float32) + {last})"
    blocks = "BLOCK: tl.constexpr" if rank == 1 else "ROWS: tl.constexpr, COLS: tl.constexpr"
    return "\n".join([
        "import triton", "import triton.language as tl", "", "",
        "@triton.jit",
        f"def kernel({ins}, out, n{params}, {blocks}):",
        *head,
        *body,
        f"    tl.store(out + {out_at}, {last}.to(out.dtype.element_ty), mask=m)", "",
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


def kernel_for(program: list[str], n_inputs: int, layout: Layout | None = FLAT):
    src = source(program, n_inputs, layout)
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


Geometry = tuple[tuple[int, ...], tuple[int, ...]]  # a tensor's (shape, strides)


def _dense(shape, strides) -> bool:
    """The elements fill their memory exactly once, in some order of the dims (contiguous, channels-last, a
    transpose of either)."""
    expect = 1
    for st, n in sorted((st, n) for st, n in zip(strides, shape) if n != 1):
        if st != expect:
            return False
        expect *= n
    return True


def _dense_strides(shape, order) -> tuple[int, ...]:
    """Dense strides for `shape` with its dims laid out in `order`, innermost first."""
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def output_strides(inputs: list[Geometry], shape) -> tuple[int, ...]:
    """The output in the memory format of its largest input (one of the output's shape, a dense one first,
    its strides as they are; else dense in that input's order of dims), else contiguous: a channels-last
    activation times a per-channel scale, or a channel slice of one plus another, stays channels-last."""
    shape = tuple(shape)
    full = [st for sh, st in inputs if tuple(sh) == shape]
    dense = next((st for st in full if _dense(shape, st)), None)
    if dense is not None:
        return tuple(dense)
    if full:  # innermost first: smallest stride, a later dim before an earlier one where they tie
        return _dense_strides(shape, sorted(range(len(shape)), key=lambda d: (full[0][d], -d)))
    return _dense_strides(shape, range(len(shape) - 1, -1, -1))


def empty_output(inputs: list[torch.Tensor], shape) -> torch.Tensor:
    dtype = next(x.dtype for x in inputs if x.dtype.is_floating_point)
    strides = output_strides([(tuple(x.shape), x.stride()) for x in inputs], shape)
    return torch.empty_strided(tuple(shape), strides, dtype=dtype, device=inputs[0].device)


@dataclass(frozen=True)
class Plan:
    layout: Layout
    sizes: tuple[int, ...]  # the merged dims, outermost first
    strides: tuple[tuple[int, ...], ...]  # each input's strides along them


def _broadcast_strides(shape, strides, out_shape) -> list[int]:
    """An input's strides over the output's dims: 0 along the dims it broadcasts (size 1 or missing)."""
    lead = len(out_shape) - len(shape)
    return [0 if d < lead or shape[d - lead] == 1 else strides[d - lead] for d in range(len(out_shape))]


@functools.lru_cache(maxsize=4096)
def plan_geometry(inputs: tuple[Geometry, ...], out: Geometry) -> Plan | None:
    """The merged layout the kernel indexes for inputs and an output of these shapes and strides, or None
    where it does not apply (an output that is not dense, more than MAX_RANK dims left after merging)."""
    shape, out_strides = out
    if not _dense(shape, out_strides):
        return None
    order = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -out_strides[d])  # memory order
    full = [_broadcast_strides(sh, st, shape) for sh, st in inputs]
    sizes = [shape[d] for d in order]
    per_input = [[st[d] for d in order] for st in full]
    # merge a dim into the one before it where every input steps over both as over one
    k = 0
    while k + 1 < len(sizes):
        if all(s[k] == s[k + 1] * sizes[k + 1] for s in per_input):
            sizes[k] *= sizes[k + 1]
            for s in per_input:
                s[k] = s[k + 1]
                del s[k + 1]
            del sizes[k + 1]
        else:
            k += 1
    if not sizes:
        sizes, per_input = [1], [[0] for _ in inputs]
    if len(sizes) > MAX_RANK:
        return None
    rank = len(sizes)
    dense = [math.prod(sizes[d + 1:]) for d in range(rank)]
    patterns = tuple("=" if s == dense else "".join(
        "0" if v == 0 else "1" if v == 1 else "s" for v in s) for s in per_input)
    span = max([math.prod(shape)] + [sum((n - 1) * abs(v) for n, v in zip(sizes, s)) + 1 for s in per_input])
    return Plan(Layout(rank, patterns, wide=span >= 2**31), tuple(sizes), tuple(tuple(s) for s in per_input))


def plan(inputs: list[torch.Tensor], out: torch.Tensor) -> Plan | None:
    return plan_geometry(tuple((tuple(x.shape), tuple(x.stride())) for x in inputs),
                         (tuple(out.shape), tuple(out.stride())))


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def supports(inputs: list[torch.Tensor]) -> bool:
    """One float type (FP32, FP16 or BF16) over the float inputs, bool for the others (a Where's condition),
    one device, shapes that broadcast, no empty input, and a layout of at most MAX_RANK merged dims."""
    floats = [x for x in inputs if x.dtype.is_floating_point]
    if not floats or floats[0].dtype not in _FLOATS or any(x.dtype != floats[0].dtype for x in floats) \
            or any(not x.dtype.is_floating_point and x.dtype != torch.bool for x in inputs) \
            or any(x.numel() == 0 or x.device != inputs[0].device for x in inputs):
        return False
    shape = _out_shape(inputs)
    if shape is None:
        return False
    geometry = tuple((tuple(x.shape), tuple(x.stride())) for x in inputs)
    return plan_geometry(geometry, (tuple(shape), output_strides(list(geometry), shape))) is not None


@functools.lru_cache(maxsize=1024)
def _kernel(program: tuple[str, ...], n_inputs: int, layout: Layout | None):
    """kernel_for, remembered by the program's lines: a layer's later calls skip generating and hashing."""
    return kernel_for(list(program), n_inputs, layout)


BLOCK = 2048  # elements a program writes


def run(program: list[str], inputs: list[torch.Tensor], block: int = BLOCK, out: torch.Tensor | None = None):
    shape = _out_shape(inputs)
    out = empty_output(inputs, shape) if out is None else out
    p = plan(inputs, out)
    if p is None:
        raise ValueError(f"no generated kernel for inputs {[tuple(x.shape) for x in inputs]} into a "
                         f"{tuple(out.shape)} output of strides {out.stride()}")
    n = out.numel()
    kernel = _kernel(tuple(program), len(inputs), p.layout)
    strides = [s[d] for s, pat in zip(p.strides, p.layout.patterns) if pat != "=" for d in range(p.layout.rank)
               if pat[d] == "s"]
    if p.layout.rank == 1:
        kernel[(triton_cdiv(n, block),)](*inputs, out, n, *strides, BLOCK=block)
        return out
    inner = p.sizes[-1]
    cols = tile_cols(inner, block)
    rows = max(1, block // cols)
    grid = (triton_cdiv(n // inner, rows) * triton_cdiv(inner, cols),)
    kernel[grid](*inputs, out, n, *p.sizes[1:], *strides, ROWS=rows, COLS=cols)
    return out


def tile_cols(inner: int, block: int) -> int:
    """A tile's width across the innermost dim: the power of two that pays least for its masked lanes
    (ceil(inner / cols) * cols) plus a row's index arithmetic (counted as ROW_COST lanes), so 1152 channels
    take tiles of 128 (9 full ones), not one of 2048 with 896 lanes idle."""
    widths = [1 << k for k in range(min(block, 1 << (inner - 1).bit_length()).bit_length())]
    return min(reversed(widths), key=lambda c: triton_cdiv(inner, c) * (c + ROW_COST))


ROW_COST = 16


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
