"""Kiln's graph: what passes rewrite and the runtime executes.

A deliberately small IR: nodes keep ONNX's op_type/domain/attributes (decoded to
Python values, tensors as torch tensors, subgraphs as Graph), so the fused graph
converts back to an ONNX graph anyone can open (fused ops live in the "kiln"
domain, like onnxruntime's com.microsoft contrib ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Dim = int | str | None  # int: static; str: named dynamic axis; None: unnamed dynamic axis


@dataclass
class Value:
    """A graph input or output: name, element type and (possibly dynamic) shape."""

    name: str
    dtype: torch.dtype | None
    shape: tuple[Dim, ...] | None
    # An ONNX sequence(tensor(T)) value: dtype and shape are its elements' (shape None unless all share one).
    # At run time it is a Python list of tensors (src/kiln/ops/sequence.py).
    sequence: bool = False
    # An ONNX optional(...) value of that tensor or sequence: None at run time when empty (ops/optional.py).
    optional: bool = False

    @property
    def is_dynamic(self) -> bool:
        return self.shape is None or any(not isinstance(d, int) for d in self.shape)


@dataclass
class Node:
    op_type: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""
    opset: int = 17  # opset version of the node's domain in its model
    # Set by the builder and kept in the engine:
    precision: str = "float32"  # compute precision chosen for this layer
    placement: str = "device"  # "device" or "host" (shape arithmetic, see builder/placement.py)
    sources: list[str] = field(default_factory=list)  # ONNX nodes fused into this one
    tactic: str = "reference"
    # The fastest tactic per optimization profile, when they differ (tactic is then the best over all of them).
    profile_tactics: list[str] = field(default_factory=list)
    note: str = ""  # why a layer deviates from the requested precision, etc.
    # Set when the engine is loaded onto a device; not serialized.
    device: torch.device = field(default=torch.device("cpu"), repr=False, compare=False)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def tactic_for(self, profile: int) -> str:
        """The tactic this layer runs while the engine runs optimization profile `profile`."""
        return self.profile_tactics[profile] if self.profile_tactics else self.tactic

    @property
    def label(self) -> str:
        return self.name or f"{self.op_type}({', '.join(self.outputs)})"


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[Value]
    outputs: list[Value]
    initializers: dict[str, torch.Tensor] = field(default_factory=dict)
    name: str = "graph"
    opsets: dict[str, int] = field(default_factory=lambda: {"": 17})
    # What the passes noticed but could not do (e.g. a fusion that did not fire, and why).
    findings: list[dict] = field(default_factory=list)
    # INT8 builds: calibrated absolute range per activation name (passes/insert_qdq.py).
    quant_amax: dict[str, float] | None = None
    # ... and the largest |value| calibration saw per activation (builder/quantized_io.py: residual scales)
    quant_absmax: dict[str, float] | None = None
    quant_type: str = "int8"  # or "fp8" (E4M3)

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[Node]]:
        uses: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    uses.setdefault(i, []).append(n)
        return uses

    def walk(self):
        """Every node, including those inside subgraphs (If/Loop/Scan bodies)."""
        for n in self.nodes:
            yield n
            for v in n.attrs.values():
                for g in v if isinstance(v, list) else [v]:
                    if isinstance(g, Graph):
                        yield from g.walk()


def reads(node: Node) -> set[str]:
    """Names a node reads, including outer-scope names read inside its subgraphs (If/Loop/Scan bodies)."""
    names = {i for i in node.inputs if i}
    for v in node.attrs.values():
        for g in v if isinstance(v, list) else [v]:
            if isinstance(g, Graph):
                names |= {i for sub in g.walk() for i in sub.inputs if i}
    return names


def set_body_precision(node: Node, precision: str) -> None:
    """Every node of a control-flow layer's bodies runs in the layer's precision."""
    for v in node.attrs.values():
        for g in v if isinstance(v, list) else [v]:
            if isinstance(g, Graph):
                for sub in g.walk():
                    sub.precision = precision
