"""load_hf_dir: an HF directory in, refusals naming the file and the tensor."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kiln.errors import ModelError, UnsupportedError
from kiln.llm.loader import load_hf_dir


def _copy(src, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def test_loads_config_tensors_tokenizer(tiny_llama):
    hf, tensors, tok = load_hf_dir(tiny_llama)
    assert hf["model_type"] == "llama" and tensors["model.embed_tokens.weight"].shape == (384, 64)
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "Hello world"
    assert tok.eos_token_ids == {tok.token_to_id("</s>")}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_sharded_index(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, d / f)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    _, loaded, _ = load_hf_dir(d)
    assert set(loaded) == set(tensors)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        load_hf_dir(d)


def test_missing_and_misshaped_tensors(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path)
    tensors = load_file(d / "model.safetensors")
    bad = dict(tensors)
    del bad["model.layers.1.mlp.down_proj.weight"]
    save_file(bad, d / "model.safetensors")
    with pytest.raises(ModelError, match="model.layers.1.mlp.down_proj.weight.*missing"):
        load_hf_dir(d)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:16].clone()
    save_file(bad, d / "model.safetensors")
    with pytest.raises(ModelError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has "
                                         r"shape \[16, 64\], expected \[32, 64\]"):
        load_hf_dir(d)


def test_tokenizer_larger_than_vocab_and_unknown_architecture(tiny_llama, tmp_path):
    d = _copy(tiny_llama, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon_mamba",
                                               "architectures": ["FalconMambaForCausalLM"]}))
    with pytest.raises(UnsupportedError, match="config.json.*model_type"):
        load_hf_dir(d)
    tensors = load_file(d / "model.safetensors")
    small = {k: (v[:300].clone() if k in ("model.embed_tokens.weight", "lm_head.weight") else v)
             for k, v in tensors.items()}
    save_file(small, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(ModelError, match="tokenizer.json.*384 tokens.*vocab_size is 300"):
        load_hf_dir(d)


def test_no_weights_and_bad_json(tmp_path, tiny_llama):
    d = _copy(tiny_llama, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no \*.safetensors"):
        load_hf_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        load_hf_dir(d)
    with pytest.raises(ModelError, match="not a model directory"):
        load_hf_dir(tmp_path / "nope")
