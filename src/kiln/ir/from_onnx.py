"""ONNX ModelProto -> kiln Graph."""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from ..errors import ModelError, UnsupportedError
from . import dtypes
from .graph import Graph, Node, Value


def tensor_to_torch(t: onnx.TensorProto, where: str):
    if t.data_type == onnx.TensorProto.STRING:
        raise UnsupportedError(f"{where} is a string tensor; Kiln supports numeric tensors only.")
    if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data:
        raise ModelError(
            f"{where} keeps its data in an external file that was not loaded; load the model "
            "with its external data (kiln.frontend.load_onnx does this)."
        )
    try:
        array = numpy_helper.to_array(t)
    except Exception as e:  # malformed raw_data length, unknown type...
        raise ModelError(f"{where} cannot be decoded: {e}") from None
    if t.data_type in (onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2):
        import torch

        bits = dtypes.to_torch(array.view("uint8"))
        return bits.view(dtypes.onnx_to_torch(t.data_type))
    if t.data_type == onnx.TensorProto.BFLOAT16:
        import torch

        return dtypes.to_torch(array.astype("float32")).to(torch.bfloat16)
    try:
        return dtypes.to_torch(array)
    except TypeError as e:
        raise UnsupportedError(f"{where}: {e}") from None


def _nodes_using(name: str, g: onnx.GraphProto) -> str:
    """' (used by node 'a' (Equal), ...)' for the error messages of a graph value, or ''."""
    users = [f"'{n.name or f'{n.op_type}_{i}'}' ({n.op_type})" for i, n in enumerate(g.node)
             if name in n.input or name in n.output]
    return f" (used by node {', '.join(users)})" if users else ""


def _type_name(t: onnx.TypeProto) -> str:
    """ONNX's notation for a value type: tensor(float), sequence(tensor(float)), optional(...)."""
    kind = t.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(t, kind).elem_type
        name = onnx.TensorProto.DataType.Name(elem).lower() if elem else "?"
        return f"{kind.removesuffix('_type')}({name})"
    if kind in ("sequence_type", "optional_type"):
        return f"{kind.removesuffix('_type')}({_type_name(getattr(t, kind).elem_type)})"
    if kind == "map_type":
        key = onnx.TensorProto.DataType.Name(t.map_type.key_type).lower()
        return f"map({key}, {_type_name(t.map_type.value_type)})"
    return "unknown"


def _value(vi: onnx.ValueInfoProto, g: onnx.GraphProto) -> Value:
    t = vi.type
    optional = t.WhichOneof("value") == "optional_type"
    if optional:  # an optional tensor or sequence (ops/optional.py): typed by what it holds
        t = t.optional_type.elem_type
    tt = t.tensor_type
    kind = t.WhichOneof("value")
    sequence = kind == "sequence_type" and t.sequence_type.elem_type.WhichOneof("value") == "tensor_type"
    if sequence:  # a sequence of tensors (ops/sequence.py): typed by its elements
        tt, kind = t.sequence_type.elem_type.tensor_type, "tensor_type"
    if kind not in (None, "tensor_type"):  # map, sparse tensor, a sequence or optional of those
        raise UnsupportedError(
            f"graph value '{vi.name}'{_nodes_using(vi.name, g)} has type {_type_name(vi.type)}; "
            "Kiln builds dense tensors, sequences of them and optionals of either only.")
    if kind is None:
        return Value(vi.name, None, None)
    try:
        dtype = dtypes.onnx_to_torch(tt.elem_type) if tt.elem_type else None
    except KeyError as e:
        why = " (Kiln, like TensorRT, has numeric tensors only)" if tt.elem_type == onnx.TensorProto.STRING else ""
        raise UnsupportedError(f"graph value '{vi.name}'{_nodes_using(vi.name, g)} has element type {e}, "
                               f"which Kiln does not support{why}.") from None
    shape = None
    if tt.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
    return Value(vi.name, dtype, shape, sequence=sequence, optional=optional)


def _attr(a: onnx.AttributeProto, node_label: str, opsets: dict[str, int]):
    A = onnx.AttributeProto
    if a.type == A.FLOAT:
        return a.f
    if a.type == A.INT:
        return a.i
    if a.type == A.STRING:
        return a.s.decode("utf-8", errors="replace")
    if a.type == A.TENSOR:
        return tensor_to_torch(a.t, f"attribute '{a.name}' of node '{node_label}'")
    if a.type == A.GRAPH:
        return graph_from_onnx(a.g, opsets)
    if a.type == A.FLOATS:
        return list(a.floats)
    if a.type == A.INTS:
        return list(a.ints)
    if a.type == A.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in a.strings]
    if a.type == A.TENSORS:
        return [tensor_to_torch(t, f"attribute '{a.name}' of node '{node_label}'") for t in a.tensors]
    if a.type == A.GRAPHS:
        return [graph_from_onnx(g, opsets) for g in a.graphs]
    if a.type == A.TYPE_PROTO:  # Optional's 'type': kept as ONNX's TypeProto, written back as it is
        return a.tp
    raise UnsupportedError(
        f"attribute '{a.name}' of node '{node_label}' has type {A.AttributeType.Name(a.type)}, "
        "which Kiln does not support."
    )


def graph_from_onnx(g: onnx.GraphProto, opsets: dict[str, int]) -> Graph:
    inits = {}
    for t in g.initializer:
        inits[t.name] = tensor_to_torch(t, f"initializer '{t.name}'")
    if len(g.sparse_initializer):
        raise UnsupportedError(f"graph '{g.name}' has sparse initializers, which Kiln does not support.")
    nodes = []
    for i, n in enumerate(g.node):
        label = n.name or f"{n.op_type}_{i}"
        node = Node(
            op_type=n.op_type,
            inputs=list(n.input),
            outputs=list(n.output),
            attrs={a.name: _attr(a, label, opsets) for a in n.attribute},
            name=n.name or label,
            domain=n.domain if n.domain != "ai.onnx" else "",
        )
        node.opset = opsets.get(node.domain, opsets.get("", 17))
        nodes.append(node)
    # Old exporters list initializers among the inputs; they are weights, not bindings.
    inputs = [_value(v, g) for v in g.input if v.name not in inits]
    outputs = [_value(v, g) for v in g.output]
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, initializers=inits, name=g.name or "graph", opsets=opsets)


def model_to_graph(model: onnx.ModelProto) -> Graph:
    model = dtypes.pin_narrow_types(model)  # int4/float4 values live in wider torch types: keep the ONNX type
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    opsets.setdefault("", 1)
    graph = graph_from_onnx(model.graph, opsets)
    optional = [v.name for v in graph.inputs if v.optional]
    if optional:  # an engine's bindings are tensors, as TensorRT's are; optionals live inside the graph
        raise UnsupportedError(
            f"model input(s) {optional} are optional values; an engine binds tensors only. Say which are given "
            "(kiln.frontend.bind_optional_inputs rewrites the model so).")
    bound = [v.name for v in graph.inputs if v.sequence]
    if bound:  # sequences too live inside the graph
        raise UnsupportedError(
            f"model input(s) {bound} are sequences of tensors; an engine binds tensors only. Give each element "
            "its own tensor input (kiln.frontend.bind_sequence_inputs rewrites the model so).")
    return graph
