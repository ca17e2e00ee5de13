"""The TMA kernels and flash attention's 8-bit output compile for Hopper (sm_90) on a machine without a GPU (Triton
bundles ptxas): the interpreter runs their arithmetic, this catches what only the compiler refuses (5-D boxes, two
8-bit outputs, a loop's variable read after the loop) and how it pipelines loads. Run as
bench/sm90_compile.py in a fresh process: kernels defined under TRITON_INTERPRET cannot be compiled."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tma_and_flash_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "sm90_compile.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr  # the exit code counts the kernels that failed
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("TMA ")]
    assert len(lines) == 13 and all("TMA loads, wgmma" in ln for ln in lines), run.stdout
    # where K fits one tile the pipeliner issues the residual's load tiles ahead (it needs the loop's num_stages)
    one_k = [ln for ln in lines if "K in one tile" in ln]
    assert len(one_k) == 4 and all("residual prefetched" in ln for ln in one_k), run.stdout
    assert sum(ln.startswith("flash attention") and ln.endswith("compiles") for ln in run.stdout.splitlines()) == 3
    assert sum(ln.startswith("layernorm") and ln.endswith("compiles") for ln in run.stdout.splitlines()) == 4
    assert sum(ln.startswith("max pool") and ln.endswith("compiles") for ln in run.stdout.splitlines()) == 4
    assert sum(ln.startswith("stem patches") and ln.endswith("compiles") for ln in run.stdout.splitlines()) == 2
    assert "row gather, fp16 table: compiles" in run.stdout.splitlines()
    assert any(ln.startswith("every TMA GEMM tile, both loops: ") for ln in run.stdout.splitlines())
    tiles = next(ln for ln in run.stdout.splitlines() if ln.startswith("every TMA convolution tile: "))
    compiled, offered = tiles.split(": ")[1].split(" compile")[0].split(" of ")
    assert compiled == offered, tiles
    # the single loop reads the residual after the dot: read before it, 128x128 INT8 tiles spilled
    spills = next(ln for ln in run.stdout.splitlines() if ln.startswith("tiles of the TMA GEMM that spill registers: "))
    assert not [t for t in spills.split(": ", 1)[1].split(", ") if "_w4_" in t and "K in one tile" in t], spills
