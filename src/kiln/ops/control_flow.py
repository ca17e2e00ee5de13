"""Control flow: If, Loop, Scan.

Bodies run through the interpreter (the run_subgraph it passes) with the enclosing values as their outer
scope. Conditions and trip counts are read on the host, so these ops make an
engine run eagerly rather than as one CUDA graph.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node, Value
from .registry import register


def _on_device(node: Node, values) -> tuple:
    """Body outputs may be CPU weights of the body; consumers expect them on the node's device."""
    return tuple(v.to(node.device) if isinstance(v, torch.Tensor) else v for v in values)


def _empty_scan(node: Node, value: Value, axis: int) -> torch.Tensor:
    """The stacked output of zero iterations: a 0-length axis, other dims from the body's declared shape."""
    dims = value.shape if value.shape is not None and all(isinstance(d, int) for d in value.shape) else ()
    shape = list(dims)
    shape.insert(axis if axis >= 0 else len(shape) + 1 + axis, 0)
    return torch.empty(shape, dtype=value.dtype or torch.float32, device=node.device)


@register("If", uses_scope=True, data_dependent=True, host_inputs=(0,))
def if_(node, cond, *, scope, run_subgraph):
    branch = node.attr("then_branch") if bool(cond.reshape(-1)[0]) else node.attr("else_branch")
    return _on_device(node, run_subgraph(branch, {}, scope))


@register("Loop", uses_scope=True, data_dependent=True, host_inputs=(0, 1))
def loop(node, max_trip_count, cond, *initial, scope, run_subgraph):
    body: Graph = node.attr("body")
    n = len(initial)
    names = [v.name for v in body.inputs]
    limit = int(max_trip_count.reshape(-1)[0]) if max_trip_count is not None else None
    running = cond is None or bool(cond.reshape(-1)[0])
    cond_t = torch.tensor(running, device=node.device)
    carried = list(initial)
    scans: list[list] = [[] for _ in body.outputs[1 + n:]]
    i = 0
    while running and (limit is None or i < limit):
        it = torch.tensor(i, dtype=torch.int64, device=node.device)
        outs = run_subgraph(body, dict(zip(names, [it, cond_t, *carried])), scope)
        # Without a cond input the loop is a plain for-loop: the body's cond output is ignored.
        if cond is not None:
            cond_t = outs[0]
            running = bool(cond_t.reshape(-1)[0])
        carried = outs[1:1 + n]
        for acc, t in zip(scans, outs[1 + n:]):
            acc.append(t)
        i += 1
    stacked = [
        torch.stack([t.to(node.device) for t in acc]) if acc else _empty_scan(node, v, 0)
        for acc, v in zip(scans, body.outputs[1 + n:])
    ]
    return _on_device(node, carried + stacked)


def _scan_loop(body: Graph, states: list, xs: list, scope, run_subgraph, valid=None):
    """Run `body` once per slice along axis 0 of each of `xs` (already in iteration order).

    Returns (final states, per scan output the list of its slices). valid: optional
    bool vector over iterations (Scan-8 sequence_lens); where it is False the states
    stop changing and the outputs are zero.
    """
    names = [v.name for v in body.inputs]
    n = len(states)
    ys: list[list] = [[] for _ in body.outputs[n:]]
    for t in range(xs[0].shape[0] if xs else 0):
        outs = run_subgraph(body, dict(zip(names, [*states, *(x[t] for x in xs)])), scope)
        if valid is None:
            states = list(outs[:n])
            for acc, y in zip(ys, outs[n:]):
                acc.append(y)
        else:
            states = [torch.where(valid[t], new, old) for new, old in zip(outs[:n], states)]
            for acc, y in zip(ys, outs[n:]):
                acc.append(torch.where(valid[t], y, torch.zeros_like(y)))
    return states, ys


def _stack(node: Node, slices: list, value: Value, axis: int) -> torch.Tensor:
    if not slices:
        return _empty_scan(node, value, axis)
    return torch.stack([y.to(node.device) for y in slices], axis % (slices[0].dim() + 1))


def _scan9(node, inputs, scope, run_subgraph):
    body: Graph = node.attr("body")
    m = node.attr("num_scan_inputs")
    states, xs = list(inputs[: len(inputs) - m]), list(inputs[len(inputs) - m:])
    n = len(states)
    k = len(body.outputs) - n
    in_axes = node.attr("scan_input_axes") or [0] * m
    in_dirs = node.attr("scan_input_directions") or [0] * m
    out_axes = node.attr("scan_output_axes") or [0] * k
    out_dirs = node.attr("scan_output_directions") or [0] * k
    xs = [x.movedim(a, 0).flip(0) if d else x.movedim(a, 0) for x, a, d in zip(xs, in_axes, in_dirs)]
    states, ys = _scan_loop(body, states, xs, scope, run_subgraph)
    # A reverse scan output gets the first iteration's slice last.
    outs = [_stack(node, acc[::-1] if d else acc, v, a)
            for acc, a, d, v in zip(ys, out_axes, out_dirs, body.outputs[n:])]
    return _on_device(node, states + outs)


def _scan8(node, sequence_lens, inputs, scope, run_subgraph):
    """Scan-8: inputs carry a leading batch axis and each batch entry is scanned on its own.

    sequence_lens stays on the device: every entry runs all steps, masked past its
    length; a reverse input is read backwards from its own last valid step.
    """
    body: Graph = node.attr("body")
    m = node.attr("num_scan_inputs")
    states, xs = list(inputs[: len(inputs) - m]), list(inputs[len(inputs) - m:])
    n = len(states)
    dirs = node.attr("directions") or [0] * m
    batch, steps = xs[0].shape[0], xs[0].shape[1]
    t = torch.arange(steps, device=xs[0].device)
    lens = sequence_lens.to(device=t.device, dtype=torch.long) if sequence_lens is not None else None
    final: list[list] = [[] for _ in range(n)]
    per_batch: list[list] = [[] for _ in body.outputs[n:]]
    for b in range(batch):
        if lens is None:
            valid = None
            back = t.flip(0)
        else:
            valid = t < lens[b]
            back = torch.where(valid, lens[b] - 1 - t, t)
        seqs = [x[b].index_select(0, back) if d else x[b] for x, d in zip(xs, dirs)]
        st, ys = _scan_loop(body, [s[b] for s in states], seqs, scope, run_subgraph, valid)
        for acc, s in zip(final, st):
            acc.append(s)
        for acc, y, v in zip(per_batch, ys, body.outputs[n:]):
            acc.append(_stack(node, y, v, 0))
    return _on_device(node, [torch.stack(f) for f in final] + [torch.stack(y) for y in per_batch])


@register("Scan", uses_scope=True, data_dependent=True, since=8)
def scan(node, *inputs, scope, run_subgraph):
    if node.opset < 9:
        return _scan8(node, inputs[0], inputs[1:], scope, run_subgraph)
    return _scan9(node, inputs, scope, run_subgraph)
