"""The selector's numerical check of a candidate against the reference."""

import torch

from kiln.tactics.select import _close

FP8 = torch.float8_e4m3fn


def test_float_outputs_are_judged_as_a_share_of_the_range():
    ref = torch.tensor([100.0, -50.0, 1.0])
    assert _close(ref + 1.0, ref, "float16")[0]  # 1% of the range
    ok, why = _close(ref + torch.tensor([0.0, 0.0, 3.0]), ref, "float16")
    assert not ok and "3.00e-02 of output range" in why
    assert not _close(torch.tensor([float("nan"), 0.0, 1.0]), ref, "float16")[0]


def test_an_fp8_output_may_differ_by_one_step_plus_the_float_share_of_the_range():
    ref = torch.tensor([448.0, 416.0, 1.0, 0.0]).to(FP8)
    one_step = torch.tensor([416.0, 448.0, 1.125, 2.0 ** -9]).to(FP8)  # 7% of the range at the top
    assert _close(one_step, ref, "fp8")[0]
    near_zero = torch.tensor([448.0, 416.0, 1.0, 8.0]).to(FP8)  # 8 = 0.018 x 448: float error, not a bug
    assert _close(near_zero, ref, "fp8")[0]
    two_steps = torch.tensor([384.0, 416.0, 1.0, 0.0]).to(FP8)
    ok, why = _close(two_steps, ref, "fp8")
    assert not ok and "8-bit values" in why


def test_an_int8_output_may_differ_by_one_step():
    ref = torch.tensor([127, -128, 0, 5], dtype=torch.int8)
    assert _close(ref + torch.tensor([0, 1, -1, 1], dtype=torch.int8), ref, "int8")[0]
    assert _close(ref + torch.tensor([0, 0, 0, 3], dtype=torch.int8), ref, "int8")[0]  # 1 step + 2% of 127
    assert not _close(ref + torch.tensor([0, 0, 0, 4], dtype=torch.int8), ref, "int8")[0]
    assert not _close(torch.tensor([0, -128, 0, 5], dtype=torch.int8), ref, "int8")[0]  # 127 steps
    assert not _close(ref.float(), ref, "int8")[0]  # floats where 8-bit values were due
