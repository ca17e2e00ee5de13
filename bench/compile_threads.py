"""Does Triton's compiler run in parallel threads? (builder/compile_ahead.py relies on it.) Needs no GPU: it
compiles kiln's 8-bit GEMM kernel (kernels/gemm.py) for sm_90 through Triton's own pipeline (TTIR, TTGIR, LLVM
IR, PTX, ptxas), each time into a fresh cache.

    python bench/compile_threads.py --threads 1 2 4      # wall time of N compiles in 1, 2, 4 threads
    python bench/compile_threads.py --stall              # does a compile hold the GIL?

--stall compiles in one thread while the main thread spins a pure-Python loop and records its longest stall:
a C++ step that held the GIL would stall the loop for its whole length (LLVM's PTX emission alone takes about a
second per kernel), one that releases it only for thread switches.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# Tile configurations compiled (block M, N, K, warps, stages): the 8-bit GEMM's own and neighbours.
CONFIGS = [(128, 128, 64, 8, 3), (64, 128, 128, 4, 4), (128, 256, 64, 8, 3), (128, 256, 128, 8, 3),
           (128, 64, 64, 4, 4), (64, 64, 128, 4, 4), (128, 128, 128, 8, 3), (64, 128, 64, 4, 3)]


def _compile(i: int) -> float:
    """Compile variant i (a configuration, with or without the 8-bit copy epilogue); its seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kiln.kernels.gemm import _gemm_kernel

    sig = {a: "*i8" for a in ("x_ptr", "w_ptr", "q_ptr")}
    sig.update({a: "*fp32" for a in ("b_ptr", "xs_ptr", "ws_ptr", "ys_ptr", "qs_ptr", "zs_ptr")})
    sig.update({"z_ptr": "*fp16", "y_ptr": "*fp16", "p0": "fp32", "p1": "fp32"})
    sig.update({a: "i32" for a in ("M", "N", "K", "stride_xm", "stride_xk", "stride_wk", "stride_wn", "stride_zm",
                                   "stride_zn", "stride_ym", "stride_yn", "stride_ws")})
    bm, bn, bk, warps, stages = CONFIGS[i % len(CONFIGS)]
    const = {"HAS_BIAS": True, "HAS_Z": False, "ACT": "Relu", "PREC": "ieee", "EVEN_K": True, "QUANT": "int8",
             "Y_QUANTIZED": False, "COPY": i // len(CONFIGS) % 2 == 1, "Z_SCALED": False, "BLOCK_M": bm,
             "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}
    sig.update({k: "constexpr" for k in const})
    start = time.perf_counter()
    triton.compile(ASTSource(_gemm_kernel, sig, const), target=GPUTarget("cuda", 90, 64),
                   options={"num_warps": warps, "num_stages": stages})
    return time.perf_counter() - start


def _fresh_cache() -> None:
    import triton.knobs

    triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-compile-threads-")


def scaling(thread_counts: list[int], n: int) -> None:
    for threads in thread_counts:
        _fresh_cache()
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            each = list(pool.map(_compile, range(n)))
        wall = time.perf_counter() - start
        print(f"{threads} thread(s): {n} compiles in {wall:.2f} s wall, {sum(each):.2f} s summed "
              f"({sum(each) / wall:.2f} compiling at once on average)", flush=True)


def stall(n: int) -> None:
    _fresh_cache()
    took, done = [0.0], threading.Event()

    def work():
        start = time.perf_counter()
        for i in range(n):
            _compile(len(CONFIGS) + i)
        took[0] = time.perf_counter() - start
        done.set()

    thread = threading.Thread(target=work)
    thread.start()
    last, longest = time.perf_counter(), 0.0
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    print(f"{n} compiles in a thread took {took[0]:.2f} s; the main thread's longest stall meanwhile: "
          f"{longest * 1e3:.1f} ms", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    p.add_argument("--compiles", type=int, default=8)
    p.add_argument("--stall", action="store_true")
    args = p.parse_args(argv)
    _fresh_cache()
    _compile(0)  # the first compile loads LLVM's targets: not part of any measurement
    if args.stall:
        stall(min(args.compiles, 3))
    else:
        scaling(args.threads, args.compiles)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
