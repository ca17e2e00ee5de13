"""Build options, in trtexec's vocabulary."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..engine.profile import Profile, Shape
from ..errors import ConfigError


@dataclass
class BuildConfig:
    fp16: bool = False
    bf16: bool = False
    tf32: bool = False
    # INT8 (post-training): GEMMs and convolutions run on int8 with calibrated activation scales.
    # Needs calibration data (a .npz/.npy/folder, or an iterable of input dicts) or a calibration cache.
    int8: bool = False
    fp8: bool = False  # FP8 E4M3 GEMMs and convolutions (Hopper/Ada), calibrated like INT8
    calib: object = None
    calib_cache: str | None = None  # read if it exists, else written after calibrating
    calib_method: str = "entropy"  # "entropy" (TensorRT's EntropyCalibration2), "minmax", "percentile"
    layer_precisions: dict[str, str] = field(default_factory=dict)  # ONNX node name -> fp32/fp16/bf16/tf32
    # trtexec's --precisionConstraints: "none" (default) lets a GPU build keep a quantizable layer in float where
    # its timed float tactics beat the 8-bit ones (quant/speed.py); "obey" quantizes every one it can.
    precision_constraints: str = "none"
    # Precision search (quant/search.py): {"top1": 0.5} = at most 0.5 points below FP32 on budget_data.
    accuracy_budget: dict[str, float] = field(default_factory=dict)
    budget_data: object = None
    # Either explicit profiles, or `shapes` (one fixed shape per input) as a shortcut.
    profiles: list[Profile] = field(default_factory=list)
    shapes: dict[str, Shape] = field(default_factory=dict)
    workspace_bytes: int | None = None
    device: str = "auto"  # "auto" (a GPU if there is one), "cuda", "cuda:N" or "cpu"
    cuda_graphs: bool = True
    # Auxiliary streams in the CUDA graph for layers beside the main chain (engine/streams.py); Kiln uses
    # at most one (trtexec --maxAuxStreams). Off by default: its gain is within run-to-run noise so far
    # (docs/design/streams.md).
    max_aux_streams: int = 0
    progress: bool = True
    validate: bool = True  # run each profile once at build time (errors surface now, arena is measured)
    # FP16/BF16 builds, and the float layers of INT8/FP8 ones (with or without validate): each layer is compared
    # with FP32 on the profiles' opt shapes and kept in FP32 where it overflows or drifts (builder/precision.guard;
    # the build's findings say which and why).
    precision_guard: bool = True
    # 0: reference kernels only; 1-2: library tactics (cuDNN, cuBLASLt, SDPA); 3 (default): also
    # Triton fused add+LayerNorm and generated elementwise kernels; 4-5: also Triton GEMM,
    # implicit-GEMM convolution and flash-attention configurations. Higher = longer build.
    optimization_level: int = 3
    timing_cache: str | None = None  # JSON file of tactic timings reused across builds
    # Tactic names (shell-style patterns, e.g. "triton_tma_*") never to time or choose: to take a misbehaving
    # tactic out of a build, or to measure what a family of tactics is worth (bench/ab_tactics.py).
    exclude_tactics: tuple[str, ...] = ()
    # 8-bit GEMMs and convolutions timed with their weights out of L2, as an engine meets them (tactic_selection.py);
    # False times them warm, to compare the two (bench/ab_tactics.py --off time_quantized_cold).
    time_quantized_cold: bool = True
    # A folder for the graph after each build pass (builder/pipeline.py), as NN-pass.onnx (or .txt): to see what
    # each pass did. Not part of the engine.
    dump_passes: str | None = None
    # Fusion passes (passes.PIPELINE's fuse_* and merge_*) the build leaves out, by name: to see what one changes,
    # in speed or accuracy (kiln build --skipPasses fuse_view_chains). The others are needed to build at all.
    skip_passes: tuple[str, ...] = ()

    @property
    def quantized(self) -> str | None:
        """"fp8" or "int8" when GEMMs and convolutions are quantized (FP8 wins when both are allowed)."""
        return "fp8" if self.fp8 else "int8" if self.int8 else None

    @property
    def precision(self) -> str:
        if self.fp16:
            return "float16"
        if self.bf16:
            return "bfloat16"
        if self.tf32:
            return "tf32"
        return "float32"

    def to_json(self) -> dict:
        return {
            "precision": self.precision, "fp16": self.fp16, "bf16": self.bf16, "tf32": self.tf32,
            "int8": self.int8, "fp8": self.fp8, "calib_method": self.calib_method if self.quantized else None,
            "workspace_bytes": self.workspace_bytes, "cuda_graphs": self.cuda_graphs,
            "max_aux_streams": min(1, max(0, self.max_aux_streams)),
            "optimization_level": self.optimization_level, "layer_precisions": self.layer_precisions,
            "precision_constraints": self.precision_constraints, "precision_guard": self.precision_guard,
            "exclude_tactics": list(self.exclude_tactics), "time_quantized_cold": self.time_quantized_cold,
            "skip_passes": list(self.skip_passes),
        }


def parse_layer_precisions(text: str) -> dict[str, str]:
    """'conv1:fp32,fc:fp16' -> {'conv1': 'fp32', 'fc': 'fp16'} (names may contain ':', the last one splits)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if ":" not in item:
            raise ConfigError(f"--layerPrecisions: '{item}' should be LAYER:PRECISION, e.g. conv1:fp32.")
        name, prec = item.rsplit(":", 1)
        out[name.strip()] = prec.strip()
    return out


def parse_mem_pool(text: str) -> int:
    """'workspace:4096' (MiB, as trtexec) or 'workspace:4G' -> bytes."""
    m = re.fullmatch(r"\s*workspace\s*:\s*([0-9.]+)\s*([KMG]?)\s*", text, re.I)
    if not m:
        raise ConfigError(f"--memPoolSize: '{text}' should look like workspace:4096 (MiB) or workspace:4G.")
    scale = {"": 2**20, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)
