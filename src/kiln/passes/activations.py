"""Recognizing an activation applied to a value, so conv/GEMM fusion can absorb it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.graph import Node
from .rewrite import View


@dataclass
class Act:
    name: str  # a name kiln.ops.fused.activation knows
    params: list[float]
    nodes: list[Node]  # the nodes the activation consists of
    output: str


def _near(x: float | None, want: float, tol: float = 1e-3) -> bool:
    return x is not None and abs(x - want) <= tol * max(1.0, abs(want))


def match(view: View, value: str) -> Act | None:
    users = view.consumers.get(value, [])
    if value in view.outputs or not users:
        return None
    if len(users) == 1:
        n = users[0]
        simple = {"Relu": "Relu", "Sigmoid": "Sigmoid", "HardSwish": "HardSwish", "Tanh": "Tanh"}
        if n.op_type in simple and n.domain == "":
            return Act(simple[n.op_type], [], [n], n.outputs[0])
        if n.op_type == "LeakyRelu":
            return Act("LeakyRelu", [n.attr("alpha", 0.01)], [n], n.outputs[0])
        if n.op_type == "Gelu":
            name = "GeluTanh" if n.attr("approximate", "none") == "tanh" else "GeluErf"
            return Act(name, [], [n], n.outputs[0])
        if n.op_type == "Clip":
            lo, hi = _clip_bounds(view, n)
            if lo is not None and hi is not None:
                return Act("Clip", [lo, hi], [n], n.outputs[0])
    if len(users) == 2:
        return _silu(view, value, users) or _gelu_erf(view, value, users)
    return None


def _clip_bounds(view: View, n: Node):
    if n.opset < 11:
        return n.attr("min", -math.inf), n.attr("max", math.inf)
    lo = view.scalar(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] else -math.inf
    hi = view.scalar(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else math.inf
    return lo, hi


def _silu(view: View, v: str, users: list[Node]) -> Act | None:
    sig = next((u for u in users if u.op_type == "Sigmoid"), None)
    mul = next((u for u in users if u.op_type == "Mul"), None)
    if sig and mul and view.other_input(mul, v) == sig.outputs[0] and view.sole_reader(sig.outputs[0]) is mul:
        return Act("Silu", [], [sig, mul], mul.outputs[0])
    return None


def _gelu_erf(view: View, v: str, users: list[Node]) -> Act | None:
    """x * 0.5 * (1 + erf(x / sqrt(2))), as torch's exporter writes it."""
    div = next((u for u in users if u.op_type == "Div" and u.inputs[0] == v), None)
    if div is None or not _near(view.scalar(div.inputs[1]), math.sqrt(2)):
        return None
    erf = view.sole_reader(div.outputs[0])
    if erf is None or erf.op_type != "Erf":
        return None
    add = view.sole_reader(erf.outputs[0])
    if add is None or add.op_type != "Add" or not _near(view.scalar(view.other_input(add, erf.outputs[0]) or ""), 1.0):
        return None
    half = view.sole_reader(add.outputs[0])
    if (half is None or half.op_type != "Mul"
            or not _near(view.scalar(view.other_input(half, add.outputs[0]) or ""), 0.5)):
        return None
    last = view.sole_reader(half.outputs[0])
    if last is None or last.op_type != "Mul" or view.other_input(last, half.outputs[0]) != v or last not in users:
        return None
    return Act("GeluErf", [], [div, erf, add, half, last], last.outputs[0])
