"""Kiln: an open, Python-first inference compiler."""

__version__ = "0.1.0"

from . import ops as _ops  # noqa: F401,E402  (fills the operator registry)
from .engine.builder import build  # noqa: E402
from .engine.config import BuildConfig, Profile  # noqa: E402
from .engine.serialize import load  # noqa: E402
from .errors import KilnError  # noqa: E402
from .compile import CompiledModule, Input, compile  # noqa: E402,A004
from .frontend import load_onnx  # noqa: E402


def from_torch(*args, **kwargs):
    """Export a PyTorch module to ONNX (torch.onnx.export, dynamo); see kiln.frontend.torch_export."""
    from .frontend.torch_export import from_torch as _from_torch

    return _from_torch(*args, **kwargs)

__all__ = [
    "BuildConfig", "CompiledModule", "Input", "KilnError", "Profile", "__version__", "build", "compile",
    "from_torch", "load", "load_onnx",
]
