"""KV-cache calibration's key centring on a tiny Llama (CPU): FP8 scales carry the keys' calibrated mean as
the cache's key offset, INT8 and soft-capped models none; the pair still unpacks as (k_scale, v_scale); the
engine's caches and the manifest's description take the offset; centred FP8 keys score as the float cache does
to within FP8's rounding."""

from pathlib import Path

import pytest
import torch

from kiln.llm.calibrate import (
    calibrate_kv_scales,
    describe_kv_scales,
    kv_scales_from_absmax,
    kv_statistics,
)
from kiln.llm.config import ModelConfig
from kiln.llm.model import DecoderModel
from kiln.llm.perplexity import perplexity

CALIB = Path(__file__).parent / "data" / "macbeth_act1.txt"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from kiln.llm.loader import load_hf_dir

    hf, tensors, tok = load_hf_dir(tiny_llama)
    model = DecoderModel(ModelConfig.from_hf(hf), tensors, torch.float32, "cpu")
    return model, tok, tok.encode(CALIB.read_text()[:700])


def test_fp8_scales_carry_the_key_mean(tiny):
    model, _, ids = tiny
    cfg = model.cfg
    stats = kv_statistics(model, ids, window=128)
    assert stats.key_mean.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert stats.absmax.shape == (cfg.num_layers, 2, cfg.num_kv_heads)
    fp8 = calibrate_kv_scales(model, ids, "fp8", window=128, centre_keys=True)
    assert all(p.k_offset is None for p in calibrate_kv_scales(model, ids, "fp8", window=128))
    for n, pair in enumerate(fp8):
        k_scale, _ = pair  # still a pair
        torch.testing.assert_close(pair.k_offset, stats.key_mean[n])
        # the scale is that of the uncentred keys: it holds them with the offset or without
        assert torch.allclose(k_scale, stats.absmax[n, 0].max() / 448)
    assert all(p.k_offset is None for p in calibrate_kv_scales(model, ids, "int8", window=128, centre_keys=True))
    assert all(p.k_offset is None for p in kv_scales_from_absmax(stats.absmax, "fp8"))
    described = describe_kv_scales(fp8, "fp8")
    assert described["keys_centred"] and len(described["layers"][0]["k_offset"]) == cfg.num_kv_heads


def test_soft_capped_models_get_no_offset(tiny, monkeypatch):
    model, _, ids = tiny
    monkeypatch.setattr(model.cfg, "attn_logit_softcap", 50.0)
    assert all(p.k_offset is None for p in calibrate_kv_scales(model, ids, "fp8", window=128, centre_keys=True))


def test_centred_fp8_keys_score_as_the_float_cache(tiny):
    """Same text, same scales: the FP8 cache's perplexity lies within FP8's rounding of the float cache's, with
    and without centring (the offset changes the rounding, not what softmax sees)."""
    model, _, ids = tiny
    stats = kv_statistics(model, ids, window=128)
    evaluated = ids[:120]
    base = perplexity(model, evaluated, window=120, stride=120).perplexity
    for mean in (stats.key_mean, None):
        r = perplexity(model, evaluated, kv_cache_dtype="fp8", window=120, stride=120,
                       kv_scales=kv_scales_from_absmax(stats.absmax, "fp8", mean))
        assert r.perplexity != base and abs(r.perplexity / base - 1) < 0.05


def test_engine_caches_take_the_offset(tiny_llama):
    from kiln.llm import LLM, SamplingParams

    llm = LLM(tiny_llama, kv_cache_dtype="fp8", kv_calib=str(CALIB), max_model_len=128)
    caches = llm.llm_engine.runner.caches
    assert all(c.k_offset is not None and c.k_offset.shape == c.k.shape[2:] for c in caches)
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
