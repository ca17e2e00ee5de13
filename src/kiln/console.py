"""What the commands print: a rich console (wide enough for layer tables in files and pipes), byte counts,
and the note that says which device a measurement comes from."""

from __future__ import annotations

import os


def console(stderr: bool = False):
    from rich.console import Console

    con = Console(stderr=stderr, highlight=False, soft_wrap=True, markup=False, emoji=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con.width = 200  # files and pipes: room for the layer tables
    return con


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def device_note(target) -> str:
    """Says which device a measurement comes from (a CPU figure is not a GPU figure)."""
    if target.kind == "cuda":
        return f"measured on {target.describe()}"
    return (f"measured on {target.describe()}: a CPU figure from the reference kernels, "
            "not a latency on the target GPU")
