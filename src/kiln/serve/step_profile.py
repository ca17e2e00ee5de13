"""Where each LLMEngine step's time goes, and the batch it ran: the served engine's steps beside offline ones.

`StepProfile(engine)` wraps the engine's own parts on that instance (the scheduler's `schedule`, the runner's
`prepare`, `run_inputs` and `collect`) and times every `step()` call in five phases:

    schedule   Scheduler.schedule: which sequences run, KV blocks appended
    prepare    ModelRunner.prepare: the step's input lists on the host
    forward    ModelRunner.run_inputs: the forward (on a GPU mostly kernel launches or one graph replay)
    collect    ModelRunner.collect: the wait for the step's token ids on the device (and a sampler that is
               not plain greedy)
    post       the rest of step(): tokens appended, stop rules, text detokenized, RequestOutputs built

A step() call collects one step's tokens; where the engine overlaps steps it also schedules and launches the
next one, so schedule / prepare / forward are the next step's and the batch recorded is the collected step's.
Each record holds that batch (sequences, tokens, decode-only or not) and the call's start on the monotonic
clock, which every process of a machine shares: a load test selects the steps of its measured window from a
server's engine process by time. `summary()` is one line; `by_batch()` groups the steps by kind and batch size so that two
runs (served and offline) are compared at the same batches; `save(path)` writes the records as JSON.
"""

from __future__ import annotations

import json
import time

PHASES = ("schedule", "prepare", "forward", "collect", "post")
# A record: (start on time.monotonic(), call total, schedule, prepare, forward, collect, seqs, tokens, decode-only)
START, TOTAL, N_SEQS, N_TOKENS, DECODE = 0, 1, 6, 7, 8


class StepProfile:
    def __init__(self, engine):
        self.records: list[tuple] = []
        self._cur = [0.0] * 4
        self._batches: list[tuple] = []  # scheduled and launched, not yet collected (the engine overlaps steps)
        self._collected: tuple | None = None
        clock = time.perf_counter
        cur = self._cur
        sch, runner = engine.scheduler, engine.runner
        schedule, prepare, run_inputs, collect, step = (sch.schedule, runner.prepare, runner.run_inputs,
                                                        runner.collect, engine.step)

        def timed(i, fn):
            def call(*args):
                t = clock()
                try:
                    return fn(*args)
                finally:
                    cur[i] += clock() - t
            return call

        timed_schedule, timed_collect = timed(0, schedule), timed(3, collect)

        def scheduled():
            s = timed_schedule()
            if s.seqs:
                self._batches.append((len(s.seqs), s.num_tokens, s.is_decode_only))
            return s

        def collected(launched):
            if self._batches:
                self._collected = self._batches.pop(0)
            return timed_collect(launched)

        def profiled_step():
            cur[:] = (0.0, 0.0, 0.0, 0.0)
            self._collected = None
            start = time.monotonic()
            t = clock()
            out = step()
            if self._collected is not None:
                self.records.append((start, clock() - t, *cur, *self._collected))
            return out

        sch.schedule = scheduled
        runner.prepare = timed(1, prepare)
        runner.run_inputs = timed(2, run_inputs)
        runner.collect = collected
        engine.step = profiled_step

    def between(self, start: float | None = None, end: float | None = None) -> list[tuple]:
        """The records of steps that started in [start, end] (time.monotonic())."""
        return [r for r in self.records if (start is None or r[START] >= start) and (end is None or r[START] <= end)]

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump({"phases": list(PHASES), "records": self.records}, f)


def load(path) -> list[tuple]:
    with open(path) as f:
        return [tuple(r) for r in json.load(f)["records"]]


def phase_means(records: list[tuple]) -> dict:
    """Mean ms per step: total and each phase (post = total less the four timed phases)."""
    n = len(records) or 1
    total = sum(r[TOTAL] for r in records) / n
    parts = [sum(r[2 + i] for r in records) / n for i in range(4)]
    return {"total": total * 1e3, **{p: v * 1e3 for p, v in zip(PHASES, parts + [total - sum(parts)])}}


def summary(records: list[tuple]) -> str:
    if not records:
        return "no steps"
    dec = [r for r in records if r[DECODE]]
    mix = [r for r in records if not r[DECODE]]

    def line(rs):
        if not rs:
            return "-"
        m = phase_means(rs)
        seqs = sum(r[N_SEQS] for r in rs) / len(rs)
        return (f"{m['total']:.2f} ms (" + " / ".join(f"{m[p]:.2f}" for p in PHASES) + f"), {seqs:.0f} seqs")

    return (f"{len(records)} steps, {sum(r[TOTAL] for r in records):.2f} s; {len(dec)} decode-only at {line(dec)}; "
            f"{len(mix)} with prompt tokens at {line(mix)} [ms: {' / '.join(PHASES)}]")


def _bin(n: int) -> int:
    """The power-of-two bin of n: 1, 2-3 -> 2, 4-7 -> 4, ..."""
    return 1 << (max(1, n).bit_length() - 1)


def by_batch(records: list[tuple]) -> dict:
    """{(kind, low): records}: decode-only steps binned by sequences, steps with prompt tokens by tokens, each
    into power-of-two bins [low, 2 * low)."""
    groups: dict = {}
    for r in records:
        key = ("decode", _bin(r[N_SEQS])) if r[DECODE] else ("prompt", _bin(r[N_TOKENS]))
        groups.setdefault(key, []).append(r)
    return groups


def comparison_table(served: list[tuple], offline: list[tuple], min_steps: int = 3) -> str:
    """Markdown: mean step time and its phases, served beside offline, per batch bin both runs have."""
    a, b = by_batch(served), by_batch(offline)
    lines = ["| steps | batch | served n | served ms (" + " / ".join(PHASES) + ") | offline n | offline ms | "
             "served / offline |", "|---|---|---|---|---|---|---|"]
    for key in sorted(set(a) | set(b)):
        kind, low = key
        ra, rb = a.get(key, []), b.get(key, [])
        if len(ra) < min_steps and len(rb) < min_steps:
            continue
        unit = "seqs" if kind == "decode" else "tokens"
        ma, mb = phase_means(ra), phase_means(rb)

        def cell(m, rs):
            if not rs:
                return "-"
            return f"{m['total']:.2f} (" + " / ".join(f"{m[p]:.2f}" for p in PHASES) + ")"

        ratio = f"{ma['total'] / mb['total']:.2f}" if ra and rb and mb["total"] else "-"
        lines.append(f"| {'decode-only' if kind == 'decode' else 'with prompt'} | {low}-{2 * low - 1} {unit} | "
                     f"{len(ra)} | {cell(ma, ra)} | {len(rb)} | {cell(mb, rb)} | {ratio} |")
    return "\n".join(lines)
