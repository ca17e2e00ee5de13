"""kiln Graph -> ONNX, so a (fused) graph stays a file anyone can open."""

from __future__ import annotations

import onnx
import torch
from onnx import helper, numpy_helper

from . import dtypes
from .graph import Graph, Node, Value

KILN_DOMAIN = "kiln"


def torch_to_tensor(t: torch.Tensor, name: str = "") -> onnx.TensorProto:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        proto = numpy_helper.from_array(t.view(torch.int16).numpy().view("uint16"), name)
        proto.data_type = onnx.TensorProto.BFLOAT16
        return proto
    if t.dtype in dtypes.FLOAT8_TYPES:
        proto = onnx.TensorProto(name=name, dims=list(t.shape), data_type=dtypes.torch_to_onnx(t.dtype))
        proto.raw_data = t.view(torch.uint8).numpy().tobytes()
        return proto
    return numpy_helper.from_array(dtypes.to_numpy(t), name)


def _attr(key: str, v):
    if isinstance(v, Graph):
        return helper.make_attribute(key, graph_to_onnx(v))
    if isinstance(v, torch.Tensor):
        return helper.make_attribute(key, torch_to_tensor(v))
    if isinstance(v, list) and v and isinstance(v[0], Graph):
        return helper.make_attribute(key, [graph_to_onnx(g) for g in v])
    if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
        return helper.make_attribute(key, [torch_to_tensor(t) for t in v])
    return helper.make_attribute(key, v)


def _value(v: Value) -> onnx.ValueInfoProto:
    elem = dtypes.torch_to_onnx(v.dtype) if v.dtype is not None else onnx.TensorProto.UNDEFINED
    shape = list(v.shape) if v.shape is not None else None
    if not (v.sequence or v.optional):
        return helper.make_tensor_value_info(v.name, elem, shape)
    t = helper.make_tensor_type_proto(elem, shape)
    t = helper.make_sequence_type_proto(t) if v.sequence else t
    return helper.make_value_info(v.name, helper.make_optional_type_proto(t) if v.optional else t)


def _make_node(n: Node) -> onnx.NodeProto:
    proto = onnx.NodeProto(op_type=n.op_type, name=n.name, domain=n.domain)
    proto.input.extend(n.inputs)
    proto.output.extend(n.outputs)
    for k, v in sorted(n.attrs.items()):
        if isinstance(v, list) and not v:
            continue  # an empty list has no ONNX attribute type; absent means the same
        proto.attribute.append(_attr(k, v))
    return proto


def graph_to_onnx(g: Graph, with_initializers: bool = True) -> onnx.GraphProto:
    inits = [torch_to_tensor(t, k) for k, t in g.initializers.items()] if with_initializers else []
    return helper.make_graph(
        [_make_node(n) for n in g.nodes], g.name,
        [_value(v) for v in g.inputs], [_value(v) for v in g.outputs], inits,
    )


def graph_to_model(g: Graph, with_initializers: bool = True) -> onnx.ModelProto:
    opsets = [helper.make_opsetid(d, v) for d, v in g.opsets.items()]
    if KILN_DOMAIN not in g.opsets:
        opsets.append(helper.make_opsetid(KILN_DOMAIN, 1))
    model = helper.make_model(graph_to_onnx(g, with_initializers), opset_imports=opsets, producer_name="kiln")
    return model
