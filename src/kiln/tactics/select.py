"""Tactic selection: time every applicable candidate of every layer at the profiles' opt shapes.

The engine runs once per profile at its opt shape, layer by layer; at each layer
with candidates, each candidate runs on that layer's real inputs, is checked
against the reference implementation's output, and is timed. The fastest
correct candidate wins (summed over profiles). Candidates excluded by the
workspace cap, failing, or numerically wrong are reported, not silently dropped.
"""

from __future__ import annotations

import torch

from ..engine.interpreter import cast_for
from ..ops.registry import lookup
from . import candidates, load_all
from .cache import TimingCache, layer_key
from .timer import median_ms, synchronizes

# Max error of a candidate against the reference, as a share of the output's range. INT8/FP8 layers
# return FP16 (or BF16) values and their reference sums exactly in float64, so they get FP16's bound.
_TOL = {"float32": 1e-3, "tf32": 5e-3, "float16": 2e-2, "bfloat16": 5e-2, "int8": 2e-2, "fp8": 2e-2}


def _close(out, ref, precision: str) -> tuple[bool, float]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        if r is None or o is None:
            continue
        if o.shape != r.shape:
            return False, float("inf")
        o, r = o.float(), r.float()
        if not torch.isfinite(o).eq(torch.isfinite(r)).all():
            return False, float("inf")
        scale = r.abs().max().clamp_min(1.0)
        err = float(((o - r).abs().nan_to_num(0.0)).max() / scale)
        worst = max(worst, err)
    return worst <= _TOL.get(precision, 1e-3), worst


class Selector:
    """Collects timings during the per-profile runs, then assigns node.tactic."""

    def __init__(self, engine, level: int, workspace_bytes: int | None, cache: TimingCache, on_layer=None):
        load_all()
        self.engine, self.level, self.cap, self.cache = engine, level, workspace_bytes, cache
        self.totals: dict[int, dict[str, float]] = {}
        self.report: dict[int, dict] = {}
        self.on_layer = on_layer

    def visit(self, node, args) -> None:
        cands = [t for t in candidates(node) if t.level <= self.level]
        if not cands:
            return
        args = cast_for(node, lookup(node.op_type, node.domain), args)  # as the layer will see them
        idx = id(node)
        key = layer_key(self.engine.target, self.engine.versions, node, args)
        cached = self.cache.get(key)
        if cached is None:
            cached = self._measure(node, args, cands)
            self.cache.put(key, cached)
        if self.on_layer:
            self.on_layer(node)
        rep = self.report.setdefault(idx, {"layer": node.name, "op": node.op_type, "timings": {}, "excluded": {}})
        totals = self.totals.setdefault(idx, {})
        for name, ms in cached["timings"].items():
            totals[name] = totals.get(name, 0.0) + ms
            rep["timings"][name] = rep["timings"].get(name, 0.0) + ms
        rep["excluded"].update(cached["excluded"])

    def _measure(self, node, args, cands) -> dict:
        entry = lookup(node.op_type, node.domain)
        ref = entry.impl(node, *args)
        timings = {"reference": median_ms(lambda: entry.impl(node, *args))}
        excluded = {}
        for t in cands:
            try:
                if not t.applies(node, args):
                    continue
                need = t.workspace(node, args) if t.workspace else 0
                if self.cap is not None and need > self.cap:
                    excluded[t.name] = f"needs {need / 2**20:.1f} MiB workspace, cap is {self.cap / 2**20:.1f} MiB"
                    continue
                if synchronizes(lambda: t.fn(node, *args)):  # the reference may (data-dependent ops); a tactic not
                    excluded[t.name] = "synchronizes with the host: it would break the engine's CUDA graph"
                    continue
                ok, err = _close(t.fn(node, *args), ref, node.precision)
                if not ok:
                    excluded[t.name] = f"numerically wrong (max error {err:.2e} of output range)"
                    continue
                timings[t.name] = median_ms(lambda: t.fn(node, *args), may_sync=False)  # checked above
            except Exception as e:  # a candidate that cannot run here is simply not chosen
                excluded[t.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return {"timings": timings, "excluded": excluded}

    def assign(self) -> list[dict]:
        by_id = {id(n): n for n in self.engine.graph.nodes}
        out = []
        for idx, totals in self.totals.items():
            node = by_id[idx]
            node.tactic = min(totals, key=totals.get)
            rep = self.report[idx]
            rep["chosen"] = node.tactic
            rep["timings"] = {k: round(v, 5) for k, v in sorted(rep["timings"].items(), key=lambda kv: kv[1])}
            out.append(rep)
        return out
