"""The graph as a file after each build pass (kiln build --dumpPasses DIR), to see what each pass did.

DIR/NN-pass.onnx opens in Netron or onnx: nodes, attributes (each node's precision and placement in its
doc_string), and the weights' names, types and shapes (a weight of more than SMALL_WEIGHT elements is declared
as a graph input instead of stored: the dumps of a large model stay small, and its values are in the engine). Where ONNX cannot hold the graph at that stage, DIR/NN-pass.txt
holds the IR's text form (ir/text.py) instead.
"""

from __future__ import annotations

from pathlib import Path

from onnx import helper

from ..errors import ConfigError
from ..fileio import atomic_write_bytes, atomic_write_text
from ..ir import dtypes
from ..ir.graph import Graph
from ..ir.text import graph_text
from ..ir.to_onnx import graph_to_model, torch_to_tensor

SMALL_WEIGHT = 64  # elements: shape arguments, scales and biases of small layers are stored


def _onnx(graph: Graph) -> bytes:
    model = graph_to_model(graph, with_initializers=False)
    for proto, n in zip(model.graph.node, graph.nodes):  # what the passes after the rewrites decide, per node
        proto.doc_string = f"precision {n.precision}, placement {n.placement}" + (f"; {n.note}" if n.note else "")
    for name, t in graph.initializers.items():
        if t.numel() <= SMALL_WEIGHT:
            model.graph.initializer.append(torch_to_tensor(t, name))
        else:
            model.graph.input.append(helper.make_tensor_value_info(name, dtypes.torch_to_onnx(t.dtype), list(t.shape)))
    return model.SerializeToString()


def dump_folder(folder) -> Path:
    """The --dumpPasses folder, created (with its parents) if missing."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--dumpPasses: '{folder}' is a file; give a folder to write the graph after each pass.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--dumpPasses: cannot create the folder '{folder}': {e.strerror or e}.") from None
    return folder


def dump_graph(graph: Graph, folder: Path, stem: str) -> Path:
    """Write the graph as folder/stem.onnx, or folder/stem.txt where ONNX cannot hold it; returns the path."""
    try:
        data = _onnx(graph)
    except (ValueError, TypeError, KeyError) as e:  # an attribute or type ONNX has no encoding for
        path = folder / f"{stem}.txt"
        atomic_write_text(path, f"# not writable as ONNX at this stage: {type(e).__name__}: {e}\n" + graph_text(graph))
        return path
    path = folder / f"{stem}.onnx"
    atomic_write_bytes(path, data)
    return path
