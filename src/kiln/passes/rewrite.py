"""Small helpers the passes share: who produces and reads a value, constants, replacing nodes, pinned layers,
host-known values."""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node, reads
from ..ops.registry import lookup


class View:
    """Producer/consumer maps of a graph, rebuilt after each rewrite."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.refresh()

    def refresh(self) -> None:
        g = self.graph
        self.producer = g.producers()
        self.consumers = g.consumers()
        self.outputs = {v.name for v in g.outputs}
        # Values read inside subgraphs count as extra readers.
        for n in g.nodes:
            for v in n.attrs.values():
                for sub in v if isinstance(v, list) else [v]:
                    if isinstance(sub, Graph):
                        for inner in sub.walk():
                            for i in inner.inputs:
                                self.consumers.setdefault(i, []).append(n)

    def readers(self, value: str) -> int:
        return len(self.consumers.get(value, [])) + (value in self.outputs)

    def sole_reader(self, value: str) -> Node | None:
        """The only node reading `value`, if it is not also a graph output."""
        users = self.consumers.get(value, [])
        return users[0] if len(users) == 1 and value not in self.outputs else None

    def const(self, value: str) -> torch.Tensor | None:
        return self.graph.initializers.get(value)

    def ints(self, value: str) -> list[int] | None:
        """An integer constant (a shape, say) as a flat list of Python ints, else None."""
        t = self.const(value)
        return [int(v) for v in t.reshape(-1)] if t is not None and not t.dtype.is_floating_point else None

    def scalar(self, value: str) -> float | None:
        t = self.const(value)
        return float(t.reshape(-1)[0]) if t is not None and t.numel() == 1 else None

    def other_input(self, node: Node, value: str) -> str | None:
        """For a binary node reading `value`, the name of its other input."""
        if len(node.inputs) != 2 or value not in node.inputs:
            return None
        return node.inputs[1] if node.inputs[0] == value else node.inputs[0]


def replace(graph: Graph, old: list[Node], new: Node) -> None:
    """Replace `old` nodes by `new`, placed where the last of them was (its inputs exist by then)."""
    ids = {id(n) for n in old}
    last = max(i for i, n in enumerate(graph.nodes) if id(n) in ids)
    new.sources = [s for n in old for s in (n.sources or [n.name])]
    new.opset = old[0].opset
    pin = next((n for n in old if pinned(n)), None)
    if pin is not None:  # --layerPrecisions on any source holds for the fused layer
        new.precision, new.note = pin.precision, pin.note
    elif not new.note:  # why a source kept its precision holds for the fused layer
        new.note = next((n.note for n in old if n.note), "")
    nodes = []
    for i, n in enumerate(graph.nodes):
        if i == last:
            nodes.append(new)
        if id(n) not in ids:
            nodes.append(n)
    graph.nodes = _readers_after(nodes, new)


def _readers_after(nodes: list[Node], new: Node) -> list[Node]:
    """A fused node that also exposes an intermediate (SkipLayerNorm's sum) sits where its last source sat, so a
    reader of that intermediate placed between the sources (GPT-2's Shape of the embedding sum) would run before
    it: move such readers, and what reads their outputs in turn, to just after the fused node, in order."""
    at = next(i for i, n in enumerate(nodes) if n is new)
    produced, moved = {o for o in new.outputs if o}, []
    for n in nodes[:at]:
        if reads(n) & produced:
            moved.append(n)
            produced |= {o for o in n.outputs if o}
    if not moved:
        return nodes
    ids = {id(n) for n in moved}
    kept = [n for n in nodes if id(n) not in ids]
    at = next(i for i, n in enumerate(kept) if n is new)
    return kept[:at + 1] + moved + kept[at + 1:]


def bypass(graph: Graph, view: View, node: Node, src: str) -> bool:
    """Make readers of node's output read `src` instead and drop node; False when the output is a graph output."""
    out = node.outputs[0]
    if out in view.outputs:
        return False
    for n in graph.walk():
        n.inputs = [src if i == out else i for i in n.inputs]
    graph.nodes.remove(node)
    view.refresh()
    return True


def fused_name(nodes: list[Node]) -> str:
    return " + ".join(s for n in nodes for s in (n.sources or [n.name]))


def miss(graph: Graph, pattern: str, nodes: list[Node], reason: str) -> None:
    graph.findings.append({"kind": "fusion-missed", "pattern": pattern,
                           "nodes": [n.name for n in nodes], "reason": reason})


def pinned(node) -> bool:
    """Whether --layerPrecisions pinned the layer (or, fused, one of its sources): it keeps that float precision."""
    return node.note.startswith("pinned")


def host_values(graph: Graph) -> set[str]:
    """Names of the values computable on the host (weights and shape arithmetic)."""
    known = set(graph.initializers)
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        ins = [i for i in node.inputs if i]
        pure = not (entry.nondeterministic or entry.uses_scope or entry.data_dependent)
        if entry.shape_only or (pure and ins and all(i in known for i in ins)):
            known.update(o for o in node.outputs if o)
    return known
