"""ONNX conformance: >= 95% of ONNX's node cases pass for every op Kiln claims."""

import functools

import pytest

from kiln.ops import claimed_ops

from .conformance import results_by_op, unclaimed_ops

TARGET = 0.95


@functools.lru_cache(maxsize=1)
def _all_results():
    return results_by_op()


def test_conformance_summary(capsys):
    results = _all_results()
    passed = sum(len(r.passed) for r in results.values())
    total = passed + sum(len(r.failed) for r in results.values())
    with capsys.disabled():
        print(f"\nONNX conformance (CPU target): {passed}/{total} case-op pairs pass "
              f"({100 * passed / max(total, 1):.1f}%) over {len(claimed_ops())} claimed ops")
        print(f"claimed ops: {', '.join(claimed_ops())}")
        print(f"unclaimed ops seen in ONNX's cases (not run): {', '.join(unclaimed_ops())}")
        below = {op: r for op, r in results.items() if r.rate < TARGET}
        for op, r in sorted(below.items()):
            print(f"  below target: {op} {len(r.passed)}/{len(r.passed) + len(r.failed)}")
    assert total > 0


@pytest.mark.parametrize("op", claimed_ops())
def test_op_conformance(op):
    r = _all_results().get(op)
    if r is None:
        pytest.skip(f"ONNX ships no node case for {op} that uses only claimed ops")
    details = "\n".join(f"  {name}: {why}" for name, why in sorted(r.failed.items()))
    assert r.rate >= TARGET, f"{op}: {len(r.passed)}/{len(r.passed) + len(r.failed)} cases pass\n{details}"
