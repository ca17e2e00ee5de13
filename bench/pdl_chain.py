"""Programmatic dependent launch (PDL) across Kiln's warp-specialized 8-bit kernels, timed on chains of ResNet-50's
bottleneck blocks at batch 32: each block's 1x1 (ws_gemm), 3x3 (ws_conv) and 1x1 with the residual (ws_gemm),
the blocks one after another, captured in one CUDA graph with and without launch_pdl, the two replays timed
alternately (the device's time, and the host's time in graph.replay()) and their outputs compared (they must be
equal: only when each kernel may start changes).

    python bench/pdl_chain.py [--fp8]      (GPU)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# (name, image size, block's outer channels, inner channels, blocks)
STAGES = [("layer1", 56, 256, 64, 3), ("layer2", 28, 512, 128, 4), ("layer3", 14, 1024, 256, 6),
          ("layer4", 7, 2048, 512, 3)]


def main() -> int:
    import torch
    import triton

    from bench.conv_sweep import node
    from kiln.kernels import ws_conv, ws_gemm

    qtype = "fp8" if "--fp8" in sys.argv else "int8"
    dt = torch.int8 if qtype == "int8" else torch.float8_e4m3fn
    cl = torch.channels_last
    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__, qtype, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)

    def codes(*shape):  # 8-bit values from small integers (random FP8 bytes would hold NaNs)
        v = torch.randint(-15, 16, shape, device="cuda", generator=g).float()
        return v.to(dt).to(memory_format=cl)

    def scales(n):
        return torch.rand(n, device="cuda", generator=g) * 1e-2 + 1e-3

    one, three = node(1, 1, qtype), node(3, 1, qtype)
    one.attrs["pads"] = [0] * 4
    s = torch.tensor(0.05, device="cuda")
    for name, hw, outer, inner, blocks in STAGES:
        x0 = codes(32, outer, hw, hw)
        layers = []
        for _ in range(blocks):
            w1, w2, w3 = codes(inner, outer, 1, 1), codes(inner, inner, 3, 3), codes(outer, inner, 1, 1)
            layers.append([(w, torch.randn(w.shape[0], device="cuda", generator=g).half(), scales(w.shape[0]))
                           for w in (w1, w2, w3)])
        probe = codes(32, inner, hw, hw)
        c1 = next(c for c, _ in ws_gemm.CONFIGS if ws_gemm.supports(one, x0, layers[0][0][0], None, None, s, None,
                                                                    None, c))
        c2 = next(c for c, _ in ws_conv.CONFIGS if ws_conv.supports(three, probe, layers[0][1][0], None, None, s,
                                                                    None, c))
        c3 = next(c for c, _ in ws_gemm.CONFIGS if ws_gemm.supports(one, probe, layers[0][2][0], None, x0, s, None,
                                                                    s, c))

        def chain(pdl):
            x = x0
            for (w1, b1, s1), (w2, b2, s2), (w3, b3, s3) in layers:
                h = ws_gemm.matmul8(one, x, w1, b1, None, c1, s, s1, s, pdl=pdl)
                h = ws_conv.conv2d(three, h, w2, b2, c2, s, s2, s, pdl=pdl)
                x = ws_gemm.matmul8(one, h, w3, b3, x, c3, s, s3, s, s, pdl=pdl)
            return x

        graphs, outs = {}, {}
        for on in (False, True):
            chain(on)  # compiles this launch option's kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[on] = chain(on)
            graphs[on] = graph
        times, host = {False: [], True: []}, {False: [], True: []}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            for on in (False, True):
                graphs[on].replay()
        for _ in range(50):
            for on in (False, True):  # alternated: both see the same clocks and neighbours
                start.record()
                t0 = time.perf_counter()
                graphs[on].replay()
                host[on].append(1e6 * (time.perf_counter() - t0))
                end.record()
                end.synchronize()
                times[on].append(1000 * start.elapsed_time(end))
        equal = torch.equal(outs[False].float(), outs[True].float())
        off, on = statistics.median(times[False]), statistics.median(times[True])
        kernels = 3 * blocks
        print(f"{name}: {blocks} blocks, {kernels} kernels ({c1.name}, {c2.name}, {c3.name}): "
              f"without PDL {off:.1f} us, with {on:.1f} us ({(off - on) / kernels:.2f} us a kernel saved); "
              f"outputs equal: {equal}; host time of a replay {statistics.median(host[False]):.1f} us without, "
              f"{statistics.median(host[True]):.1f} us with", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
