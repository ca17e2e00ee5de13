"""bench/llm.py on the CPU target with its tiny config, as a real process: the sections the GPU request runs
(Kiln at two batches in several decode variants on one engine, FP8 against BF16 KV at a longer context with the
KV capacity, prefix caching on and off) finish every request, and the report carries the variants' comparison
and the table of issue 41's targets. bench/llm_attention.py's --quick plan: the 8k-context decode cases of every
cache, no prefill."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_llm_bench_tiny(tmp_path):
    # one torch thread: the tiny model gains nothing from more, and on a busy machine they only wait for each other
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    if not torch.cuda.is_available():  # graph_argmax's kernel on the CPU target; on CUDA the real kernels run
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(ROOT / "bench" / "llm.py"), "--tiny", "--sections", "kiln,kvctx,prefix",
           "--batches", "1", "4", "--variants", "default,async,graph_argmax", "--out", str(tmp_path)]
    run = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "H200-llm.json").read_text())
    kiln = res["kiln"]
    for b in (1, 4):
        for key, variant in ((f"batch{b}", "default"), (f"batch{b}_async", "async"),
                             (f"batch{b}_graph_argmax", "graph_argmax")):
            r = kiln[key]
            assert r["variant"] == variant and r["finished"] == r["requests"] == b and not r["cut"]
            assert r["output_tokens"] == 16 * b
            assert variant == "default" or r["tokens_equal_first"]  # the same prompts, the same greedy tokens
    kv = res["kvctx"]
    assert kv["capacity"]["bf16"]["blocks"] > 0 and kv["fp8_speedup"] > 0
    assert [r["kv_cache_dtype"] for r in kv["runs"]] == ["float32", "float8_e4m3fn"]
    pc = res["prefix_caching"]
    assert pc["on"]["prefix_cache_hits"] > 0 and pc["off"]["prefix_cache_hits"] == 0
    md = (tmp_path / "H200-llm.md").read_text()
    assert "## Decode variants against the default" in md and "| graph_argmax | True |" in md
    assert "## Issue 41 targets measured in this run" in md and "prefix caching" in md


def test_llm_attention_quick_plan():
    spec = importlib.util.spec_from_file_location("llm_attention", ROOT / "bench" / "llm_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases, sweep, prefills = mod.plan(True)
    assert cases[:3] == [(64, 8192, "bf16"), (64, 8192, "fp8"), (64, 8192, "int8")] and not prefills
    assert sweep and {kv for kv, *_ in sweep} <= set(mod.CACHE_DTYPES)
    full = mod.plan(False)
    assert len(full[0]) == len(mod.BATCHES) * len(mod.CONTEXTS) + 2 and full[2] == mod.PREFILLS
