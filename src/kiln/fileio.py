"""Atomic file writes: a temporary file in the same folder, fsync, then a rename.

A crash or a full disk never leaves a half-written engine, report or output
file, and an existing file is only replaced by a complete one. The temporary is
named `.NAME.PID.RANDOM.tmp`: SIGTERM during a write removes it, and a later
write to the same path removes the ones a killed process (SIGKILL) left behind.
Every OSError becomes the caller's KilnError naming the path.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import ConfigError, KilnError

_UNNAMED_STALE_S = 3600  # a temporary without a process id (older Kiln) counts as stale after an hour


def _folder(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def check_destination(path, error: type[KilnError] = ConfigError, what: str = "") -> None:
    """Refuse, before any work, a destination that cannot be written: a folder, a missing or read-only
    folder, a path under a regular file. Probes by creating (and removing) a file beside it."""
    path = Path(path)
    label = f"{what}: " if what else ""
    folder = _folder(path)
    if path.is_dir():
        raise error(f"{label}cannot write '{path}': it is a directory; name a file in it, "
                    f"e.g. '{path / 'model.kiln'}'.")
    if not folder.exists():
        raise error(f"{label}cannot write '{path}': folder '{folder}' does not exist.")
    if not folder.is_dir():
        raise error(f"{label}cannot write '{path}': '{folder}' is not a folder.")
    if path.exists() and not path.is_file():
        raise error(f"{label}cannot write '{path}': it exists and is not a regular file.")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise error(f"{label}cannot write '{path}': folder '{folder}' is not writable "
                    f"({e.strerror or e}).") from None


def sweep_stale_temporaries(path) -> list[Path]:
    """Remove the `.NAME.*.tmp` files beside `path` that earlier writes by this user left behind (their
    process is gone). Returns what was removed."""
    path = Path(path)
    folder, removed = _folder(path), []
    try:
        candidates = list(folder.glob(f".{path.name}.*.tmp"))
    except OSError:
        return removed
    for tmp in candidates:
        try:
            st = tmp.lstat()
            if not tmp.is_file() or tmp.is_symlink() or st.st_uid != os.getuid():
                continue
            pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
            alive = _alive(int(pid)) if pid.isdigit() else time.time() - st.st_mtime < _UNNAMED_STALE_S
            if not alive:
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Terminated(BaseException):
    """SIGTERM arrived during a write: unwind (removing the temporary), then exit as SIGTERM asks."""


@contextmanager
def _sigterm_unwinds():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not settable here (an embedded interpreter)
        yield
        return
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def atomic_write(path, write: Callable[[BinaryIO], None], error: type[KilnError] = ConfigError) -> None:
    path = Path(path)
    folder = _folder(path)
    if not folder.is_dir():
        raise error(f"cannot write '{path}': folder '{folder}' does not exist.")
    if path.is_dir():
        raise error(f"cannot write '{path}': it is a directory.")
    sweep_stale_temporaries(path)
    with _sigterm_unwinds():
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=folder)
        except OSError as e:
            raise error(f"cannot write '{path}': {e.strerror or e} (folder '{folder}').") from None
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
            os.replace(tmp, path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise error(f"cannot write '{path}': {e.strerror or e}. Nothing was written; an existing file at "
                        "that path is unchanged.") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def atomic_write_bytes(path, data: bytes, error: type[KilnError] = ConfigError) -> None:
    atomic_write(path, lambda f: f.write(data), error)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path, text: str) -> None:
    """`text` as UTF-8, written as atomic_write_bytes writes."""
    atomic_write_bytes(path, text.encode("utf-8"))
