"""The decoder: packed tokens of one step in, hidden states out; logits only for the rows asked for.

Two families share this file. The Llama shape (Llama, Mistral, Qwen2/3, Gemma 2/3): RMSNorm, RoPE, grouped-query
attention over the paged cache, SwiGLU (GeGLU for Gemma). GPT-2: learned positions, LayerNorm, GELU, Conv1D
weights (stored [in, out], transposed here). Q/K/V and gate/up projections are concatenated at load so a layer
is four matrix multiplies. Under tensor parallelism (parallel.py) each rank holds its shard of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.llm.attention import (
    AttentionMetadata,
    LayerCache,
    attend,
    check_key_offset,
    paged_attention,
)
from kiln.llm.config import ModelConfig
from kiln.llm.parallel import (
    Shard,
    all_gather_last,
    all_reduce,
    layout,
    shard_matrix,
    shard_vocab,
    vocab_parallel_embedding,
)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """transformers' tensor names and shapes for cfg (what a checkpoint must hold)."""
    h, v, i = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    shapes: dict[str, tuple] = {}
    if cfg.family == "gpt2":
        shapes.update({"transformer.wte.weight": (v, h), "transformer.wpe.weight": (cfg.max_position_embeddings, h),
                       "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
        for n in range(cfg.num_layers):
            p = f"transformer.h.{n}."
            shapes.update({p + "ln_1.weight": (h,), p + "ln_1.bias": (h,), p + "ln_2.weight": (h,),
                           p + "ln_2.bias": (h,), p + "attn.c_attn.weight": (h, 3 * h),
                           p + "attn.c_attn.bias": (3 * h,), p + "attn.c_proj.weight": (h, h),
                           p + "attn.c_proj.bias": (h,), p + "mlp.c_fc.weight": (h, i), p + "mlp.c_fc.bias": (i,),
                           p + "mlp.c_proj.weight": (i, h), p + "mlp.c_proj.bias": (h,)})
        return shapes
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes.update({"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (qd, h), p + "self_attn.k_proj.weight": (kvd, h),
                       p + "self_attn.v_proj.weight": (kvd, h), p + "self_attn.o_proj.weight": (h, qd),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (qd,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,),
                           p + "self_attn.k_norm.weight": (cfg.head_dim,)})
        if cfg.sandwich_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def normalize_names(tensors: dict) -> dict:
    """Checkpoints of GPT-2 on the Hub omit the 'transformer.' prefix; Kiln keys them as transformers does."""
    if "wte.weight" in tensors and "transformer.wte.weight" not in tensors:
        return {("transformer." + k if not k.startswith("lm_head") else k): t for k, t in tensors.items()}
    return tensors


# --------------------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------------------

def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv_freq
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rope:
    """cos/sin tables [max_positions, rotary_dim] (FP32), applied in the rotate-half (NeoX) layout."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None, device):
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)
        self.dim = rotary_dim

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, head_dim]; the first rotary_dim features rotate (partial rotary keeps the rest).
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        rot, rest = x[..., :self.dim].float(), x[..., self.dim:]
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = (rot * cos + rotated * sin).to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma multiplies in FP32 by (1 + w)
        return (xf * (offset + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    return F.gelu(x, approximate="tanh")  # gelu_new, gelu_pytorch_tanh, gelu_fast


# --------------------------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------------------------

class DecoderModel:
    """Weights on `device` in `dtype`; `forward` runs one packed step, `compute_logits` the LM head."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device,
                 fused: bool | None = None, shard: Shard | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        # Tensor parallelism (parallel.py): this rank's heads, KV heads, MLP columns and vocabulary rows.
        self.shard = shard or Shard()
        self.layout = layout(cfg, self.shard.rank, self.shard.world_size) if self.shard.active else None
        self.num_heads = cfg.num_heads // self.shard.world_size
        self.num_kv_heads = cfg.num_kv_heads
        self.kv_head_ids = None  # the KV heads of the full model this rank keeps (None: all)
        if self.layout is not None:
            k0, k1 = self.layout.kv_heads
            self.num_kv_heads, self.kv_head_ids = k1 - k0, list(range(k0, k1))
        # Triton fusions (fused_ops.py) on CUDA; the torch forms elsewhere (or under TRITON_INTERPRET in tests).
        self.fused = self.device.type == "cuda" if fused is None else fused
        # Three of those fusions, apart so that a benchmark can time the step without them: RoPE with the
        # KV-cache write (kernels/rope_cache.py); in decode steps (one query a sequence) both with the attention
        # too (kernels/decode_attention.py; off until a GPU run times it against the two kernels); the MLP's
        # activation inside the down projection's GEMV, off: it made the batch-1 step slower
        # (docs/design/decode-gemv.md).
        self.fuse_rope_cache = self.fused
        self.fuse_decode_attention = False
        self.fuse_act_down = False
        self.decode_attention_splits = None  # context slices of the fused decode attention (None: the kernel's rule)
        self.decode_attention_merge = False  # its slices merged by the last to finish (True) or by a second kernel
        # Bytes of the next matrix asked into L2 before the small kernels between two GEMVs (kernels/l2_prefetch.py);
        # 0: none (not timed yet)
        self.l2_prefetch_bytes = 0
        tensors = normalize_names(tensors)

        def w(name):
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        self.layers = []
        if cfg.family == "gpt2":
            self.embed, self.pos_embed = w("transformer.wte.weight"), w("transformer.wpe.weight")
            self.norm = (w("transformer.ln_f.weight"), w("transformer.ln_f.bias"))
            for n in range(cfg.num_layers):
                p = f"transformer.h.{n}."
                self.layers.append({
                    "ln_1": (w(p + "ln_1.weight"), w(p + "ln_1.bias")),
                    "ln_2": (w(p + "ln_2.weight"), w(p + "ln_2.bias")),
                    "qkv": w(p + "attn.c_attn.weight").t().contiguous(), "qkv_bias": w(p + "attn.c_attn.bias"),
                    "o": w(p + "attn.c_proj.weight").t().contiguous(), "o_bias": w(p + "attn.c_proj.bias"),
                    "fc": w(p + "mlp.c_fc.weight").t().contiguous(), "fc_bias": w(p + "mlp.c_fc.bias"),
                    "proj": w(p + "mlp.c_proj.weight").t().contiguous(), "proj_bias": w(p + "mlp.c_proj.bias"),
                })
            self.lm_head = self.embed
            self.ropes = []
            return
        lay = self.layout

        def matrix(key, *names):
            """model.py's matrix `key`, concatenated from transformers' tensors; this rank's part of it."""
            full = torch.cat([tensors[name] for name in names]) if len(names) > 1 else tensors[names[0]]
            part = full if lay is None else shard_matrix(cfg, key, full, lay)
            return part.to(device=self.device, dtype=dtype).contiguous()

        def vocab_rows(name):
            return w(name) if lay is None else shard_vocab(tensors[name], lay).to(self.device, dtype)

        self.embed = vocab_rows("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else vocab_rows("lm_head.weight")
        for n in range(cfg.num_layers):
            p = f"model.layers.{n}."
            a = p + "self_attn."
            layer = {
                "qkv": matrix("qkv", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                "o": matrix("o", a + "o_proj.weight"),
                "gate_up": matrix("gate_up", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                "down": matrix("down", p + "mlp.down_proj.weight"),
                "input_norm": w(p + "input_layernorm.weight"),
                "post_attn_norm": w(p + "post_attention_layernorm.weight"),
            }
            if cfg.attention_bias:
                bias = matrix("qkv", a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                layer["qkv_bias"] = bias
            if cfg.qk_norm:
                layer["q_norm"], layer["k_norm"] = w(a + "q_norm.weight"), w(a + "k_norm.weight")
            if cfg.sandwich_norms:
                layer["pre_ffn_norm"] = w(p + "pre_feedforward_layernorm.weight")
                layer["post_ffn_norm"] = w(p + "post_feedforward_layernorm.weight")
            self.layers.append(layer)
        max_pos = cfg.max_position_embeddings
        global_rope = Rope(cfg.rotary_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, self.device)
        local_rope = global_rope
        if cfg.rope_local_theta is not None:  # Gemma 3's sliding layers
            local_rope = Rope(cfg.rotary_dim, max_pos, cfg.rope_local_theta, None, self.device)
        self.ropes = [local_rope if cfg.layer_windows[n] else global_rope for n in range(cfg.num_layers)]

    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (each tensor once; tied embeddings counted once)."""
        seen, total = set(), 0
        tensors = [self.lm_head] + [t for layer in self.layers for v in layer.values()
                                    for t in (v if isinstance(v, tuple) else (v,))]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                caches: list[LayerCache]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (final norm applied)."""
        if self.cfg.family == "gpt2":
            return self._forward_gpt2(input_ids, positions, md, caches)
        cfg = self.cfg
        if self.layout is None:
            h = F.embedding(input_ids, self.embed)
        else:
            h = vocab_parallel_embedding(input_ids, self.embed, self.layout, self.shard)
        if cfg.embed_scale != 1.0:
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        eps, off = cfg.norm_eps, cfg.norm_offset
        nh, nkv = self.num_heads, self.num_kv_heads  # this rank's
        qd, kvd = nh * cfg.head_dim, nkv * cfg.head_dim
        delta = None  # the last block's output, added to the residual stream h by the next norm
        for n, L in enumerate(self.layers):
            x, h = self._add_norm(delta, h, L["input_norm"])
            qkv = F.linear(x, L["qkv"], L.get("qkv_bias"))
            self._prefetch(L["o"])  # into L2 while attention runs
            q = qkv[:, :qd].view(-1, nh, cfg.head_dim)
            k = qkv[:, qd:qd + kvd].view(-1, nkv, cfg.head_dim)
            v = qkv[:, qd + kvd:].view(-1, nkv, cfg.head_dim)
            if self.fuse_decode_attention and not cfg.qk_norm and md.max_query_len == 1 \
                    and qkv.shape[0] == md.seq_lens.shape[0]:  # decode: RoPE, the cache write and attention
                o = self._decode_attention(n, qkv, positions, caches[n], md)
            elif self.fuse_rope_cache and not cfg.qk_norm:  # RoPE and the cache write in one kernel
                self._rope_and_cache(n, qkv, positions, caches[n], md)
                o = attend(q, caches[n], md, cfg.softmax_scale, cfg.layer_windows[n], cfg.attn_logit_softcap)
            else:
                if cfg.qk_norm:
                    q, k = rms_norm(q, L["q_norm"], eps, off), rms_norm(k, L["k_norm"], eps, off)
                q, k = self._rope(n, q, k, qkv, positions)
                o = paged_attention(q, k, v, caches[n], md, cfg.softmax_scale, cfg.layer_windows[n],
                                    cfg.attn_logit_softcap)
            o = all_reduce(F.linear(o.reshape(-1, qd), L["o"]), self.shard)  # row-parallel: sum the ranks' parts
            self._prefetch(L["gate_up"])
            if cfg.sandwich_norms:
                x, h = self._add_norm(rms_norm(o, L["post_attn_norm"], eps, off), h, L["pre_ffn_norm"])
            else:
                x, h = self._add_norm(o, h, L["post_attn_norm"])
            gate_up = F.linear(x, L["gate_up"])
            self._prefetch(L["down"])
            x = all_reduce(self._mlp_down(gate_up, L["down"]), self.shard)
            if n + 1 < len(self.layers):
                self._prefetch(self.layers[n + 1]["qkv"])
            delta = rms_norm(x, L["post_ffn_norm"], eps, off) if cfg.sandwich_norms else x
        return self._add_norm(delta, h, self.norm)[0]

    def _add_norm(self, delta, h, weight):
        """(RMSNorm(h + delta), h + delta); delta None: (RMSNorm(h), h)."""
        cfg = self.cfg
        if self.fused and cfg.norm_offset == 0:
            from kiln.llm import fused_ops

            if delta is None:
                return fused_ops.rms_norm(h, weight, cfg.norm_eps), h
            return fused_ops.add_rms_norm(delta, h, weight, cfg.norm_eps)
        if delta is not None:
            h = h + delta
        return rms_norm(h, weight, cfg.norm_eps, cfg.norm_offset), h

    def _rope(self, n, q, k, qkv, positions):
        rope = self.ropes[n]
        if not self.fused:
            return rope(q, positions), rope(k, positions)
        from kiln.llm import fused_ops

        if self.cfg.qk_norm:  # q and k are fresh tensors
            fused_ops.rope_(q, positions, rope.cos, rope.sin, rope.dim)
            fused_ops.rope_(k, positions, rope.cos, rope.sin, rope.dim)
        else:  # q's heads then k's, in place in the projection's output: one launch
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, :heads * self.cfg.head_dim].view(-1, heads, self.cfg.head_dim)
            fused_ops.rope_(qk, positions, rope.cos, rope.sin, rope.dim)
        return q, k

    def _rope_and_cache(self, n, qkv, positions, cache: LayerCache, md: AttentionMetadata):
        from kiln.kernels.rope_cache import rope_and_cache

        rope = self.ropes[n]
        rope_and_cache(qkv, positions, rope.cos, rope.sin, rope.dim, self.num_heads, self.num_kv_heads,
                       self.cfg.head_dim, cache.k, cache.v, md.slot_mapping, cache.k_scale, cache.v_scale,
                       cache.k_offset)

    def _decode_attention(self, n, qkv, positions, cache: LayerCache, md: AttentionMetadata):
        from kiln.kernels.decode_attention import decode_attention

        cfg, rope = self.cfg, self.ropes[n]
        check_key_offset(cache, cfg.attn_logit_softcap)
        return decode_attention(qkv, positions, rope.cos, rope.sin, rope.dim, self.num_heads, self.num_kv_heads,
                                cfg.head_dim, cache.k, cache.v, md.slot_mapping, md.query_start_loc, md.seq_lens,
                                md.block_tables, md.max_seq_len, cfg.softmax_scale, cache.k_scale, cache.v_scale,
                                cache.k_offset, cfg.layer_windows[n], cfg.attn_logit_softcap,
                                num_splits=self.decode_attention_splits, merge_in_kernel=self.decode_attention_merge)

    def _prefetch(self, weight) -> None:
        if self.l2_prefetch_bytes and weight.device.type == "cuda":
            from kiln.kernels.l2_prefetch import prefetch_l2

            prefetch_l2(weight, self.l2_prefetch_bytes)

    def _mlp_down(self, gate_up, down):
        """down(act(gate) * up): in the down projection's GEMV where it applies the activation as it loads its
        input (fused_ops.act_and_down), else act_and_mul and then the projection."""
        if self.fuse_act_down:
            from kiln.llm import fused_ops

            y = fused_ops.act_and_down(gate_up, down, self.cfg.hidden_act)
            if y is not None:
                return y
        return F.linear(self._act_and_mul(gate_up), down)

    def _act_and_mul(self, gate_up):
        act = self.cfg.hidden_act
        if self.fused and act in ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            from kiln.llm import fused_ops

            return fused_ops.act_and_mul(gate_up, gelu=act != "silu")
        gate, up = gate_up.chunk(2, dim=-1)
        return activation(act, gate) * up

    def _forward_gpt2(self, input_ids, positions, md, caches):
        cfg = self.cfg
        h = F.embedding(input_ids, self.embed) + F.embedding(positions, self.pos_embed)
        hd, nh = cfg.head_dim, cfg.num_heads
        for n, L in enumerate(self.layers):
            x = F.layer_norm(h, (cfg.hidden_size,), *L["ln_1"], eps=cfg.norm_eps)
            q, k, v = F.linear(x, L["qkv"], L["qkv_bias"]).view(-1, 3, nh, hd).unbind(1)
            o = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), caches[n], md, cfg.softmax_scale)
            h = h + F.linear(o.reshape(-1, cfg.hidden_size), L["o"], L["o_bias"])
            x = F.layer_norm(h, (cfg.hidden_size,), *L["ln_2"], eps=cfg.norm_eps)
            x = activation(cfg.hidden_act, F.linear(x, L["fc"], L["fc_bias"]))
            h = h + F.linear(x, L["proj"], L["proj_bias"])
        return F.layer_norm(h, (cfg.hidden_size,), *self.norm, eps=cfg.norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> FP32 logits [S, vocab] (Gemma's final soft cap applied)."""
        logits = F.linear(hidden, self.lm_head)
        if self.layout is not None:  # vocabulary-parallel: each rank's slice, then the padding cut off
            logits = all_gather_last(logits, self.shard)[:, :self.cfg.vocab_size]
        logits = logits.float()
        cap = self.cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
