"""The .kiln LLM engine (`kiln llm build`): a decoder with its quantization and KV-cache choices fixed.

Same container as Kiln's other engines (kiln.engine.serialize: an uncompressed zip, no pickle, written
atomically, every member checksummed, stamped with the GPU and versions it was built with):

    manifest.json          format "kiln-llm-engine", versions, target, build config, the architecture
                           (the Hugging Face config dict), per-layer precisions, quantization, the KV-cache
                           layout and its calibrated per-layer scales, perplexity when measured
    tokenizer.json         the `tokenizers` tokenizer
    tokenizer_config.json  its special tokens, BOS rule and chat template
    weights.safetensors    float tensors by transformers' names (embeddings, norms, biases, LM head, and any
                           matrix left in float); quantized matrices as '<key>.codes', '<key>.scale'
                           (+ '.zero', '.input_scale'), key = 'layers.N.qkv|o|gate_up|down'
    checksums.json         SHA-256 and size of every member above, the manifest included (serialize.py's
                           format-2 convention); a member that does not match is a refusal

`read_llm_engine(path)` checks every digest and the target, and returns an `LLMEngineFile`;
`load_llm_engine(path)` returns (hf_config, tensors, tokenizer, extras) for kiln.llm.engine.LLMEngine, where the
tensors are complete float weights (quantized matrices dequantized, split back to q/k/v and gate/up) and extras
holds kv_cache_dtype, kv_scales, the QuantizedWeights ("quantized_weights") to install into the built model with
kiln.llm.quantize.install, and the build's max_model_len / max_num_seqs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..engine import serialize
from ..errors import ConfigError, EngineFileError, UnsupportedError
from . import quantize
from .parallel import check_tensor_parallel, shard_manifest
from .perplexity import EIGHT_BIT, kv_cache_name, resolve_kv_dtype

FORMAT = "kiln-llm-engine"
FORMAT_VERSION = 1
MANIFEST, WEIGHTS, TOKENIZER, TOKENIZER_CONFIG, CHECKSUMS = (
    "manifest.json", "weights.safetensors", "tokenizer.json", "tokenizer_config.json", "checksums.json")
MEMBERS = (MANIFEST, WEIGHTS, TOKENIZER, TOKENIZER_CONFIG)  # the members checksums.json covers
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
KV_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checksums_of(members: dict[str, bytes], sign_key: bytes | None = None) -> bytes:
    """checksums.json over this format's members, as serialize.py writes it for compiled engines."""
    return serialize.checksums_of(members, sign_key, names=MEMBERS)


# --- the model a command works on ----------------------------------------------------------------------------


@dataclass
class PreparedModel:
    """A DecoderModel ready to score or serve, with the choices made for it."""

    model: object
    tokenizer: object
    hf_config: dict
    weights: str  # quantization method of the matrices ("none" = float)
    kv_cache_dtype: str
    kv_scales: list | None
    quantized: dict = field(default_factory=dict)


def _device(device: str) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is available here.")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"--device {device!r}: choose auto, cpu, cuda or cuda:N.")
    return torch.device(device)


def _model_dtype(dtype: str | None, cfg, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return DTYPES[cfg.dtype] if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def calibration_ids(tokenizer, path, max_tokens: int) -> list[int]:
    from .perplexity import read_text_tokens

    return read_text_tokens(tokenizer, path, max_tokens)


def prepare_model(source, *, dtype=None, device="auto", weights=None, kv_cache_dtype=None, calib=None,
                  calib_tokens: int = 2048, loaded=None, on_step=None) -> PreparedModel:
    """Load an HF directory, .gguf or .kiln engine as a DecoderModel; quantize its weights (`weights`) and
    calibrate 8-bit KV scales (`kv_cache_dtype`) from the `calib` text when the source does not carry them.
    loaded: the source's (hf_config, tensors, tokenizer, extras) when already read. on_step(message): told each
    calibration pass and each matrix quantized (a progress display's step)."""
    from .config import ModelConfig
    from .engine import load_model
    from .model import DecoderModel

    def step(message: str) -> None:
        if on_step is not None:
            on_step(message)

    hf_config, tensors, tokenizer, extras = loaded or load_model(source)
    is_engine = bool(extras)
    cfg = ModelConfig.from_hf(hf_config, source=str(source))
    if weights not in (None, "none") and cfg.family == "gpt2":
        raise UnsupportedError(f"--weights {weights}: weight quantization of GPT-2 models ('{source}') is not "
                               "supported (their fused Conv1D layout); use --weights none.")
    dev = _device(device)
    model = DecoderModel(cfg, tensors, _model_dtype(dtype, cfg, dev), dev)
    method = "none"
    if is_engine:
        if weights not in (None, extras.get("weights", "none")):
            raise ConfigError(f"--weights {weights}: '{source}' is an engine built with weights "
                              f"{extras.get('weights')}; rebuild it from the model to change them.")
        quantize.install(model, extras.get("quantized_weights", {}))
        method = extras.get("weights", "none")
    elif weights not in (None, "none"):
        method = quantize.check_method(weights)
        stats = None
        if quantize.needs_calibration(method):
            if calib is None:
                raise ConfigError(f"--weights {method} needs calibration text: give --calib FILE.")
            from .calibrate import activation_stats

            ids = calibration_ids(tokenizer, calib, calib_tokens)
            step(f"calibrating {method}: activations over {len(ids)} tokens of {Path(calib).name}")
            stats = activation_stats(model, ids)
        quantize.quantize_model(model, method, stats, on_matrix=lambda key, done, total: step(
            f"quantized {key} to {method} ({done}/{total})"))
    kv_name = kv_cache_dtype or (extras.get("kv_cache_dtype") if is_engine else None) or "auto"
    kv_dtype = resolve_kv_dtype(kv_name, model.dtype)
    scales = None
    if kv_dtype in EIGHT_BIT:
        if is_engine and extras.get("kv_cache_dtype") == kv_cache_name(kv_dtype):
            scales = extras["kv_scales"]
        elif calib is None:
            raise ConfigError(f"--kvCacheDtype {kv_name} needs calibrated K/V scales: give --calib FILE "
                              "(Kiln never assumes a scale of 1.0).")
        else:
            from .calibrate import calibrate_kv_scales

            ids = calibration_ids(tokenizer, calib, calib_tokens)
            step(f"calibrating {kv_cache_name(kv_dtype)} KV scales over {len(ids)} tokens of {Path(calib).name}")
            scales = calibrate_kv_scales(model, ids, kv_dtype, centre_keys=True)
    quantized = {k: w for k, w in quantize.linear_weights(model).items() if isinstance(w, quantize.QuantizedWeight)}
    return PreparedModel(model, tokenizer, hf_config, method, kv_cache_name(kv_dtype), scales, quantized)


# --- writing --------------------------------------------------------------------------------------------------


def _float_tensors(model, hf_tensors: dict, quantized: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF-named tensors the engine stores in float: everything but the matrices stored quantized."""
    skip = set()
    for key in quantized:
        skip |= set(_hf_names_of(model.cfg, key))
    return {k: t.detach().to(dtype).contiguous().cpu() for k, t in hf_tensors.items() if k not in skip}


def _hf_names_of(cfg, key: str) -> list[str]:
    """transformers' tensors a model.py matrix is concatenated from (Llama family)."""
    if cfg.family == "gpt2":
        raise UnsupportedError("weight quantization of GPT-2 models is not supported (their fused Conv1D layout).")
    _, n, k = key.split(".")
    p = f"model.layers.{n}."
    return {"qkv": [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
            "o": [p + "self_attn.o_proj.weight"], "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "down": [p + "mlp.down_proj.weight"]}[k]


def _split_rows(cfg, key: str) -> list[int]:
    k = key.split(".")[2]
    if k == "qkv":
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    if k == "gate_up":
        return [cfg.intermediate_size, cfg.intermediate_size]
    return [cfg.hidden_size]


def _tokenizer_members(tokenizer) -> dict[str, bytes]:
    cfg = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
           "eos_token_ids": sorted(tokenizer.eos_token_ids), "chat_template": tokenizer.chat_template,
           "add_bos_token": bool(getattr(tokenizer, "_prepend_bos", False))}
    return {TOKENIZER: tokenizer._tok.to_str().encode(), TOKENIZER_CONFIG: json.dumps(cfg, indent=1).encode()}


def layer_table(cfg, quantized: dict, method: str, kv_dtype_name: str, kv_scales) -> list[dict]:
    rows = []
    for n in range(cfg.num_layers):
        linears = {}
        for k, shape in (("qkv", [(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size]),
                         ("o", [cfg.hidden_size, cfg.num_heads * cfg.head_dim]),
                         ("gate_up", [2 * cfg.intermediate_size, cfg.hidden_size]),
                         ("down", [cfg.hidden_size, cfg.intermediate_size])):
            q = quantized.get(f"layers.{n}.{k}")
            linears[k] = {"shape": shape, "precision": q.method if q is not None else "float",
                          "storage": str(q.codes.dtype).removeprefix("torch.") if q is not None else None,
                          "scales": _scale_kind(q.method) if q is not None else None}
        kv = {"dtype": kv_dtype_name}
        if kv_scales is not None:
            kv["k_scale"], kv["v_scale"] = kv_scales[n][0].tolist(), kv_scales[n][1].tolist()
        rows.append({"index": n, "attention": {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                                               "head_dim": cfg.head_dim}, "linears": linears, "kv_cache": kv})
    return rows


def _scale_kind(method: str) -> str:
    return {"fp8": "per-output-channel", "int8": "per-output-channel",
            "w8a8": "per-output-channel (weights), per-token dynamic (activations), SmoothQuant alpha 0.5",
            "int4-awq": f"per-group of {quantize.INT4_GROUP} (scale + 4-bit zero), AWQ input scales"}[method]


def write_llm_engine(path, prepared: PreparedModel, hf_tensors: dict, *, dtype: str, build_config: dict,
                     target, perplexity: dict | None = None, sign_key: bytes | None = None) -> dict:
    """Write `prepared` as a .kiln LLM engine at `path` (atomically); returns its manifest. sign_key: sign the
    member digests with it (`kiln llm generate|serve|inspect --verifyKey` accept only such engines)."""
    from ..engine.target import versions

    model = prepared.model
    cfg = model.cfg
    store = DTYPES[dtype]
    tensors = _float_tensors(model, hf_tensors, prepared.quantized, store)
    for key, q in prepared.quantized.items():
        for part, t in q.tensors().items():
            tensors[f"{key}.{part}"] = t.detach().contiguous().cpu()
    kv_dtype = resolve_kv_dtype(prepared.kv_cache_dtype, model.dtype)
    members = {WEIGHTS: st_save(tensors), **_tokenizer_members(prepared.tokenizer)}
    kv = {"dtype": prepared.kv_cache_dtype, "layout": KV_LAYOUT, "block_size": build_config.get("block_size", 16),
          "bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize,
          "quantization": ("stored = x / scale, FP8 E4M3 saturated to +-448; one scale per layer"
                           if prepared.kv_cache_dtype == "fp8" else
                           "stored = round(x / scale) clamped to +-127; one scale per KV head"
                           if prepared.kv_cache_dtype == "int8" else None)}
    if prepared.kv_scales is not None:
        from .calibrate import describe_kv_scales

        kv["scales"] = describe_kv_scales(prepared.kv_scales, kv_dtype)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "versions": versions(), "target": target.to_json(),
        "build_config": build_config, "architecture": prepared.hf_config,
        "quantization": {"weights": prepared.weights, "group_size": quantize.INT4_GROUP
                         if prepared.weights == "int4-awq" else None,
                         "smoothquant_alpha": quantize.SMOOTH_ALPHA if prepared.weights == "w8a8" else None,
                         "matrices": {k: {"method": q.method, "shape": [q.out_features, q.in_features]}
                                      for k, q in prepared.quantized.items()}},
        "kv_cache": kv,
        "layers": layer_table(cfg, prepared.quantized, prepared.weights, prepared.kv_cache_dtype, prepared.kv_scales),
        "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "perplexity": perplexity,
        # Every rank's shard (rank, world size, its heads / KV heads / MLP columns / vocabulary rows); the weights
        # are stored whole and each rank cuts its shard at load (kiln.llm.parallel).
        "tensor_parallel": shard_manifest(cfg, build_config.get("tensor_parallel_size", 1)),
    }
    members[MANIFEST] = json.dumps(manifest, indent=1).encode()
    members[CHECKSUMS] = checksums_of(members, sign_key)
    serialize.save_members({name: members[name] for name in (*MEMBERS, CHECKSUMS)}, path)
    return manifest


# --- reading --------------------------------------------------------------------------------------------------


@dataclass
class LLMEngineFile:
    path: Path
    manifest: dict
    hf_config: dict
    tensors: dict  # HF-named float tensors (the stored ones; quantized matrices excluded)
    quantized: dict  # key -> QuantizedWeight
    tokenizer: object
    kv_cache_dtype: str
    kv_scales: list | None

    def float_tensors(self) -> dict[str, torch.Tensor]:
        """Complete HF-named float weights: the stored ones plus the quantized matrices dequantized."""
        from .config import ModelConfig

        cfg = ModelConfig.from_hf(self.hf_config, source=str(self.path))
        out = dict(self.tensors)
        for key, q in self.quantized.items():
            w = q.dequantize(torch.float32)
            for name, part in zip(_hf_names_of(cfg, key), w.split(_split_rows(cfg, key))):
                out[name] = part.contiguous()
        return out


def _rebuild(path, why: str) -> EngineFileError:
    return EngineFileError(f"'{path}' {why}. Rebuild it with `kiln llm build`.")


def _members(path: Path, verify_key: bytes | None = None, expect: dict | None = None,
             verified: dict | None = None) -> dict[str, bytes]:
    """The engine's members, checked as serialize.py checks every Kiln engine: each stored uncompressed at the size
    checksums.json records and matching its SHA-256; with verify_key, only if checksums.json carries a valid
    signature by that key; with expect, only if its digests are those (serialize.read_members)."""
    return serialize.read_members(path, verify_key, names=MEMBERS, command="kiln llm build", expect=expect,
                                  verified=verified)


def read_manifest(path, verify_key: bytes | None = None) -> dict:
    """The manifest, after every member's checksum (and, with verify_key, the signature) is verified."""
    path = Path(path)
    return _parse_manifest(path, _members(path, verify_key))


def _parse_manifest(path: Path, members: dict) -> dict:
    try:
        m = json.loads(members[MANIFEST])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise EngineFileError(f"'{path}': manifest.json is corrupted (not JSON).") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise EngineFileError(f"'{path}' is not a Kiln LLM engine (format {str(m.get('format'))[:40]!r}).")
    if m.get("format_version") != FORMAT_VERSION:
        raise EngineFileError(f"'{path}' uses LLM engine format {str(m.get('format_version'))[:20]}, this Kiln "
                              f"reads format {FORMAT_VERSION}; rebuild it with `kiln llm build`.")
    for key in ("target", "versions", "architecture", "quantization", "kv_cache", "layers", "build_config"):
        if not isinstance(m.get(key), (dict, list)):
            raise _rebuild(path, f"is malformed: manifest.json has no valid '{key}'")
    return m


def is_llm_engine(path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("manifest.json")  # never inflate or read an oversized member of an untrusted file
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > 64 * 2**20:
                return False
            m = json.loads(z.read("manifest.json"))
            return isinstance(m, dict) and m.get("format") == FORMAT
    except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return False


def read_llm_engine(path, device: str = "auto", verify_key: bytes | None = None) -> LLMEngineFile:
    from .tokenizer import Tokenizer

    path = Path(path)
    verified: dict = {}
    members = _members(path, verify_key or _PINNED.get(path.resolve()), _EXPECTED.get(path.resolve()), verified)
    _LOADED[path.resolve()] = verified
    m = _parse_manifest(path, members)
    serialize._check_compatible(path, m, device)
    try:
        stored = st_load(members[WEIGHTS])
        from tokenizers import Tokenizer as HFTokenizer

        tok_cfg = json.loads(members[TOKENIZER_CONFIG])
        hf_tok = HFTokenizer.from_str(members[TOKENIZER].decode())
    except Exception as e:  # noqa: BLE001 - safetensors / tokenizers raise their own types on malformed data
        raise EngineFileError(f"'{path}' cannot be decoded: {e}") from None
    tokenizer = Tokenizer(hf_tok, bos_token=tok_cfg.get("bos_token"),
                          eos_tokens=[tok_cfg["eos_token"]] if tok_cfg.get("eos_token") else [],
                          eos_token_ids=tok_cfg.get("eos_token_ids", []), chat_template=tok_cfg.get("chat_template"),
                          add_bos_token=tok_cfg.get("add_bos_token"), source=f"{path}:tokenizer.json")
    quantized, tensors = {}, dict(stored)
    for key, info in m["quantization"]["matrices"].items():
        parts = {}
        for part in ("codes", "scale", "zero", "input_scale"):
            t = tensors.pop(f"{key}.{part}", None)
            if t is not None:
                parts[part] = t
        if "codes" not in parts or "scale" not in parts:
            raise EngineFileError(f"'{path}': quantized matrix '{key}' lacks its codes or scales.")
        quantized[key] = quantize.QuantizedWeight.from_tensors(info["method"], info["shape"][1], parts)
    kv = m["kv_cache"]
    scales = _kv_scales(path, kv["scales"]) if kv.get("scales") else None
    return LLMEngineFile(path, m, m["architecture"], tensors, quantized, tokenizer, kv["dtype"], scales)


def _kv_scales(path: Path, described) -> list:
    """The manifest's K/V scales (and key offsets, where the keys are stored centred) as KVScales per layer, each
    field checked to be finite numbers of a consistent shape: a manifest is data from a file."""
    from .attention import KVScales

    def numbers(n, field, value, positive):
        t = None
        if isinstance(value, list) and value and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                     for x in value):
            t = torch.tensor(value, dtype=torch.float32)
        if t is None or not torch.isfinite(t).all() or (positive and not (t > 0).all()):
            raise EngineFileError(f"'{path}' is malformed: kv_cache.scales layer {n} '{field}' is not a list of "
                                  f"finite{' positive' if positive else ''} numbers; rebuild it with `kiln llm build`.")
        return t

    layers = described.get("layers") if isinstance(described, dict) else None
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise EngineFileError(f"'{path}' is malformed: kv_cache.scales has no list of layers; rebuild it with "
                              "`kiln llm build`.")
    out = []
    for n, layer in enumerate(layers):
        k, v = numbers(n, "k_scale", layer.get("k_scale"), True), numbers(n, "v_scale", layer.get("v_scale"), True)
        offset = None
        if layer.get("k_offset") is not None:
            rows = layer["k_offset"]
            if not isinstance(rows, list) or len(rows) != len(k) or len({len(r) if isinstance(r, list) else -1
                                                                          for r in rows}) != 1:
                raise EngineFileError(f"'{path}' is malformed: kv_cache.scales layer {n} 'k_offset' needs one row "
                                      f"of equal length per KV head ({len(k)}); rebuild it with `kiln llm build`.")
            offset = torch.stack([numbers(n, "k_offset", row, False) for row in rows])
        out.append(KVScales(k, v, offset))
    return out


# Engine path -> the key `--verifyKey` pinned it to: every later read of that path in this process checks the
# signature on the very bytes it loads (a file swapped after the first check is refused too).
_PINNED: dict[Path, bytes] = {}
# Engine path -> the member digests its last read in this process checked, and -> the digests a read must find:
# a tensor-parallel worker loads the very bytes rank 0 checked (tp_workers passes them in its spec).
_LOADED: dict[Path, dict] = {}
_EXPECTED: dict[Path, dict] = {}


def checked_digests(path) -> dict:
    """The member digests (serialize.read_members' `verified`) this process's last read of the engine at path
    checked; an engine it has not read is checked now (with the key --verifyKey pinned it to, if any)."""
    path = Path(path).resolve()
    if path not in _LOADED:
        verified: dict = {}
        _members(path, _PINNED.get(path), _EXPECTED.get(path), verified)
        _LOADED[path] = verified
    return _LOADED[path]


def expect_digests(path, digests: dict) -> None:
    """Every later read of the engine at path in this process refuses a file whose member digests are not these."""
    _EXPECTED[Path(path).resolve()] = digests


def require_signed(model, verify_key: bytes | None) -> None:
    """--verifyKey for `kiln llm generate|bench|serve`: MODEL must be a .kiln LLM engine signed with the key.
    Checked here (a clear error before anything starts) and pinned for the load that follows."""
    if verify_key is None:
        return
    path = Path(model)
    if path.suffix != ".kiln":
        raise ConfigError(f"--verifyKey checks a .kiln LLM engine, and '{path}' is not one: build a signed engine "
                          f"with `kiln llm build {path} --saveEngine=model.kiln --sign KEYFILE`.")
    _members(path, verify_key)
    _PINNED[path.resolve()] = verify_key


def load_llm_engine(path, device: str = "auto", progress: bool = False):
    """(hf_config, tensors, tokenizer, extras) for kiln.llm.engine.LLMEngine (see the module docstring).
    progress: each step (checksums, weights, dequantizing) on stderr when it is a terminal."""
    from ..progress import terminal_progress
    from .config import ModelConfig
    from .loader import check_tensors, check_tokenizer

    name = Path(path).name
    with terminal_progress("loading", None, f"{name}: checking every member's SHA-256", enabled=progress) as bar:
        ef = read_llm_engine(path, device)
        bar.step(f"{name}: dequantizing {len(ef.quantized)} quantized matrices for the float copy")
        tensors = ef.float_tensors()
    # The manifest's architecture, the weights and the tokenizer must belong together, as in an HF directory: a
    # resealed engine with another model's tokenizer or config would otherwise load and produce garbage.
    cfg = ModelConfig.from_hf(ef.hf_config, source=f"{path}:manifest.json")
    check_tensors(cfg, tensors, source=f"{path}:{WEIGHTS}")
    check_tokenizer(cfg, ef.tokenizer, f"{path}:{TOKENIZER}")
    bc = ef.manifest.get("build_config", {})
    extras = {"kv_cache_dtype": ef.kv_cache_dtype, "kv_scales": ef.kv_scales, "weights": ef.manifest["quantization"]
              ["weights"], "quantized_weights": ef.quantized, "max_model_len": bc.get("max_seq_len"),
              "max_num_seqs": bc.get("max_batch_size"), "tensor_parallel_size": bc.get("tensor_parallel_size"),
              "engine": ef}
    return ef.hf_config, tensors, ef.tokenizer, extras


# --- build -------------------------------------------------------------------------------------------------


def build_llm_engine(model_path, out, *, dtype: str = "bf16", weights: str = "none", kv_cache_dtype: str = "auto",
                     calib=None, calib_tokens: int = 2048, max_seq_len: int | None = None, max_batch_size: int = 64,
                     block_size: int = 16, device: str = "auto", budget: float | None = None, eval_text=None,
                     eval_tokens: int = 1024, window: int = 512, stride: int = 256, tensor_parallel_size: int = 1,
                     sign_key: bytes | None = None, log=print, progress: bool = False) -> dict:
    """Build and write a .kiln LLM engine; returns its manifest. With `budget` (percent), the perplexity of the
    engine on `eval_text` may rise at most that much over the float model's, or nothing is written.
    progress: the loading bar, then each step (calibration, every matrix quantized, perplexity, writing) on
    stderr when it is a terminal."""
    from ..engine.target import resolve
    from ..progress import terminal_progress
    from .engine import load_model
    from .perplexity import perplexity, read_text_tokens

    started = time.perf_counter()
    if Path(model_path).suffix == ".kiln":
        raise ConfigError(f"'{model_path}' is already an engine: build from the model (HF directory or .gguf).")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
    quantize.check_method(weights)
    if budget is not None and eval_text is None:
        raise ConfigError("--budget needs --evalText FILE: held-out text on which the build measures perplexity.")
    if budget is not None and budget < 0:
        raise ConfigError(f"--budget {budget}: a perplexity rise in percent, >= 0.")
    target = resolve(device)
    loaded = load_model(model_path, progress)  # its own bar: one live display at a time
    with terminal_progress("kiln llm build", None, "preparing", enabled=progress) as bar:
        hf_tensors = loaded[1]
        run_dtype = dtype if target.kind == "cuda" else "fp32"  # the CPU target computes in FP32
        ppl = None
        if budget is not None:
            base = prepare_model(model_path, dtype=run_dtype, device=device, loaded=loaded)
            eval_ids = read_text_tokens(base.tokenizer, eval_text, eval_tokens)
            bar.step(f"perplexity of the float model over {len(eval_ids)} tokens of {Path(eval_text).name}")
            reference = perplexity(base.model, eval_ids, window=window, stride=stride)
            log(f"float model ({base.model.dtype}, {base.kv_cache_dtype} KV): perplexity {reference.perplexity:.4f} "
                f"over {reference.tokens} tokens of {eval_text}")
            del base
        prepared = prepare_model(model_path, dtype=run_dtype, device=device, weights=weights,
                                 kv_cache_dtype=kv_cache_dtype, calib=calib, calib_tokens=calib_tokens, loaded=loaded,
                                 on_step=bar.step)
        cfg = prepared.model.cfg
        if max_seq_len is not None and not 0 < max_seq_len <= cfg.max_position_embeddings:
            raise ConfigError(f"--maxSeqLen {max_seq_len} must be in 1..{cfg.max_position_embeddings} (the model's "
                              "context).")
        if max_batch_size < 1:
            raise ConfigError(f"--maxBatchSize {max_batch_size} must be >= 1.")
        check_tensor_parallel(cfg, tensor_parallel_size, source=str(model_path))
        if budget is not None:
            bar.step(f"perplexity of the engine (weights {prepared.weights}, {prepared.kv_cache_dtype} KV)")
            result = perplexity(prepared.model, eval_ids, kv_cache_dtype=prepared.kv_cache_dtype,
                                kv_scales=prepared.kv_scales, window=window, stride=stride)
            rise = 100.0 * (result.perplexity / reference.perplexity - 1.0)
            ppl = {"text": str(eval_text), "tokens": result.tokens, "window": window, "stride": stride,
                   "reference": reference.perplexity, "engine": result.perplexity, "rise_percent": rise,
                   "budget_percent": budget}
            log(f"engine (weights {prepared.weights}, {prepared.kv_cache_dtype} KV): perplexity "
                f"{result.perplexity:.4f}, {rise:+.3f}% (budget {budget}%)")
            if rise > budget:
                raise ConfigError(
                    f"the engine's perplexity on {eval_text} is {result.perplexity:.4f}, {rise:+.3f}% over the float "
                    f"model's {reference.perplexity:.4f}, beyond --budget {budget}% (weights {prepared.weights}, KV "
                    f"cache {prepared.kv_cache_dtype}); no engine was written. Use a wider precision or a larger "
                    "budget.")
        calib_info = None
        if calib is not None:
            data = Path(calib).read_bytes()
            calib_info = {"file": Path(calib).name, "sha256": _sha(data), "max_tokens": calib_tokens}
        build_config = {"source": str(model_path), "dtype": dtype, "weights": weights,
                        "kv_cache_dtype": prepared.kv_cache_dtype,
                        "max_seq_len": max_seq_len or cfg.max_position_embeddings,
                        "max_batch_size": max_batch_size, "block_size": block_size, "calibration": calib_info,
                        "tensor_parallel_size": tensor_parallel_size, "build_seconds": None}
        build_config["build_seconds"] = round(time.perf_counter() - started, 3)
        bar.step(f"writing {Path(out).name}")
        return write_llm_engine(out, prepared, hf_tensors, dtype=dtype, build_config=build_config, target=target,
                                perplexity=ppl, sign_key=sign_key)


# --- inspect ------------------------------------------------------------------------------------------------


def render_inspection(path, con) -> None:
    """`kiln inspect` for an LLM engine: target, build, layers with their precisions, KV layout and scales."""
    from rich.table import Table

    from ..console import fmt_bytes

    m = read_manifest(path)
    t, bc, kv, q = m["target"], m["build_config"], m["kv_cache"], m["quantization"]
    arch = m["architecture"]
    con.print(f"LLM engine: {path}")
    con.print(f"  target: {t.get('name')}" + (f" (compute capability {t['capability']})" if t.get("capability") else "")
              + f"   built with kiln {m['versions'].get('kiln')}, torch {m['versions'].get('torch')}, "
              f"CUDA {m['versions'].get('cuda')}")
    con.print(f"  model: {', '.join(arch.get('architectures') or [arch.get('model_type', '?')])}, "
              f"{arch.get('num_hidden_layers')} layers, hidden {arch.get('hidden_size')}, "
              f"{arch.get('num_attention_heads')} heads over {arch.get('num_key_value_heads')} KV heads, "
              f"vocab {arch.get('vocab_size')}   weights: {fmt_bytes(m['weight_bytes'])}")
    con.print(f"  build: dtype {bc['dtype']}, weights {q['weights']}"
              + (f" (group {q['group_size']})" if q.get("group_size") else "")
              + (f" (SmoothQuant alpha {q['smoothquant_alpha']})" if q.get("smoothquant_alpha") else "")
              + f", max_seq_len {bc['max_seq_len']}, max_batch_size {bc['max_batch_size']}"
              + (f", calibrated on {bc['calibration']['file']}" if bc.get("calibration") else ""))
    con.print(f"  KV cache: {kv['dtype']}, layout {kv['layout']}, block {kv['block_size']} tokens, "
              f"{kv['bytes_per_token']:,} bytes per token" + (f"; {kv['quantization']}" if kv.get("quantization") else ""))
    if m.get("perplexity"):
        p = m["perplexity"]
        con.print(f"  perplexity on {p['text']} ({p['tokens']} tokens): {p['engine']:.4f} against the float model's "
                  f"{p['reference']:.4f} ({p['rise_percent']:+.3f}%, budget {p['budget_percent']}%)")
    table = Table(show_lines=False, pad_edge=False, box=None, header_style="bold")
    for col in ("#", "qkv", "o", "gate_up", "down", "KV", "K scale", "V scale"):
        table.add_column(col, overflow="fold")

    def fmt(xs):
        if xs is None:
            return "-"
        return f"{xs[0]:.4g}" if len(set(xs)) == 1 else " ".join(f"{x:.4g}" for x in xs)

    for layer in m["layers"]:
        lin = layer["linears"]
        cells = [f"{lin[k]['precision']} {lin[k]['shape'][0]}x{lin[k]['shape'][1]}" for k in ("qkv", "o", "gate_up",
                                                                                             "down")]
        table.add_row(str(layer["index"]), *cells, layer["kv_cache"]["dtype"], fmt(layer["kv_cache"].get("k_scale")),
                      fmt(layer["kv_cache"].get("v_scale")))
    con.print(table)


# --- command line -------------------------------------------------------------------------------------------


def add_llm_command(llm_sub) -> argparse.ArgumentParser:
    p = llm_sub.add_parser("build", help="build a .kiln LLM engine (like trtllm-build)", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="a Hugging Face model directory or a .gguf file")
    p.add_argument("--saveEngine", "--save-engine", dest="save_engine", required=True, metavar="FILE",
                   help="where to write the engine (.kiln)")
    p.add_argument("--dtype", default="bf16", help="float type of the stored and computed weights (default bf16)")
    p.add_argument("--weights", default="none", choices=list(quantize.METHODS), help="weight quantization")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), bf16, fp16, fp32, fp8, int8")
    p.add_argument("--calib", metavar="FILE", help="calibration text (8-bit KV scales, w8a8, int4-awq)")
    p.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens used (default 2048)")
    p.add_argument("--max-seq-len", type=int, default=None, help="context length the engine serves")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--budget", type=float, default=None, metavar="PCT",
                   help="refuse to write the engine if its perplexity on --evalText rises more than PCT percent")
    p.add_argument("--eval-text", metavar="FILE", help="held-out text for --budget")
    p.add_argument("--eval-tokens", type=int, default=1024, help="tokens of --eval-text scored (default 1024)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (the engine's target)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks the engine is split for (its default at serve time; default 1)")
    p.add_argument("--sign", metavar="KEYFILE", help="sign the engine with this key (a file of at least 16 bytes), "
                   "so `kiln llm generate|serve|inspect --verifyKey KEYFILE` accepts only engines you built")
    p.set_defaults(func=run_build)
    return p


def run_build(args) -> int:
    from ..console import console, fmt_bytes
    from ..engine.signing import load_key

    con = console()
    sign_key = load_key(args.sign) if args.sign else None  # before the build: a bad key file costs nothing
    m = build_llm_engine(args.model, args.save_engine, dtype=args.dtype, weights=args.weights,
                         kv_cache_dtype=args.kv_cache_dtype, calib=args.calib, calib_tokens=args.calib_tokens,
                         max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size, block_size=args.block_size,
                         device=args.device, budget=args.budget, eval_text=args.eval_text,
                         eval_tokens=args.eval_tokens, tensor_parallel_size=args.tp, sign_key=sign_key, log=con.print,
                         progress=True)
    con.print(f"LLM engine written to {args.save_engine}: weights {m['quantization']['weights']}, KV cache "
              f"{m['kv_cache']['dtype']}, {fmt_bytes(m['weight_bytes'])} of weights, built in "
              f"{m['build_config']['build_seconds']} s for {m['target']['name']}")
    return 0
