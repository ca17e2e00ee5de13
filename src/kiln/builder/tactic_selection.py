"""Tactic selection: time every applicable candidate of every layer at the profiles' opt shapes.

The engine runs once per profile at its opt shape, layer by layer; at each layer
with candidates, each candidate runs on that layer's real inputs, is checked
against the reference implementation's output, and is timed. The fastest
correct candidate wins, per profile: a layer whose best tactic differs between
profiles (split-K at batch 1, cuBLAS at 32) runs each profile's own. Candidates excluded by the
workspace cap or --excludeTactics, failing, or numerically wrong are reported, not silently dropped.
"""

from __future__ import annotations

import fnmatch
import os
import time

import torch

from ..engine.interpreter import cast_for
from ..errors import summary
from ..ops.registry import lookup
from ..tactics import candidates, load_all
from ..tactics.cache import TimingCache, layer_key
from ..tactics.timer import L2Reset, median_ms, synchronizes

# Max error of a candidate against the reference, as a share of the output's range. INT8/FP8 layers
# return FP16 (or BF16) values and their reference sums exactly in float64, so they get FP16's bound.
_TOL = {"float32": 1e-3, "tf32": 5e-3, "float16": 2e-2, "bfloat16": 5e-2, "int8": 2e-2, "fp8": 2e-2}
_EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)
# Layers timed with their weights out of L2 (timer.L2Reset), as in an engine, unless the build's
# time_quantized_cold is off; float layers are timed warm (docs/design/timing.md says why, with the numbers).
_TIMED_COLD = ("QGemm", "QConv")


def _steps(r: torch.Tensor) -> torch.Tensor:
    """The quantization step at each reference value of an 8-bit output: 1 for int8; for FP8 E4M3 the
    spacing of its binade (3 mantissa bits, subnormal below 2^-6)."""
    if r.dtype == torch.int8:
        return torch.ones_like(r, dtype=torch.float32)
    exponent = torch.floor(torch.log2(r.float().abs().clamp_min(2.0 ** -6)))
    return torch.exp2(exponent - 3)


def _close(out, ref, precision: str) -> tuple[bool, str]:
    """(passes, worst error in words). Float outputs: max error as a share of the output's range. 8-bit
    outputs (a layer that quantizes for the next one): within one quantization step plus the same share of
    the range, since a value within float error of a rounding tie may round either way, and FP8's step
    is relative (7% of the range at 448, far finer than the float error near zero)."""
    tol = _TOL.get(precision, 1e-3)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst, worst_8bit = 0.0, 0.0
    if len(outs) != len(refs):
        return False, f"{len(outs)} outputs where the reference gives {len(refs)}"
    for o, r in zip(outs, refs):
        if r is None or o is None:
            continue
        if o.shape != r.shape or (o.dtype != r.dtype and r.dtype in _EIGHT_BIT):
            return False, f"{tuple(o.shape)} {o.dtype} where the reference gives {tuple(r.shape)} {r.dtype}"
        diff = (o.float() - r.float()).abs()
        if r.dtype in _EIGHT_BIT:
            bound = _steps(r) + tol * float(r.float().abs().max())
            worst_8bit = max(worst_8bit, float((diff.nan_to_num(float("inf")) / bound).max()))
            continue
        if not torch.isfinite(o).eq(torch.isfinite(r)).all():
            return False, "non-finite values where the reference has none (or the reverse)"
        worst = max(worst, float(diff.nan_to_num(0.0).max() / r.float().abs().max().clamp_min(1.0)))
    words = f"max error {worst:.2e} of output range"
    if worst_8bit:
        words += f", 8-bit values {worst_8bit:.3g}x their bound (one step + {tol:g} of the range)"
    return worst <= tol and worst_8bit <= 1.0, words


# Triton and Gluon candidates compile on their first call; a cold 8-bit build spends most of its time there
# (docs/design/compile-ahead.md). With N >= 2 compile threads the selector compiles them ahead
# (builder/compile_ahead.py); 0 or 1 compiles each on its first call in the timing loop. KILN_PARALLEL_COMPILE=N
# chooses; without it, COMPILE_THREADS (None: one thread per CPU core, at most MAX_COMPILE_THREADS).
COMPILE_THREADS: int | None = None
MAX_COMPILE_THREADS = 16
_JIT_TACTICS = ("triton_", "gluon_")


def compile_threads(target_kind: str = "cuda") -> int:
    value = os.environ.get("KILN_PARALLEL_COMPILE", "")
    if value.strip().isdigit():
        return int(value)
    if target_kind != "cuda":
        return 0  # JIT candidates compile for a GPU only
    return COMPILE_THREADS if COMPILE_THREADS is not None else min(MAX_COMPILE_THREADS, os.cpu_count() or 1)


# Candidates that a better family of kernels supersedes below optimization level PRUNE_BELOW_LEVEL: (the
# superseded names' prefixes, the superseding family's prefixes). Where a candidate of the second applies to a
# layer and times correctly, the first are neither compiled nor timed; where none does (none applies, or each
# raised or was wrong), they are timed as before. Each superseded candidate is one more compile per layer in a
# cold build, and in whole engines it was never chosen (docs/design/tactic-levels.md).
SUPERSEDED = (
    (("triton_qconv_", "triton_qconv1x1_", "triton_qgemm_"), ("triton_tma_q", "gluon_")),
    (("triton_tma_qconv_",), ("gluon_ws_qconv_", "gluon_halo_")),
)
PRUNE_BELOW_LEVEL = 4


def superseded(names, level: int) -> dict[str, tuple[str, ...]]:
    """{name: the prefixes of the candidates that supersede it} for those of `names` (a layer's candidates) that
    SUPERSEDED offers only as a fallback at optimization `level`: a candidate of theirs is among `names`."""
    if level >= PRUNE_BELOW_LEVEL:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for losers, winners in SUPERSEDED:
        if any(n.startswith(winners) for n in names):
            for n in names:
                if n.startswith(losers):
                    out[n] = out.get(n, ()) + winners
    return out


def _superseded_because(winners: tuple[str, ...], by: list[str]) -> str:
    return (f"superseded below optimization level {PRUNE_BELOW_LEVEL}: {len(by)} "
            f"{'/'.join(p.rstrip('_') + '*' for p in winners)} candidate(s) timed correctly")


def _family(node, args, weights) -> str:
    """What decides most of a layer's kernels' specializations: its op, attributes, weights' shapes and every
    input's type (not the activations' shapes). compile_ahead.CompileAhead never compiles one tactic for two
    layers of a family at once."""
    inputs = [None if not isinstance(a, torch.Tensor) else
              (str(a.dtype), list(a.shape) if name in weights else a.dim()) for name, a in zip(node.inputs, args)]
    attrs = {k: v for k, v in sorted(node.attrs.items()) if isinstance(v, (int, float, str, list))}
    return repr((node.domain, node.op_type, node.precision, attrs, inputs))


class Selector:
    """Collects timings during the per-profile runs, then assigns node.tactic.

    The timing cache holds each tactic's result per layer signature (its time, or why it cannot be used:
    failed, numerically wrong, synchronizes). A build measures only the candidates the cache lacks, so a
    cache written at a lower optimization level still gets the extra tactics of a higher one timed. What
    depends on this build's settings (the workspace cap, --excludeTactics) is applied on top, never cached.
    """

    def __init__(self, engine, level: int, workspace_bytes: int | None, cache: TimingCache, on_layer=None,
                 exclude: tuple[str, ...] = (), time_quantized_cold: bool = True):
        load_all()
        self.engine, self.level, self.cap, self.cache = engine, level, workspace_bytes, cache
        self.exclude = tuple(exclude)
        self.time_quantized_cold = time_quantized_cold
        self.profile = 0  # the profile whose run visits the layers (the builder sets it)
        self.totals: dict[int, dict[int, dict[str, float]]] = {}  # layer -> profile -> tactic -> ms
        self.report: dict[int, dict] = {}
        self.on_layer = on_layer
        self.l2: L2Reset | None = None  # made for the first layer timed cold
        self.compiler = None  # a compile_ahead.CompileAhead, for the run before the timing run (ahead)
        # Where the selection's time went (the engine's build_config["tactic_selection"]).
        self.stats = {"layers_measured": 0, "layers_from_cache": 0, "candidates_measured": 0, "superseded": 0,
                      "first_calls_s": 0.0, "timing_s": 0.0}

    def _offered(self, node, args):
        """(args cast as the layer will see them, usable candidates, {name: why skipped}), or None for a layer
        without candidates at this level."""
        cands = [t for t in candidates(node) if t.level <= self.level]
        if not cands:
            return None
        args = cast_for(node, lookup(node.op_type, node.domain), args)  # as the layer will see them
        usable, skipped = self._screen(node, args, cands)
        return args, usable, skipped

    def _key(self, node, args) -> str:
        key = layer_key(self.engine.target, self.engine.versions, node, args)
        if node.op_type in _TIMED_COLD and not self._cold(node):  # warm timings are cached apart from cold ones
            key += "-warm"
        return key

    def ahead(self, node, args) -> None:
        """The run before timing: each layer the timing loop will measure hands the JIT candidates the timing
        cache lacks to the compile pool (self.compiler); superseded ones (SUPERSEDED) are left to the timing
        loop, which compiles them only where the candidates superseding them fail."""
        offered = self._offered(node, args)
        if offered is None or self.compiler is None:
            return
        args, usable, _ = offered
        key = self._key(node, args)
        cached = self.cache.entries.get(key) or {"timings": {}, "excluded": {}}
        fallback = superseded([t.name for t in usable], self.level)
        todo = [t for t in usable if t.name.startswith(_JIT_TACTICS) and t.name not in fallback
                and t.name not in cached["timings"] and t.name not in cached["excluded"]]
        weights = self.engine.graph.initializers
        held = [a for name, a in zip(node.inputs, args) if name not in weights and isinstance(a, torch.Tensor)]
        self.compiler.submit(key, node, args, todo, held, family=_family(node, args, weights))

    def visit(self, node, args) -> None:
        offered = self._offered(node, args)
        if offered is None:
            return
        args, usable, skipped = offered
        key = self._key(node, args)
        cached = self.cache.get(key) or {"timings": {}, "excluded": {}}
        fallback = superseded([t.name for t in usable], self.level)
        todo = [t for t in usable if t.name not in cached["timings"] and t.name not in cached["excluded"]]
        first = [t for t in todo if t.name not in fallback]
        measured = bool(first) or "reference" not in cached["timings"]
        if measured:
            cached = self._measure_into(key, node, args, cached, first)
        # The superseded candidates: skipped where a superseding one this build allows timed correctly, else timed.
        allowed = {t.name for t in usable}
        passed = [n for n in cached["timings"] if n in allowed]
        for name, winners in fallback.items():
            by = [n for n in passed if n.startswith(winners)]
            if by:
                skipped[name] = _superseded_because(winners, by)
        rest = [t for t in todo if t.name in fallback and t.name not in skipped]
        if rest:
            cached = self._measure_into(key, node, args, cached, rest)
        self.stats["layers_measured" if measured or rest else "layers_from_cache"] += 1
        self.stats["superseded"] += sum(why.startswith("superseded") for why in skipped.values()) if measured else 0
        if self.on_layer:
            self.on_layer(node)
        names = {t.name for t in usable if t.name not in skipped} | {"reference"}
        rep = self.report.setdefault(id(node), {"layer": node.name, "op": node.op_type, "timings": {},
                                                "excluded": {}})
        totals = self.totals.setdefault(id(node), {}).setdefault(self.profile, {})
        for name, ms in cached["timings"].items():
            if name in names:
                totals[name] = totals.get(name, 0.0) + ms
                rep["timings"][name] = rep["timings"].get(name, 0.0) + ms
        rep["excluded"].update({n: why for n, why in cached["excluded"].items() if n in names}, **skipped)

    def _measure_into(self, key: str, node, args, cached: dict, cands: list) -> dict:
        """Measure `cands` (and the reference) and add them to the layer's timing cache entry."""
        found = self._measure(node, args, cands)
        cached = {k: {**cached[k], **found[k]} for k in ("timings", "excluded")}
        self.cache.put(key, cached)
        self.stats["candidates_measured"] += len(cands)
        return cached

    def _screen(self, node, args, cands) -> tuple[list, dict]:
        """(the candidates that apply to these inputs and this build allows, {name: why this build skips it})."""
        usable, skipped = [], {}
        for t in cands:
            try:
                if not t.applies(node, args):
                    continue
                need = t.workspace(node, args) if t.workspace else 0
            except Exception as e:  # an applicability check that cannot judge these inputs: not offered
                skipped[t.name] = f"failed: {summary(e, 120)}"
                continue
            pattern = next((p for p in self.exclude if fnmatch.fnmatchcase(t.name, p)), None)
            if pattern is not None:
                skipped[t.name] = f"excluded by --excludeTactics ({pattern})"
            elif self.cap is not None and need > self.cap:
                skipped[t.name] = f"needs {need / 2**20:.1f} MiB workspace, cap is {self.cap / 2**20:.1f} MiB"
            else:
                usable.append(t)
        return usable, skipped

    def _measure(self, node, args, cands) -> dict:
        entry = lookup(node.op_type, node.domain)
        ref = entry.impl(node, *args)
        before = self._l2_reset(node, args) if self._cold(node) else None
        start = time.perf_counter()
        timings = {"reference": median_ms(lambda: entry.impl(node, *args), before=before)}
        excluded = {}
        first = 0.0
        for t in cands:
            try:
                called = time.perf_counter()
                try:
                    out = t.fn(node, *args)  # one-time work (cuDNN's plan search, a Triton compile) happens here
                finally:
                    first += time.perf_counter() - called
                if synchronizes(lambda: t.fn(node, *args)):  # the reference may (data-dependent ops); a tactic not
                    excluded[t.name] = "synchronizes with the host: it would break the engine's CUDA graph"
                    continue
                ok, err = _close(out, ref, node.precision)
                if not ok:
                    excluded[t.name] = f"numerically wrong ({err})"
                    continue
                timings[t.name] = median_ms(lambda: t.fn(node, *args), may_sync=False, before=before)  # checked above
            except Exception as e:  # a candidate that cannot run here is simply not chosen
                excluded[t.name] = f"failed: {summary(e, 120)}"
        self.stats["first_calls_s"] += first
        self.stats["timing_s"] += time.perf_counter() - start - first
        return {"timings": timings, "excluded": excluded}

    def _cold(self, node) -> bool:
        return self.time_quantized_cold and node.op_type in _TIMED_COLD

    def _l2_reset(self, node, args) -> L2Reset | None:
        """The reset that leaves this layer's weights out of L2 and its other inputs in it (GPU builds)."""
        device = torch.device(self.engine.target.device)
        if device.type != "cuda":
            return None
        self.l2 = self.l2 or L2Reset(device)
        weights = self.engine.graph.initializers
        return self.l2.keeping([a for name, a in zip(node.inputs, args) if name not in weights])

    def findings(self) -> list[dict]:
        """A finding per tactic dropped from a layer because it raised or disagreed with the reference
        (the layer runs its next candidate); exclusions by the build's own settings are not findings."""
        out = []
        for rep in self.report.values():
            for name, why in rep["excluded"].items():
                if why.startswith(("failed", "numerically wrong")):
                    out.append({"kind": "tactic", "layer": rep["layer"], "tactic": name, "reason": why,
                                "runs": rep.get("chosen", "reference")})
        return out

    def assign(self) -> list[dict]:
        """Each layer's tactic per profile, and node.tactic: the least total time over the profiles among the
        tactics every profile timed (one that applies at batch 1 only must not win on its batch-1 time alone)."""
        by_id = {id(n): n for n in self.engine.graph.nodes}
        out = []
        for idx, per_profile in self.totals.items():
            node = by_id[idx]
            runs = [per_profile[p] for p in sorted(per_profile)]
            everywhere = [name for name in runs[0] if all(name in r for r in runs)]  # in timing order: ties resolve
            node.tactic = min(everywhere, key=lambda name: sum(r[name] for r in runs))  # the same in every build
            n = max(len(self.engine.profiles), max(per_profile) + 1)
            best = [min(per_profile[p], key=per_profile[p].get) if p in per_profile else node.tactic
                    for p in range(n)]  # a profile that never ran the layer keeps the overall choice
            node.profile_tactics = best if len(set(best)) > 1 else []
            rep = self.report[idx]
            rep["chosen"] = node.tactic
            if node.profile_tactics:
                rep["chosen_per_profile"] = list(best)
            rep["timings"] = {k: round(v, 5) for k, v in sorted(rep["timings"].items(), key=lambda kv: kv[1])}
            out.append(rep)
        return out
