"""ModelConfig.from_hf: the families Kiln runs, and refusals that name config.json and the key."""

import pytest

from kiln.errors import ModelError, UnsupportedError
from kiln.llm.config import ModelConfig

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "eos_token_id": [2, 7]}


def test_llama_fields():
    c = ModelConfig.from_hf(LLAMA)
    assert (c.family, c.head_dim, c.num_kv_heads, c.rope_theta, c.eos_token_ids) == ("llama", 16, 2, 5e5, [2, 7])
    assert c.layer_windows == [None, None] and not c.tie_word_embeddings


def test_rope_parameters_of_transformers_5_and_llama3_scaling():
    hf = {**LLAMA, "rope_theta": None, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}
    c = ModelConfig.from_hf(hf)
    assert c.rope_theta == 1e4 and c.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ModelError, match="rope_scaling.low_freq_factor"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(UnsupportedError, match="yarn"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen3_gemma2_gpt2():
    q = ModelConfig.from_hf({**LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                             "sliding_window": 32, "use_sliding_window": False, "head_dim": 32})
    assert q.qk_norm and q.head_dim == 32 and q.layer_windows == [None, None]
    g = ModelConfig.from_hf({**LLAMA, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                             "sliding_window": 8, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
                             "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"})
    assert g.layer_windows == [8, None] and g.norm_offset == 1.0 and g.softmax_scale == 64 ** -0.5
    assert g.tie_word_embeddings and g.attn_logit_softcap == 50.0
    gpt = ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4,
                               "n_positions": 64})
    assert (gpt.family, gpt.intermediate_size, gpt.head_dim, gpt.hidden_act) == ("gpt2", 128, 8, "gelu_new")


@pytest.mark.parametrize("change, error, words", [
    ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, UnsupportedError, "model_type"),
    ({"architectures": ["LlamaForSequenceClassification"]}, UnsupportedError, "architectures"),
    ({"num_key_value_heads": 3}, ModelError, "num_key_value_heads"),
    ({"hidden_size": "64"}, ModelError, "hidden_size"),
    ({"num_hidden_layers": 0}, ModelError, "num_hidden_layers"),
    ({"hidden_act": "relu2"}, UnsupportedError, "relu2"),
    ({"torch_dtype": "float64"}, UnsupportedError, "torch_dtype"),
])
def test_refusals_name_the_key(change, error, words):
    with pytest.raises(error, match=words) as e:
        ModelConfig.from_hf({**LLAMA, **change}, source="m/config.json")
    assert "m/config.json" in str(e.value)


def test_missing_key():
    hf = dict(LLAMA)
    del hf["intermediate_size"]
    with pytest.raises(ModelError, match="'intermediate_size' is missing"):
        ModelConfig.from_hf(hf)
