"""Tiny Hugging Face decoder checkpoints for tests, made locally (nothing downloaded).

`make_tiny_llama(dir)` writes what a Hugging Face model directory holds: config.json, model.safetensors
(random weights from a fixed seed, built by transformers from its own config class, so the tensor names and
shapes are transformers'), tokenizer.json (a byte-level BPE trained with `tokenizers` on an inline text) and
tokenizer_config.json (special tokens and a small chat template). transformers is a test reference only.
"""

from __future__ import annotations

import json
from pathlib import Path

TEXT = """\
Once upon a time there was a small kiln at the edge of a quiet town. Every morning the potter lit the fire,
and every evening the pots came out hard and bright. The children asked how the clay became stone, and the
potter said: heat, patience and a careful hand. Numbers too: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256.
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thank you.
User: what is a kiln? Assistant: a kiln is an oven that fires clay into ceramics.
"""

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIALS = [UNK, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(out: Path, vocab: int) -> int:
    """Train a byte-level BPE of at most `vocab` entries; returns its size. BOS is prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}, indent=1))
    return tok.get_vocab_size()


def _hf_model(arch: str, cfg: dict):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    }[arch]
    return model_cls(config_cls(**cfg))


def make_tiny_model(out, arch: str = "llama", *, vocab: int = 384, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, hidden: int = 64, intermediate: int = 128, head_dim: int | None = None,
                    max_positions: int = 512, tie_embeddings: bool = False, rope_scaling: dict | None = None,
                    seed: int = 0, init_std: float = 0.1, **extra) -> Path:
    """Write a tiny HF checkpoint of `arch` (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt2) into
    `out`."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_size = write_tokenizer(out, vocab)
    vocab = max(vocab, tok_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if arch == "gpt2":
        cfg = dict(vocab_size=vocab, n_positions=max_positions, n_embd=hidden, n_layer=layers, n_head=heads,
                   n_inner=intermediate, bos_token_id=bos, eos_token_id=eos, initializer_range=init_std,
                   attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    else:
        cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=head_dim or hidden // heads, max_position_embeddings=max_positions,
                   tie_word_embeddings=tie_embeddings, bos_token_id=bos, eos_token_id=eos,
                   initializer_range=init_std, rope_scaling=rope_scaling)
    cfg.update(extra)
    torch.manual_seed(seed)
    model = _hf_model(arch, cfg).float().eval()
    with torch.no_grad():  # transformers initialises norms to 1 (or 0 for Gemma); perturb them so tests see them
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_llama(out, *, vocab: int = 384, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    hidden: int = 64, **kw) -> Path:
    """A tiny Llama (GQA by default: 4 query heads over 2 KV heads)."""
    return make_tiny_model(out, "llama", vocab=vocab, layers=layers, heads=heads, kv_heads=kv_heads,
                           hidden=hidden, **kw)


def make_tiny_gqa9(out, **kw) -> Path:
    """A tiny Llama with a non-power-of-two GQA group: 9 query heads over 3 KV heads (SmolLM2's shape)."""
    return make_tiny_model(out, "llama", heads=9, kv_heads=3, hidden=72, head_dim=8, **kw)


def load_hf_reference(path):
    """transformers' model for a tiny checkpoint, fp32, eval (the reference tests compare against)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").eval()
