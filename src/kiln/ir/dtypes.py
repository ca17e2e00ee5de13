"""ONNX <-> torch <-> numpy element types."""

import numpy as np
import onnx
import torch

_ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.UINT16: torch.uint16,
    onnx.TensorProto.UINT32: torch.uint32,
    onnx.TensorProto.UINT64: torch.uint64,
    onnx.TensorProto.BOOL: torch.bool,
    onnx.TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    onnx.TensorProto.FLOAT8E5M2: torch.float8_e5m2,
}
_TORCH_TO_ONNX = {v: k for k, v in _ONNX_TO_TORCH.items()}

FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Short names used in manifests, CLI output and inspector JSON.
_NAMES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
    torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.bool: "bool", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
}
_BY_NAME = {v: k for k, v in _NAMES.items()}


def onnx_to_torch(elem_type: int) -> torch.dtype:
    try:
        return _ONNX_TO_TORCH[elem_type]
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
    """numpy array (any ONNX-representable dtype) -> torch tensor, copying."""
    a = np.asarray(array)
    if a.dtype == np.uint16 or a.dtype == np.uint32 or a.dtype == np.uint64:
        return torch.from_numpy(a.astype(np.int64)).to(getattr(torch, a.dtype.name))
    if a.dtype.kind in "OUS":
        raise TypeError(f"string tensors are not supported (dtype {a.dtype})")
    return torch.from_numpy(np.array(a, copy=True, order="C"))  # ascontiguousarray would make 0-d arrays 1-d


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).numpy().astype(name_of(t.dtype))
    return t.numpy()
