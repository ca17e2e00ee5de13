"""Perplexity through Kiln's decoder and paged cache: the sliding window against transformers on a tiny Llama,
SmolLM2 on Hamlet with FP32, FP8 and INT8 KV caches (calibrated on Macbeth), KV-scale calibration, the CLI, and
the build's perplexity budget."""

import math
from pathlib import Path

import pytest
import torch

from kiln.errors import ConfigError, InputError
from kiln.llm.calibrate import calibrate_kv_scales
from kiln.llm.config import ModelConfig
from kiln.llm.model import DecoderModel
from kiln.llm.perplexity import perplexity

DATA = Path(__file__).parent / "data"
EVAL, CALIB = DATA / "hamlet_act1.txt", DATA / "macbeth_act1.txt"
N_EVAL = 192  # SmolLM2 tokens scored in the test (bench/llm_perplexity.py scores thousands)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from kiln.llm.loader import load_hf_dir

    hf, tensors, tok = load_hf_dir(tiny_llama)
    return DecoderModel(ModelConfig.from_hf(hf), tensors, torch.float32, "cpu"), tok


def test_single_window_equals_transformers(tiny, tiny_llama):
    from tests.llm.tiny import load_hf_reference

    model, tok = tiny
    ids = tok.encode(EVAL.read_text()[:400])
    ref = load_hf_reference(tiny_llama)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), labels=torch.tensor([ids]))
    ours = perplexity(model, ids, window=len(ids), stride=len(ids), chunk=32)
    assert ours.tokens == len(ids) - 1 and ours.windows == 1
    assert ours.nll == pytest.approx(out.loss.item(), rel=1e-4)


def test_sliding_window_scores_each_token_once(tiny):
    model, tok = tiny
    ids = tok.encode(EVAL.read_text()[:500])
    r = perplexity(model, ids, window=96, stride=40, chunk=32)
    assert r.tokens == len(ids) - 1
    assert r.windows == math.ceil((len(ids) - 96) / 40) + 1
    # more context per scored token cannot make a trained model worse by much; for a random one it only
    # has to stay finite and differ
    wide = perplexity(model, ids, window=192, stride=192)
    assert math.isfinite(r.perplexity) and r.perplexity != wide.perplexity


def test_kv_scales_are_calibrated_not_defaults(tiny):
    model, tok = tiny
    ids = tok.encode(CALIB.read_text()[:1000])
    fp8 = calibrate_kv_scales(model, ids, "fp8")
    int8 = calibrate_kv_scales(model, ids, "int8")
    assert len(fp8) == len(int8) == model.cfg.num_layers
    for (k8, v8), (ki, vi) in zip(fp8, int8):
        assert k8.shape == ki.shape == (model.cfg.num_kv_heads,)
        assert len(set(k8.tolist())) == 1  # FP8: one per layer
        assert (ki > 0).all() and not torch.all(ki == 1.0) and not torch.all(k8 == 1.0)
        # FP8's layer scale is the largest head's INT8 scale rescaled from 127 to 448
        assert k8[0].item() == pytest.approx(ki.max().item() * 127 / 448, rel=1e-5)
        assert v8[0].item() == pytest.approx(vi.max().item() * 127 / 448, rel=1e-5)
    with pytest.raises(InputError, match="no tokens"):
        calibrate_kv_scales(model, [], "int8")
    with pytest.raises(ConfigError, match="fp8 or int8"):
        calibrate_kv_scales(model, ids, "bf16")
    with pytest.raises(ConfigError, match="needs calibrated K/V scales"):
        perplexity(model, ids, kv_cache_dtype="int8")


def test_smollm2_shakespeare_with_8bit_kv():
    """SmolLM2 on the opening of Hamlet with FP8 and INT8 KV caches (scales calibrated on Macbeth) against the FP32
    cache. On these 192 tokens (one window) FP8 measured +1.9% and INT8 -0.4%; the issue's targets (FP8 <= 1%,
    INT8 <= 1.5%) are for longer text, measured by bench/llm_perplexity.py (bench/results/cpu-llm-perplexity.md)."""
    from kiln.llm.calibrate import kv_absmax, kv_scales_from_absmax
    from tests.llm.test_gguf import smollm2

    hf, tensors, tok = smollm2()
    model = DecoderModel(ModelConfig.from_hf(hf), tensors, torch.float32, "cpu")
    ids = tok.encode(EVAL.read_text())[:N_EVAL]
    amax = kv_absmax(model, tok.encode(CALIB.read_text())[:128])  # one calibration pass serves both caches
    base = perplexity(model, ids, window=N_EVAL, stride=N_EVAL)
    assert 5 < base.perplexity < 60  # a trained model on English verse (a scrambled load gives thousands)
    for dtype, budget in (("fp8", 3.0), ("int8", 1.5)):
        scales = kv_scales_from_absmax(amax, dtype)
        r = perplexity(model, ids, kv_cache_dtype=dtype, kv_scales=scales, window=N_EVAL, stride=N_EVAL)
        rise = 100 * (r.perplexity / base.perplexity - 1)
        assert r.kv_cache_dtype == dtype and r.tokens == base.tokens
        assert abs(rise) <= budget, (dtype, base.perplexity, r.perplexity)
        assert r.perplexity != base.perplexity  # the 8-bit cache was really used


def test_cli_perplexity(tiny_llama, tmp_path, capsys):
    import json

    from kiln.cli import main

    out = tmp_path / "ppl.json"
    assert main(["llm", "perplexity", str(tiny_llama), "--text", str(EVAL), "--max-tokens", "200",
                 "--kv-cache-dtype", "int8", "--calib", str(CALIB), "--window", "128", "--stride", "64",
                 "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "int8" and result["tokens"] == 199
    assert f"{result['perplexity']:.4f}" in shown
    assert main(["llm", "perplexity", str(tiny_llama), "--text", str(EVAL), "--kv-cache-dtype", "fp8"]) == 2
    assert "needs calibrated K/V scales" in capsys.readouterr().err


def test_build_refuses_an_engine_over_the_perplexity_budget(tiny_llama, tmp_path):
    from kiln.llm.engine_file import build_llm_engine, read_llm_engine

    out = tmp_path / "fp8.kiln"
    common = {"dtype": "fp32", "weights": "fp8", "kv_cache_dtype": "int8", "calib": CALIB, "calib_tokens": 128,
              "eval_text": EVAL, "eval_tokens": 160, "window": 96, "stride": 48, "log": lambda *a: None}
    with pytest.raises(ConfigError, match=r"beyond --budget 0.01%.*no engine was written"):
        build_llm_engine(tiny_llama, out, budget=0.01, **common)
    assert list(tmp_path.iterdir()) == []
    m = build_llm_engine(tiny_llama, out, budget=1000.0, **common)
    p = m["perplexity"]
    assert p["rise_percent"] > 0.01 and p["budget_percent"] == 1000.0 and p["tokens"] == 159
    assert read_llm_engine(out).manifest["perplexity"] == p
