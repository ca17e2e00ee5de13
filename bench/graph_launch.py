"""How long the device waits for the host at the start of a CUDA-graph call, by graph and by how many graphs calls
rotate through: the 8-bit ResNet-50 engines' calls have waited several times longer for the host than FP16's
(docs/performance.md), and bench/run.py rotates four input sets, each with its own bound graph
(engine/context.py). Graphs of 40 Triton TMA GEMM launches (five tensor descriptors a launch, as the 8-bit
engines' kernels take) against graphs of 40 cuBLAS launches, calls rotating through 1, 2 or 4 such graphs; per
call timed as bench/run.py does (events around one replay, synchronized) and with the host's part hidden (a
sleep kernel ahead of the first event).

    python bench/graph_launch.py > bench/results/H200-graph-launch.log      (GPU)

In bench/results/H200-graph-launch-1127.log neither made the device wait more than 2-5 us: the 8-bit engines'
waits come from elsewhere.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.tma_sweep import engine_operands  # noqa: E402
from kiln.kernels import tma_gemm  # noqa: E402
from kiln.kernels.gemm import TileConfig  # noqa: E402

LAUNCHES = 40


def graphs(make, count: int) -> list:
    out = []
    for _ in range(count):
        call = make()
        call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(LAUNCHES):
                call()
        g.replay()
        out.append(g)
    torch.cuda.synchronize()
    return out


def per_call(gs: list, hide_host: bool, runs: int = 200) -> float:
    times = []
    for i in range(runs):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hide_host:
            torch.cuda._sleep(2_000_000)
        e0.record()
        gs[i % len(gs)].replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(times[20:])


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__)

    def tma():
        x8, w8, b, kw, _ = engine_operands(4096, 128, 256, True, "int8", False)
        return lambda: tma_gemm.gemm(x8, w8, b, "Relu", config=TileConfig(128, 128, 128, 4, 2), **kw)

    def cublas():
        a, w = torch.randn(4096, 128, device="cuda").half(), torch.randn(128, 256, device="cuda").half()
        return lambda: torch.mm(a, w)

    for name, make in (("Triton TMA GEMM (5 descriptors)", tma), ("cuBLAS", cublas)):
        gs = graphs(make, 4)
        for count in (1, 2, 4):
            call, device = per_call(gs[:count], False), per_call(gs[:count], True)
            print(f"{name}: {LAUNCHES} launches a graph, calls rotating through {count}: per call {call:.1f} us, "
                  f"host hidden {device:.1f} us, device waits {call - device:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
