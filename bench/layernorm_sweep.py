"""Kiln's residual add + LayerNorm kernel (kiln/kernels/layernorm.py) at every launch shape, on BERT-base's rows:
rows per program x elements a warp, for the FP16 engine's norm (FP16 in, FP16 out) and the FP8 engine's (FP16 out and an
FP8 copy for the next GEMM), against the bytes it must move.

Times are kiln.tactics.timer.median_ms (CUDA-graph replays, as the builder's selector times tactics), us; TB/s is
the bytes read and written over that time.

    python bench/layernorm_sweep.py > bench/results/H200-layernorm-sweep.log        (GPU)
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import layernorm  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

SHAPES = [("bert-base b32", 4096, 768), ("bert-base b1", 128, 768), ("vit-b16 b32", 32 * 197, 768)]
LAUNCHES = [layernorm.Launch(r, e) for r, e in itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048))]


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for (name, rows, cols), fp8 in itertools.product(SHAPES, (False, True)):
        g = torch.Generator(device="cuda").manual_seed(0)
        a, b = (torch.randn(rows, cols, device="cuda", generator=g).half() for _ in range(2))
        gamma, beta = torch.randn(cols, device="cuda").half(), torch.randn(cols, device="cuda").half()
        q_scale = torch.tensor([0.02], device="cuda") if fp8 else None
        moved = rows * cols * (2 + 2 + 2 + (1 if fp8 else 0))  # a, b in; y (and its FP8 copy) out
        ref = layernorm.reference(a, b, gamma, beta)[0].float()
        print(f"\n## {name}, {rows}x{cols} FP16" + (" + FP8 copy" if fp8 else "")
              + ": rows/program, elements/warp, us, TB/s")
        cells = []
        for launch in LAUNCHES:
            def run(launch=launch):
                return layernorm.skip_layernorm(a, b, gamma, beta, write_sum=False, q_scale=q_scale,
                                                qtype="fp8" if fp8 else "", launch=launch)
            try:
                err = (run()[0].float() - ref).abs().max().item()
                t = median_ms(run, runs=20) * 1000
                cells.append((t, f"{launch.name}: {t:.1f} us, {moved / t / 1e6:.2f} TB/s (err {err:.1e})"))
            except Exception as e:  # a launch that does not compile here
                cells.append((float("inf"), f"{launch.name}: fail {type(e).__name__}: {str(e)[:80]}"))
        for _, line in sorted(cells):
            print(line)


if __name__ == "__main__":
    main()
