"""Runs ONNX's own node conformance cases against Kiln's backend (CPU target by default).

A case runs when Kiln claims every op in its graph. `python -m tests.conformance` prints the
counts and every failing case with its error (--device CUDA on a GPU machine, --ops to select,
--markdown for the table in docs/operators.md).
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx.backend.test.case.node import collect_testcases

import kiln.backend as backend
from kiln.ops import claimed_ops, lookup


# The ONNX operators TensorRT supports: onnx-tensorrt's docs/operators.md for TensorRT 10.1, plus the
# three its changelog adds in 10.15 (RotaryEmbedding, RMSNormalization, TensorScatter).
TENSORRT_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike Ceil Celu Clip
Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace DequantizeLinear Div
Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm
GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU Hardmax
HardSigmoid HardSwish Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less
LessOrEqual Log LogSoftmax Loop LpNormalization LpPool LRN LSTM MatMul Max MaxPool Mean MeanVarianceNormalization Min
Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal
RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence
RMSNormalization RNN RoiAlign RotaryEmbedding Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape
Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
TensorScatter ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# The cases Kiln refuses on purpose, each with the reason (docs/operators.md lists them). Any other
# failure is a regression.
REFUSED = {
    "test_equal_string": "string tensors: Kiln, like TensorRT, builds numeric tensors only",
    "test_equal_string_broadcast": "string tensors: Kiln, like TensorRT, builds numeric tensors only",
}

# Cases where the spec is ambiguous and Kiln follows onnxruntime and PyTorch (what exported models
# expect) rather than ONNX's reference evaluator, which computed these cases' expected outputs.
DIVERGES = {
    "test_maxunpool_export_with_output_shape":
        "with output_shape, MaxUnpool's indices address the output shape, as in onnxruntime and PyTorch; "
        "ONNX's reference unpools to the inferred shape and pads it",
    **{name: "the expected values carry numpy's FP32 FFT rounding (1.9e-7) where the exact result, which Kiln "
             "returns, is 0: the case's absolute tolerance of 1e-7 is below FP32 noise on values near 50"
       for name in ("test_dft_inverse", "test_dft_inverse_opset19")},
}


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


def _compare(got, want, case, random: bool) -> str | None:
    """None when one output matches, else why not (a sequence output: element by element); raises
    AssertionError for values outside the case's tolerance."""
    if want is None or got is None:  # an empty optional
        return None if want is None and got is None else f"{got!r:.60}, expected {want!r:.60}"
    if isinstance(want, list):
        if not isinstance(got, list):
            return f"a {type(got).__name__}, expected a sequence of {len(want)} tensor(s)"
        if len(got) != len(want):
            return f"a sequence of {len(got)} tensor(s), expected {len(want)}"
        return next((why for g, w in zip(got, want) if (why := _compare(g, w, case, random))), None)
    want = np.asarray(want)
    got = np.asarray(got)
    if want.dtype == object or want.dtype.kind in "US":
        return "string output"
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if random:
        return None
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


def run_case(case, device: str = "CPU") -> str | None:
    """None when the case passes, else a short reason."""
    try:
        rep = backend.prepare(case.model, device)
        random = _random(case)  # ONNX's expected values are numpy's random draws: check shape and type only
        for inputs, expected in case.data_sets:
            inputs, expected = _load_inputs(case, inputs), _load_inputs(case, expected)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outs = rep.run(list(inputs))
            if len(outs) < len(expected):
                return f"{len(outs)} outputs, expected {len(expected)}"
            for got, want in zip(outs, expected):
                why = _compare(got, want, case, random)
                if why:
                    return why
        return None
    except AssertionError as e:
        return "mismatch: " + " ".join(str(e).split())[:200]
    except Exception as e:  # any failure of the thing under test is a failed case
        return f"{type(e).__name__}: " + " ".join(str(e).split())[:200]


def node_cases():
    return [c for c in collect_testcases() if c.kind == "node"]


@dataclass
class CaseResult:
    ops: set[str]
    reason: str | None  # None: passed

    @property
    def tensorrt(self) -> bool:
        """Every op of the case is one TensorRT supports."""
        return self.ops <= TENSORRT_OPS


def results_by_case(ops: set[str] | None = None, device: str = "CPU") -> dict[str, CaseResult]:
    """Every case whose ops Kiln all claims (and, with `ops`, that uses one of them), run once."""
    claimed = set(claimed_ops())
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cases' tensors are tiny: a second intra-op thread only adds its synchronisation
    try:
        for case in node_cases():
            used = case_ops(case)
            if used and used <= claimed and (ops is None or used & ops):
                results[case.name] = CaseResult(used, run_case(case, device))
    finally:
        torch.set_num_threads(threads)
    return results


def results_by_op(ops: set[str] | None = None, device: str = "CPU",
                  cases: dict[str, CaseResult] | None = None) -> dict[str, OpResult]:
    """Each case counts for every op in its graph, if Kiln claims all of them."""
    cases = results_by_case(ops, device) if cases is None else cases
    results: dict[str, OpResult] = defaultdict(OpResult)
    for name, r in cases.items():
        for op in r.ops:
            if ops is None or op in ops:
                if r.reason is None:
                    results[op].passed.append(name)
                else:
                    results[op].failed[name] = r.reason
    return dict(results)


@functools.cache
def _unclaimed_ops() -> tuple[str, ...]:
    claimed = set(claimed_ops())
    seen = set()
    for case in node_cases():
        seen |= case_ops(case)
    return tuple(sorted(seen - claimed))


def unclaimed_ops() -> list[str]:
    return list(_unclaimed_ops())


def summary(cases: dict[str, CaseResult]) -> list[str]:
    """Pass counts: all cases Kiln runs, the TensorRT-supported subset, and case-op pairs."""
    def count(rs):
        rs = list(rs)
        ok = sum(r.reason is None for r in rs)
        return f"{ok}/{len(rs)} ({100 * ok / max(len(rs), 1):.1f}%)"

    pairs = [r for r in cases.values() for _ in r.ops]
    return [f"cases: {count(cases.values())}",
            f"cases whose ops TensorRT all supports: {count(r for r in cases.values() if r.tensorrt)}",
            f"case-op pairs: {count(pairs)}"]


def markdown_table(cases: dict[str, CaseResult]) -> list[str]:
    """One row per claimed op: TensorRT support and the ONNX cases that use it."""
    per_op = results_by_op(cases=cases)
    rows = ["| operator | TensorRT | ONNX cases pass |", "|---|---|---|"]
    for op in claimed_ops():
        r = per_op.get(op)
        n = f"{len(r.passed)}/{len(r.passed) + len(r.failed)}" if r else "no case"
        rows.append(f"| {op} | {'yes' if op in TENSORRT_OPS else 'no'} | {n} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="CPU", help="CPU or CUDA")
    ap.add_argument("--ops", help="comma-separated ops: only the cases using one of them")
    ap.add_argument("--markdown", action="store_true", help="print the per-op table of docs/operators.md")
    args = ap.parse_args(argv)
    ops = set(args.ops.split(",")) if args.ops else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ONNX's case generators warn about the overflows they test
        cases = results_by_case(ops, args.device)
    if args.markdown:
        print("\n".join(markdown_table(cases)))
        return
    print("\n".join(summary(cases)))
    for name, r in sorted(cases.items()):
        if r.reason is not None:
            tag = "refused" if name in REFUSED else "diverges" if name in DIVERGES else "FAILED"
            print(f"  {tag} {name} [{', '.join(sorted(r.ops))}]: {r.reason}")


if __name__ == "__main__":
    main()
