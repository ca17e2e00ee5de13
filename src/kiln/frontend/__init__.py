"""Model frontends: ONNX files and PyTorch modules."""

from .onnx_loader import load_onnx

__all__ = ["load_onnx"]
