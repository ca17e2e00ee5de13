"""Export a calibrated model as Q/DQ ONNX that onnxruntime (and TensorRT) accept.

The model goes through Kiln's pass list (passes/__init__.py) up to Q/DQ insertion
(constant folding, BatchNorm folding, insert_qdq, ...), so the exported file is the
quantized graph Kiln's INT8 engine is built from: comparing onnxruntime on it with the
engine checks Kiln's INT8 kernels, and the file can be shipped to other runtimes.
The passes that write Kiln's own operators are left out: a stride-2 RGB stem stays a
float convolution here, where the engine runs it in 8 bits over stem patches
(passes/stem_patches.py), a Kiln op that onnxruntime does not have.
"""

from __future__ import annotations

import onnx

from .. import passes
from ..fileio import atomic_write_bytes
from ..ir.from_onnx import model_to_graph
from ..ir.to_onnx import graph_to_model
from ..passes import dead_code, insert_qdq


def quantized_graph(model: onnx.ModelProto, amax: dict[str, float]):
    graph = model_to_graph(model)
    graph.quant_amax = dict(amax)
    for p in passes.up_to(insert_qdq, standard_onnx=True):
        p.run(graph)
    dead_code.run(graph)  # the float weights insert_qdq replaced
    return graph


def export_qdq(model: onnx.ModelProto, amax: dict[str, float], path=None) -> onnx.ModelProto:
    graph = quantized_graph(model, amax)
    graph.opsets[""] = max(13, graph.opsets.get("", 13))  # per-axis DequantizeLinear
    out = graph_to_model(graph)
    out.ir_version = min(out.ir_version, 9)  # readable by onnxruntime releases of the last two years
    onnx.checker.check_model(out)
    if path is not None:
        atomic_write_bytes(path, out.SerializeToString())
    return out
