"""bench/gluon_conv.py's warp-specialized 8-bit convolution (an experiment, not a tactic) compiles for sm_90 with
the installed Triton: warp-specialized, one wgmma in flight, the input box read from shared memory. CPU only; the
GPU run checks its output against tma_conv's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gluon_convolution_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # kernels defined under it cannot compile
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gluon_conv.py"), "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [ln for ln in run.stdout.splitlines() if "compiles for sm_90" in ln]
    assert len(lines) == 6, run.stdout  # three patches x two stage counts
    assert all("warp-specialized: True; wgmma kept in flight: True; box read from shared memory: True" in ln
               for ln in lines), run.stdout
