"""Runs a graph's nodes in order with each op's torch implementation.

The same loop serves the CPU target, the eager GPU path, and CUDA-graph capture
(the runtime records the device work this loop issues once, then replays it).
"""

from __future__ import annotations

import warnings
from collections import ChainMap
from typing import Iterable, MutableMapping

import torch

from ..errors import KilnError, summary
from ..ir.dtypes import FLOAT_TYPES
from ..ir.graph import Graph, Node
from ..kernels import pad_channels
from ..ops.registry import lookup
from ..tactics import implementation

_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_CONVOLUTIONS = ("Conv", "FusedConv", "QConv")  # the layers whose weights builder/layout.py stores channels-last


def compute_type(node: Node, entry) -> torch.dtype | None:
    """The float type a layer's float inputs are cast to, or None when they are taken as they come:
    FP16/BF16 layers get low-precision inputs, layers kept in FP32 inside a low-precision engine FP32."""
    if entry.keeps_input_types:
        return None
    want = _LOW.get(node.precision)
    if want is None and node.note.startswith(("kept FP32", "pinned")):
        want = torch.float32
    return want


def casts(entry, pos: int, a, want: torch.dtype | None) -> bool:
    """Whether input `pos` of a layer is cast to `want` (float tensors of another type; not shape arguments)."""
    return (want is not None and isinstance(a, torch.Tensor) and a.dtype in FLOAT_TYPES and a.dtype != want
            and entry.narrows(pos))


def cast_input(entry, pos: int, a, want: torch.dtype | None, channels_last: bool = False):
    """Input `pos` of a layer, cast to `want` where that applies (casts); channels_last: a 4-D input is
    written in that layout by the same copy."""
    if not casts(entry, pos, a, want):
        return a
    if pos in entry.saturating_inputs:
        return saturating_cast(a, want)
    return a.to(want, memory_format=torch.channels_last) if channels_last and a.dim() == 4 else a.to(want)


def cast_for(node: Node, entry, args: list):
    """Cast float inputs to the layer's compute precision (compute_type). A convolution whose weights are
    stored channels-last (builder/layout.py) gets its input cast into that layout by the same copy: its
    kernel would otherwise make a second, layout-only copy (ResNet-50's FP32 NCHW image: 2.6 us at batch 1).
    A stem whose weights were given a zero fourth channel gets its image padded to match in that copy."""
    want = compute_type(node, entry)
    # Only a convolution's input 1 is a weight stored channels-last: a Concat or Mul whose second input is
    # a channels-last activation must not be padded or re-laid out (that padded a detector's concatenation).
    conv = node.op_type in _CONVOLUTIONS and len(args) > 1
    nhwc = conv and _channels_last_weights(args[1])
    # A stem weight given a zero channel (builder/layout.py): a 1x1 weight reads as contiguous in both layouts,
    # so the channel counts, not the strides, say so (RepVGG's 1x1 stem branch).
    if (conv and isinstance(args[1], torch.Tensor) and args[1].dim() == 4 and node.attr("group", 1) == 1
            and args[0].dim() == 4 and args[0].shape[1] < args[1].shape[1]):
        args = [_zero_padded_channels(args[0], args[1].shape[1], want or args[0].dtype), *args[1:]]
        nhwc = True
    if want is None:
        return args
    return [cast_input(entry, i, a, want, channels_last=nhwc and i == 0) for i, a in enumerate(args)]


def _zero_padded_channels(x: torch.Tensor, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """x [N, C, H, W] cast into a channels-last [N, channels, H, W], the added channels zero: one kernel on a GPU."""
    if x.is_cuda and x.numel() // x.shape[1] * channels < 2**31:
        return pad_channels.pad_channels(x, channels, dtype)
    return pad_channels.reference(x, channels, dtype)


def _channels_last_weights(w) -> bool:
    return (isinstance(w, torch.Tensor) and w.dim() == 4 and not w.is_contiguous()
            and w.is_contiguous(memory_format=torch.channels_last))


def call_node(node: Node, args: list, env: MutableMapping | None = None, tactic: str | None = None) -> tuple:
    """Run one node's implementation on its input tensors (tactic: the running profile's choice, default
    node.tactic); returns its outputs as a tuple."""
    entry = lookup(node.op_type, node.domain)
    if entry is None:
        raise KilnError(f"node '{node.label}': operator {node.domain or 'ai.onnx'}::{node.op_type} is not implemented.")
    args = cast_for(node, entry, args)
    kwargs = {"scope": env if env is not None else {}, "run_subgraph": run_subgraph} if entry.uses_scope else {}
    tactic = tactic or node.tactic
    fn = (tactic != "reference" and implementation(node, args, tactic)) or entry.impl
    try:
        out = fn(node, *args, **kwargs)
    except KilnError:
        raise
    except Exception as e:
        if fn is not entry.impl:  # never fail where a slower path exists: the reference runs instead
            return _after_tactic_failure(node, entry, tactic, args, kwargs, e)
        # torch's own message says what was wrong with the shapes/values
        shapes = ", ".join(
            f"{n}:{tuple(a.shape)}/{str(a.dtype).removeprefix('torch.')}" if isinstance(a, torch.Tensor) else f"{n}:-"
            for n, a in zip(node.inputs, args)
        )
        raise KilnError(f"node '{node.label}' ({node.op_type}) failed on inputs [{shapes}]: {e}") from e
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class TacticFallbackWarning(UserWarning):
    pass


def _after_tactic_failure(node: Node, entry, tactic: str, args: list, kwargs: dict, error: Exception) -> tuple:
    """A layer's tactic raised: record why on the node (node.tactic_failures, which the build turns into a
    finding), warn once for the layer, and return the reference implementation's outputs."""
    failures = node.__dict__.setdefault("tactic_failures", {})
    if tactic not in failures:
        failures[tactic] = summary(error)
        warnings.warn(f"layer '{node.label}': tactic {tactic} failed ({failures[tactic]}); the layer runs its "
                      "reference implementation instead.", TacticFallbackWarning, stacklevel=3)
    out = entry.impl(node, *args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def run_node(node: Node, env: MutableMapping[str, torch.Tensor]) -> None:
    try:
        args = [env[name] if name else None for name in node.inputs]
    except KeyError as e:
        raise KilnError(f"node '{node.label}' ({node.op_type}) reads tensor {e}, which nothing produces.") from None
    outs = call_node(node, args, env)
    for name, t in zip(node.outputs, outs):
        if name:
            env[name] = t


def execute(nodes: Iterable[Node], env: MutableMapping[str, torch.Tensor],
            free_after: dict[int, list[str]] | None = None) -> None:
    """Run nodes in order, reading and writing `env`.

    free_after[i] lists values whose last reader is node i: dropping them lets the
    allocator reuse their memory (this is what keeps the activation arena small).
    """
    for i, node in enumerate(nodes):
        run_node(node, env)
        if free_after:
            for name in free_after.get(i, ()):
                env.pop(name, None)


def run_subgraph(graph: Graph, feeds: dict[str, torch.Tensor],
                 scope: MutableMapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run a control-flow body: its own inputs and initializers, then the enclosing scope."""
    local: dict[str, torch.Tensor] = dict(graph.initializers)
    local.update(feeds)
    env = ChainMap(local, scope)
    execute(graph.nodes, env)
    try:
        return [env[v.name] for v in graph.outputs]
    except KeyError as e:
        raise KilnError(f"subgraph '{graph.name}' output {e} is never produced.") from None


def saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in a float type, finite values beyond its range clamped to its largest finite values instead of
    becoming infinite. An exporter's "masked" constant, float32's lowest value, would otherwise turn into
    -inf in FP16, and a fully masked attention row into NaN where the FP32 model computes numbers."""
    big = torch.finfo(dtype).max
    return torch.where(torch.isfinite(t), t.clamp(-big, big), t).to(dtype)
