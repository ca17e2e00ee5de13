"""Runs ONNX's own node conformance cases against Kiln's backend (CPU target)."""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx.backend.test.case.node import collect_testcases

import kiln.backend as backend
from kiln.ops import claimed_ops, lookup


@dataclass
class OpResult:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        total = len(self.passed) + len(self.failed)
        return len(self.passed) / total if total else 1.0


def _graph_nodes(graph):
    for n in graph.node:
        yield n
        for a in n.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                yield from _graph_nodes(g)


def case_ops(case) -> set[str]:
    """Every op the case uses, in control-flow bodies too: a case counts only when Kiln claims all.
    Ops of other domains (ai.onnx.preview...) are named domain::op, which Kiln does not claim."""
    return {n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
            for n in _graph_nodes(case.model.graph)}


def _random(case) -> bool:
    return any(getattr(lookup(op), "nondeterministic", False) for op in case_ops(case))


def _load_inputs(case, data):
    return [onnx.numpy_helper.to_array(t) if isinstance(t, onnx.TensorProto) else t for t in data]


def run_case(case) -> str | None:
    """None when the case passes, else a short reason."""
    try:
        rep = backend.prepare(case.model, "CPU")
        random = _random(case)  # ONNX's expected values are numpy's random draws: check shape and type only
        for inputs, expected in case.data_sets:
            inputs, expected = _load_inputs(case, inputs), _load_inputs(case, expected)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outs = rep.run(list(inputs))
            if len(outs) < len(expected):
                return f"{len(outs)} outputs, expected {len(expected)}"
            for got, want in zip(outs, expected):
                want = np.asarray(want)
                got = np.asarray(got)
                if want.dtype == object or want.dtype.kind in "US":
                    return "string output"
                if got.shape != want.shape:
                    return f"shape {got.shape}, expected {want.shape}"
                if random:
                    continue
                if want.dtype.kind == "f" or got.dtype.kind == "f" or want.dtype.name == "bfloat16":
                    # One bfloat16 step near 1 is 2^-8: ONNX's rtol of 1e-3 would demand sub-step agreement.
                    # Allow four steps: chains of bf16-rounded ops (expanded attention) differ from
                    # numpy's sequential rounding by a few steps.
                    rtol = max(case.rtol, 2.0**-6) if want.dtype.name == "bfloat16" else case.rtol
                    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                               rtol=rtol, atol=case.atol, equal_nan=True)
                else:
                    np.testing.assert_array_equal(got, want)
        return None
    except AssertionError as e:
        return "mismatch: " + " ".join(str(e).split())[:200]
    except Exception as e:  # any failure of the thing under test is a failed case
        return f"{type(e).__name__}: " + " ".join(str(e).split())[:200]


def node_cases():
    return [c for c in collect_testcases() if c.kind == "node"]


def results_by_op(ops: set[str] | None = None) -> dict[str, OpResult]:
    """Each case counts for every op in its graph, if Kiln claims all of them."""
    claimed = set(claimed_ops())
    results: dict[str, OpResult] = defaultdict(OpResult)
    for case in node_cases():
        used = case_ops(case)
        if not used or not used <= claimed or (ops is not None and not used & ops):
            continue
        reason = run_case(case)
        for op in used:
            if ops is None or op in ops:
                if reason is None:
                    results[op].passed.append(case.name)
                else:
                    results[op].failed[case.name] = reason
    return dict(results)


def unclaimed_ops() -> list[str]:
    claimed = set(claimed_ops())
    seen = set()
    for case in node_cases():
        seen |= case_ops(case)
    return sorted(seen - claimed)
