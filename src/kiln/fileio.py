"""Atomic file writes: a temporary file in the same folder, fsync, then a rename.

A crash or a full disk never leaves a half-written engine, report or output
file, and an existing file is only replaced by a complete one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import ConfigError, KilnError


def atomic_write(path, write: Callable[[BinaryIO], None], error: type[KilnError] = ConfigError) -> None:
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise error(f"cannot write '{path}': folder '{folder}' does not exist.")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path, data: bytes, error: type[KilnError] = ConfigError) -> None:
    atomic_write(path, lambda f: f.write(data), error)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
