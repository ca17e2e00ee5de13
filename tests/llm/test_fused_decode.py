"""The decoder with its CUDA fusions forced on (Triton under TRITON_INTERPRET=1 without a GPU) against its torch
path: RoPE + the KV-cache write in one kernel (kernels/rope_cache.py, the prefill), with the attention too in
decode steps (kernels/decode_attention.py), the MLP's activation inside the down projection's GEMV
(fused_ops.act_and_down, off by default), add + RMSNorm. Greedy tokens of a prefill and decode steps over the
paged cache are the same; logits agree to FP32 rounding."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import fp8_gemv as fg
from kiln.llm import fused_ops
from kiln.llm.attention import AttentionMetadata, LayerCache
from kiln.llm.config import ModelConfig
from kiln.llm.loader import load_hf_dir
from kiln.llm.model import DecoderModel
from kiln.llm.quantize import QuantizedWeight, quantize_model

BS = 4
TABLE = [5, 2, 7, 0, 3, 6]  # the sequence's blocks, out of order


def _generate(model, prompt, steps, dtype, device="cpu"):
    """Greedy tokens after `prompt` (one prefill, then one decode step a token) and every step's logits."""
    cfg = model.cfg
    shape = (8, BS, cfg.num_kv_heads, cfg.head_dim)
    caches = [LayerCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(cfg.num_layers)]
    ids, pos0, tokens, logits = list(prompt), 0, [], []
    for _ in range(steps):
        n = len(ids)
        pos = list(range(pos0, pos0 + n))
        def t(v, dt=None):
            return torch.tensor(v, dtype=dt, device=device)

        md = AttentionMetadata(t([TABLE[p // BS] * BS + p % BS for p in pos]), t([0, n], torch.int32),
                               t([pos0 + n], torch.int32), t([TABLE], torch.int32), n, pos0 + n)
        hidden = model.forward(t(ids), t(pos), md, caches)
        out = model.compute_logits(hidden[-1:]).cpu()
        logits.append(out[0])
        tokens.append(int(out[0].argmax()))
        ids, pos0 = [tokens[-1]], pos0 + n
    return tokens, torch.stack(logits)


# The interpreter's checks on CPU tensors; with CUDA present Triton would be handed CPU tensors (the GPU test below
# runs the same comparison on the device).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through TRITON_INTERPRET")


@cpu_only
def test_fused_decoder_gives_the_same_tokens(tiny_llama):
    hf, tensors, tok = load_hf_dir(tiny_llama)
    cfg = ModelConfig.from_hf(hf)
    prompt = tok.encode("The potter lit the fire")
    want, want_logits = _generate(DecoderModel(cfg, tensors, torch.float32, "cpu", fused=False), prompt, 6,
                                  torch.float32)
    fused = DecoderModel(cfg, tensors, torch.float32, "cpu", fused=True)
    # off by default: fuse_decode_attention (not timed yet), fuse_act_down (slower on the H200)
    assert fused.fuse_rope_cache and not fused.fuse_decode_attention and not fused.fuse_act_down
    for decode_attention in (False, True):
        fused.fuse_decode_attention = decode_attention
        got, got_logits = _generate(fused, prompt, 6, torch.float32)
        assert got == want
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)


@cpu_only
def test_activation_in_the_down_gemv(tiny_llama):
    """FP16 with FP8 weights: the fused model's down projection runs the GEMV with the activation in its input
    load, which equals act_and_mul then the GEMV bit for bit; the tokens equal those of the torch path."""
    hf, tensors, tok = load_hf_dir(tiny_llama)
    cfg = ModelConfig.from_hf(hf)
    models = [DecoderModel(cfg, tensors, torch.float16, "cpu", fused=f) for f in (False, True)]
    for m in models:
        quantize_model(m, "fp8")
    models[1].fuse_act_down = True  # off by default (slower on the H200); its path still gives the same tokens
    down = models[1].layers[0]["down"]
    assert isinstance(down, QuantizedWeight)
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(1, 2 * cfg.intermediate_size, generator=g).half()
    got = fused_ops.act_and_down(gate_up, down, cfg.hidden_act)
    assert got is not None
    assert torch.equal(got, fg.fp8_gemv(fused_ops.act_and_mul(gate_up), down.codes, down.scale))
    assert fused_ops.act_and_down(gate_up.float(), down, cfg.hidden_act) is None  # FP32: no fused form
    prompt = tok.encode("Hello world")
    want, _ = _generate(models[0], prompt, 4, torch.float16)
    got, _ = _generate(models[1], prompt, 4, torch.float16)
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decoder_on_the_gpu(tiny_llama):
    """On CUDA (FP32): the fused decoder's greedy tokens equal the unfused one's (Triton attention over the same
    cache, torch norms, RoPE and activation) and its logits agree to FP32 rounding, with the decode attention in
    one kernel too (its slices merged by a second kernel or by the last slice); asking L2 for the next weights
    changes no result."""
    hf, tensors, tok = load_hf_dir(tiny_llama)
    cfg = ModelConfig.from_hf(hf)
    prompt = tok.encode("The potter lit the fire")
    unfused = DecoderModel(cfg, tensors, torch.float32, "cuda", fused=False)
    fused = DecoderModel(cfg, tensors, torch.float32, "cuda")
    want, want_logits = _generate(unfused, prompt, 8, torch.float32, "cuda")
    got, got_logits = _generate(fused, prompt, 8, torch.float32, "cuda")
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-3, rtol=0)
    fused.l2_prefetch_bytes = 1 << 20
    again, again_logits = _generate(fused, prompt, 8, torch.float32, "cuda")
    assert again == got and torch.equal(again_logits, got_logits)
    fused.l2_prefetch_bytes = 0
    for merge in (False, True):
        fused.fuse_decode_attention, fused.decode_attention_merge = True, merge
        one, one_logits = _generate(fused, prompt, 8, torch.float32, "cuda")
        assert one == want
        torch.testing.assert_close(one_logits, want_logits, atol=1e-3, rtol=0)
