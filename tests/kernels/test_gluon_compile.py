"""The warp-specialized Gluon kernels compile for sm_90 with the installed Triton: kernels/ws_conv.py's tiles (INT8
and FP8, stride 1 and 2; bench/gluon_conv.py --compile-only), kernels/ws_gemm.py's (bench/gluon_gemm.py) and the
layer1 halo-box experiment (bench/gluon_halo_conv.py): warp-specialized, the tactics' kernels with one wgmma kept
in flight, the convolution reading its input box from shared memory, no spills. CPU only (Triton's interpreter
does not run Gluon); on the GPU test_ws_conv.py and test_ws_gemm.py check the tactics' kernels against tma_conv
and tma_gemm."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, variants, flags", [
    ("gluon_conv.py", 28, "warp-specialized: True; wgmma kept in flight: True; box read from shared memory: True; "
                          "waits for the kernel before: True"),
    ("gluon_gemm.py", 16, "warp-specialized: True; wgmma kept in flight: True; waits for the kernel before: True"),
    ("gluon_halo_conv.py", 6, "warp-specialized: True"),
])
def test_the_gluon_kernels_compile_for_hopper(script, variants, flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # kernels defined under it cannot compile
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [ln for ln in run.stdout.splitlines() if "compiles for sm_90" in ln]
    assert len(lines) == variants and all(flags in ln and "; 0 bytes spilled" in ln for ln in lines), run.stdout
