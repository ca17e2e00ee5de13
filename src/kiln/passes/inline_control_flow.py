"""Control flow the build can decide, inlined: an If whose condition is a constant becomes the nodes of the
branch it takes, and a Loop whose iterations the build can count becomes that many copies of its body.

A Loop is counted when its trip count and condition are constants and the body's condition output folds to a
constant in every iteration (it reads only the iteration number, loop-carried values that fold, and weights):
what exporters write for a loop over a fixed count (torch.onnx's nn.EmbeddingBag loops over the bags). Each
copy gets the iteration number as a weight, so what depends on it folds too (a Slice of the offsets, an If on
an empty bag), and its scan outputs are stacked with Unsqueeze + Concat. The unrolled graph runs real kernels
and can be captured as one CUDA graph; a loop that cannot be counted, or is too long to copy, stays a Loop
and runs in the interpreter. Sequences it carried become chains that passes/lower_sequences.py turns into
tensors.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ir.graph import Graph, Node
from . import fold_constants

MAX_TRIPS = 1024  # iterations copied at most; a longer loop stays a Loop
MAX_NODES = 50000  # nodes one unrolled loop may add
_ROUNDS = 8  # an unrolled body may hold an If that folding decides, and so on


def run(graph: Graph) -> None:
    for _ in range(_ROUNDS):
        if not any(n.op_type in ("If", "Loop") and not n.domain for n in graph.nodes):
            return
        fold_constants.run(graph)
        tags = _Tags(graph)
        inlined = _inline_ifs(graph, tags)
        unrolled = _unroll_loops(graph, tags)
        if not (inlined or unrolled):
            return
    fold_constants.run(graph)


class _Tags:
    """Prefixes for the names of the copies that no name of the graph starts with: ONNX does not require node
    names to be unique, and two Loops of one name must not write the same values."""

    def __init__(self, graph: Graph):
        self.taken: set[str] = set()
        names = set(graph.initializers) | {v.name for v in graph.inputs}
        names |= {o for n in graph.walk() for o in n.outputs if o}
        for name in names:
            parts = name.split("/")
            self.taken.update("/".join(parts[:k]) for k in range(1, len(parts)))

    def __call__(self, base: str) -> str:
        tag, k = base, 1
        while tag in self.taken:
            tag, k = f"{base}#{k}", k + 1
        self.taken.add(tag)
        return tag


def _subgraphs(node: Node):
    for v in node.attrs.values():
        for g in v if isinstance(v, list) else [v]:
            if isinstance(g, Graph):
                yield g


def _defined(g: Graph) -> set[str]:
    """Every name a (sub)graph defines: its inputs, weights and node outputs, in nested bodies too."""
    names = {v.name for v in g.inputs} | set(g.initializers)
    for n in g.nodes:
        names |= {o for o in n.outputs if o}
        for sub in _subgraphs(n):
            names |= _defined(sub)
    return names


def _renamed_graph(g: Graph, rename) -> Graph:
    return replace(g, nodes=[_renamed_node(n, rename, n.name) for n in g.nodes],
                   inputs=[replace(v, name=rename(v.name)) for v in g.inputs],
                   outputs=[replace(v, name=rename(v.name)) for v in g.outputs],
                   initializers={rename(k): t for k, t in g.initializers.items()}, findings=[])


def _renamed_node(n: Node, rename, name: str) -> Node:
    attrs = {}
    for k, v in n.attrs.items():
        if isinstance(v, Graph):
            v = _renamed_graph(v, rename)
        elif isinstance(v, list) and v and isinstance(v[0], Graph):
            v = [_renamed_graph(g, rename) for g in v]
        attrs[k] = v
    return replace(n, inputs=[rename(i) if i else "" for i in n.inputs],
                   outputs=[rename(o) if o else "" for o in n.outputs], attrs=attrs, name=name,
                   sources=list(n.sources) or [n.name])


def _identity(src: str, dst: str, like: Node) -> Node:
    return Node("Identity", [src], [dst], name=f"{like.name}/{dst}", opset=like.opset)


def _outputs_renamed(nodes: list[Node], results: list[str], outs: list[str], like: Node) -> list[Node]:
    """`nodes` computing `results`, made to write them as `outs` (the replaced node's outputs) instead: the
    copies' own names are renamed where they produce them, so no Identity per output is left (a long
    unrolled loop would leave thousands for remove_noops). A result the copies do not produce (an outer
    value, a weight) is passed on by an Identity."""
    produced = {o for n in nodes for o in n.outputs if o}
    alias, extra = {}, []
    for src, dst in zip(results, outs):
        if not dst:
            continue
        if src in produced and src not in alias:
            alias[src] = dst
        else:
            extra.append(_identity(alias.get(src, src), dst, like))
    if alias:
        nodes = [_renamed_node(n, lambda s: alias.get(s, s), n.name) for n in nodes]
    return nodes + extra


def _inline_ifs(graph: Graph, tags: _Tags) -> bool:
    consts = graph.initializers
    out, changed = [], False
    for node in graph.nodes:
        cond = node.inputs[0] if node.op_type == "If" and not node.domain else None
        if cond not in consts or consts[cond].numel() != 1:
            out.append(node)
            continue
        branch: Graph = node.attr("then_branch") if bool(consts[cond].reshape(-1)[0]) else node.attr("else_branch")
        local = _defined(branch)
        prefix = f"{tags(node.name)}/"

        def rename(s, local=local, prefix=prefix):
            return prefix + s if s in local else s

        copy = _renamed_graph(branch, rename)
        consts.update(copy.initializers)
        out += _outputs_renamed([replace(n, name=prefix + n.name) for n in copy.nodes],
                                [v.name for v in copy.outputs], node.outputs, node)
        changed = True
    graph.nodes = out
    return changed


def _unroll_loops(graph: Graph, tags: _Tags) -> bool:
    out, changed = [], False
    for node in graph.nodes:
        unrolled = _unrolled(node, graph, tags) if node.op_type == "Loop" and not node.domain else None
        if unrolled is None:
            out.append(node)
            continue
        nodes, consts = unrolled
        graph.initializers = consts
        out += nodes
        changed = True
    graph.nodes = out
    return changed


def _unrolled(loop: Node, graph: Graph, tags: _Tags) -> tuple[list[Node], dict] | None:
    """(the nodes replacing `loop`, the weights with the folded values added), or None where the build cannot
    count its iterations or the copies would be too many."""
    consts = dict(graph.initializers)  # a copy: an abandoned unroll leaves the graph's weights as they were
    trip_name, cond_name, *initial = loop.inputs + [""] * max(0, 2 - len(loop.inputs))
    if (trip_name and trip_name not in consts) or (cond_name and cond_name not in consts):
        return None
    if not trip_name and not cond_name:
        return None  # an infinite loop as far as the graph says
    limit = int(consts[trip_name].reshape(-1)[0]) if trip_name else None
    if limit is not None and limit > MAX_TRIPS and not cond_name:
        return None  # too many copies, known before making any
    running = bool(consts[cond_name].reshape(-1)[0]) if cond_name else True
    body: Graph = loop.attr("body")
    n = len(initial)
    iter_in, cond_in, *carried_in = [v.name for v in body.inputs]
    cond_out, carried_out, scan_out = body.outputs[0].name, [v.name for v in body.outputs[1:1 + n]], \
        [v.name for v in body.outputs[1 + n:]]
    local = _defined(body)
    tag = tags(loop.name)
    current = list(initial)
    scans: list[list[str]] = [[] for _ in scan_out]
    nodes: list[Node] = []
    i = 0
    while running and (limit is None or i < limit):
        if i >= MAX_TRIPS or len(nodes) > MAX_NODES:
            return None
        prefix = f"{tag}/{i}/"
        bound = {iter_in: prefix + iter_in, cond_in: prefix + cond_in, **dict(zip(carried_in, current))}
        shared = {k: f"{tag}/{k}" for k in body.initializers}  # one copy of a body weight for all iterations

        def rename(s, prefix=prefix, bound=bound, shared=shared):
            return bound.get(s) or shared.get(s) or (prefix + s if s in local else s)

        consts[bound[iter_in]] = torch.tensor(i, dtype=torch.int64)
        consts[bound[cond_in]] = torch.tensor(running)
        consts.update({shared[k]: t for k, t in body.initializers.items()})
        copy = Graph(nodes=[_renamed_node(x, rename, prefix + x.name) for x in body.nodes], inputs=[], outputs=[],
                     initializers=consts)
        fold_constants.run(copy)  # the iteration number is a weight now: what reads it folds
        nodes += copy.nodes
        if cond_name:  # without a cond input the body's condition is ignored (a plain for-loop)
            cond = consts.get(rename(cond_out))
            if cond is None or cond.numel() != 1:
                return None  # the condition depends on data
            running = bool(cond.reshape(-1)[0])
        current = [rename(v) for v in carried_out]
        for acc, v in zip(scans, scan_out):
            acc.append(rename(v))
        i += 1
    if scan_out and i == 0:
        return None  # zero iterations: the stacked outputs' shapes are not known here; the Loop makes them
    outs = loop.outputs + [""] * (n + len(scan_out) - len(loop.outputs))
    scanned = {name for acc in scans for name in acc}  # also read by the stacking: not renamed away
    kept = [(src, dst) for src, dst in zip(current, outs[:n]) if dst and src not in scanned]
    nodes = _outputs_renamed(nodes, [src for src, _ in kept], [dst for _, dst in kept], loop)
    nodes += [_identity(src, dst, loop) for src, dst in zip(current, outs[:n]) if dst and src in scanned]
    for acc, dst in zip(scans, outs[n:]):
        if dst:
            nodes += _stacked(acc, dst, loop, tag, consts)
    return nodes, consts


def _stacked(names: list[str], dst: str, loop: Node, tag: str, consts: dict) -> list[Node]:
    """Scan outputs stacked on a new axis 0: Unsqueeze each, then one Concat."""
    axes = f"{tag}/axis0"
    consts[axes] = torch.tensor([0], dtype=torch.int64)
    nodes = []
    for k, name in enumerate(names):
        ins, attrs = ([name, axes], {}) if loop.opset >= 13 else ([name], {"axes": [0]})
        nodes.append(Node("Unsqueeze", ins, [f"{dst}/{k}"], attrs, name=f"{tag}/{dst}/{k}", opset=loop.opset))
    nodes.append(Node("Concat", [f"{dst}/{k}" for k in range(len(names))], [dst], {"axis": 0},
                      name=f"{tag}/{dst}", opset=loop.opset))
    return nodes
