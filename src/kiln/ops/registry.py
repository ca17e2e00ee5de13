"""The operator registry: one entry per ONNX op Kiln claims.

An entry holds the op's torch reference implementation (ground truth; runs on
CPU and GPU) plus the facts the builder needs about it. Adding an op is one
`@register` and one test (the ONNX conformance cases for it run in CI).

    @register("Relu")
    def relu(node, x):
        return torch.relu(x)

An implementation gets the Node (attributes via node.attr, opset via
node.opset, device via node.device) and the input tensors in order; an omitted
optional input arrives as None, missing trailing inputs fall back to Python
defaults. It returns one tensor or a tuple (one per output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir.graph import Node


@dataclass(frozen=True)
class OpEntry:
    op_type: str
    domain: str
    impl: Callable
    # Input positions read on the host as Python numbers (Reshape's shape, Slice's
    # starts...). In an engine they must come from shape arithmetic or constants,
    # which Kiln evaluates on the host once per input shape.
    host_inputs: tuple[int, ...] = ()
    # Output depends only on input *shapes* (Shape, Size): evaluated on the host.
    shape_only: bool = False
    # Output shape depends on input *values* (NonZero, Unique, If...): the engine
    # cannot be captured as one CUDA graph and runs eagerly instead.
    data_dependent: bool = False
    # Output is random (RandomNormal...): never constant-folded or cached.
    nondeterministic: bool = False
    # Why this op stays FP32 in an FP16/BF16 engine (None: it follows the build).
    keep_fp32: str | None = None
    # Ops whose inputs are not cast to the layer precision (Cast, Q/DQ, ...).
    keeps_input_types: bool = False
    # Input positions never cast (quantization scales: FP32 like those of the layers that share them).
    uncast_inputs: tuple[int, ...] = ()
    # Input positions narrowed to the layer precision saturating (finite stays finite): an attention
    # mask's "masked" constant, float32's lowest value, must not become -inf in FP16.
    saturating_inputs: tuple[int, ...] = ()
    # Control flow: impl also receives `scope=` (the enclosing values) and `run_subgraph=` (the runtime's
    # interpreter, run_subgraph(body, feeds, scope) -> outputs) to run its bodies.
    uses_scope: bool = False
    # Returns a reason string when this node's attributes/inputs are outside
    # what the implementation handles, else None. Used by `kiln check`.
    check: Callable[[Node], str | None] | None = None
    since: int = 1  # lowest opset Kiln implements for this op

    def narrows(self, pos: int) -> bool:
        """Whether input `pos` takes the layer's float precision (else it is read as stored)."""
        return not self.keeps_input_types and pos not in self.host_inputs and pos not in self.uncast_inputs


_REGISTRY: dict[tuple[str, str], OpEntry] = {}


def register(op_type: str, domain: str = "", **facts) -> Callable:
    def deco(fn: Callable) -> Callable:
        key = (domain, op_type)
        if key in _REGISTRY:
            raise RuntimeError(f"op {domain or 'ai.onnx'}::{op_type} registered twice")
        _REGISTRY[key] = OpEntry(op_type=op_type, domain=domain, impl=fn, **facts)
        return fn

    return deco


def lookup(op_type: str, domain: str = "") -> OpEntry | None:
    if domain == "ai.onnx":
        domain = ""
    return _REGISTRY.get((domain, op_type))


def entries() -> list[OpEntry]:
    return sorted(_REGISTRY.values(), key=lambda e: (e.domain, e.op_type))


def claimed_ops(domain: str = "") -> list[str]:
    return sorted(op for d, op in _REGISTRY if d == domain)


def unsupported_reason(node: Node) -> str | None:
    """None if Kiln can build this node, else a short reason naming what is missing."""
    entry = lookup(node.op_type, node.domain)
    if entry is None:
        dom = node.domain or "ai.onnx"
        return f"operator {dom}::{node.op_type} is not implemented"
    if node.opset < entry.since:
        return (f"{node.op_type} at opset {node.opset} is older than Kiln supports (>= {entry.since}); "
                "use --upgrade-opset")
    if entry.check is not None:
        return entry.check(node)
    return None
