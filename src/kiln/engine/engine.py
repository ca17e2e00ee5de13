"""The Engine: an optimized, placed, precision-assigned graph for one target."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ir import dtypes
from ..ir.graph import Graph, Value
from ..ops.registry import lookup
from .profile import Profile
from .target import Target


@dataclass
class Engine:
    graph: Graph
    profiles: list[Profile]
    target: Target
    build_config: dict
    capturable: bool  # the whole plan can be one CUDA graph per input shape
    # Measured at build time on the target: activation bytes at each profile's max shapes.
    arena_bytes: list[int | None] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    build_seconds: float | None = None
    # Builder findings the inspector shows, e.g. {"kind": "fusion-missed", "pattern": ..., "nodes": [...],
    # "reason": ...} or {"kind": "precision", "layer": ..., "reason": ...}.
    findings: list[dict] = field(default_factory=list)
    # Per layer with candidates: timings of each tactic, those excluded and why, the one chosen.
    tactics: list[dict] = field(default_factory=list)
    # Convolution weights stored channels-last on the device (NHWC: Tensor Core friendly).
    channels_last: list[str] = field(default_factory=list)
    # Of those, [K, 3, R, S] stem weights stored with a fourth, zero input channel (kiln/builder/layout.py).
    padded_channels: list[str] = field(default_factory=list)
    column_major: list[str] = field(default_factory=list)  # 2-D weights stored transposed (kiln/builder/layout.py)
    _device_weights: dict | None = field(default=None, repr=False)

    # --- bindings -------------------------------------------------------------
    @property
    def inputs(self) -> list[Value]:
        return self.graph.inputs

    @property
    def outputs(self) -> list[Value]:
        return self.graph.outputs

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_profile_shape(self, profile: int, name: str):
        """(min, opt, max) for one input in one profile."""
        return self.profiles[profile].shapes[name]

    def bindings(self) -> list[dict]:
        rows = []
        for io, values in (("input", self.inputs), ("output", self.outputs)):
            for v in values:
                rows.append({
                    "name": v.name, "io": io,
                    "dtype": dtypes.name_of(v.dtype) if v.dtype is not None else None,
                    "shape": [d if isinstance(d, int) else -1 for d in v.shape] if v.shape is not None else None,
                })
        return rows

    def random_inputs(self, profile: int = 0, pick: int = 1, shapes: dict | None = None, seed: int = 0,
                      device=None, val_range: dict | None = None) -> dict[str, torch.Tensor]:
        """Seeded synthetic inputs at a profile's min (pick=0), opt (1) or max (2) shape, or at `shapes`,
        drawn to look like data (kiln/engine/synthetic.py): token ids over the embedding's rows, masks as
        masks, floats standard normal, `val_range` {input or None: (lo, hi)} as --valRange gives."""
        from .synthetic import synthetic_inputs

        return synthetic_inputs(self, profile, pick, shapes, seed, device, val_range)

    @property
    def precision(self) -> str:
        return self.build_config.get("precision", "float32")

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.graph.initializers.values())

    # --- placement of weights on the target ----------------------------------
    def host_weight_names(self) -> set[str]:
        """Weights read as shape arguments or by host (shape arithmetic) nodes: kept on the CPU."""
        names = set()
        for node in self.graph.nodes:
            entry = lookup(node.op_type, node.domain)
            for pos, name in enumerate(node.inputs):
                if name in self.graph.initializers and (node.placement == "host" or pos in entry.host_inputs):
                    names.add(name)
        return names

    def weights_on_target(self) -> dict[str, torch.Tensor]:
        """Weights as the runtime reads them: on the device, except host-read ones. Shared by contexts."""
        if self._device_weights is None:
            dev = self.target.device
            host = self.host_weight_names()
            nhwc, kmajor, padded = set(self.channels_last), set(self.column_major), set(self.padded_channels)

            def placed(k, t):
                if k in host:
                    return t
                if k in padded:
                    t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 4 - t.shape[1]))
                if k in nhwc:  # exact channels-last strides, size-1 axes too (builder/layout.py says why)
                    _, c, h, w = t.shape
                    return torch.empty_strided(t.shape, (c * h * w, 1, w * c, c), dtype=t.dtype, device=dev).copy_(t)
                return t.to(dev).t().contiguous().t() if k in kmajor else t.to(dev)

            self._device_weights = {k: placed(k, t) for k, t in self.graph.initializers.items()}
            for node in self.graph.walk():
                node.device = dev if node.placement == "device" else torch.device("cpu")
                for v in node.attrs.values():  # control-flow bodies keep their own weights
                    for sub in v if isinstance(v, list) else [v]:
                        if isinstance(sub, Graph):
                            sub.initializers = {k: t.to(dev) for k, t in sub.initializers.items()}
        return self._device_weights

    def create_execution_context(self, profile: int = 0, cuda_graphs: bool | None = None):
        from .context import ExecutionContext

        return ExecutionContext(self, profile=profile, cuda_graphs=cuda_graphs)

    def save(self, path) -> None:
        from .serialize import save

        save(self, path)
