"""Kiln: an open, Python-first inference compiler."""

from . import dynamo as _dynamo
from . import ops as _ops  # noqa: F401  (fills the operator registry)
from .build import build
from .builder.config import BuildConfig
from .compile import CompiledModule, Input, compile  # noqa: A004
from .engine.profile import Profile
from .engine.serialize import load
from .errors import KilnError
from .frontend import check_model, from_torch, load_onnx
from .version import __version__

if not _dynamo.registered_by_entry_point():  # run from a source tree: no package metadata for torch to find
    _dynamo.register()

__all__ = [
    "BuildConfig", "CompiledModule", "Input", "KilnError", "Profile", "__version__", "build", "check_model",
    "compile", "from_torch", "load", "load_onnx",
]
