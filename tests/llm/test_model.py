"""The decoder's logits against transformers' on tiny checkpoints (FP32, 1e-4), over the paged cache.

Two prompts are packed into one step with scattered block tables; then the first prompt again in two chunks
(the second chunk reads the first's K/V from the cache), as chunked prefill does.
"""

import pytest
import torch

from kiln.llm.attention import AttentionMetadata, LayerCache
from kiln.llm.config import ModelConfig
from kiln.llm.loader import load_hf_dir
from kiln.llm.model import DecoderModel
from tests.llm.tiny import load_hf_reference, make_tiny_model

BS = 4  # small blocks: sequences span several, out of order


def _caches(cfg, num_blocks=32, device="cpu"):
    shape = (num_blocks, BS, cfg.num_kv_heads, cfg.head_dim)
    return [LayerCache(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(cfg.num_layers)]


def _step(model, caches, chunks):
    """chunks: (token ids, first position, block table) per sequence; returns logits of every token."""
    ids, pos, slots, starts, lens = [], [], [], [0], []
    for toks, p0, table in chunks:
        ids += toks
        for p in range(p0, p0 + len(toks)):
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        starts.append(starts[-1] + len(toks))
        lens.append(p0 + len(toks))
    width = max(len(t) for _, _, t in chunks)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in chunks], dtype=torch.int32)
    d = model.device
    md = AttentionMetadata(torch.tensor(slots, device=d), torch.tensor(starts, dtype=torch.int32, device=d),
                           torch.tensor(lens, dtype=torch.int32, device=d), tables.to(d), max(len(c[0]) for c in chunks),
                           max(lens))
    ids, pos = torch.tensor(ids, device=d), torch.tensor(pos, device=d)
    return model.compute_logits(model.forward(ids, pos, md, caches)).cpu()


def _check(path):
    hf, tensors, tok = load_hf_dir(path)
    cfg = ModelConfig.from_hf(hf)
    model = DecoderModel(cfg, tensors, torch.float32, "cpu")
    ref = load_hf_reference(path)
    a = tok.encode("The potter lit the fire, and every evening the pots came out hard and bright.")
    b = tok.encode("Hello world! How are you?")
    with torch.no_grad():
        ra, rb = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    caches = _caches(cfg)
    ta, tb = [9, 2, 30, 5, 17, 11, 3, 28, 21, 4][: -(-len(a) // BS)], [1, 25, 7, 13, 19][: -(-len(b) // BS)]
    out = _step(model, caches, [(a, 0, ta), (b, 0, tb)])
    torch.testing.assert_close(out[:len(a)], ra, atol=1e-4, rtol=0)
    torch.testing.assert_close(out[len(a):], rb, atol=1e-4, rtol=0)
    caches = _caches(cfg)
    k = 6
    first = _step(model, caches, [(a[:k], 0, ta)])
    rest = _step(model, caches, [(a[k:], k, ta)])
    torch.testing.assert_close(torch.cat([first, rest]), ra, atol=1e-4, rtol=0)
    return cfg


def test_llama(tiny_llama):
    _check(tiny_llama)


def test_gqa_9_over_3(tiny_gqa9):
    cfg = _check(tiny_gqa9)
    assert (cfg.num_heads, cfg.num_kv_heads) == (9, 3)


@pytest.mark.parametrize("arch, kw", [
    ("gpt2", {}),
    ("qwen3", {"heads": 6, "kv_heads": 2, "hidden": 48}),
    ("qwen2", {}),
    ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 16}),
    ("gemma3_text", {"sliding_window": 8, "query_pre_attn_scalar": 16, "rope_scaling": {
        "rope_type": "linear", "factor": 8.0}, "layer_types": ["sliding_attention", "full_attention"]}),
    ("mistral", {"sliding_window": 8}),
    ("llama", {"tie_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
])
def test_other_families(tmp_path, arch, kw):
    _check(make_tiny_model(tmp_path / arch, arch, layers=2, vocab=320, **kw))


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("qwen3", {"heads": 6, "kv_heads": 2, "hidden": 48}),
                                      ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 16})])
def test_fused_ops_match_torch_forms(tmp_path, arch, kw):
    """The CUDA path's Triton fusions (RoPE in place, act * up, add + RMSNorm), run by Triton's interpreter."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    path = make_tiny_model(tmp_path / arch, arch, layers=2, vocab=320, **kw)
    hf, tensors, tok = load_hf_dir(path)
    cfg = ModelConfig.from_hf(hf)
    a = tok.encode("The potter lit the fire, and every evening the pots came out hard.")
    table = list(range(-(-len(a) // BS)))
    outs = []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs CPU tensors only under its interpreter
    for fused in (False, True):
        model = DecoderModel(cfg, tensors, torch.float32, device, fused=fused)
        outs.append(_step(model, _caches(cfg, device=device), [(a, 0, table)]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)
