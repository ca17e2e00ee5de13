"""ModelConfig: the decoder shape Kiln builds, parsed and validated from a Hugging Face config.json dict.

One config covers the families Kiln runs: the Llama shape (Llama 2/3, Mistral, Qwen2/2.5, Qwen3 with q/k norms,
Gemma 2/3 with their norm and soft-cap variants) and GPT-2 (learned positions, LayerNorm, GELU). Every refusal
names config.json and the key at fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import ModelError, UnsupportedError

# model_type -> family. The Llama family shares one decoder with switches (bias, q/k norm, Gemma's variants).
FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma2": "gemma", "gemma3_text": "gemma", "gpt2": "gpt2",
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "GPT2LMHeadModel": "gpt2",
}
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # RoPE (Llama family): theta, scaling dict (rope_type + its fields), fraction of head_dim rotated.
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_local_theta: float | None = None  # Gemma 3: sliding layers use their own base, unscaled
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k
    # Per-layer sliding window (None = full attention on that layer).
    layer_windows: list[int | None] = field(default_factory=list)
    # Gemma: norms scale by (1 + w), embeddings scaled by sqrt(hidden), norms before and after each block.
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    query_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    dtype: str = "float32"

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def softmax_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict; refuses what Kiln cannot run, naming `source` and the key."""
        if not isinstance(hf, dict):
            raise ModelError(f"{source}: expected a JSON object, got {type(hf).__name__}.")
        hf = dict(hf)
        if "text_config" in hf and hf.get("model_type") in ("gemma3",):
            raise UnsupportedError(f"{source}: model_type 'gemma3' is the multimodal model; Kiln runs the text "
                                   "decoder only (model_type 'gemma3_text').")
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type is None and archs:
            model_type = ARCHITECTURES.get(archs[0])
        if model_type not in FAMILIES:
            key = "model_type" if hf.get("model_type") is not None else "architectures"
            raise UnsupportedError(
                f"{source}: unsupported architecture ({key} = {hf.get(key)!r}). Kiln runs model_type "
                f"{sorted(FAMILIES)} (architectures {sorted(ARCHITECTURES)}).")
        for a in archs:
            if a not in ARCHITECTURES:
                raise UnsupportedError(f"{source}: unsupported architecture (architectures = {archs!r}); Kiln "
                                       f"runs {sorted(ARCHITECTURES)}.")

        def get(key, typ, default=..., *aliases):
            for k in (key, *aliases):
                if k in hf and hf[k] is not None:
                    v = hf[k]
                    if typ is float and isinstance(v, int) and not isinstance(v, bool):
                        v = float(v)
                    if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
                        raise ModelError(f"{source}: key '{k}' must be {typ.__name__}, got {v!r}.")
                    return v
            if default is ...:
                raise ModelError(f"{source}: required key '{key}' is missing.")
            return default

        def positive(key, v):
            if v <= 0:
                raise ModelError(f"{source}: key '{key}' must be positive, got {v}.")
            return v

        if model_type == "gpt2":
            hidden = positive("n_embd", get("n_embd", int, ..., "hidden_size"))
            heads = positive("n_head", get("n_head", int, ..., "num_attention_heads"))
            cfg = cls(model_type=model_type, vocab_size=positive("vocab_size", get("vocab_size", int)),
                      hidden_size=hidden, intermediate_size=get("n_inner", int, 4 * hidden),
                      num_layers=positive("n_layer", get("n_layer", int, ..., "num_hidden_layers")),
                      num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                      max_position_embeddings=positive("n_positions", get("n_positions", int, 1024)),
                      norm_eps=get("layer_norm_epsilon", float, 1e-5),
                      hidden_act=get("activation_function", str, "gelu_new"),
                      tie_word_embeddings=get("tie_word_embeddings", bool, True))
            if hidden % heads:
                raise ModelError(f"{source}: n_embd ({hidden}) is not divisible by n_head ({heads}).")
            if get("scale_attn_by_inverse_layer_idx", bool, False) or get("reorder_and_upcast_attn", bool, False):
                raise UnsupportedError(f"{source}: GPT-2 attention variants (scale_attn_by_inverse_layer_idx, "
                                       "reorder_and_upcast_attn) are not supported.")
        else:
            hidden = positive("hidden_size", get("hidden_size", int))
            heads = positive("num_attention_heads", get("num_attention_heads", int))
            kv_heads = positive("num_key_value_heads", get("num_key_value_heads", int, heads))
            if heads % kv_heads:
                raise ModelError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads}).")
            head_dim = get("head_dim", int, None)
            if head_dim is None:
                if hidden % heads:
                    raise ModelError(f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads "
                                     f"({heads}) and no head_dim is given.")
                head_dim = hidden // heads
            cfg = cls(model_type=model_type, vocab_size=positive("vocab_size", get("vocab_size", int)),
                      hidden_size=hidden,
                      intermediate_size=positive("intermediate_size", get("intermediate_size", int)),
                      num_layers=positive("num_hidden_layers", get("num_hidden_layers", int)),
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=positive("head_dim", head_dim),
                      max_position_embeddings=positive("max_position_embeddings",
                                                       get("max_position_embeddings", int, 2048)),
                      norm_eps=get("rms_norm_eps", float, 1e-6),
                      hidden_act=get("hidden_act", str, "silu", "hidden_activation"),
                      tie_word_embeddings=get("tie_word_embeddings", bool, model_type.startswith("gemma")),
                      attention_bias=get("attention_bias", bool, model_type == "qwen2"),
                      qk_norm=model_type in ("qwen3", "gemma3_text"),
                      partial_rotary_factor=get("partial_rotary_factor", float, 1.0))
            cfg._parse_rope(hf, get, source)
            cfg._parse_windows(hf, get, source)
            if cfg.family == "gemma":
                cfg.norm_offset = 1.0
                cfg.embed_scale = math.sqrt(hidden)
                cfg.sandwich_norms = True
                qpas = get("query_pre_attn_scalar", float, float(head_dim))
                cfg.query_scale = positive("query_pre_attn_scalar", qpas) ** -0.5
                cfg.attn_logit_softcap = get("attn_logit_softcapping", float, None)
                cfg.final_logit_softcap = get("final_logit_softcapping", float, None)
            if hf.get("mlp_bias"):
                raise UnsupportedError(f"{source}: key 'mlp_bias' = true is not supported.")
        if cfg.hidden_act not in ACTIVATIONS:
            raise UnsupportedError(f"{source}: activation {cfg.hidden_act!r} (key 'hidden_act') is not supported; "
                                   f"Kiln runs {list(ACTIVATIONS)}.")
        cfg.bos_token_id = get("bos_token_id", int, None)
        eos = hf.get("eos_token_id")
        cfg.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not all(isinstance(e, int) for e in cfg.eos_token_ids):
            raise ModelError(f"{source}: key 'eos_token_id' must be an int or a list of ints, got {eos!r}.")
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if dtype not in ("float32", "float16", "bfloat16"):
            raise UnsupportedError(f"{source}: key 'torch_dtype' = {dtype!r}; Kiln loads float32, float16, bfloat16.")
        cfg.dtype = dtype
        return cfg

    def _parse_rope(self, hf: dict, get, source: str) -> None:
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs `rope_theta` and
        # `rope_scaling`. Gemma 3 may key them by layer kind ("full_attention", "sliding_attention").
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            local = params.get("sliding_attention") or {}
            self.rope_local_theta = float(local.get("rope_theta", 10000.0))
            params = params["full_attention"]
        scaling = hf.get("rope_scaling") if params is None else params
        self.rope_theta = float(get("rope_theta", float, None) or (params or {}).get("rope_theta") or 10000.0)
        if self.model_type == "gemma3_text" and self.rope_local_theta is None:
            self.rope_local_theta = get("rope_local_base_freq", float, 10000.0)
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ModelError(f"{source}: key 'rope_scaling' must be an object, got {scaling!r}.")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedError(f"{source}: rope_scaling type {rope_type!r} (key 'rope_scaling.rope_type') is not "
                                   f"supported; Kiln runs {list(ROPE_TYPES)}.")
        need = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"]}.get(rope_type, [])
        for k in need:
            if not isinstance(scaling.get(k), (int, float)):
                raise ModelError(f"{source}: key 'rope_scaling.{k}' is required for rope_type {rope_type!r}.")
        if "partial_rotary_factor" in scaling:
            self.partial_rotary_factor = float(scaling["partial_rotary_factor"])
        self.rope_scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}

    def _parse_windows(self, hf: dict, get, source: str) -> None:
        window = get("sliding_window", int, None)
        use = hf.get("use_sliding_window", True)  # Qwen2/3 carry a window but turn it off
        n = self.num_layers
        types = hf.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or len(types) != n:
                raise ModelError(f"{source}: key 'layer_types' must list one entry per layer ({n}).")
            bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
            if bad:
                raise UnsupportedError(f"{source}: layer_types entry {bad[0]!r} is not supported.")
            kinds = [t == "sliding_attention" for t in types]
        elif self.model_type == "gemma2":
            kinds = [i % 2 == 0 for i in range(n)]
        elif self.model_type == "gemma3_text":
            pattern = get("sliding_window_pattern", int, 6)
            kinds = [(i + 1) % pattern != 0 for i in range(n)]
        elif self.model_type in ("qwen2", "qwen3"):
            first_full = get("max_window_layers", int, n)
            kinds = [bool(use) and i >= first_full for i in range(n)]
        else:
            kinds = [True] * n
        if window is None or not use:
            kinds = [False] * n
        self.layer_windows = [window if k else None for k in kinds]
