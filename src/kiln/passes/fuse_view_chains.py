"""Chains of Reshapes and Transposes that would copy more than once -> one kiln::ViewChain (ops/view_chain.py),
which copies at most once.

A Reshape of a transposed tensor copies it; a chain with two such Reshapes (MobileViT's unfold of a feature map
into patch sequences, and its fold back: Reshape -> Transpose -> Reshape -> Transpose -> Reshape) copies the
same elements two or three times where one strided copy moves them where they end. Only chains like that are
rewritten: a Reshape -> Transpose head split or a Transpose -> Reshape head merge is one copy at most already,
and the attention passes before this one read those. Each Reshape's shape must be a constant (with no 0
where allowzero is set);
every value inside the chain has the next node as its only reader. The chain's result keeps its name. Where a
convolution reads the 4-D result, the layer writes it channels-last (attribute channels_last) on a GPU at
FP16/BF16, the layout the convolution kernels take. Not in 8-bit builds (builder/quantized_io.py links 8-bit
values through the Reshapes and Transposes themselves), nor before an attention layer (the attention passes lay
out q, k and v for its kernels: Whisper's keys would become a transposed view). `--skipPasses
fuse_view_chains` leaves it out (A/B timings).
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, pinned, replace

_CONVS = (("", "Conv"), ("kiln", "FusedConv"))


def _step(view: View, n: Node) -> str | None:
    """The node as a ViewChain step, or None if it is not one."""
    if n.domain or pinned(n):
        return None
    if n.op_type == "Transpose":
        perm = n.attr("perm")
        return "T:" + ",".join(str(p) for p in perm) if perm else None  # no perm: its rank is not known here
    if n.op_type == "Reshape" and n.opset >= 5 and len(n.inputs) == 2:
        shape = view.ints(n.inputs[1])
        if not shape or (n.attr("allowzero", 0) and 0 in shape):  # allowzero matters only where a 0 is given
            return None
        return "R:" + ",".join(str(d) for d in shape)
    return None


def _copies(steps: list[str]) -> int:
    """Reshapes after a Transpose in the chain: each may copy when run one op at a time."""
    seen_t, count = False, 0
    for s in steps:
        seen_t |= s.startswith("T")
        count += s.startswith("R") and seen_t
    return count


def _chains(graph: Graph, view: View):
    starts = [n for n in graph.nodes if _step(view, n) is not None]
    claimed: set[int] = set()
    for head in starts:
        if id(head) in claimed:
            continue
        prev = view.producer.get(head.inputs[0])
        if prev is not None and _step(view, prev) is not None and view.sole_reader(prev.outputs[0]) is head:
            continue  # not the chain's first node
        chain = [head]
        while True:
            nxt = view.sole_reader(chain[-1].outputs[0])
            if nxt is None or _step(view, nxt) is None or nxt.inputs[0] != chain[-1].outputs[0]:
                break
            chain.append(nxt)
        claimed.update(id(n) for n in chain)
        yield chain


def run(graph: Graph) -> None:
    if graph.quant_amax:
        return
    view = View(graph)
    for chain in list(_chains(graph, view)):
        steps = [_step(view, n) for n in chain]
        out = chain[-1].outputs[0]
        readers = view.consumers.get(out, [])
        if _copies(steps) < 2 or any(r.op_type == "Attention" for r in readers):
            continue
        rank = len(steps[-1].split(":")[1].split(",")) if steps[-1].startswith("R") else None
        to_conv = (rank == 4 and out not in view.outputs and readers
                   and all((r.domain, r.op_type) in _CONVS and r.inputs[0] == out for r in readers))
        fused = Node("ViewChain", [chain[0].inputs[0]], [out],
                     {"steps": steps, **({"channels_last": 1} if to_conv else {})},
                     name=" + ".join(s for n in chain for s in (n.sources or [n.name])), domain="kiln")
        replace(graph, chain, fused)
        view.refresh()
