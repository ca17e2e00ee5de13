"""ONNX <-> torch <-> numpy element types.

ONNX types torch has no dtype for (INT4, UINT4, INT2, UINT2, FLOAT4E2M1 and the
FLOAT6 types) are held unpacked, one element per byte, in a *carrier* dtype
that represents every value of the type exactly: int4/int2 in int8, uint4/uint2
in uint8, the small floats in float8_e4m3fn. Any op that reads such a tensor
sees exact values; an op that *produces* one needs the ONNX type itself, which
it reads from an attribute (Cast's `to`, QuantizeLinear's `output_dtype`);
`pin_narrow_types` writes those attributes where ONNX leaves the type implicit.
"""

import numpy as np
import onnx
import torch

TP = onnx.TensorProto

_ONNX_TO_TORCH = {
    TP.FLOAT: torch.float32,
    TP.DOUBLE: torch.float64,
    TP.FLOAT16: torch.float16,
    TP.BFLOAT16: torch.bfloat16,
    TP.INT8: torch.int8,
    TP.INT16: torch.int16,
    TP.INT32: torch.int32,
    TP.INT64: torch.int64,
    TP.UINT8: torch.uint8,
    TP.UINT16: torch.uint16,
    TP.UINT32: torch.uint32,
    TP.UINT64: torch.uint64,
    TP.BOOL: torch.bool,
    TP.FLOAT8E4M3FN: torch.float8_e4m3fn,
    TP.FLOAT8E5M2: torch.float8_e5m2,
    TP.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TP.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    TP.FLOAT8E8M0: torch.float8_e8m0fnu,
}
_TORCH_TO_ONNX = {v: k for k, v in _ONNX_TO_TORCH.items()}

# Narrow ONNX types -> the standard dtype that carries their values (see module doc).
NARROW = {
    TP.INT4: torch.int8,
    TP.UINT4: torch.uint8,
    TP.INT2: torch.int8,
    TP.UINT2: torch.uint8,
    TP.FLOAT4E2M1: torch.float8_e4m3fn,
    TP.FLOAT6E2M3: torch.float8_e4m3fn,
    TP.FLOAT6E3M2: torch.float8_e4m3fn,
}

FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FLOAT8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                torch.float8_e8m0fnu)

# Short names used in manifests, CLI output and inspector JSON.
_NAMES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
    torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.bool: "bool", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz", torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}
_BY_NAME = {v: k for k, v in _NAMES.items()}


def onnx_to_torch(elem_type: int) -> torch.dtype:
    """The torch dtype holding ONNX `elem_type` (its carrier, for a narrow type)."""
    try:
        return _ONNX_TO_TORCH[elem_type]
    except KeyError:
        pass
    try:
        return NARROW[elem_type]
    except KeyError:
        raise KeyError(onnx.TensorProto.DataType.Name(elem_type)) from None


def torch_to_onnx(dtype: torch.dtype) -> int:
    return _TORCH_TO_ONNX[dtype]


def name_of(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def from_name(name: str) -> torch.dtype:
    return _BY_NAME[name]


def onnx_type_name(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type)


def to_torch(array) -> torch.Tensor:
    """numpy array (any ONNX-representable dtype, ml_dtypes included) -> torch tensor, copying."""
    a = np.asarray(array)
    if a.dtype == np.uint16 or a.dtype == np.uint32 or a.dtype == np.uint64:
        return torch.from_numpy(a.astype(np.int64)).to(getattr(torch, a.dtype.name))
    if a.dtype.kind in "OUS":
        raise TypeError(f"string tensors are not supported (dtype {a.dtype})")
    if a.dtype.type.__module__ == "ml_dtypes":  # onnx.numpy_helper's bfloat16, float8, int4...
        return _from_ml_dtypes(np.array(a, order="C"))  # ascontiguousarray would make 0-d arrays 1-d
    return torch.from_numpy(np.array(a, copy=True, order="C"))  # ascontiguousarray would make 0-d arrays 1-d


def _from_ml_dtypes(a: np.ndarray) -> torch.Tensor:
    name = a.dtype.name
    if name == "bfloat16":  # same bit layout in torch: reinterpret the bytes
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if _BY_NAME.get(name) in FLOAT8_TYPES:
        return torch.from_numpy(a.view(np.uint8).copy()).view(_BY_NAME[name])
    if name in ("int4", "int2"):
        return torch.from_numpy(a.astype(np.int8))
    if name in ("uint4", "uint2"):
        return torch.from_numpy(a.astype(np.uint8))
    if name in ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"):
        return torch.from_numpy(a.astype(np.float32)).to(torch.float8_e4m3fn)  # exact
    raise TypeError(f"unsupported element type {a.dtype}")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch tensor -> numpy array. bfloat16 and float8 tensors come back as float32
    (numpy has no such types; the values are exact)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16 or t.dtype in FLOAT8_TYPES:
        return t.float().numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).numpy().astype(name_of(t.dtype))
    return t.numpy()


def _declared_types(g: onnx.GraphProto, types: dict[str, int]) -> None:
    """Element types that `g` (and its subgraphs) states for its values."""
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in g.initializer:
        types[t.name] = t.data_type
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Constant" and a.name == "value" and n.output:
                types[n.output[0]] = a.t.data_type
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                _declared_types(sub, types)


def _nodes(g: onnx.GraphProto):
    for n in g.node:
        yield n
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                yield from _nodes(sub)


def _mentions_narrow(model: onnx.ModelProto, types: dict[str, int]) -> bool:
    if any(t in NARROW for t in types.values()):
        return True
    casts = (n for n in _nodes(model.graph) if n.op_type == "Cast")
    return any(a.name == "to" and a.i in NARROW for n in casts for a in n.attribute)


def _type_source(n: onnx.NodeProto) -> str | None:
    """The input whose element type sets this node's output type, for the two ops
    where that type can be narrow: QuantizeLinear's zero point, CastLike's `like`."""
    if n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2]:
        return None if any(a.name == "output_dtype" and a.i for a in n.attribute) else n.input[2]
    if n.op_type == "CastLike" and len(n.input) > 1:
        return n.input[1]
    return None


def pin_narrow_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make explicit the narrow output types ONNX derives from an input's type.

    A narrow tensor reaches an op as its carrier (an INT4 zero point arrives as
    int8), so two ops would lose the type: QuantizeLinear, whose output type is its
    zero point's (it gets `output_dtype`), and CastLike, whose target is its second
    input's (it becomes the equivalent Cast). Returns `model` itself when nothing
    needs pinning, else a rewritten copy.
    """
    types: dict[str, int] = {}
    _declared_types(model.graph, types)
    if not _mentions_narrow(model, types):
        return model
    nodes = list(_nodes(model.graph))
    sources = [_type_source(n) for n in nodes]
    if any(src and src not in types for src in sources):
        try:  # intermediate values' types (e.g. a zero point computed by a Cast)
            _declared_types(onnx.shape_inference.infer_shapes(model).graph, types)
        except Exception:  # inference is a best effort; declared types still apply
            pass
    pins = [(i, types[src]) for i, src in enumerate(sources) if src and types.get(src) in NARROW]
    if not pins:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    copied = list(_nodes(out.graph))
    for i, elem_type in pins:
        n = copied[i]
        if n.op_type == "QuantizeLinear":
            kept = [a for a in n.attribute if a.name != "output_dtype"]
            del n.attribute[:]
            n.attribute.extend(kept)
            n.attribute.append(onnx.helper.make_attribute("output_dtype", elem_type))
        else:
            n.op_type = "Cast"
            del n.input[1:]
            n.attribute.append(onnx.helper.make_attribute("to", elem_type))
    return out
