"""Load a Hugging Face decoder directory: config.json + *.safetensors (one file or a sharded index) + tokenizer.

Returns the model data of the LLM contract: (hf_config dict, tensors keyed by transformers' names, Tokenizer).
Missing or mis-shaped tensors and a tokenizer larger than the vocabulary are refused naming file and tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.errors import ModelError
from kiln.llm.config import ModelConfig
from kiln.llm.tokenizer import Tokenizer


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found.") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e}).") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelError(f"{index}: missing the 'weight_map' object.")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).exists():
                raise ModelError(f"{index}: shard {f!r} is listed but {path / f} does not exist.")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weights found (PyTorch .bin checkpoints are not loaded: "
                         "they are pickles).")
    return files


def load_safetensors(files: list[Path], progress: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of the files, and the file each came from. progress: a bar of tensors read on a terminal."""
    from safetensors import SafetensorError, safe_open

    from kiln.progress import terminal_progress

    def unreadable(f, e):
        return ModelError(f"{f}: not a readable safetensors file ({e}).")

    names = {}
    for f in files:  # the headers first: the bar's length
        try:
            with safe_open(str(f), framework="pt") as sf:
                names[f] = list(sf.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise unreadable(f, e) from None
    tensors, origin = {}, {}
    with terminal_progress("loading", sum(map(len, names.values())), files[0].parent.name if files else "",
                           enabled=progress) as bar:
        for f, keys in names.items():
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in keys:
                        tensors[name] = sf.get_tensor(name)
                        origin[name] = f
                        bar.advance(f"{f.name}: {name}")
            except (SafetensorError, OSError, ValueError) as e:
                raise unreadable(f, e) from None
    return tensors, origin


def check_tensors(cfg: ModelConfig, tensors: dict, origin: dict | None = None, source: str = "weights") -> None:
    """Every tensor the model needs is present with its shape; names the file and tensor otherwise."""
    from kiln.llm.model import expected_shapes

    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"{source}: tensor {name!r} is missing (needed for {cfg.model_type} with "
                             f"{cfg.num_layers} layers).")
        if tuple(t.shape) != tuple(shape):
            where = origin.get(name, source) if origin else source
            raise ModelError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                             "from config.json.")


def check_tokenizer(cfg: ModelConfig, tokenizer: Tokenizer, source: str) -> None:
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but config.json's vocab_size "
                         f"is {cfg.vocab_size}: the tokenizer does not match the model.")


def load_hf_dir(path, progress: bool = False) -> tuple[dict, dict[str, torch.Tensor], Tokenizer]:
    """progress: a bar of the tensors read, on a terminal."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: not a model directory (expected config.json, *.safetensors, tokenizer.json).")
    hf_config = read_json(path / "config.json")
    cfg = ModelConfig.from_hf(hf_config, source=str(path / "config.json"))
    tensors, origin = load_safetensors(safetensors_files(path), progress)
    if cfg.family == "gpt2":
        from kiln.llm.model import normalize_names

        origin = normalize_names(origin)
        tensors = normalize_names(tensors)
    if cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
        tensors.pop("lm_head.weight", None)
    check_tensors(cfg, tensors, origin, source=str(path))
    tok_json = path / "tokenizer.json"
    if not tok_json.exists():
        raise ModelError(f"{tok_json}: file not found (Kiln reads the fast-tokenizer file tokenizer.json).")
    tokenizer = Tokenizer.from_file(tok_json, path / "tokenizer_config.json")
    check_tokenizer(cfg, tokenizer, str(tok_json))
    # Instruct models list extra end tokens (e.g. Llama 3's <|eot_id|>) in config.json / generation_config.json.
    gen = read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
    gen_eos = gen.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else [e for e in gen_eos or [] if isinstance(e, int)]
    tokenizer.eos_token_ids |= set(cfg.eos_token_ids) | set(gen_eos)
    if tokenizer.bos_token_id is None and cfg.bos_token_id is not None:
        tokenizer.bos_token_id = cfg.bos_token_id
    return hf_config, tensors, tokenizer
