"""Tactics: candidate implementations of a layer, timed on the target GPU at build.

Every op's registry entry has a reference implementation (tactic "reference").
Faster candidates register here with when they apply and how much workspace
they need; the builder times the applicable ones at each profile's opt shape,
checks each against the reference once, and keeps the fastest that is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir.graph import Node


@dataclass(frozen=True)
class Tactic:
    name: str
    fn: Callable  # same signature as the op's reference implementation
    applies: Callable[[Node, list], bool]  # given the layer's actual inputs on the target
    workspace: Callable[[Node, list], int] | None = None  # scratch bytes beyond inputs/outputs
    level: int = 1  # lowest --builderOptimizationLevel that tries it


_TACTICS: dict[tuple[str, str], list[Tactic]] = {}
_BY_NAME: dict[tuple[str, str, str], Tactic] = {}


def tactic(op_type: str, name: str, applies: Callable, domain: str = "kiln", workspace=None, level: int = 1):
    def deco(fn):
        t = Tactic(name, fn, applies, workspace, level)
        _TACTICS.setdefault((domain, op_type), []).append(t)
        _BY_NAME[(domain, op_type, name)] = t
        return fn

    return deco


def offered(node: Node, name: str) -> bool:
    """Whether this installation has tactic `name` for the node's op ("reference" always)."""
    load_all()
    return name == "reference" or (node.domain, node.op_type, name) in _BY_NAME


def candidates(node: Node) -> list[Tactic]:
    return _TACTICS.get((node.domain, node.op_type), [])


def implementation(node: Node, args: list, tactic: str | None = None) -> Callable | None:
    """The function of the chosen tactic (node.tactic, or `tactic`: the one for the running profile) if it
    applies to these inputs, else None (the reference).

    Tactics are chosen at each profile's opt shape; a runtime shape elsewhere in the
    profile that the tactic cannot take (an int8 GEMM with M <= 16, say) uses the
    reference instead of failing. Checked while recording, so replays cost nothing."""
    tactic = tactic or node.tactic
    if tactic == "reference":
        return None
    load_all()  # an engine loaded from a file names tactics this process has not registered yet
    t = _BY_NAME.get((node.domain, node.op_type, tactic))
    return t.fn if t is not None and t.applies(node, args) else None


_loaded = False


def load_all() -> None:
    """Register every tactic module, once (implementation() calls this for every eager layer)."""
    global _loaded
    if not _loaded:
        from . import (  # noqa: F401  (registering)
            cudnn_benchmark,
            cudnn_one_epilogue,
            gluon_ws,
            library,
            resize,
            triton_conv,
            triton_gemm,
            triton_tactics,
            triton_tma,
        )

        _loaded = True
