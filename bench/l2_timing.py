"""How the builder's timing of an 8-bit layer compares with how long it runs in an engine's replay.

The selector times a quantized layer's candidates after an L2Reset (tactics/timer.py) and subtracts the
reset's own time. A layer that writes a large output leaves it in L2 as dirty lines, and the next reset
writes them back to memory as it evicts them: that cost lands in the subtraction, so the layer is charged
for it, where in an engine the next layer reads those lines from L2. This times ResNet-50's 8-bit 1x1
layers (engine operands as bench/tma_sweep.py --int8-engine builds them, the tile each INT8 engine took)
four ways: warm (the same operands every call), as the builder does (reset, subtracted), bracketed (events
around the layer alone inside the graph: bracketed_ms), and the output's write alone both ways, whose
difference is the write-back the subtraction charges. `--resets` instead times each layer after other resets
(each one's own time subtracted): the read of twice L2 then of the activations twice, then a rewrite of them in
place (dirty lines, as the layer before leaves them in an engine), and the activations re-read without the
flush; plus BERT-base's INT8 FFN2, whose 2.4 MB of weights an engine reads from memory.

    python bench/l2_timing.py [--resets] > bench/results/H200-l2-timing.log      (GPU)

In bench/results/H200-l2-timing-1054.log and H200-l2-resets-1105.log the write-back explained
3.7 us at layer1's 64 -> 256 and nothing elsewhere; the builder's timing ran 3-6 us above warm at every layer, and
warm within 1.6 us of the engine's replay.
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
from kiln.tactics import timer  # noqa: E402
from kiln.tactics.timer import L2Reset, median_ms  # noqa: E402

# (name, M, K, N, 8-bit residual, the tile the 09:29 INT8 engine took, its replay us in that trace)
LAYERS = [("layer1 conv3 64->256 +res", 100352, 64, 256, True, TileConfig(128, 128, 64, 4, 3), 21.9),
          ("layer1 conv1 256->64", 100352, 256, 64, False, TileConfig(128, 64, 128, 4, 4), 10.7),
          ("layer2 conv3 128->512 +res", 25088, 128, 512, True, TileConfig(64, 128, 128, 4, 2), 12.8),
          ("layer3 conv3 256->1024 +res", 6272, 256, 1024, True, TileConfig(64, 128, 128, 4, 2), 10.0)]


def bracketed_ms(fn, before, warmup: int = 3, runs: int = 10) -> float | None:
    """fn's median time with `before` run ahead of each call and left out by events around fn alone, all in one
    CUDA graph (external event records); None where fn or before cannot be captured. Unlike median_ms's
    subtraction, whatever fn leaves for the next `before` to do (writing its output's dirty L2 lines back to
    memory as the reset evicts them) is not charged to fn."""
    for _ in range(warmup):
        before()
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True, external=True), torch.cuda.Event(enable_timing=True, external=True))
             for _ in range(timer.CALLS_PER_GRAPH)]
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for start, end in pairs:
                before()
                start.record()
                fn()
                end.record()
    except Exception:
        torch.cuda.synchronize()
        return None
    graph.replay()  # first replay uploads the graph
    times = []
    for _ in range(runs):
        graph.replay()
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) for start, end in pairs]
    return statistics.median(times)


BERT_FFN2 = ("bert ffn2 3072->768", 4096, 3072, 768, True, TileConfig(128, 128, 128, 4, 4), None)


def resets(base: L2Reset, keep: list) -> dict:
    """Other resets than the builder's: (name, callable) for median_ms's `before`."""
    views = [t.view(torch.uint8).view(-1) for t in keep if t is not None]

    def read_twice():
        base()
        base.keeping(views)()

    def rewrite():
        torch.sum(base._buffer, dim=0, out=base._sink)
        for v in views:
            v.bitwise_or_(0)

    def no_flush():
        for v in views:
            torch.sum(v, dim=0, dtype=torch.int32, out=base._int_sink)

    return {"builder": base.keeping(views), "read twice": read_twice, "rewrite": rewrite, "no flush": no_flush}


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__)
    base = L2Reset(torch.device("cuda"))
    if "--resets" in sys.argv:
        for name, M, K, N, with_z, tile, replay in LAYERS + [BERT_FFN2]:
            x8, w8, b, kw, moved = engine_operands(M, K, N, with_z, "int8", False)

            def layer():
                return tma_gemm.gemm(x8, w8, b, "Relu", config=tile, **kw)

            times = {"warm": median_ms(layer, runs=20)}
            times.update({k: median_ms(layer, runs=20, before=r) for k, r in resets(base, [x8, kw["z"]]).items()})
            print(f"\n## {name}: tile {tile.name}; 09:29 replay {replay} us")
            print("  ".join(f"{k} {1000 * v:.1f} us" for k, v in times.items()), flush=True)
        return 0
    for name, M, K, N, with_z, tile, replay in LAYERS:
        x8, w8, b, kw, moved = engine_operands(M, K, N, with_z, "int8", False)
        reset = base.keeping([x8, kw["z"]])

        def layer():
            return tma_gemm.gemm(x8, w8, b, "Relu", config=tile, **kw)

        out = torch.empty(M, N, dtype=torch.int8, device="cuda")

        def write():
            return out.fill_(1)

        us = {k: 1000 * v for k, v in {
            "warm": median_ms(layer, runs=20), "builder": median_ms(layer, runs=20, before=reset),
            "bracketed": bracketed_ms(layer, reset, runs=20), "write builder": median_ms(write, runs=20, before=reset),
            "write bracketed": bracketed_ms(write, reset, runs=20)}.items()}
        print(f"\n## {name}: M {M}, K {K}, N {N}, tile {tile.name}, {moved / 1e6:.1f} MB; 09:29 replay {replay} us")
        print("  ".join(f"{k} {v:.1f} us" for k, v in us.items()))
        print(f"builder - bracketed {us['builder'] - us['bracketed']:.1f} us; the {M * N / 1e6:.1f} MB output written "
              f"alone: {us['write builder'] - us['write bracketed']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
