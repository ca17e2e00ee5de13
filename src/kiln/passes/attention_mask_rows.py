"""An attention mask widened over the queries by And with an all-True constant keeps its row shape.

HF BERT's SDPA export builds the padding mask per key, [B, 1, 1, S], And-s it with an all-True constant
[1, 1, S, 1], which only copies it to every query row, and turns the [B, 1, S, S] result into the additive
mask with Where. The attention adds its mask to the scores, broadcasting it anyway; given the [B, 1, 1, S]
form the flash kernel loads one mask row per key block instead of a tile (kernels/attention.py, MASK_ROW),
and the And and a Where over S times more values are gone.

So an And with an all-True constant that is 1 everywhere but the query axis (-2) is dropped where its
result reaches only Where conditions, Not or Cast, whose results in turn reach only attention masks.
Every position of the narrower value holds what the wider one held there, and it is broadcast the same way.
Assumed, as for any attention mask: it does not widen the scores (its query extent is theirs).
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph
from .rewrite import View, bypass

_PASS_THROUGH = {("", "Not"): 0, ("", "Cast"): 0, ("", "Where"): 0}  # op -> the input the mask may be


def _reaches_only_masks(view: View, value: str) -> bool:
    """Whether `value` flows only into attention masks, through ops that keep position-by-position values."""
    if value in view.outputs or not view.consumers.get(value):
        return False
    for reader in view.consumers[value]:
        slots = [i for i, name in enumerate(reader.inputs) if name == value]
        if reader.domain == "kiln" and reader.op_type == "Attention":
            if slots != [3]:  # read as the mask only
                return False
            continue
        if slots != [_PASS_THROUGH.get((reader.domain, reader.op_type), -1)]:
            return False
        if not _reaches_only_masks(view, reader.outputs[0]):
            return False
    return True


def _all_true_over_queries(t: torch.Tensor | None) -> bool:
    return (t is not None and t.dtype == torch.bool and t.dim() >= 2 and bool(t.all())
            and all(s == 1 for i, s in enumerate(t.shape) if i != t.dim() - 2))


def run(graph: Graph) -> None:
    view = View(graph)
    for node in list(graph.nodes):
        if node.op_type != "And" or node.domain or len(node.inputs) != 2:
            continue
        ones = [i for i in (0, 1) if _all_true_over_queries(view.const(node.inputs[i]))]
        if not ones or not _reaches_only_masks(view, node.outputs[0]):
            continue
        bypass(graph, view, node, node.inputs[1 - ones[0]])  # not a graph output: _reaches_only_masks
