"""The user's own code that a tool calls: a function named 'package.module:function' or 'path/to/file.py:function'
(a model factory, a metric), imported and checked before use."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ConfigError, KilnError


def load_callable(spec: str, what: str) -> Callable:
    """'package.module:function' or 'path/to/file.py:function'."""
    if ":" not in spec:
        raise ConfigError(f"{what}: '{spec}' should be MODULE:FUNCTION (e.g. mypkg.models:make_model).")
    mod_name, fn_name = spec.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):
            file = Path(mod_name)
            if not file.is_file():
                raise ConfigError(f"{what}: file '{mod_name}' does not exist.")
            name = f"_kiln_user_{file.stem}"
            s = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(s)
            sys.modules[name] = module
            s.loader.exec_module(module)
        else:  # from sys.path as it is: the current directory is not added (code there is not run unasked)
            module = importlib.import_module(mod_name)
    except KilnError:
        raise
    except ImportError as e:
        here = Path(mod_name.split(".")[0] + ".py")
        in_cwd = here.is_file() or Path(here.stem).is_dir()
        hint = (f" '{here}' is in the current directory, which Kiln does not add to the import path: give the file "
                f"itself ({Path('.') / here}:{fn_name}) or set PYTHONPATH." if in_cwd else "")
        raise ConfigError(f"{what}: cannot import module '{mod_name}' ({e}).{hint}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while being imported
        raise ConfigError(f"{what}: importing '{mod_name}' failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{what}: module '{mod_name}' has no callable '{fn_name}'.")
    return fn


def load_torch_module(spec: str, what: str = "--torch") -> torch.nn.Module:
    factory = load_callable(spec, what)
    try:
        module = factory() if not isinstance(factory, torch.nn.Module) else factory
    except Exception as e:  # noqa: BLE001 - the user's factory raised
        raise ConfigError(f"{what}: calling '{spec}' raised {type(e).__name__}: {e}") from None
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"{what}: '{spec}' returned a {type(module).__name__}, not a torch.nn.Module.")
    return module.eval()
