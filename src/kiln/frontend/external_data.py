"""External tensor data: weights that live in files beside the .onnx file.

A model over 2 GB cannot be one protobuf, so its tensors name a file
(`location`), an `offset` and a `length` instead of holding their bytes. Those
fields are untrusted input: a location must be a relative path that stays
inside the model's folder. Absolute paths, '..' and symbolic links are refused
(onnx itself refuses symbolic and hard links too, so a model Kiln accepts
also passes onnx.checker). A missing file, or an offset/length past the file's end, is an
error naming the tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, TensorProto

from ..errors import ModelError


@dataclass(frozen=True)
class TensorSite:
    """One TensorProto of a model and a phrase naming it for error messages."""

    tensor: TensorProto
    where: str  # e.g. "initializer 'w'" or "tensor 'value' of node 'c0' (attribute 'value')"
    top_level_initializer: bool


def iter_tensors(model: onnx.ModelProto) -> Iterator[TensorSite]:
    """Every TensorProto in the model: initializers, attribute tensors, subgraphs, functions."""
    yield from _graph_tensors(model.graph, top=True)
    for f in model.functions:
        for node in f.node:
            yield from _node_tensors(node, f"function '{f.name}'")


def _graph_tensors(g: GraphProto, top: bool) -> Iterator[TensorSite]:
    for t in g.initializer:
        yield TensorSite(t, f"initializer '{t.name}'", top)
    for s in g.sparse_initializer:
        yield TensorSite(s.values, f"sparse initializer '{s.values.name}' (values)", top)
        yield TensorSite(s.indices, f"sparse initializer '{s.values.name}' (indices)", top)
    for i, node in enumerate(g.node):
        yield from _node_tensors(node, f"node '{node.name or f'{node.op_type}_{i}'}'")


def _node_tensors(node: onnx.NodeProto, label: str) -> Iterator[TensorSite]:
    for a in node.attribute:
        if a.type == AttributeProto.TENSOR:
            yield TensorSite(a.t, f"tensor '{a.t.name or a.name}' (attribute '{a.name}' of {label})", False)
        elif a.type == AttributeProto.TENSORS:
            for t in a.tensors:
                yield TensorSite(t, f"tensor '{t.name or a.name}' (attribute '{a.name}' of {label})", False)
        elif a.type == AttributeProto.SPARSE_TENSOR:
            yield TensorSite(a.sparse_tensor.values, f"sparse tensor (attribute '{a.name}' of {label})", False)
            yield TensorSite(a.sparse_tensor.indices, f"sparse tensor indices (attribute '{a.name}' of {label})", False)
        elif a.type == AttributeProto.GRAPH:
            yield from _graph_tensors(a.g, top=False)
        elif a.type == AttributeProto.GRAPHS:
            for g in a.graphs:
                yield from _graph_tensors(g, top=False)


def is_external(t: TensorProto) -> bool:
    return t.HasField("data_location") and t.data_location == TensorProto.EXTERNAL


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(is_external(s.tensor) for s in iter_tensors(model))


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's bytes are, after the location was checked."""

    where: str
    location: str
    path: Path  # resolved, inside the model's folder
    offset: int
    length: int  # bytes to read (the rest of the file when the model gives no length)


def _fields(site: TensorSite, model_label: str) -> dict[str, str]:
    out = {}
    for e in site.tensor.external_data:
        out[e.key] = e.value
    if not out.get("location"):
        raise ModelError(
            f"{site.where} in {model_label} is marked as external data but gives no 'location'; "
            "the model is malformed (re-save it with onnx.save_model(..., save_as_external_data=True))."
        )
    return out


def _int_field(fields: dict[str, str], key: str, site: TensorSite, model_label: str) -> int | None:
    if key not in fields:
        return None
    try:
        value = int(fields[key])
    except ValueError:
        value = -1
    if value < 0:
        raise ModelError(
            f"{site.where} in {model_label} has external data {key} '{fields[key]}', "
            "which is not a non-negative integer."
        )
    return value


def resolve(site: TensorSite, base_dir: Path, model_label: str) -> ExternalRef:
    """Check a tensor's external location and bounds without reading it."""
    fields = _fields(site, model_label)
    location = fields["location"]
    refuse = (
        f"{site.where} in {model_label} keeps its data at '{location}', which Kiln refuses to read: "
    )
    if "\x00" in location:
        raise ModelError(refuse + "the path contains a NUL byte.")
    if (PurePosixPath(location).is_absolute() or PureWindowsPath(location).is_absolute()
            or PureWindowsPath(location).drive):
        raise ModelError(
            refuse + "external data must be a relative path inside the model's folder, not an absolute path. "
            "Move the data file next to the model and re-save it with a relative location."
        )
    parts = location.replace("\\", "/").split("/")
    if ".." in parts:
        raise ModelError(
            refuse + "the path uses '..' to leave the model's folder. External data must stay inside "
            f"the folder of the model ('{base_dir}')."
        )
    base_real = Path(os.path.realpath(base_dir))
    path = base_dir
    for part in (p for p in parts if p not in ("", ".")):
        path = path / part
        if path.is_symlink():
            target = os.path.realpath(path)
            inside = os.path.commonpath([target, base_real]) == str(base_real)
            why = (
                f"'{path}' is a symbolic link to '{target}', outside the model's folder"
                if not inside
                else f"'{path}' is a symbolic link (to '{target}'); like onnx, Kiln does not follow links "
                "for external data, since a link can point anywhere"
            )
            raise ModelError(refuse + why + ". Copy the file into the model's folder if you trust it.")
    if not path.exists():
        raise ModelError(
            f"{site.where} in {model_label} keeps its data in '{location}', but '{path}' does not exist. "
            "Copy the external data file(s) next to the model."
        )
    if not path.is_file():
        raise ModelError(f"{site.where} in {model_label} keeps its data in '{path}', which is not a regular file.")
    st = path.stat()
    if st.st_nlink > 1:
        raise ModelError(
            refuse + f"'{path}' has {st.st_nlink} hard links, so it may be a file from elsewhere; like onnx, "
            "Kiln refuses hard-linked external data. Copy the file (cp, not ln) into the model's folder."
        )
    size = st.st_size
    offset = _int_field(fields, "offset", site, model_label) or 0
    length = _int_field(fields, "length", site, model_label)
    if offset > size:
        raise ModelError(
            f"{site.where} in {model_label} starts at offset {offset} of '{path}', but that file holds only "
            f"{size} bytes; the data file is truncated or belongs to another model."
        )
    if length is None:
        length = size - offset
    elif offset + length > size:
        raise ModelError(
            f"{site.where} in {model_label} needs bytes {offset}..{offset + length} of '{path}', but that file "
            f"holds only {size} bytes; the data file is truncated or belongs to another model."
        )
    _check_size(site, length, path, model_label)
    return ExternalRef(where=site.where, location=location, path=path, offset=offset, length=length)


# Sub-byte types are packed: bits per element (onnx stores them densely in raw_data).
_PACKED_BITS = {
    getattr(TensorProto, name): bits
    for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
    if hasattr(TensorProto, name)
}


def _expected_bytes(t: TensorProto) -> int | None:
    n = math.prod(t.dims)
    if t.data_type in _PACKED_BITS:
        return (n * _PACKED_BITS[t.data_type] + 7) // 8
    if t.data_type in (TensorProto.UNDEFINED, TensorProto.STRING) or "FLOAT6" in TensorProto.DataType.Name(t.data_type):
        return None  # variable-size or packing Kiln does not model: left to the decoder
    try:
        return n * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:  # a type numpy cannot describe: leave the check to the decoder
        return None


def _check_size(site: TensorSite, length: int, path: Path, model_label: str) -> None:
    want = _expected_bytes(site.tensor)
    if want is not None and want != length:
        dtype = onnx.TensorProto.DataType.Name(site.tensor.data_type).lower()
        raise ModelError(
            f"{site.where} in {model_label} has shape {list(site.tensor.dims)} of {dtype} ({want} bytes), "
            f"but its external data in '{path}' is {length} bytes long."
        )


def read(ref: ExternalRef) -> bytes:
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.length)
    if len(data) != ref.length:  # the file shrank between the check and the read
        raise ModelError(f"{ref.where}: could read only {len(data)} of {ref.length} bytes from '{ref.path}'.")
    return data


def validate(model: onnx.ModelProto, base_dir: Path | None, model_label: str) -> list[ExternalRef]:
    """Check every external reference (location, link, existence, bounds) without reading data."""
    refs = []
    for site in iter_tensors(model):
        if is_external(site.tensor):
            if base_dir is None:
                raise _no_base_dir(site, model_label)
            refs.append(resolve(site, base_dir, model_label))
    return refs


def load(model: onnx.ModelProto, base_dir: Path | None, model_label: str, *,
         skip_top_level_initializers: bool = False) -> int:
    """Read external data into the tensors (in place); returns the number of tensors loaded."""
    count = 0
    for site in iter_tensors(model):
        if not is_external(site.tensor) or (skip_top_level_initializers and site.top_level_initializer):
            continue
        if base_dir is None:
            raise _no_base_dir(site, model_label)
        ref = resolve(site, base_dir, model_label)
        site.tensor.raw_data = read(ref)
        site.tensor.data_location = TensorProto.DEFAULT
        del site.tensor.external_data[:]
        count += 1
    return count


def _no_base_dir(site: TensorSite, model_label: str) -> ModelError:
    location = next((e.value for e in site.tensor.external_data if e.key == "location"), "?")
    return ModelError(
        f"{site.where} in {model_label} keeps its data in the external file '{location}', but the model was "
        "given in memory, so Kiln does not know which folder holds that file. Pass the model's path "
        "instead (or base_dir=the model's folder)."
    )
