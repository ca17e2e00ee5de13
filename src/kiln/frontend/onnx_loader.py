"""Loading ONNX files (placeholder until the frontend lands: plain onnx.load)."""

from __future__ import annotations

import onnx


def load_onnx(path) -> onnx.ModelProto:
    return onnx.load(str(path))
