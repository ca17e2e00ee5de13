"""Sliding-window perplexity through Kiln's own decoder and paged KV cache (`kiln llm perplexity`).

The text's tokens are scored in windows of `window` tokens that advance by `stride`: each window starts from an
empty cache, is prefilled in chunks through the paged KV cache (so every key and value the attention reads has
been written to, and read back from, the cache in its storage type: an 8-bit cache is quantized with its
calibrated scales), and scores only the tokens the previous window did not (each with at least
`window - stride` tokens of context, except in the first window). Perplexity = exp(mean negative
log-likelihood of the scored tokens).

The cache's blocks are handed out in a shuffled order, so the block table is exercised as in serving.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InputError

FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES = {"auto": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                   "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "fp8": FP8,
                   "fp8_e4m3": FP8, "int8": torch.int8}
EIGHT_BIT = (FP8, torch.int8)


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kvCacheDtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}.")
    return KV_CACHE_DTYPES[name] or model_dtype


def kv_cache_name(dtype: torch.dtype) -> str:
    return {FP8: "fp8", torch.int8: "int8", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float32: "fp32"}[dtype]


@dataclass
class PagedSequence:
    """One sequence's paged KV cache across all layers, its blocks in a shuffled order."""

    caches: list
    block_table: torch.Tensor  # int32 [num_blocks]
    block_size: int

    @classmethod
    def allocate(cls, model, num_tokens: int, dtype: torch.dtype, kv_scales=None, block_size: int = 16,
                 seed: int = 0) -> PagedSequence:
        from .attention import LayerCache, key_offset

        cfg, dev = model.cfg, model.device
        if dtype in EIGHT_BIT and kv_scales is None:
            raise ConfigError(f"an {kv_cache_name(dtype)} KV cache needs calibrated K/V scales (calibrate.py's "
                              "calibrate_kv_scales, or --calib TEXT).")
        blocks = max(1, -(-num_tokens // block_size))
        shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        caches = []
        for n in range(cfg.num_layers):
            ks, vs = (kv_scales[n] if dtype in EIGHT_BIT else (None, None))
            caches.append(LayerCache(torch.zeros(shape, dtype=dtype, device=dev),
                                     torch.zeros(shape, dtype=dtype, device=dev),
                                     None if ks is None else ks.to(dev, torch.float32),
                                     None if vs is None else vs.to(dev, torch.float32),
                                     key_offset(kv_scales[n], dev) if dtype in EIGHT_BIT else None))
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
        return cls(caches, order.to(dev), block_size)

    def prefill(self, model, ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """Run ids [T] through the model from position 0, `chunk` tokens a step; final hidden states [T, H]."""
        from .attention import AttentionMetadata

        dev = model.device
        ids = ids.to(dev)
        outs = []
        for start in range(0, ids.numel(), chunk):
            end = min(start + chunk, ids.numel())
            pos = torch.arange(start, end, device=dev)
            slots = self.block_table[pos // self.block_size].long() * self.block_size + pos % self.block_size
            md = AttentionMetadata(
                slot_mapping=slots, query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=dev), block_tables=self.block_table[None],
                max_query_len=end - start, max_seq_len=end)
            outs.append(model.forward(ids[start:end], pos, md, self.caches))
        return torch.cat(outs)


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int
    window: int
    stride: int
    kv_cache_dtype: str

    def to_json(self) -> dict:
        return asdict(self)


def perplexity(model, ids, *, kv_cache_dtype: str = "auto", kv_scales=None, window: int = 512,
               stride: int = 256, chunk: int = 256, block_size: int = 16) -> PerplexityResult:
    """Sliding-window perplexity of token ids under `model` (a kiln.llm.model.DecoderModel)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.numel() < 2:
        raise InputError(f"perplexity needs at least 2 tokens, the text has {ids.numel()}.")
    if not 0 < stride <= window:
        raise ConfigError(f"--stride ({stride}) must be in 1..--window ({window}).")
    if window > model.cfg.max_position_embeddings:
        raise ConfigError(f"--window {window} exceeds the model's context ({model.cfg.max_position_embeddings}).")
    dtype = resolve_kv_dtype(kv_cache_dtype, model.dtype)
    total_nll, scored, windows, prev_end = 0.0, 0, 0, 0
    with torch.inference_mode():
        for begin in range(0, ids.numel(), stride):
            end = min(begin + window, ids.numel())
            new = end - max(prev_end, begin + 1)  # targets not scored yet (the first token has no context)
            if new > 0:
                seq = PagedSequence.allocate(model, end - begin, dtype, kv_scales, block_size, seed=windows)
                hidden = seq.prefill(model, ids[begin:end], chunk)
                logits = model.compute_logits(hidden[-new - 1:-1])
                targets = ids[end - new:end].to(logits.device)
                total_nll += F.cross_entropy(logits.float(), targets, reduction="sum").item()
                scored += new
                windows += 1
            prev_end = end
            if end == ids.numel():
                break
    nll = total_nll / scored
    return PerplexityResult(math.exp(nll), nll, scored, windows, window, stride, kv_cache_name(dtype))


def read_text_tokens(tokenizer, path, max_tokens: int | None = None) -> list[int]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--text '{path}' cannot be read as UTF-8 text: {e}.") from None
    ids = tokenizer.encode(text, add_special_tokens=True)
    if max_tokens is not None:
        if max_tokens < 2:
            raise InputError(f"--maxTokens must be at least 2, got {max_tokens}.")
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InputError(f"--text '{path}' holds fewer than 2 tokens.")
    return ids


# --- command line ------------------------------------------------------------------------------------------


def add_llm_command(llm_sub) -> argparse.ArgumentParser:
    p = llm_sub.add_parser("perplexity", help="sliding-window perplexity of a text through Kiln's decoder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="a Hugging Face model directory, a .gguf file or a .kiln LLM engine")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="auto (the model's dtype), fp32, bf16, fp16, fp8 or int8 (default: the engine's, else auto)")
    p.add_argument("--weights", default=None, choices=[m for m in ("none", "fp8", "int8", "w8a8", "int4-awq")],
                   help="quantize the weights first (a model, not an engine: an engine keeps its own)")
    p.add_argument("--calib", metavar="FILE", help="calibration text for 8-bit KV scales, w8a8 and int4-awq")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--window", type=int, default=512, help="tokens of context per window (default 512)")
    p.add_argument("--stride", type=int, default=256, help="tokens a window advances (default 256)")
    p.add_argument("--dtype", default=None, help="model dtype: float32, bfloat16, float16 (default: float32 on "
                   "the CPU, the model's on CUDA)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--verify-key", "--verifyKey", dest="verify_key", metavar="KEYFILE",
                   help="refuse MODEL unless it is a .kiln LLM engine signed with this key (kiln llm build --sign)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..console import console
    from ..engine.signing import load_key
    from ..json_file import atomic_write_json
    from .engine_file import prepare_model, require_signed

    con = console()
    require_signed(args.model, load_key(args.verify_key) if args.verify_key else None)
    prepared = prepare_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights,
                             kv_cache_dtype=args.kv_cache_dtype, calib=args.calib)
    ids = read_text_tokens(prepared.tokenizer, args.text, args.max_tokens)
    result = perplexity(prepared.model, ids, kv_cache_dtype=prepared.kv_cache_dtype,
                        kv_scales=prepared.kv_scales, window=args.window, stride=args.stride)
    con.print(f"{args.model}: perplexity {result.perplexity:.4f} over {result.tokens} tokens of {args.text} "
              f"(weights {prepared.weights}, KV cache {result.kv_cache_dtype}, {result.windows} windows of "
              f"{result.window}, stride {result.stride}, {prepared.model.dtype} on {prepared.model.device})")
    if args.json:
        atomic_write_json(args.json, {"model": str(args.model), "text": str(args.text),
                                      "weights": prepared.weights, **result.to_json()})
    return 0
