"""Which CPUs the engine process steps on, apart from the HTTP process (`kiln llm serve --engineCpu`).

The engine's step loop is one busy thread. The HTTP process beside it wakes on every step's frame, and the
kernel tends to run a woken task where it last ran or near its waker: on the engine's core, or on its SMT
sibling, which shares that core's execution units and caches. `--engineCpu auto` gives the step loop a core
of its own: the last physical core of the CPUs this process may use, its first hardware thread for the engine
and its siblings left idle, every other CPU for the HTTP process (and a load generator). With fewer than four
CPUs nothing is pinned. `--engineCpu N` names the CPU; `none` (the default) leaves placement to the kernel.
"""

from __future__ import annotations

import os

from ..errors import ConfigError


def _siblings(cpu: int) -> set[int]:
    """The hardware threads of cpu's physical core (cpu alone where the topology is not readable)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def placement(spec: str | None) -> tuple[set[int], set[int]] | None:
    """(the engine's CPUs, the CPUs for everything else) for --engineCpu spec, or None: no pinning."""
    if spec in (None, "", "none"):
        return None
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if spec == "auto":
        if len(allowed) < 4:
            return None
        core = _siblings(max(allowed)) & allowed or {max(allowed)}
        return {min(core)}, allowed - core
    try:
        cpu = int(spec)
    except ValueError:
        raise ConfigError(f"--engineCpu {spec!r}: write auto, none or a CPU number.") from None
    if cpu not in allowed:
        raise ConfigError(f"--engineCpu {cpu}: this process may run on CPUs {sorted(allowed)} only.")
    core = _siblings(cpu) & allowed or {cpu}
    rest = allowed - core
    return {cpu}, rest or allowed


def pin(cpus: set[int]) -> None:
    """Pins the calling thread (Linux: sched_setaffinity of pid 0 is the calling thread's)."""
    os.sched_setaffinity(0, cpus)
