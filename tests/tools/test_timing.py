"""Timings that are noise say so; a stable one stops early; the CPU target neither oversubscribes nor hides
that FP16 there is emulated."""

import time
import warnings

import pytest
import torch

from kiln.tools import timing
from kiln.tools.timing import EmulatedPrecisionWarning, TimingNoiseWarning, time_context, time_fn


def _busy(ms: float) -> None:
    """Spin for `ms` (a sleep's wake-up jitter would be noise of its own)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def test_jittery_callable_warns_of_stalls():
    calls = [0]

    def jittery(_feeds):
        calls[0] += 1
        _busy(4.0 if calls[0] % 10 == 0 else 0.3)  # one run in ten stalls, as a thread pool waiting for a core

    with pytest.warns(TimingNoiseWarning, match=r"p99 .* the median"):
        t = time_fn(jittery, [{}], "cpu", iterations=60, warmup_ms=1)
    noise = t.noise()
    assert noise["p99_over_median"] > timing.P99_OVER_MEDIAN_LIMIT and not t.stopped_early


def test_a_machine_that_slows_down_warns_of_spread_between_repeats():
    calls = [0]

    def slowing(_feeds):
        calls[0] += 1
        _busy(0.3 if calls[0] <= 40 else 0.6)

    with pytest.warns(TimingNoiseWarning, match="consecutive groups of runs differ"):
        t = time_fn(slowing, [{}], "cpu", iterations=80, warmup_ms=0)
    assert t.noise()["repeat_spread"] > timing.REPEAT_SPREAD_LIMIT


def test_stable_timing_stops_early():
    # (a busy machine may still preempt a run or two: the median stays, and a p99 warning would be right)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimingNoiseWarning)
        t = time_fn(lambda _f: _busy(0.5), [{}], "cpu", iterations=100, warmup_ms=1, stop_when_stable=True)
    n = len(t.latency_ms)
    assert t.stopped_early and timing.MIN_STABLE_RUNS <= n < 100 and n % timing.STABLE_WINDOW == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimingNoiseWarning)
        full = time_fn(lambda _f: _busy(0.2), [{}], "cpu", iterations=30, warmup_ms=1)
    assert len(full.latency_ms) == 30 and not full.stopped_early  # without it, every asked run runs


def test_cpu_threads_do_not_oversubscribe_and_are_restored():
    import os

    before = torch.get_num_threads()
    seen = []
    t = time_fn(lambda _f: seen.append(torch.get_num_threads()), [{}], "cpu", iterations=5, warmup_ms=0)
    n, why = timing.cpu_threads()
    assert 1 <= seen[0] <= len(os.sched_getaffinity(0)) and set(seen) == {seen[0]}
    assert t.cpu_threads == seen[0] and "physical core" in t.cpu_threads_reason and "physical core" in why
    assert torch.get_num_threads() == before
    assert time_fn(lambda _f: seen.append(torch.get_num_threads()), [{}], "cpu", iterations=1, warmup_ms=0,
                   threads=1).cpu_threads == 1 and seen[-1] == 1


def test_cpu_report_says_it_is_no_gpu_figure(capsys):
    from rich.console import Console

    t = time_fn(lambda _f: _busy(0.2), [{}], "cpu", iterations=20, warmup_ms=0)
    timing.render(t, Console(highlight=False))
    out = capsys.readouterr().out
    assert "not a latency on any GPU" in out and "Run-to-run spread: medians of 5 consecutive groups" in out


def test_fp16_on_the_cpu_is_said_to_be_emulated_before_it_runs(mlp_files):
    ctx = mlp_files.engine16.create_execution_context()
    feeds = [mlp_files.engine16.random_inputs()]
    with pytest.warns(EmulatedPrecisionWarning, match="FP16 on the CPU target is emulated"):
        time_context(ctx, feeds, iterations=2, warmup_ms=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedPrecisionWarning)
        time_context(mlp_files.engine32.create_execution_context(), [mlp_files.engine32.random_inputs()],
                     iterations=2, warmup_ms=0)
    assert timing.emulation_note("bfloat16", "cpu").startswith("BF16")
    assert timing.emulation_note("float16", "cuda") is None
