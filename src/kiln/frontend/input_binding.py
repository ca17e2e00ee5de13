"""Replace some of a model's inputs by tensor inputs and the nodes, put first in the graph, that rebuild each
replaced value from them: what frontend/sequence_inputs.py and frontend/optional_inputs.py share (an engine's
bindings are tensors, so a sequence or optional model input is bound as tensors for one engine)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import onnx

from ..errors import InputError


def bind_inputs(model: onnx.ModelProto, kind: str, candidates: Iterable[str], chosen: Iterable[str],
                bind: Callable[[onnx.ValueInfoProto], tuple[list, list]]) -> onnx.ModelProto:
    """A copy of `model` in which each input named in `chosen` (all of them among `candidates`, the model's
    `kind` inputs) is replaced by the value infos bind(input) returns first, and rebuilt by the nodes it
    returns second."""
    candidates, chosen = set(candidates), set(chosen)
    unknown = sorted(chosen - candidates)
    if unknown:
        raise InputError(f"bind_{kind}_inputs: {unknown} are not {kind} inputs of the model; "
                         f"its {kind} inputs are {sorted(candidates)}.")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inputs, front = [], []
    for vi in graph.input:
        if vi.name not in chosen:
            inputs.append(vi)
            continue
        infos, nodes = bind(vi)
        inputs += infos
        front += nodes
    del graph.input[:]
    graph.input.extend(inputs)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(front + nodes)
    return out
