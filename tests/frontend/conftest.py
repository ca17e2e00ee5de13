"""Fixtures for the frontend tests: a stand-in op registry, so the check tests do not
depend on which ops the op families have registered so far."""

import pytest

from kiln.ops import registry
from kiln.ops.registry import OpEntry


def _impl(node, *args):
    raise AssertionError("the check tests never run ops")


def _gemm_check(node):
    return "Gemm with transA=1 is not supported" if node.attr("transA", 0) else None


@pytest.fixture
def fake_ops(monkeypatch):
    """A registry holding exactly: MatMul, Add, Relu, If, Identity, Reshape, Shape, Constant,
    Gemm (transA=0 only) and Softmax (opset 13 and newer)."""
    entries = {}
    for op in ("MatMul", "Add", "Relu", "If", "Identity", "Reshape", "Shape", "Constant"):
        entries[("", op)] = OpEntry(op_type=op, domain="", impl=_impl)
    entries[("", "Gemm")] = OpEntry(op_type="Gemm", domain="", impl=_impl, check=_gemm_check)
    entries[("", "Softmax")] = OpEntry(op_type="Softmax", domain="", impl=_impl, since=13)
    monkeypatch.setattr(registry, "_REGISTRY", entries)
    return entries
