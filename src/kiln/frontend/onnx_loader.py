"""Loading ONNX models: a path, serialized bytes or an in-memory ModelProto.

Every failure a user can cause (missing file, a file that is not ONNX, a
truncated protobuf, a model with no graph, bad external data) is a ModelError
whose message names the file, and the tensor where one is at fault.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from ..errors import ModelError
from . import external_data

PROTOBUF_LIMIT = 2**31 - 1  # bytes: one serialized protobuf message can be no larger


@dataclass
class LoadedModel:
    """A parsed model and where it came from (checks need the path of a model with external data)."""

    model: onnx.ModelProto
    name: str  # how messages refer to the model: its path, or "<bytes>" / "<in-memory model>"
    path: Path | None = None  # the .onnx file, when loaded from one
    base_dir: Path | None = None  # the folder external data is relative to
    external: list[external_data.ExternalRef] = field(default_factory=list)  # validated, not yet read

    @property
    def has_external_data(self) -> bool:
        return bool(self.external)

    @property
    def label(self) -> str:
        """The model as error messages name it: the quoted path, or a phrase."""
        return f"'{self.name}'" if self.path is not None else self.name


def load_onnx(source, *, base_dir: str | os.PathLike | None = None, load_external_data: bool = True) -> onnx.ModelProto:
    """Load an ONNX model with its external data.

    `source`: a path to an .onnx file, the model's serialized bytes, or an
    onnx.ModelProto (its external data, if any, is loaded into it in place).
    External data is read relative to the model's folder, or `base_dir` for
    bytes and in-memory models. With load_external_data=False, external
    references are still validated (location, bounds) but not read.
    """
    return read_model(source, base_dir=base_dir, load_external_data=load_external_data).model


def read_model(source, *, base_dir: str | os.PathLike | None = None, load_external_data: bool = True) -> LoadedModel:
    if isinstance(source, onnx.ModelProto):
        model, name, path = source, "the in-memory model", None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        name, path = "the model bytes", None
        model = _parse(bytes(source), name)
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        name = str(path)
        model = _parse(_read_file(path), f"'{path}'")
        if base_dir is None:
            base_dir = path.parent
    else:
        raise ModelError(
            f"cannot load a model from a {type(source).__name__}; give a path to an .onnx file, "
            "the model's bytes, or an onnx.ModelProto."
        )
    label = f"'{name}'" if path is not None else name
    if not model.HasField("graph"):
        raise ModelError(
            f"{label} has no graph: it parsed as a protobuf message but it is not an ONNX model "
            "(or the file is truncated)."
        )
    mark_dynamic_dims(model)
    base = Path(base_dir) if base_dir is not None else None
    loaded = LoadedModel(model=model, name=name, path=path, base_dir=base)
    loaded.external = external_data.validate(model, base, label)
    if load_external_data and loaded.external:
        external_data.load(model, base, label)
    return loaded


def mark_dynamic_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """Input and output dimensions written as -1 or 0 become unnamed dynamic axes, in place: exporters
    (Paddle's among them) write "dynamic" that way, where ONNX proper leaves dim_value unset or names the
    axis. Returns the model."""
    g = model.graph
    for vi in [*g.input, *g.output]:
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.ClearField("dim_value")
    return model


def _read_file(path: Path) -> bytes:
    if not path.exists():
        hint = ""
        if path.parent.is_dir():
            near = sorted(p.name for p in path.parent.glob("*.onnx"))[:5]
            if near:
                hint = f" ONNX files in '{path.parent}': {', '.join(near)}."
        raise ModelError(f"model file '{path}' does not exist.{hint}")
    if path.is_dir():
        raise ModelError(f"'{path}' is a folder, not an ONNX model file.")
    try:
        size = path.stat().st_size
        if size > PROTOBUF_LIMIT:
            raise ModelError(
                f"'{path}' is {size / 2**30:.1f} GB, over protobuf's 2 GB limit for one message, so it cannot be "
                "an ONNX model file; models this large keep their weights in external data files "
                "(onnx.save_model(..., save_as_external_data=True))."
            )
        return path.read_bytes()
    except OSError as e:
        raise ModelError(f"cannot read model file '{path}': {e.strerror or e}.") from None


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    if not data:
        raise ModelError(f"{where} is empty: it is not a valid ONNX model.")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelError(
            f"{where} is not a valid ONNX model: it could not be parsed as an ONNX protobuf ({e}). "
            "The file may be truncated, corrupted, or not an ONNX file at all."
        ) from None
    return model
