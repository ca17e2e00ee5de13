"""Calibrators: from activation statistics to a per-tensor amax (and scale), plus weight scales.

All activation calibrators are symmetric: they choose `amax`, the largest |x| the
quantized tensor represents; the INT8 scale is amax / 127 and the FP8 (E4M3)
scale amax / 448.

* MinMax: amax = the largest |x| seen over the calibration set.
* Percentile: amax = the given percentile (e.g. 99.99) of |x|, read from a
  histogram of |x| (resolution: one histogram bin, amax_observed / num_bins).
* Entropy: TensorRT's EntropyCalibration2. A 2048-bin histogram of |x| over
  [0, amax_observed]; for every candidate threshold i (bins 128..2048) the
  reference distribution P (bins[:i], the outliers bins[i:] folded into the last
  bin) is compared with Q, bins[:i] quantized into 128 levels and expanded back
  (each level's mass spread evenly over its non-empty bins). The threshold with
  the smallest KL(P || Q) wins (the largest such threshold on ties). This follows
  NVIDIA's reference (pytorch-quantization `_compute_amax_entropy`), including
  its bins[0] = bins[1] step, which keeps the zeros of a ReLU from dominating.
  One guard on top: no threshold may clip more than MAX_CLIPPED of the values.
  The outliers folded into P's last bin carry no information about how far they
  lay, so on a distribution away from zero (a ReLU network's globally pooled
  features, all in [0.33, 1.47]) the search finds a near-zero KL at the first
  bin that holds any value and clips almost everything to it: ResNet-18's
  pooled features became one constant and its INT8 and FP8 logits 62% off.
  On the distributions NVIDIA's search was made for (ReLU, Gaussian, Laplace,
  Student-t activations) it clips under 1e-3 anyway and the guard changes nothing.

Weights get per-output-channel scales (`weight_scales`): Conv axis 0, Gemm axis 0
with transB else 1, MatMul and Kiln's FusedGemm (weights stored [K, N]) the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
DEFAULT_BINS = 2048
# An amax of zero (a tensor that was always 0, e.g. a dead ReLU) would give a zero scale: floor it.
MIN_AMAX = 1e-8

METHODS = ("entropy", "minmax", "percentile")
# The largest fraction of the calibration values an entropy threshold may clip (see the module doc).
MAX_CLIPPED = 1e-3


def int8_scale(amax: float) -> float:
    """The symmetric INT8 scale for amax (x_q = round(x / scale), clamped to [-127, 127])."""
    return float(np.float32(max(float(amax), MIN_AMAX) / INT8_MAX))


def fp8_e4m3_scale(amax: float) -> float:
    """The FP8 E4M3 scale for amax: x / scale spans E4M3's finite range [-448, 448]."""
    return float(np.float32(max(float(amax), MIN_AMAX) / FP8_E4M3_MAX))


# --- histogram-based amax ---------------------------------------------------------------------------


def _check_hist(hist) -> np.ndarray:
    h = np.asarray(hist, dtype=np.float64)
    if h.ndim != 1 or h.size == 0:
        raise ValueError(f"a histogram must be a non-empty 1-D array, got shape {h.shape}")
    if (h < 0).any():
        raise ValueError("a histogram cannot have negative counts")
    return h


def percentile_amax(hist, hist_max: float, percentile: float) -> float:
    """amax at `percentile` (0 < p <= 100) of |x|, from a histogram of |x| over [0, hist_max]:
    the upper edge of the bin where the cumulative fraction first reaches p/100."""
    if not 0 < percentile <= 100:
        raise ConfigError(f"percentile must be in (0, 100], got {percentile}.")
    h = _check_hist(hist)
    total = h.sum()
    if total == 0 or hist_max <= 0:
        return 0.0
    cdf = np.cumsum(h) / total
    idx = int(np.searchsorted(cdf, percentile / 100.0 - 1e-12, side="left"))
    idx = min(idx, h.size - 1)
    return float(hist_max) * (idx + 1) / h.size


def entropy_amax(hist, hist_max: float, num_quant_bins: int = 128, start_bin: int = 128,
                 stride: int = 1, max_clipped: float | None = MAX_CLIPPED) -> float:
    """TensorRT's EntropyCalibration2 threshold for a histogram of |x| over [0, hist_max], clipping at most
    `max_clipped` of the values (None: NVIDIA's search as it is)."""
    return entropy_search(hist, hist_max, num_quant_bins, start_bin, stride, max_clipped)[0]


def entropy_search(hist, hist_max: float, num_quant_bins: int = 128, start_bin: int = 128,
                   stride: int = 1, max_clipped: float | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    """(amax, candidate bin counts i, KL divergence of each candidate). Threshold i means amax =
    i * hist_max / len(hist). max_clipped: candidates that clip a larger fraction of the values get an
    infinite divergence (None: every candidate counts, as in NVIDIA's reference)."""
    raw = _check_hist(hist)
    bins = raw.copy()
    n = bins.size
    if hist_max <= 0 or bins.sum() == 0:
        return 0.0, np.zeros(0, int), np.zeros(0)
    if n <= num_quant_bins:  # too few bins to clip anything: keep the whole range
        return float(hist_max), np.array([n]), np.zeros(1)
    if n > 1:
        bins[0] = bins[1]
    if bins.sum() == 0:  # every value fell in the first bin (dropped above): nothing to clip
        return float(hist_max), np.array([n]), np.zeros(1)
    starting = min(start_bin, n)
    candidates = np.arange(starting, n + 1, stride)
    divergences = _kl_all(bins, candidates, num_quant_bins)
    if max_clipped is not None:
        above = np.concatenate([np.cumsum(raw[::-1])[::-1], [0.0]])  # above[i]: the values in bins i and up
        divergences = np.where(above[candidates] > max_clipped * raw.sum(), np.inf, divergences)
        if not np.isfinite(divergences).any():
            return float(hist_max), candidates, divergences
    best = divergences.min()
    # The last minimum, as the reference's argmin over the reversed list (ties within float noise).
    last_argmin = int(np.flatnonzero(divergences <= best + 1e-12 * max(abs(best), 1e-12))[-1])
    i = int(candidates[last_argmin])
    return float(hist_max) * i / n, candidates, divergences


def _kl_all(bins: np.ndarray, candidates: np.ndarray, nq: int) -> np.ndarray:
    """KL(P || Q) for every candidate threshold at once, from prefix sums: P is bins[:i] with the outliers clipped
    into its last bin, Q the same bins merged into nq levels and spread back over their non-empty bins (TensorRT's
    EntropyCalibration2; tests/quant/test_calibrators.py checks it against a literal port of NVIDIA's loop)."""
    n = bins.size
    b = bins
    C = np.concatenate([[0.0], np.cumsum(b)])
    nz = np.concatenate([[0.0], np.cumsum(b > 0)])
    blogb = np.concatenate([[0.0], np.cumsum(np.where(b > 0, b * np.log(np.where(b > 0, b, 1.0)), 0.0))])
    i = candidates.astype(np.int64)[:, None]  # [T, 1]
    k = np.arange(nq + 1, dtype=np.int64)[None, :]  # level boundaries
    edges = (k * i + nq - 1) // nq  # first bin of level k: ceil(k * i / nq); edges[:, nq] == i
    mass = C[edges[:, 1:]] - C[edges[:, :-1]]  # [T, nq]
    count = nz[edges[:, 1:]] - nz[edges[:, :-1]]
    per_bin = np.divide(mass, count, out=np.zeros_like(mass), where=count > 0)
    log_pb = np.log(np.where(per_bin > 0, per_bin, 1.0))
    i1 = i[:, 0]
    last = i1 - 1  # the last kept bin takes the outliers
    b_last = b[last]
    last_level = (last * nq) // i1
    P = C[n]
    Q = C[i1]
    # x < i-1: sum p log p - sum p log q, p = b/P, q = per_bin[level]/Q
    mass_head = mass.copy()
    mass_head[np.arange(len(i1)), last_level] -= b_last
    head_plogp = (blogb[last] - C[last] * np.log(P)) / P
    head_plogq = ((mass_head * log_pb).sum(axis=1) - C[last] * np.log(np.where(Q > 0, Q, 1.0))) / P
    p_last = (b_last + (P - Q)) / P
    q_last = np.where(b_last > 0, per_bin[np.arange(len(i1)), last_level], 0.0) / np.where(Q > 0, Q, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where(p_last > 0, p_last * (np.log(p_last) - np.log(q_last)), 0.0)
    kl = head_plogp - head_plogq + tail
    kl = np.where((p_last > 0) & (q_last == 0), np.inf, kl)
    kl = np.where(Q > 0, kl, np.inf)
    return np.maximum(kl, 0.0)


# --- calibrators ------------------------------------------------------------------------------------


@dataclass
class MinMaxCalibrator:
    name = "minmax"
    trt_name = "MinMaxCalibration"
    needs_histogram = False

    def amax(self, absmax: float, hist=None, hist_max: float | None = None) -> float:
        return float(absmax)


@dataclass
class PercentileCalibrator:
    percentile: float = 99.99
    name = "percentile"
    trt_name = "PercentileCalibration"  # TensorRT has no percentile calibrator; Kiln's own header
    needs_histogram = True

    def __post_init__(self):
        if not 0 < self.percentile <= 100:
            raise ConfigError(f"percentile must be in (0, 100], got {self.percentile}.")

    def amax(self, absmax: float, hist=None, hist_max: float | None = None) -> float:
        if hist is None:
            return float(absmax)
        return min(float(absmax), percentile_amax(hist, absmax if hist_max is None else hist_max, self.percentile))


@dataclass
class EntropyCalibrator:
    num_quant_bins: int = 128
    name = "entropy"
    trt_name = "EntropyCalibration2"
    needs_histogram = True

    def amax(self, absmax: float, hist=None, hist_max: float | None = None) -> float:
        if hist is None:
            return float(absmax)
        return min(float(absmax), entropy_amax(hist, absmax if hist_max is None else hist_max, self.num_quant_bins))


def get_calibrator(method: str, percentile: float = 99.99):
    m = method.lower().replace("-", "").replace("_", "")
    if m in ("entropy", "entropy2", "entropycalibration2", "kl"):
        return EntropyCalibrator()
    if m in ("minmax", "max", "minmaxcalibration"):
        return MinMaxCalibrator()
    if m in ("percentile", "percentilecalibration"):
        return PercentileCalibrator(percentile)
    raise ConfigError(f"unknown calibration method '{method}'; choose one of {', '.join(METHODS)}.")


# --- weights ----------------------------------------------------------------------------------------

WEIGHT_OPS = ("Conv", "FusedConv", "ConvTranspose", "Gemm", "FusedGemm", "MatMul")


@dataclass
class WeightScale:
    """Per-output-channel symmetric scales of one weight tensor."""

    name: str
    axis: int  # the output-channel axis of the stored weight
    amax: np.ndarray  # float32 [channels]

    @property
    def scales(self) -> np.ndarray:
        return (np.maximum(self.amax, MIN_AMAX) / INT8_MAX).astype(np.float32)

    @property
    def fp8_scales(self) -> np.ndarray:
        return (np.maximum(self.amax, MIN_AMAX) / FP8_E4M3_MAX).astype(np.float32)

    def to_json(self) -> dict:
        return {"axis": self.axis, "amax": [float(a) for a in self.amax], "scales": [float(s) for s in self.scales]}

    @classmethod
    def from_json(cls, name: str, d: dict) -> WeightScale:
        return cls(name, int(d["axis"]), np.asarray(d["amax"], dtype=np.float32))


def per_channel_amax(w, axis: int) -> np.ndarray:
    """max |w| over every axis but `axis`: one amax per output channel."""
    t = w.detach().float() if isinstance(w, torch.Tensor) else torch.as_tensor(np.asarray(w, np.float32))
    axis = axis % t.dim()
    t = t.abs().movedim(axis, 0).reshape(t.shape[axis], -1)
    return t.amax(dim=1).cpu().numpy().astype(np.float32) if t.shape[1] else np.zeros(t.shape[0], np.float32)


def weight_axis(node) -> int | None:
    """The output-channel axis of input 1 (the weight) of a Conv/Gemm/MatMul-like node, or None."""
    op = node.op_type
    if op in ("Conv", "FusedConv"):
        return 0
    if op == "ConvTranspose":
        return 1 if node.attr("group", 1) == 1 else None  # [C_in, C_out/group, ...]: grouped axes interleave
    if op == "Gemm":
        return 0 if node.attr("transB", 0) else 1
    if op in ("FusedGemm", "MatMul"):
        return -1
    return None


def weight_scales(graph) -> dict[str, WeightScale]:
    """Per-output-channel scales for every constant weight read by a Conv/Gemm/MatMul layer."""
    out: dict[str, WeightScale] = {}
    for node in graph.nodes:
        if node.op_type not in WEIGHT_OPS or len(node.inputs) < 2:
            continue
        name = node.inputs[1]
        w = graph.initializers.get(name)
        axis = weight_axis(node)
        if w is None or axis is None or not w.dtype.is_floating_point or w.dim() < 2 or name in out:
            continue
        axis = axis % w.dim()
        out[name] = WeightScale(name, axis, per_channel_amax(w, axis))
    return out
