"""The warp-specialized Gluon kernels compile for sm_90 with the installed Triton: kernels/ws_conv.py's tiles (INT8
and FP8, stride 1 and 2; bench/gluon_conv.py --compile-only), kernels/halo_conv.py's kernel (the same script) and
kernels/ws_gemm.py's tiles (bench/gluon_gemm.py): warp-specialized, ws_conv and ws_gemm with one wgmma kept in
flight, the convolutions reading their input boxes from shared memory, every kernel waiting for the one before
(kernels/pdl.py), their 8-bit codes converted and packed a pair at a time, no spills. CPU only (Triton's
interpreter does not run Gluon); on the GPU test_ws_conv.py, test_halo_conv.py and test_ws_gemm.py check them
against tma_conv and tma_gemm."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, kernel, variants, flags", [
    ("gluon_conv.py", "ws_conv", 28, "warp-specialized: True; wgmma kept in flight: True; box read from shared "
                                     "memory: True; waits for the kernel before: True; codes packed in pairs: True"),
    ("gluon_conv.py", "halo_conv", 2, "warp-specialized: True; wgmma kept in flight: False; box read from shared "
                                      "memory: True; waits for the kernel before: True; codes packed in pairs: True"),
    ("gluon_gemm.py", "ws_gemm", 24, "warp-specialized: True; wgmma kept in flight: True; waits for the kernel "
                                     "before: True; codes packed in pairs: True"),
])
def test_the_gluon_kernels_compile_for_hopper(script, kernel, variants, flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # kernels defined under it cannot compile
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [ln for ln in run.stdout.splitlines() if f": {kernel} " in ln and "compiles for sm_90" in ln]
    assert len(lines) == variants and all(flags in ln and "; 0 bytes spilled" in ln for ln in lines), run.stdout
