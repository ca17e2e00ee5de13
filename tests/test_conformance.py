"""ONNX conformance: ONNX's node cases for every op Kiln claims pass, except the documented refusals
and divergences."""

import functools
import warnings

import pytest

from kiln.ops import claimed_ops

from .conformance import DIVERGES, REFUSED, node_cases, results_by_case, results_by_op, summary, unclaimed_ops

# Share of the cases Kiln runs that must pass: all but the REFUSED and DIVERGES ones (5 of 1822 with
# onnx 1.23.2). Any other failure already fails test_op_conformance.
TARGET = 0.995
# Share of the cases whose operators TensorRT all supports that must pass (issue 39 asks at least 97%): all
# but the REFUSED ones among them (2 of 1447 with onnx 1.23.2).
TENSORRT_TARGET = 0.995


@functools.lru_cache(maxsize=1)
def _cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ONNX's case generators warn about the overflows they test
        return results_by_case()


def test_conformance_summary(capsys):
    cases = _cases()
    passed = sum(r.reason is None for r in cases.values())
    with capsys.disabled():
        print(f"\nONNX conformance (CPU target) over {len(claimed_ops())} claimed ops:")
        print("\n".join("  " + line for line in summary(cases)))
        print(f"unclaimed ops seen in ONNX's cases (not run): {', '.join(unclaimed_ops())}")
    assert passed / len(cases) >= TARGET, "\n".join(summary(cases))
    tensorrt = [r for r in cases.values() if r.tensorrt]
    assert sum(r.reason is None for r in tensorrt) / len(tensorrt) >= TENSORRT_TARGET, "\n".join(summary(cases))


def _listed(table):
    """The entries of REFUSED/DIVERGES whose case this onnx version ships (names change between versions)."""
    shipped = {c.name for c in node_cases()}
    return {name: why for name, why in table.items() if name in shipped}


def test_refusals_are_documented_unsupported_errors():
    cases = _cases()
    for name, why in _listed(REFUSED).items():
        assert name in cases, f"{name} is listed as refused but no longer runs"
        reason = cases[name].reason
        assert reason is not None, f"{name} passes now: drop it from REFUSED and docs/operators.md"
        assert reason.startswith("UnsupportedError:"), f"{name} is refused ({why}) but fails with {reason}"


def test_divergences_are_documented_mismatches():
    cases = _cases()
    for name, why in _listed(DIVERGES).items():
        assert name in cases, f"{name} is listed as diverging but no longer runs"
        reason = cases[name].reason
        assert reason is not None, f"{name} passes now: drop it from DIVERGES and docs/operators.md"
        assert reason.startswith("mismatch:"), f"{name} diverges on purpose ({why}) but fails with {reason}"


@pytest.mark.parametrize("op", claimed_ops())
def test_op_conformance(op):
    r = results_by_op(ops={op}, cases=_cases()).get(op)
    if r is None:
        pytest.skip(f"ONNX ships no node case for {op} that uses only claimed ops")
    failed = {name: why for name, why in r.failed.items() if name not in REFUSED and name not in DIVERGES}
    details = "\n".join(f"  {name}: {why}" for name, why in sorted(failed.items()))
    assert not failed, f"{op}: {len(r.passed)}/{len(r.passed) + len(r.failed)} cases pass\n{details}"
