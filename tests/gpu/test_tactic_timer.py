"""The tactic timer: graph-replay timing, and the call-by-call fallback. Skipped without CUDA."""

import pytest
import torch

from kiln.tactics.timer import L2Reset, _median, median_ms, synchronizes

pytestmark = pytest.mark.gpu


def test_replay_timing_leaves_out_the_host_launch_cost():
    x = torch.randn(64, device="cuda")
    tiny = lambda: x.add(1)  # noqa: E731  one microsecond-scale kernel
    replayed = median_ms(tiny)
    per_call = _median(tiny, 10)
    assert 0 < replayed < per_call


def test_a_candidate_that_syncs_with_the_host_is_timed_call_by_call():
    x = torch.randn(64, device="cuda")
    syncing = lambda: x.sum().item()  # noqa: E731  .item() cannot be captured
    assert median_ms(syncing) > 0
    assert torch.cuda.is_current_stream_capturing() is False


def test_synchronizing_calls_are_detected():
    x = torch.randn(64, device="cuda")
    assert synchronizes(lambda: x.sum().item())
    assert not synchronizes(lambda: x.add(1))


def test_an_l2_reset_runs_before_each_call_uncharged_and_keeps_only_whole_device_tensors():
    """The selector's L2Reset (timer.py): its own time is subtracted, and it re-reads the activation inputs a
    byte view can read whole (a 64 MiB add does not fit in L2, so the reset leaves its time as it was)."""
    x = torch.randn(16 * 2**20, device="cuda")
    base = L2Reset(x.device)
    reset = base.keeping([x, x.view(4096, -1).t(), None, torch.ones(3)])
    assert [t.numel() for t in reset.keep] == [x.numel() * 4]
    assert base.keep == [] and reset._buffer is base._buffer  # a new reset over the same buffer
    add = lambda: x.add(1)  # noqa: E731
    plain, after_reset = median_ms(add), median_ms(add, before=reset)
    assert 0.7 * plain < after_reset < 1.3 * plain


def test_the_l2_reset_rereads_a_contiguous_input_with_a_wide_stride_on_a_size_1_axis():
    # an [N, C, 1, 1] activation in channels-last form is contiguous yet has stride C on its last axis
    x = torch.empty_strided((64, 1, 1, 1), (1, 512, 512, 512), dtype=torch.float16, device="cuda")
    reset = L2Reset(torch.device("cuda")).keeping([x])
    assert [t.numel() for t in reset.keep] == [128]
    reset()
