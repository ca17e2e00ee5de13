"""User-facing errors.

Every error a user can cause (a bad file, an unsupported op, a shape outside a
profile) is a KilnError: the CLI prints its one-paragraph message and exits
non-zero, with no traceback. Anything else is a bug in Kiln.
"""


def summary(error: BaseException, limit: int = 200) -> str:
    """One line for a finding or a warning about an exception Kiln caught and recovered from: its type and the
    first line of its message (an AssertionError may carry none)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__


class KilnError(Exception):
    """An error caused by the user's input; the message says what and where."""

    exit_code = 2


class ModelError(KilnError):
    """The model file or graph is malformed (bad protobuf, missing tensor...)."""


class UnsupportedError(KilnError):
    """The model uses an operator or attribute Kiln cannot build."""


class ShapeError(KilnError):
    """An input shape is wrong for the engine or outside its profile."""


class InputError(KilnError):
    """A runtime input has the wrong name, dtype or rank."""


class EngineFileError(KilnError):
    """An engine file is truncated, corrupted, foreign or built for another target."""


class ConfigError(KilnError):
    """A build or run option is malformed."""
