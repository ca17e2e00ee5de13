"""The .kiln LLM engine: build (every weight format, 8-bit KV with calibrated scales), read back bit for bit,
run it, refuse tampered members, a tampered manifest and an engine built for another GPU; `kiln inspect`."""

import json
import zipfile
from pathlib import Path

import pytest
import torch

from kiln.errors import ConfigError, EngineFileError
from kiln.llm import engine_file as ef
from kiln.llm.quantize import QuantizedWeight

DATA = Path(__file__).parent / "data"
CALIB = DATA / "macbeth_act1.txt"


def _rewrite(path, out, edit):
    """Copy the engine zip with edit(members) applied."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    edit(members)
    with zipfile.ZipFile(out, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
    return out


@pytest.fixture(scope="module")
def fp8_engine(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "tiny-fp8.kiln"
    manifest = ef.build_llm_engine(tiny_llama, out, dtype="fp32", weights="fp8", kv_cache_dtype="fp8", calib=CALIB,
                                   calib_tokens=256, max_seq_len=256, max_batch_size=8, log=lambda *a: None)
    return out, manifest


def test_manifest_records_layers_quantization_kv_and_stamp(fp8_engine, tiny_llama):
    path, m = fp8_engine
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == ["checksums.json", "manifest.json", "tokenizer.json", "tokenizer_config.json",
                                        "weights.safetensors"]
        sums = json.loads(z.read("checksums.json"))["members"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    assert m["format"] == "kiln-llm-engine" and m["target"]["kind"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert {"kiln", "torch"} <= set(m["versions"])
    assert m["architecture"] == json.loads((tiny_llama / "config.json").read_text())
    assert m["build_config"]["max_seq_len"] == 256 and m["build_config"]["max_batch_size"] == 8
    assert m["build_config"]["calibration"]["file"] == CALIB.name
    assert m["quantization"]["weights"] == "fp8" and len(m["quantization"]["matrices"]) == 8
    assert m["kv_cache"]["layout"] == "[num_blocks, block_size, num_kv_heads, head_dim]"
    assert m["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 1  # K+V, 2 layers, 2 KV heads, head_dim 16, FP8
    for layer in m["layers"]:
        assert all(lin["precision"] == "fp8" for lin in layer["linears"].values())
        ks, vs = layer["kv_cache"]["k_scale"], layer["kv_cache"]["v_scale"]
        assert len(ks) == 2 and len(set(ks)) == 1  # FP8: one scale per layer, repeated over the KV heads
        assert all(0 < s != 1.0 for s in ks + vs)
    assert set(sums) == {"manifest.json", "weights.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_round_trip_is_exact_and_runs(fp8_engine, tiny_llama):
    from kiln.llm.loader import load_hf_dir

    path, _ = fp8_engine
    built = ef.prepare_model(tiny_llama, dtype="fp32", weights="fp8", kv_cache_dtype="fp8", calib=CALIB,
                             calib_tokens=256)
    back = ef.read_llm_engine(path)
    assert set(back.quantized) == set(built.quantized)
    for key, q in built.quantized.items():
        r = back.quantized[key]
        assert isinstance(r, QuantizedWeight) and r.method == "fp8"
        assert torch.equal(r.codes.view(torch.uint8).cpu(), q.codes.view(torch.uint8).cpu())
        assert torch.equal(r.scale.cpu(), q.scale.cpu())
    for (k0, v0), (k1, v1) in zip(built.kv_scales, back.kv_scales):
        assert torch.equal(k0.cpu(), k1.cpu()) and torch.equal(v0.cpu(), v1.cpu())
    for b, r in zip(built.kv_scales, back.kv_scales):  # FP8 keys are stored centred on their calibrated mean
        assert b.k_offset is not None and torch.equal(b.k_offset.cpu(), r.k_offset)
    _, _, tok = load_hf_dir(tiny_llama)
    text = "The potter lit the fire. Hello world!"
    assert back.tokenizer.encode(text) == tok.encode(text)
    assert back.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    loaded = ef.prepare_model(path, dtype="fp32")
    assert loaded.weights == "fp8" and loaded.kv_cache_dtype == "fp8"
    ids = tok.encode(text)
    from kiln.llm.perplexity import PagedSequence

    def logits(p):
        seq = PagedSequence.allocate(p.model, len(ids), torch.float8_e4m3fn, p.kv_scales)
        return p.model.compute_logits(seq.prefill(p.model, torch.tensor(ids), chunk=8))

    assert torch.equal(logits(loaded), logits(built))


def test_core_engine_generates_from_the_file(fp8_engine):
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sampling import SamplingParams

    path, _ = fp8_engine
    engine = LLMEngine.from_model(str(path), device="cpu", num_kv_blocks=64)
    assert engine.kv_cache_dtype == torch.float8_e4m3fn
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


@pytest.mark.parametrize("weights", ["int8", "w8a8", "int4-awq"])
def test_other_weight_formats_round_trip(tiny_llama, tmp_path, weights):
    out = tmp_path / f"tiny-{weights}.kiln"
    ef.build_llm_engine(tiny_llama, out, dtype="bf16", weights=weights, kv_cache_dtype="int8", calib=CALIB,
                        calib_tokens=128, log=lambda *a: None)
    back = ef.read_llm_engine(out)
    q = back.quantized["layers.1.gate_up"]
    assert q.method == weights and (q.out_features, q.in_features) == (256, 64)
    assert q.codes.dtype == (torch.uint8 if weights == "int4-awq" else torch.int8)
    assert (q.input_scale is not None) == (weights in ("w8a8", "int4-awq"))
    assert back.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    ks = back.kv_scales[0][0]
    assert ks.shape == (2,) and (ks > 0).all()  # INT8: per KV head
    _, tensors, _, extras = ef.load_llm_engine(out)
    assert tensors["model.layers.1.mlp.up_proj.weight"].shape == (128, 64)
    assert extras["weights"] == weights and extras["kv_cache_dtype"] == "int8"


def test_tampering_is_refused(fp8_engine, tmp_path):
    path, _ = fp8_engine

    def flip_weight(members):
        data = bytearray(members["weights.safetensors"])
        data[-3] ^= 0x40
        members["weights.safetensors"] = bytes(data)

    with pytest.raises(EngineFileError, match="checksum of weights.safetensors does not match"):
        ef.read_llm_engine(_rewrite(path, tmp_path / "w.kiln", flip_weight))

    def edit_scale(members):
        m = json.loads(members["manifest.json"])
        m["kv_cache"]["scales"]["layers"][0]["k_scale"] = [1.0, 1.0]
        members["manifest.json"] = json.dumps(m).encode()

    with pytest.raises(EngineFileError, match="corrupted: member manifest.json holds"):
        ef.read_llm_engine(_rewrite(path, tmp_path / "m.kiln", edit_scale))

    def same_size_edit(members):  # one digit of a scale changed: the size matches, the digest does not
        raw = members["manifest.json"].decode()
        i = raw.index('"k_scale": [') + len('"k_scale": [') + 2
        members["manifest.json"] = (raw[:i] + ("1" if raw[i] != "1" else "2") + raw[i + 1:]).encode()

    with pytest.raises(EngineFileError, match="checksum of manifest.json does not match"):
        ef.read_llm_engine(_rewrite(path, tmp_path / "m2.kiln", same_size_edit))
    (tmp_path / "trunc.kiln").write_bytes(path.read_bytes()[:1000])
    with pytest.raises(EngineFileError, match="truncated, corrupted"):
        ef.read_llm_engine(tmp_path / "trunc.kiln")


@pytest.mark.parametrize("field, value, words", [
    ("k_scale", ["1"], "'k_scale' is not a list of finite positive numbers"),
    ("v_scale", [0.0, 1.0], "'v_scale' is not a list of finite positive numbers"),
    ("k_offset", [[0.0]], "'k_offset' needs one row of equal length per KV head"),
    ("k_offset", [[0.0, 1.0], [float("nan"), 1.0]], "'k_offset' is not a list of finite numbers"),
])
def test_malformed_kv_scales_are_refused(fp8_engine, tmp_path, field, value, words):
    path, _ = fp8_engine

    def edit(members):  # a consistent file whose manifest holds what no build writes
        m = json.loads(members["manifest.json"])
        m["kv_cache"]["scales"]["layers"][1][field] = value
        members["manifest.json"] = json.dumps(m).encode()
        members["checksums.json"] = ef.checksums_of(members)

    with pytest.raises(EngineFileError, match="layer 1 " + words.replace("(", r"\(")):
        ef.read_llm_engine(_rewrite(path, tmp_path / "bad.kiln", edit))


def test_engine_for_another_gpu_is_refused(fp8_engine, tmp_path):
    path, _ = fp8_engine

    def retarget(members):
        m = json.loads(members["manifest.json"])
        m["target"] = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}
        members["manifest.json"] = json.dumps(m).encode()
        members["checksums.json"] = ef.checksums_of(members)  # a consistent file, only built elsewhere

    other = _rewrite(path, tmp_path / "h100.kiln", retarget)
    if torch.cuda.is_available():
        pytest.skip("this check is for a machine without that GPU")
    with pytest.raises(EngineFileError, match=r"built for NVIDIA H100 80GB HBM3 \(compute capability 9.0\), but this "
                                              "machine has no CUDA GPU"):
        ef.read_llm_engine(other)


def test_build_refusals(tiny_llama, tmp_path, fp8_engine):
    out = tmp_path / "x.kiln"
    with pytest.raises(ConfigError, match="needs calibrated K/V scales: give --calib"):
        ef.build_llm_engine(tiny_llama, out, kv_cache_dtype="int8", log=lambda *a: None)
    with pytest.raises(ConfigError, match="needs calibration text"):
        ef.build_llm_engine(tiny_llama, out, weights="int4-awq", log=lambda *a: None)
    with pytest.raises(ConfigError, match="already an engine"):
        ef.build_llm_engine(fp8_engine[0], out, log=lambda *a: None)
    with pytest.raises(ConfigError, match="--budget needs --evalText"):
        ef.build_llm_engine(tiny_llama, out, budget=1.0, log=lambda *a: None)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left behind


def test_cli_build_and_inspect(tiny_llama, tmp_path, capsys):
    from kiln.cli import main

    out = tmp_path / "cli.kiln"
    assert main(["llm", "build", str(tiny_llama), "--dtype", "fp32", "--weights", "int8", "--kv-cache-dtype", "int8",
                 "--calib", str(CALIB), "--calib-tokens", "128", "--saveEngine", str(out)]) == 0
    assert "LLM engine written to" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "LLM engine:" in shown and "KV cache: int8" in shown and "K scale" in shown
    assert "int8 128x64" in shown  # the fused QKV: (4 + 2 * 2) heads x 16 rows over hidden 64
    assert main(["llm", "build", str(tiny_llama), "--kv-cache-dtype", "fp8", "--saveEngine", str(tmp_path / "y.kiln")]) == 2
    assert "needs calibrated K/V scales" in capsys.readouterr().err
