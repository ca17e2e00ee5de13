"""What a build will allocate, checked against the memory there is before anything is allocated.

The build's validation run feeds every profile's opt and max shapes through the
engine on its target. A dimension of -3 or 2**40, or a profile whose inputs at
max cannot fit next to the weights, would otherwise end in an allocator error
deep inside that run; here it is refused naming the input, the axis and the bytes.
The estimate is a lower bound (weights plus the inputs at the profile's max, the
activations come on top), so a refusal is never a false alarm.
"""

from __future__ import annotations

import math
import os

import torch

from ..errors import ConfigError, ShapeError
from ..ir.graph import Graph
from ..ir.shapes import fmt_shape
from .config import Profile
from .target import Target


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def available_bytes(target: Target) -> int | None:
    """Free memory where the build's tensors live: the GPU's free memory, else the host's available memory."""
    if target.kind == "cuda":
        try:
            return torch.cuda.mem_get_info(target.index)[0]
        except Exception:  # noqa: BLE001 - no answer: do not guess
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


def check(graph: Graph, profiles: list[Profile], target: Target) -> None:
    """Refuse negative dimensions, and profiles whose inputs at max plus the weights exceed free memory."""
    dtypes = {v.name: v.dtype for v in graph.inputs}
    weights = sum(t.numel() * t.element_size() for t in graph.initializers.values() if hasattr(t, "numel"))
    free = available_bytes(target)
    where = "the GPU's free memory" if target.kind == "cuda" else "the host's available memory"
    for idx, prof in enumerate(profiles):
        total, biggest = 0, None
        for name, shapes in prof.shapes.items():
            for which, shape in zip(("min", "opt", "max"), shapes):
                for axis, d in enumerate(shape):
                    if not isinstance(d, int) or d < 0:
                        raise ShapeError(f"profile {idx}, input '{name}' axis {axis}: the {which} shape "
                                         f"{fmt_shape(shape)} has dimension {d}; a dimension is 0 or more.")
            nbytes = math.prod(shapes[2]) * _itemsize(dtypes.get(name))
            total += nbytes
            if biggest is None or nbytes > biggest[1]:
                biggest = (name, nbytes, shapes[2])
        if free is not None and biggest is not None and weights + total > free:
            name, nbytes, shape = biggest
            raise ConfigError(
                f"profile {idx} cannot fit in memory: at its max shapes the inputs alone take {_gib(total)} (input "
                f"'{name}' at {fmt_shape(shape)} is {_gib(nbytes)}), plus {_gib(weights)} of weights, but "
                f"{where} is {_gib(free)}, and activations need more on top. Lower the profile's max "
                "(--maxShapes).")
