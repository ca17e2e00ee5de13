"""Running several requests of one Kiln engine as few engine calls (the serving systems' dynamic batching).

Requests whose non-batch dims agree run as one call, concatenated on axis 0, and their outputs are split back.
A merged batch below a profile's min batch is padded with copies of its last row, whose outputs are dropped.
Each call runs on the first optimization profile that accepts its shapes. Used by the Triton Python-backend
model (kiln/serve/triton_model.py) and the Ray Serve engine replicas (kiln/serve/ray_engine.py).
"""

from __future__ import annotations

import torch

from ..errors import InputError, KilnError, ShapeError


def batch_range(manifest: dict) -> tuple[int, int] | None:
    """(largest max batch, opt batch of the profile holding it) when axis 0 of every binding is a batch axis."""
    bindings = manifest["bindings"]
    if any(not b["shape"] or b["shape"][0] != -1 for b in bindings):
        return None
    best = None
    for p in manifest["profiles"]:
        lo, opt, hi = ({p[n][k][0] for n in p} for k in ("min", "opt", "max"))
        if len(lo) != 1 or len(opt) != 1 or len(hi) != 1:
            return None  # inputs disagree on the batch range: not one batch axis
        if best is None or max(hi) > best[0]:
            best = (max(hi), max(opt))
    return best


def batch_limit(path) -> tuple[int, bool]:
    """(largest batch the engine's profiles accept on a batch axis, or 0 without one; built for a GPU?)."""
    from ..engine.serialize import read_manifest

    manifest = read_manifest(path)
    batch = batch_range(manifest) if "bindings" in manifest else None
    return (batch[0] if batch else 0), manifest.get("target", {}).get("kind") == "cuda"


class BatchRunner:
    def __init__(self, engine, device, batching: bool, max_rows: int | None = None):
        self.engine, self.device, self.batching = engine, torch.device(device), batching
        self.max_rows = max_rows  # rows per engine call; Triton's batcher keeps to it by itself
        self.contexts = [engine.create_execution_context(profile=i) for i in range(engine.num_optimization_profiles)]
        self.input_names = [v.name for v in engine.inputs]
        self.output_names = [v.name for v in engine.outputs]

    def run_many(self, feeds: list[dict]) -> list[dict | KilnError]:
        """Outputs (name -> tensor) of each request, or the KilnError that refused its group."""
        results: list = [None] * len(feeds)
        for group in self._groups(feeds):
            try:
                for i, outs in zip(group, self._run([feeds[i] for i in group])):
                    results[i] = outs
            except KilnError as e:
                for i in group:
                    results[i] = e
        return results

    def _groups(self, feeds):
        """Indices of requests that can share one engine call (same inputs, same non-batch dims)."""
        if not self.batching:
            return [[i] for i in range(len(feeds))]
        groups: dict = {}
        for i, f in enumerate(feeds):
            key = tuple((k, tuple(x.shape[1:]), x.dtype) for k, x in sorted(f.items()))
            groups.setdefault(key, []).append(i)
        if not self.max_rows:
            return list(groups.values())
        calls = []
        for members in groups.values():  # split where the rows would pass max_rows
            call, rows = [], 0
            for i in members:
                n = next(iter(feeds[i].values())).shape[0] if feeds[i] else 0
                if call and rows + n > self.max_rows:
                    calls.append(call)
                    call, rows = [], 0
                call.append(i)
                rows += n
            calls.append(call)
        return calls

    def _run(self, feeds):
        missing = [k for k in self.input_names if k not in feeds[0]]
        if missing or len(feeds[0]) != len(self.input_names):
            raise InputError(f"the request gives inputs {sorted(feeds[0])}; this engine takes {self.input_names}.")
        if self.batching:
            if any(x.dim() == 0 for x in feeds[0].values()):
                raise InputError("a batched model's inputs need a batch axis; a scalar was given.")
            sizes = [next(iter(f.values())).shape[0] for f in feeds]
            merged = {k: torch.cat([f[k] for f in feeds]).to(self.device) for k in self.input_names}
        else:
            sizes, merged = None, {k: x.to(self.device) for k, x in feeds[0].items()}
        ctx, merged = self._context_for(merged)
        with torch.inference_mode():
            outs = ctx.run(merged)
        if sizes is None:
            return [outs]
        splits = {k: torch.split(v[:sum(sizes)], sizes) for k, v in outs.items()}  # drops padded rows
        return [{k: splits[k][i] for k in outs} for i in range(len(sizes))]

    def _context_for(self, feeds):
        """The first profile that accepts these shapes, padding the batch up to its min where batching."""
        error = None
        for ctx in self.contexts:
            padded = feeds
            if self.batching:
                batch = next(iter(feeds.values())).shape[0]
                need = self.engine.get_profile_shape(ctx.profile, self.input_names[0])[0][0] - batch
                if need > 0:
                    padded = {k: torch.cat([x, x[-1:].expand(need, *x.shape[1:])]) for k, x in feeds.items()}
            try:
                for k, x in padded.items():
                    ctx.check_shape(k, tuple(x.shape))
                return ctx, padded
            except ShapeError as e:
                error = error or e
        raise error
