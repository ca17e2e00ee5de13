"""Kiln: an open, Python-first inference compiler."""

__version__ = "0.1.0"

from . import ops as _ops  # noqa: F401,E402  (fills the operator registry)
from .compile import CompiledModule, Input, compile  # noqa: E402,A004
from .engine.builder import build  # noqa: E402
from .engine.config import BuildConfig, Profile  # noqa: E402
from .engine.serialize import load  # noqa: E402
from .errors import KilnError  # noqa: E402
from .frontend import check_model, from_torch, load_onnx  # noqa: E402
from .frontend import dynamo as _dynamo  # noqa: E402

if not _dynamo.registered_by_entry_point():  # run from a source tree: no package metadata for torch to find
    _dynamo.register()

__all__ = [
    "BuildConfig", "CompiledModule", "Input", "KilnError", "Profile", "__version__", "build", "check_model",
    "compile", "from_torch", "load", "load_onnx",
]
