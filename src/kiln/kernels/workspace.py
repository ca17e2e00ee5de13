"""Per-stream scratch: zeroed FP32 sums and int32 arrival counters for kernels that reduce across programs
with atomics, and plain bytes for library kernels' workspaces.

A reducing kernel (splitk_conv.py, pooled_gemm.py) adds its programs' partial results into an FP32 sum;
the last program of each output tile to arrive (an atomic counter per tile) applies the epilogue and
zeroes the tile's sum and counter again. So the buffers are zero between calls and one pair serves
every such layer on a stream: no memset kernel per call, and a CUDA graph replays the layers as they
were captured. Per stream because kernels on two streams may run at the same time. `add_part` is that
protocol, for the kernels to share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_part(part, sums, mask, count, parts):
    """Adds a program's part of an output tile into its sums (pointers; mask: those inside the output) and counts
    its arrival at `count` (the tile's counter). Returns (the complete sum, True) to the last of the tile's `parts`
    programs to arrive, which zeroes the sums and the counter again for the next call; (part, False) to the others."""
    tl.atomic_add(sums, part, mask=mask, sem="relaxed")  # spread over L2: no one program reads every part
    tl.debug_barrier()  # every thread's share is added before the program's arrival is counted
    last = tl.atomic_add(count, 1, sem="acq_rel") == parts - 1
    if last:
        tl.debug_barrier()
        part = tl.load(sums, mask=mask, other=0, cache_modifier=".cg")
        tl.store(sums, tl.zeros_like(part), mask=mask)
        tl.atomic_xchg(count, 0)
    return part, last


_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced buffers: CUDA graphs captured earlier still point at them


def _stream_key(device: torch.device) -> tuple:
    return (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


def zeroed_workspace(device: torch.device, sums: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP32 sums, int32 counters) for the current stream with at least `sums` and `tiles` elements.
    Allocated in the first, uncaptured warm-up call of a layer; one allocated during a capture is
    zeroed by the graph itself."""
    key = _stream_key(device)
    total, counters = _BUFFERS.get(key, (None, None))
    if total is None or total.numel() < sums or counters.numel() < tiles:
        if total is not None:
            _OUTGROWN.extend((total, counters))
        total = torch.zeros(max(sums, 1 << 18), dtype=torch.float32, device=device)
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _BUFFERS[key] = total, counters
    return total, counters


_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    """Uninitialized bytes for the current stream, at least `nbytes` (a library kernel's workspace: cuBLASLt's)."""
    key = _stream_key(device)
    ws = _SCRATCH.get(key)
    if ws is None or ws.numel() < nbytes:
        if ws is not None:
            _OUTGROWN.append(ws)
        ws = _SCRATCH[key] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
    return ws
