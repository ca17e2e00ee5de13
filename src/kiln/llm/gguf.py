"""GGUF files (llama.cpp's format) in: `load_gguf(path) -> (hf_config, tensors, tokenizer)`.

The file is read with the `gguf` package. Its metadata becomes the dict a Hugging Face config.json holds, its
tensors get transformers' names, quantized tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...) are dequantized to
float32, and llama.cpp's reordering of the Q and K projection rows (it interleaves the two rotary halves of each
head for its own RoPE kernel) is undone, so the result is what the Hugging Face checkpoint held. The tokenizer
is rebuilt from the `tokenizer.ggml.*` metadata as a `tokenizers` byte-level BPE.

Anything this loader cannot map is refused with the file and the tensor named: an architecture it does not
know, a tensor it has no name for, a missing or mis-shaped tensor, a vocabulary whose size differs from the
embedding's rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelError, UnsupportedError


@dataclass(frozen=True)
class _Arch:
    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp's converter reorders Q/K rows for these (its LlamaModel and subclasses)
    qkv_bias: bool = False
    qk_norm: bool = False


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False, qkv_bias=True),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", permuted_qk=False, qk_norm=True),
}

# `{arch}.<key>` metadata -> HF config key
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_REQUIRED_CONFIG = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                    "attention.layer_norm_rms_epsilon")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# Text splitting before byte-level BPE, by tokenizer.ggml.pre (llama.cpp's llama-vocab.cpp lists the same).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "gpt-2": [_GPT2_SPLIT],
    # SmolLM2 (and StarCoder-style vocabularies): every digit on its own, then GPT-2's split
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT], "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
}


def load_gguf(path, progress: bool = False):
    """(hf_config, tensors by transformers' names (float32), kiln.llm.tokenizer.Tokenizer) of a GGUF file.
    progress: a bar of the tensors read and dequantized, on a terminal."""
    from gguf import GGUFReader

    from ..progress import terminal_progress

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"GGUF file '{path}' does not exist.")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct or numpy errors on a foreign file
        raise ModelError(f"'{path}' cannot be read as a GGUF file: {e}.") from None
    meta = _Metadata(path, reader)
    arch_name = meta.get("general.architecture")
    if arch_name not in _ARCHS:
        raise UnsupportedError(
            f"'{path}': GGUF architecture {arch_name!r} (general.architecture) is not supported; Kiln maps "
            f"{', '.join(sorted(_ARCHS))}.")
    arch = _ARCHS[arch_name]
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelError(f"'{path}': tensor 'token_embd.weight' (model.embed_tokens.weight) is missing.")
    embedding_rows = int(by_name["token_embd.weight"].shape[-1])
    config = _hf_config(meta, arch_name, arch, tied="output.weight" not in by_name, embedding_rows=embedding_rows)
    shapes = _expected_shapes(config, arch)
    tensors = {}
    with terminal_progress("loading", len(reader.tensors), path.name, enabled=progress) as bar:
        for t in reader.tensors:
            hf_name = _hf_name(path, t.name, config["num_hidden_layers"])
            if hf_name is None:
                continue
            w = _dequantize(path, t)
            if hf_name not in shapes:
                raise ModelError(f"'{path}': tensor '{t.name}' ({hf_name}) does not belong to a {arch_name} model "
                                 "with this file's metadata.")
            if tuple(w.shape) != shapes[hf_name]:
                raise ModelError(f"'{path}': tensor '{t.name}' has shape {list(w.shape)}, expected "
                                 f"{list(shapes[hf_name])} from the file's metadata ({hf_name}).")
            if arch.permuted_qk and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                                      "attn_k.bias")):
                heads = config["num_attention_heads"] if ".attn_q." in t.name else config["num_key_value_heads"]
                w = _unpermute_rows(w, heads)
            tensors[hf_name] = w
            bar.advance(f"{path.name}: {t.name} ({t.tensor_type.name})")
    optional = {"lm_head.weight"} | {n for n in shapes if n.endswith(".bias") or "_norm." in n and "self_attn" in n}
    for hf_name in shapes:
        if hf_name not in tensors and hf_name not in optional:
            raise ModelError(f"'{path}': tensor '{_gguf_name(hf_name)}' ({hf_name}) is missing.")
    if arch.qkv_bias and not any(n.endswith("q_proj.bias") for n in tensors):
        raise ModelError(f"'{path}': {arch_name} needs Q/K/V biases but tensor 'blk.0.attn_q.bias' is missing.")
    if arch.qk_norm and "model.layers.0.self_attn.q_norm.weight" not in tensors:
        raise ModelError(f"'{path}': {arch_name} needs Q/K norms but tensor 'blk.0.attn_q_norm.weight' is missing.")
    tokenizer = _tokenizer(meta, embedding_rows)
    return config, tensors, tokenizer


# --- metadata ----------------------------------------------------------------------------------------------


class _Metadata:
    def __init__(self, path: Path, reader):
        self.path, self.fields = path, reader.fields

    def __contains__(self, key) -> bool:
        return key in self.fields

    def get(self, key, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def require(self, key):
        if key not in self.fields:
            raise ModelError(f"'{self.path}': metadata key '{key}' is missing.")
        return self.get(key)


def _hf_config(meta: _Metadata, arch_name: str, arch: _Arch, tied: bool, embedding_rows: int) -> dict:
    for key in _REQUIRED_CONFIG:
        meta.require(f"{arch_name}.{key}")
    cfg = {"architectures": [arch.hf_class], "model_type": arch.model_type}
    for key, hf_key in _CONFIG_KEYS.items():
        if f"{arch_name}.{key}" in meta:
            cfg[hf_key] = meta.get(f"{arch_name}.{key}")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if not isinstance(meta.get(f"{arch_name}.{key}"), int):  # per-layer lists (hybrid models) are not mapped
            raise UnsupportedError(f"'{meta.path}': metadata '{arch_name}.{key}' is "
                                   f"{meta.get(f'{arch_name}.{key}')!r}, not one integer.")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("max_position_embeddings", 2048)
    head_dim = meta.get(f"{arch_name}.attention.key_length") or meta.get(f"{arch_name}.rope.dimension_count")
    cfg["head_dim"] = int(head_dim or cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["rms_norm_eps"] = float(cfg["rms_norm_eps"])
    cfg["rope_theta"] = float(cfg["rope_theta"])
    cfg["rope_scaling"] = _rope_scaling(meta, arch_name)
    cfg["vocab_size"] = int(meta.get(f"{arch_name}.vocab_size") or embedding_rows)
    cfg["tie_word_embeddings"] = tied
    cfg["hidden_act"] = "silu"
    cfg["attention_bias"] = arch.qkv_bias
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf_key] = int(meta.get(f"tokenizer.ggml.{key}"))
    cfg["torch_dtype"] = "bfloat16"
    cfg["_name_or_path"] = str(meta.get("general.name") or meta.path.stem)
    return cfg


def _rope_scaling(meta: _Metadata, arch_name: str) -> dict | None:
    kind = meta.get(f"{arch_name}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.get(f"{arch_name}.rope.scaling.factor") or 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.get(f"{arch_name}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise UnsupportedError(f"'{meta.path}': RoPE scaling '{kind}' ({arch_name}.rope.scaling.type) is not supported.")


# --- tensors -----------------------------------------------------------------------------------------------


def _hf_name(path: Path, gguf_name: str, layers: int) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight":
        # Llama 3.1's per-frequency RoPE factors; applying them needs its rope_scaling, which GGUF does not carry
        raise UnsupportedError(f"'{path}': tensor 'rope_freqs.weight' (Llama 3.1 RoPE frequency factors) is not "
                               "supported.")
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        layer = int(m.group(1))
        if layer >= layers:
            raise ModelError(f"'{path}': tensor '{gguf_name}' belongs to layer {layer}, but the metadata says the "
                             f"model has {layers} layers.")
        return f"model.layers.{layer}.{_LAYER_TENSORS[m.group(2)]}"
    raise UnsupportedError(f"'{path}': tensor '{gguf_name}' has no Hugging Face name Kiln knows.")


def _gguf_name(hf_name: str) -> str:
    for g, h in _GLOBAL_TENSORS.items():
        if h == hf_name:
            return g
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{next(g for g, h in _LAYER_TENSORS.items() if h == rest)}"


def _expected_shapes(cfg: dict, arch: _Arch) -> dict[str, tuple]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if arch.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def _dequantize(path: Path, t) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    try:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            data = np.asarray(t.data)
            if t.tensor_type == GGMLQuantizationType.BF16:  # numpy has no bfloat16: widen the raw bits
                w = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
            else:
                w = torch.from_numpy(data.astype(np.float32))
        else:
            w = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    except NotImplementedError:
        raise UnsupportedError(f"'{path}': tensor '{t.name}' is stored as {t.tensor_type.name}, which the gguf "
                               "package cannot dequantize.") from None
    return w.reshape(shape)


def _unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: it stores each head's rows as (half, pair) where HF has (pair, half)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# --- tokenizer ---------------------------------------------------------------------------------------------


def _tokenizer(meta: _Metadata, embedding_rows: int):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    path = meta.path
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedError(f"'{path}': tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; Kiln "
                               "builds byte-level BPE ('gpt2') tokenizers from GGUF metadata.")
    tokens = meta.require("tokenizer.ggml.tokens")
    if len(tokens) != embedding_rows:
        raise ModelError(f"'{path}': the tokenizer has {len(tokens)} tokens (tokenizer.ggml.tokens) but tensor "
                         f"'token_embd.weight' has {embedding_rows} rows: the vocabulary does not match the model.")
    merges = meta.require("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError(f"'{path}': tokenizer.ggml.tokens holds duplicate tokens.")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre") or "default"
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        raise UnsupportedError(f"'{path}': pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; Kiln knows "
                               f"{', '.join(sorted(_PRE_SPLITS))}.")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>, ...) match whole and are skipped on decode; user-defined
    # tokens match whole but stay in decoded text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelError(f"'{path}': the tokenizer built from the metadata has "
                         f"{tok.get_vocab_size(with_added_tokens=True)} entries, not {len(tokens)}.")

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    from .tokenizer import Tokenizer

    eos = token("eos_token_id")
    return Tokenizer(tok, bos_token=token("bos_token_id"), eos_tokens=[eos] if eos else [],
                     chat_template=meta.get("tokenizer.chat_template"),
                     add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)), source=str(path))
