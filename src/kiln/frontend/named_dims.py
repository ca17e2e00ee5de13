"""A profile from the names of a model's dynamic dimensions (onnxruntime's free-dimension overrides).

Exporters name their dynamic axes, and Hugging Face Optimum's decoders tie them together: input_ids is
[batch_size, sequence_length], each past_key_values.N.key [batch_size, heads, past_sequence_length,
head_dim], and attention_mask [batch_size, past_sequence_length + sequence_length]. Building one
min/opt/max shape per input by hand is error prone (a mask one token short fails deep inside the
graph); giving each *name* its range once and evaluating every input's dimensions is not:

    profile = profile_from_dims(model, {"batch_size": (1, 2, 4), "sequence_length": (1, 16, 64),
                                        "past_sequence_length": (0, 16, 64)})

A dimension may be a name, a number, or a sum, difference or product of them ("past_sequence_length +
sequence_length"). A dimension named by nothing given, or one written in another form, is a ConfigError
naming the input, the axis and the name, and listing the names the model uses.
"""

from __future__ import annotations

import ast

import onnx

from ..engine.profile import Profile
from ..errors import ConfigError, UnsupportedError


def dim_names(model: onnx.ModelProto) -> dict[str, list[str]]:
    """{dimension name: ["input[axis]", ...]} for every named dimension of the model's inputs."""
    out: dict[str, list[str]] = {}
    for vi in _inputs(model):
        for a, d in enumerate(vi.type.tensor_type.shape.dim):
            if not d.HasField("dim_value") and d.dim_param:
                for name in _names(d.dim_param, vi.name, a):
                    out.setdefault(name, []).append(f"{vi.name}[{a}]")
    return out


def profile_from_dims(model: onnx.ModelProto, dims: dict[str, tuple[int, int, int]]) -> Profile:
    """A Profile whose min/opt/max shapes evaluate each input's dimensions at the names' min, opt and max."""
    used = dim_names(model)
    for name, rng in dims.items():
        if len(tuple(rng)) != 3 or not all(isinstance(v, int) and v >= 0 for v in rng) or not rng[0] <= rng[1] <= rng[2]:
            raise ConfigError(f"dimension '{name}': give (min, opt, max) as integers with min <= opt <= max, "
                              f"not {rng!r}.")
    unknown = sorted(set(dims) - set(used))
    if unknown:
        raise ConfigError(f"dimension(s) {unknown} are not used by the model's inputs; its named dimensions are "
                          f"{sorted(used)}.")
    missing = {n: where for n, where in used.items() if n not in dims}
    if missing:
        listed = "; ".join(f"'{n}' (in {', '.join(w)})" for n, w in sorted(missing.items()))
        raise ConfigError(f"the model's inputs have dynamic dimensions Kiln has no range for: {listed}. Give each "
                          f"name a (min, opt, max); the model's names are {sorted(used)}.")
    shapes = {}
    for vi in _inputs(model):
        per = []
        for a, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                per.append((d.dim_value,) * 3)
            elif not d.dim_param:
                raise ConfigError(f"input '{vi.name}' axis {a} is dynamic and unnamed: name it in the model, or give "
                                  "the input's shapes with --minShapes/--optShapes/--maxShapes.")
            else:
                per.append(tuple(_eval(d.dim_param, {n: dims[n][k] for n in dims}, vi.name, a) for k in range(3)))
        shapes[vi.name] = tuple(tuple(p[k] for p in per) for k in range(3))
    return Profile(shapes)


def _inputs(model: onnx.ModelProto):
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


_OPS = (ast.Add, ast.Sub, ast.Mult)


def _parse(text: str, inp: str, axis: int) -> ast.expr:
    try:
        tree = ast.parse(text.replace(".", "_dot_"), mode="eval").body
    except SyntaxError:
        tree = None
    ok = tree is not None and all(isinstance(n, (ast.BinOp, ast.Name, ast.Constant, ast.Load, *_OPS))
                                  for n in ast.walk(tree))
    if not ok:
        raise UnsupportedError(f"input '{inp}' axis {axis} is the dimension '{text}', which Kiln cannot map to a "
                               "size: a dimension must be a name, a number or a sum, difference or product of them.")
    return tree


def _names(text: str, inp: str, axis: int) -> list[str]:
    return [n.id.replace("_dot_", ".") for n in ast.walk(_parse(text, inp, axis)) if isinstance(n, ast.Name)]


def _eval(text: str, values: dict[str, int], inp: str, axis: int) -> int:
    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name):
            return values[n.id.replace("_dot_", ".")]
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            return a + b if isinstance(n.op, ast.Add) else a - b if isinstance(n.op, ast.Sub) else a * b
        raise UnsupportedError(f"input '{inp}' axis {axis}: '{text}' is not a size Kiln can compute.")

    size = ev(_parse(text, inp, axis))
    if size < 0:
        raise ConfigError(f"input '{inp}' axis {axis} ('{text}') is {size} at the given ranges.")
    return size
