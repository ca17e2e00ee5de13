"""Layer precision: which compute precision each layer runs in.

FP16/BF16 builds run every layer in the requested precision except ops whose
registry entry says why they must stay FP32 (e.g. large sums overflow FP16);
those stay FP32 and the engine records the reason. Shape arithmetic (host
nodes) always keeps its original types. Weights low-precision layers read are
stored in that precision (in a copy where other layers read them as stored). A
layer that computes a model's FP32 output from FP32 sums can write it in FP32
(attribute output_type): the engine then ends without a cast kernel (2.4 us at
ResNet-50 batch 1 on an H200, bench/results/H200-trace-resnet50-b1-pad4.md).
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph
from ..ops.registry import lookup

_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}
INT8_LAYERS = ("QGemm", "QConv")  # int8 math with float epilogues, whatever the build's float precision
WEIGHT_ONLY = ("Int4Gemm",)  # int4 weights, activations in the build's float precision
# Every tactic of these honours attribute output_type="float32" (its first output in FP32): a CNN's head, a
# transformer's last norm.
WRITES_FP32_OUTPUT = ("PooledGemm", "SkipLayerNorm", "GemmSkipLayerNorm")
PINNED = "pinned by --layerPrecisions"
_PIN_NAMES = {"fp32": "float32", "float32": "float32", "tf32": "tf32", "fp16": "float16", "float16": "float16",
              "bf16": "bfloat16", "bfloat16": "bfloat16"}


def pinned(node) -> bool:
    """Whether --layerPrecisions pinned the layer (or, fused, one of its sources): it keeps that float precision."""
    return node.note.startswith("pinned")


def pin(graph: Graph, pins: dict[str, str]) -> None:
    """--layerPrecisions=name:fp16,...: mark ONNX nodes (before fusion) to run in a given float precision.
    Pinned layers are not quantized, and a fused layer keeps the pin of its sources."""
    from ..errors import ConfigError

    by_name = {n.name: n for n in graph.nodes}
    for name, prec in pins.items():
        if name not in by_name:
            close = [n for n in by_name if name.lower() in n.lower()][:5]
            raise ConfigError(f"--layerPrecisions names layer '{name}', which the model does not have"
                              + (f" (similar: {close})." if close else "."))
        if prec.lower() not in _PIN_NAMES:
            raise ConfigError(f"--layerPrecisions: '{prec}' for layer '{name}' is not one of {sorted(_PIN_NAMES)}.")
        by_name[name].precision, by_name[name].note = _PIN_NAMES[prec.lower()], PINNED


def set_body(node, precision: str) -> None:
    for v in node.attrs.values():
        for g in v if isinstance(v, list) else [v]:
            if isinstance(g, Graph):
                for sub in g.walk():
                    sub.precision = precision


def assign(graph: Graph, precision: str) -> None:
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        if node.placement == "host":
            node.precision = "float32"
        elif node.note == PINNED:
            pass
        elif node.domain == "kiln" and node.op_type in INT8_LAYERS:
            node.precision = node.attr("qtype", "int8")
        elif node.domain == "kiln" and node.op_type in WEIGHT_ONLY:
            node.precision, node.note = precision, "INT4 weights"
        elif precision in _LOW and entry.keep_fp32:
            node.precision, node.note = "float32", f"kept FP32: {entry.keep_fp32}"
        else:
            node.precision = precision
        set_body(node, node.precision)
    _cast_weights(graph)
    _fp32_outputs(graph)


def _fp32_outputs(graph: Graph) -> None:
    """Low-precision layers of WRITES_FP32_OUTPUT producing an FP32 model output that no layer reads write it
    in FP32 themselves."""
    fp32 = {v.name for v in graph.outputs if v.dtype == torch.float32}
    read = graph.consumers()
    for node in graph.nodes:
        if (node.domain == "kiln" and node.op_type in WRITES_FP32_OUTPUT and node.precision in _LOW
                and node.outputs[0] in fp32 and node.outputs[0] not in read):
            node.attrs["output_type"] = "float32"


def _cast_weights(graph: Graph) -> None:
    """FP16/BF16 layers' weights are stored in that type, so that no replay casts them. A weight that other
    layers read as it is (host layers, quantized layers, scale inputs) or in another precision gets a cast
    copy for each low precision's readers. Exported models share identical constants (a freshly initialized
    BERT's zero biases are one initializer, read by its LayerNorms and by its 8-bit GEMMs), and such a beta,
    left FP32, cost every replay one copy kernel per norm."""
    uses: dict[str, dict] = {}  # weight -> its readers' precision (None: read as stored) -> [(node, input position)]
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        for pos, name in enumerate(node.inputs):
            if name in graph.initializers:
                keep = node.placement == "host" or not entry.narrows(pos)
                uses.setdefault(name, {}).setdefault(None if keep else node.precision, []).append((node, pos))
    outputs = {v.name for v in graph.outputs}
    for name, readers in uses.items():
        w = graph.initializers[name]
        if w.dtype != torch.float32 or name in outputs:
            continue
        for p in [p for p in readers if p in _LOW]:
            if len(readers) == 1:  # every reader in this precision: cast in place
                graph.initializers[name] = saturating_cast(w, _LOW[p])
                continue
            copy = f"{name}.{p}"
            while copy in graph.initializers:  # a name the model already uses
                copy += "_"
            graph.initializers[copy] = saturating_cast(w, _LOW[p])
            for node, pos in readers[p]:
                node.inputs[pos] = copy


def saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in a float type, finite values beyond its range clamped to its largest finite values instead of
    becoming infinite. An exporter's "masked" constant, float32's lowest value, would otherwise turn into
    -inf in FP16, and a fully masked attention row into NaN where the FP32 model computes numbers."""
    big = torch.finfo(dtype).max
    return torch.where(torch.isfinite(t), t.clamp(-big, big), t).to(dtype)
