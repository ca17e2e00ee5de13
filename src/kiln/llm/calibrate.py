"""Calibration on representative text: KV-cache scales, and the activation statistics weight quantization uses.

`calibrate_kv_scales` runs the calibration tokens through the decoder with a float paged cache, then reads the
cache back: per layer, the absolute maximum of the keys (after RoPE, as the cache holds them) and of the values,
and the keys' mean. FP8 (E4M3): one scale per layer, amax / 448, repeated over the KV heads (the cache
contract's layout), and the keys stored centred on their mean (kiln.kernels.paged_attention's k_offset: exact
for softmax, and FP8's 3-bit mantissa then rounds the keys' spread instead of their large common part); INT8:
one per KV head, amax / 127. (Centring is asked for by `centre_keys`; a .kiln engine file stores the offsets in
its manifest.) Every scale comes from data: an empty or all-zero calibration is refused, never replaced by 1.0.

`activation_stats` records, for every decoder matrix, the inputs it multiplies: the per-input-channel absolute
maximum (SmoothQuant's statistic) and a bounded random sample of input rows (AWQ's scale search).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InputError
from .attention import KVScales, key_offset
from .perplexity import EIGHT_BIT, FP8, PagedSequence, kv_cache_name
from .quantize import linear_weights, set_linear_weight

FP8_MAX, INT8_MAX = 448.0, 127.0


def calibration_windows(ids, window: int) -> list[torch.Tensor]:
    """Token ids split into consecutive windows of at most `window` tokens (each is its own sequence)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.numel() == 0:
        raise InputError("the calibration text holds no tokens.")
    return [ids[i:i + window] for i in range(0, ids.numel(), window)]


@dataclass
class KVStatistics:
    """What the cache held while the calibration tokens ran, per layer."""

    absmax: torch.Tensor  # FP32 [num_layers, 2 (K, V), num_kv_heads]: largest |value| per KV head
    key_mean: torch.Tensor  # FP32 [num_layers, num_kv_heads, head_dim]: the keys' mean over the tokens


def kv_statistics(model, ids, *, window: int = 512, chunk: int = 256) -> KVStatistics:
    """Runs the calibration tokens (windows of at most `window` tokens, each its own sequence) through a float
    paged cache and reads back what it holds: keys after RoPE, values."""
    cfg = model.cfg
    amax = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads)
    key_sum = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    count = 0
    with torch.inference_mode():
        for piece in calibration_windows(ids, min(window, cfg.max_position_embeddings)):
            seq = PagedSequence.allocate(model, piece.numel(), model.dtype)
            seq.prefill(model, piece, chunk)
            written = seq.block_table.long()
            for n, cache in enumerate(seq.caches):
                for j, c in enumerate((cache.k, cache.v)):
                    tokens = c[written].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:piece.numel()].float()
                    amax[n, j] = torch.maximum(amax[n, j], tokens.abs().amax(dim=(0, 2)).cpu())
                    if j == 0:
                        key_sum[n] += tokens.double().sum(dim=0).cpu()
            count += piece.numel()
    return KVStatistics(amax, (key_sum / count).float())


def kv_absmax(model, ids, *, window: int = 512, chunk: int = 256) -> torch.Tensor:
    """FP32 [num_layers, 2 (K, V), num_kv_heads]: the largest |value| the cache held for each KV head while the
    calibration tokens ran (kv_statistics' absmax)."""
    return kv_statistics(model, ids, window=window, chunk=chunk).absmax


def kv_scales_from_absmax(amax: torch.Tensor, kv_cache_dtype, key_mean: torch.Tensor | None = None):
    """[KVScales] per layer from kv_absmax's maxima: FP8 amax / 448 (one per layer, repeated over the KV heads),
    INT8 amax / 127 per KV head. With key_mean (kv_statistics'; FP8 only) each layer's FP8 cache also stores its
    keys centred on that mean (KVScales.k_offset), which softmax does not see; the scales stay those of the
    uncentred keys, so they hold either form. Refuses maxima that are zero or not finite."""
    dtype = {"fp8": FP8, "int8": torch.int8}.get(kv_cache_dtype, kv_cache_dtype)
    if dtype not in EIGHT_BIT:
        raise ConfigError(f"KV scales are for fp8 or int8 caches, not {kv_cache_dtype!r}.")
    if not torch.isfinite(amax).all() or (key_mean is not None and not torch.isfinite(key_mean).all()):
        raise InputError("calibration produced non-finite keys or values: the model overflows on this text.")
    for n in range(amax.shape[0]):
        for j, name in enumerate("KV"):
            if (amax[n, j] <= 0).any():
                raise InputError(f"calibration saw only zeros in layer {n}'s {name} cache (KV head "
                                 f"{int((amax[n, j] <= 0).nonzero()[0])}); give a longer, representative --calib "
                                 "text.")
    if dtype == FP8:  # one scale per layer
        amax = amax.amax(dim=2, keepdim=True).expand_as(amax)
    scales = (amax / (FP8_MAX if dtype == FP8 else INT8_MAX)).float()
    offsets = key_mean if dtype == FP8 else None
    return [KVScales(scales[n, 0].contiguous(), scales[n, 1].contiguous(),
                     None if offsets is None else offsets[n].contiguous()) for n in range(amax.shape[0])]


def calibrate_kv_scales(model, ids, kv_cache_dtype, *, window: int = 512, chunk: int = 256,
                        centre_keys: bool = False):
    """[KVScales] per layer, FP32 [num_kv_heads] each, for an FP8 or INT8 cache (torch dtype or name). With
    centre_keys, an FP8 cache also stores its keys centred on their calibrated mean (KVScales.k_offset), unless
    the model soft-caps its attention logits. (Off by default: a .kiln engine file keeps the scales alone.)"""
    kv_scales_from_absmax(torch.ones(1, 2, 1), kv_cache_dtype)  # refuse a float cache before running anything
    stats = kv_statistics(model, ids, window=window, chunk=chunk)
    centre = centre_keys and not getattr(model.cfg, "attn_logit_softcap", None)
    return kv_scales_from_absmax(stats.absmax, kv_cache_dtype, stats.key_mean if centre else None)


def describe_kv_scales(scales, dtype) -> dict:
    """The manifest's form: per layer, K and V scales as lists of floats (and the key offset, per KV head and
    channel, where the cache centres its keys)."""
    layers = []
    for pair in scales:
        k, v = pair
        entry = {"k_scale": k.tolist(), "v_scale": v.tolist()}
        if key_offset(pair) is not None:
            entry["k_offset"] = key_offset(pair).tolist()
        layers.append(entry)
    return {"dtype": kv_cache_name(dtype) if isinstance(dtype, torch.dtype) else dtype,
            "granularity": "per-layer" if dtype in (FP8, "fp8") else "per-kv-head",
            "keys_centred": any(key_offset(p) is not None for p in scales), "layers": layers}


@dataclass
class ActivationStats:
    absmax: torch.Tensor  # FP32 [in]: max |x| per input channel
    sample: torch.Tensor  # FP32 [<= max_rows, in]: input rows, drawn uniformly from all seen
    rows_seen: int = 0


class _Recorder(torch.Tensor):
    """Stands in a weight's place during calibration: records what F.linear multiplies it by, then multiplies."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor, stats: dict, key: str, max_rows: int, generator: torch.Generator):
        t = torch.Tensor._make_subclass(cls, weight, False)
        t.weight, t.stats, t.key, t.max_rows, t.generator = weight, stats, key, max_rows, generator
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.linear:
                x, w = args[0], args[1]
                w.record(x.reshape(-1, x.shape[-1]).float())
                return F.linear(x, w.weight, *args[2:], **kwargs)
            return func(*args, **kwargs)

    def record(self, x: torch.Tensor) -> None:
        s = self.stats.get(self.key)
        if s is None:
            s = self.stats[self.key] = ActivationStats(torch.zeros(x.shape[1]), torch.zeros(0, x.shape[1]))
        s.absmax = torch.maximum(s.absmax, x.abs().amax(dim=0).cpu())
        # reservoir-style: keep a uniform sample of at most max_rows rows over everything seen
        s.rows_seen += x.shape[0]
        keep = torch.rand(x.shape[0], generator=self.generator) < self.max_rows / max(s.rows_seen, 1)
        s.sample = torch.cat([s.sample, x.cpu()[keep]])
        if s.sample.shape[0] > self.max_rows:
            idx = torch.randperm(s.sample.shape[0], generator=self.generator)[:self.max_rows]
            s.sample = s.sample[idx.sort().values]


def activation_stats(model, ids, *, window: int = 512, chunk: int = 256, max_rows: int = 512,
                     seed: int = 0) -> dict[str, ActivationStats]:
    """{'layers.N.<key>': ActivationStats} of every decoder matrix's input over the calibration tokens."""
    stats: dict[str, ActivationStats] = {}
    gen = torch.Generator().manual_seed(seed)
    originals = linear_weights(model)
    for key, w in originals.items():
        if not isinstance(w, torch.Tensor) or type(w) is not torch.Tensor:
            raise ConfigError(f"'{key}' is already quantized; calibrate on the float model.")
        set_linear_weight(model, key, _Recorder(w, stats, key, max_rows, gen))
    try:
        with torch.inference_mode():
            for piece in calibration_windows(ids, min(window, model.cfg.max_position_embeddings)):
                seq = PagedSequence.allocate(model, piece.numel(), model.dtype)
                seq.prefill(model, piece, chunk)
    finally:
        for key, w in originals.items():
            set_linear_weight(model, key, w)
    return stats
