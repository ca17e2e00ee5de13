"""Bad inputs for the LLM command line (`kiln llm generate|bench|build|perplexity|serve`, `kiln inspect`).

make_llm_corpus(root, model_dir, engine, signed, key, other_key) writes the damaged models and engines
under `root` and returns the cases (tests/robustness/corpus.py's Case: a command that must exit non-zero
without a traceback, naming one of `names`).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

from kiln.llm import engine_file as ef

from .corpus import Case


def _rewrite(src: Path, dst: Path, edit, reseal: bool = True) -> Path:
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    edit(members)
    if reseal:
        members[ef.CHECKSUMS] = ef.checksums_of(members)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return dst


def _engines(root: Path, engine: Path, other_model: Path) -> dict[str, tuple[Path, tuple]]:
    def flip_weight(m):
        data = bytearray(m[ef.WEIGHTS])
        data[-3] ^= 0x40
        m[ef.WEIGHTS] = bytes(data)

    def retarget(m):
        doc = json.loads(m[ef.MANIFEST])
        doc["target"] = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}
        m[ef.MANIFEST] = json.dumps(doc).encode()

    def other_tokenizer(m):  # a consistent file whose tokenizer is another model's (a larger vocabulary)
        m[ef.TOKENIZER] = (other_model / "tokenizer.json").read_bytes()

    def no_architecture(m):
        doc = json.loads(m[ef.MANIFEST])
        del doc["architecture"]
        m[ef.MANIFEST] = json.dumps(doc).encode()

    def bad_hidden(m):
        doc = json.loads(m[ef.MANIFEST])
        doc["architecture"]["hidden_size"] = 48
        m[ef.MANIFEST] = json.dumps(doc).encode()

    out = {
        "tampered": (_rewrite(engine, root / "tampered.kiln", flip_weight, reseal=False),
                     ("tampered.kiln", "weights.safetensors")),
        "other-gpu": (_rewrite(engine, root / "h100.kiln", retarget), ("h100.kiln", "H100")),
        "wrong-tokenizer": (_rewrite(engine, root / "wrong_tokenizer.kiln", other_tokenizer),
                            ("wrong_tokenizer.kiln", "tokenizer")),
        "no-architecture": (_rewrite(engine, root / "no_arch.kiln", no_architecture), ("no_arch.kiln", "architecture")),
        "mis-shaped": (_rewrite(engine, root / "mis_shaped.kiln", bad_hidden), ("mis_shaped.kiln", "hidden_size",
                                                                                  "shape")),
    }
    (root / "truncated.kiln").write_bytes(engine.read_bytes()[: engine.stat().st_size // 2])
    out["truncated"] = (root / "truncated.kiln", ("truncated.kiln",))
    (root / "garbage.kiln").write_bytes(b"not a zip at all\n" * 64)
    out["garbage"] = (root / "garbage.kiln", ("garbage.kiln",))
    return out


def _models(root: Path, model_dir: Path) -> dict[str, tuple[Path, tuple]]:
    out = {"absent-dir": (root / "absent_model", ("absent_model",))}
    (root / "empty_model").mkdir()
    out["empty-dir"] = (root / "empty_model", ("empty_model", "config.json"))
    bad = root / "garbage_config"
    shutil.copytree(model_dir, bad)
    (bad / "config.json").write_text("{not json")
    out["garbage-config"] = (bad, ("config.json",))
    shaped = root / "mis_shaped_model"
    shutil.copytree(model_dir, shaped)
    cfg = json.loads((shaped / "config.json").read_text())
    cfg["hidden_size"] = 48
    (shaped / "config.json").write_text(json.dumps(cfg))
    out["mis-shaped-dir"] = (shaped, ("mis_shaped_model", "hidden_size", "shape"))
    noweights = root / "no_weights_model"
    shutil.copytree(model_dir, noweights)
    (noweights / "model.safetensors").unlink()
    out["no-weights"] = (noweights, ("no_weights_model", "safetensors"))
    badst = root / "garbage_weights_model"
    shutil.copytree(model_dir, badst)
    (badst / "model.safetensors").write_bytes(b"\xff" * 100)
    out["garbage-weights"] = (badst, ("garbage_weights_model", "model.safetensors"))
    (root / "garbage.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    out["garbage-gguf"] = (root / "garbage.gguf", ("garbage.gguf",))
    (root / "text.gguf").write_text("hello")
    out["text-gguf"] = (root / "text.gguf", ("text.gguf",))
    try:
        from ..llm.test_gguf import write_gguf
    except ImportError:  # the gguf package is not installed: the GGUF-writing cases are left out
        return out
    good = write_gguf(root / "good.gguf", model_dir)
    (root / "truncated.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    out["truncated-gguf"] = (root / "truncated.gguf", ("truncated.gguf",))
    write_gguf(root / "mis_shaped.gguf", model_dir, reshape={"blk.0.attn_k.weight": 16})
    out["mis-shaped-gguf"] = (root / "mis_shaped.gguf", ("mis_shaped.gguf", "blk.0.attn_k.weight"))
    write_gguf(root / "short_vocab.gguf", model_dir, tokens_cut=3)
    out["tokenizer-mismatch-gguf"] = (root / "short_vocab.gguf", ("short_vocab.gguf", "tokenizer"))
    return out


def make_llm_corpus(root: Path, model_dir: Path, engine: Path, signed: Path, key: Path, other_key: Path,
                    other_model: Path) -> list[Case]:
    cpu = "--device=cpu"
    gen = ["llm", "generate", str(model_dir), cpu]
    long_ids = ",".join(["5"] * 40)
    cases = [
        Case("llm-generate-prompt-longer-than-context", [*gen, "--max-model-len=32", f"--prompt-ids={long_ids}"],
             ("context", "max_model_len", "--max-model-len")),
        Case("llm-generate-max-tokens-0", [*gen, "--prompt=hi", "--max-tokens=0"], ("max_tokens",)),
        Case("llm-generate-max-tokens-negative", [*gen, "--prompt=hi", "--max-tokens=-4"], ("max_tokens",)),
        Case("llm-generate-unknown-sampling-key", [*gen, "--prompt=hi", "--sampling=warmth=3"], ("warmth",)),
        Case("llm-generate-sampling-no-value", [*gen, "--prompt=hi", "--sampling=min_p"], ("min_p",)),
        Case("llm-generate-sampling-wrong-type", [*gen, "--prompt=hi", "--sampling=top_k=\"many\""], ("top_k",)),
        Case("llm-generate-empty-prompt", [*gen, "--prompt="], ("prompt",)),
        Case("llm-generate-empty-prompt-ids", [*gen, "--prompt-ids=,"], ("prompt",)),
        Case("llm-generate-no-prompt", gen, ("--prompt",)),
        Case("llm-generate-token-outside-vocab", [*gen, "--prompt-ids=1,99999"], ("99999", "vocab")),
        Case("llm-generate-negative-token", [*gen, "--prompt-ids=1,-3"], ("-3", "vocab")),
        Case("llm-generate-prompt-ids-text", [*gen, "--prompt-ids=a,b"], ("--promptIds",)),
        Case("llm-generate-temperature-negative", [*gen, "--prompt=hi", "--temperature=-1"], ("temperature",)),
        Case("llm-generate-top-p-2", [*gen, "--prompt=hi", "--top-p=2"], ("top_p",)),
        Case("llm-generate-chat-ids", [*gen, "--prompt-ids=1,2", "--chat"], ("--chat",)),
        Case("llm-generate-block-size-0", [*gen, "--prompt=hi", "--block-size=0"], ("block",)),
        Case("llm-generate-dtype-bad", [*gen, "--prompt=hi", "--dtype=fp7"], ("fp7",)),
        Case("llm-generate-device-tpu", ["llm", "generate", str(model_dir), "--device=tpu:3", "--prompt=hi"],
             ("tpu:3",)),
        Case("llm-bench-input-len-0", ["llm", "bench", str(model_dir), cpu, "--input-len=0"], ("--input-len",)),
        Case("llm-bench-longer-than-context", ["llm", "bench", str(model_dir), cpu, "--max-model-len=64",
                                                "--input-len=60", "--output-len=10"], ("context", "--inputLen")),
        Case("llm-build-sign-key-missing", ["llm", "build", str(model_dir), "--saveEngine=out.kiln", cpu,
                                             "--dtype=fp32", "--sign=absent.key"], ("absent.key",)),
        Case("llm-build-bad-dtype", ["llm", "build", str(model_dir), "--saveEngine=out.kiln", cpu, "--dtype=fp7"],
             ("fp7",)),
        Case("llm-build-from-engine", ["llm", "build", str(engine), "--saveEngine=out.kiln", cpu],
             (engine.name,)),
        Case("llm-build-absent", ["llm", "build", str(root / "absent_model"), "--saveEngine=out.kiln", cpu],
             ("absent_model",)),
        Case("llm-perplexity-absent-text", ["llm", "perplexity", str(model_dir), "--text=absent.txt", cpu],
             ("absent.txt",)),
        Case("llm-perplexity-verify-key-unsigned", ["llm", "perplexity", str(engine), cpu, "--text=absent.txt",
                                                    f"--verify-key={key}"], ("not signed",)),
        Case("llm-perplexity-verify-key-other", ["llm", "perplexity", str(signed), cpu, "--text=absent.txt",
                                                 f"--verifyKey={other_key}"], ("another key",)),
        Case("llm-generate-verify-key-unsigned", ["llm", "generate", str(engine), cpu, "--prompt=hi",
                                                  f"--verify-key={key}"], ("not signed",)),
        Case("llm-generate-verify-key-other", ["llm", "generate", str(signed), cpu, "--prompt=hi",
                                               f"--verifyKey={other_key}"], ("another key",)),
        Case("llm-generate-verify-key-hf-dir", [*gen, "--prompt=hi", f"--verify-key={key}"],
             (str(model_dir), ".kiln")),
        Case("llm-bench-verify-key-other", ["llm", "bench", str(signed), cpu, "--input-len=4", "--output-len=4",
                                            f"--verify-key={other_key}"], ("another key",)),
        Case("llm-serve-verify-key-other", ["llm", "serve", str(signed), cpu, "--port=0",
                                            f"--verify-key={other_key}"], ("another key",)),
        Case("llm-inspect-verify-key-other", ["inspect", str(signed), f"--verify-key={other_key}"],
             ("another key",)),
        Case("llm-inspect-verify-key-unsigned", ["inspect", str(engine), f"--verifyKey={key}"], ("not signed",)),
    ]
    for name, (path, names) in {**_engines(root, engine, other_model), **_models(root, model_dir)}.items():
        cases.append(Case(f"llm-generate-{name}", ["llm", "generate", str(path), cpu, "--prompt=hi",
                                                   "--max-tokens=2"], names))
        if name in ("tampered", "truncated", "wrong-tokenizer", "garbage-config", "garbage-gguf"):
            cases.append(Case(f"llm-bench-{name}", ["llm", "bench", str(path), cpu, "--input-len=4",
                                                    "--output-len=2"], names))
        if name.endswith("dir") or name in ("garbage-gguf", "no-weights", "mis-shaped-gguf"):
            cases.append(Case(f"llm-build-{name}", ["llm", "build", str(path), "--saveEngine=out.kiln", cpu],
                              names))
        if name in ("tampered", "truncated", "no-architecture"):  # inspect shows engines built for other GPUs
            cases.append(Case(f"llm-inspect-{name}", ["inspect", str(path)], names))
    return cases
