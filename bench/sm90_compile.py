"""Compile Kiln's TMA kernels (and flash attention's 8-bit output, the norm's FP8 copy, the pool's 8-bit I/O,
the stem patches, the row gather) for Hopper (sm_90) on any machine, no GPU needed (Triton bundles ptxas), and say
what the compiler made of them: whether each loop's wgmma is pipelined (`warp_group_dot_wait {pendings = 1}`:
the next MMA issues while one is in flight; `pendings = 0` after every dot: each waits for the last), whether the
convolution's left tile reaches the MMA from shared memory or through registers, and the shared memory used.

Found with it (Triton 3.8): FP16 and FP8 dots are pipelined, INT8 ones never are. Triton makes a
Hopper dot properly asynchronous only with an FP32 accumulator (WGMMAPipeline.cpp, "rule 2.1"), and INT8 sums
in int32, so every INT8 wgmma in Kiln's Triton kernels waits for the one before it. The TMA convolution's input box
is loaded into registers to be reshaped into the dot's left tile (`local_load` + `reshape`), in every precision,
not read by the MMA from shared memory.

    python bench/sm90_compile.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import attention, tma_conv, tma_gemm  # noqa: E402

DTYPES = {"int8": "i8", "fp8": "fp8e4nv", "": "fp16"}
POINTERS = {"b_ptr": "*fp16", **{p: "*fp32" for p in ("xs_ptr", "ws_ptr", "ys_ptr", "qs_ptr", "zs_ptr")}}


def conv_source(stride: int, quant: str, out8: bool, bh=8, bw=16, bn=128, bk=128, copy=True):
    """The TMA convolution with bias, residual and ReLU; with out8 an 8-bit output and a copy (copy=False: alone)."""
    x = DTYPES[quant]
    xbox = f"[1,{bh},{bw},{bk}]" if stride == 1 else f"[1,{bh},1,{bw},{bk}]"
    sig = {"x_desc": f"tensordesc<{x}{xbox}>", "w_desc": f"tensordesc<{x}[{bn},{bk}]>",
           "y_desc": f"tensordesc<{x if out8 else 'fp16'}[1,{bh},{bw},{bn}]>",
           "z_desc": f"tensordesc<{x}[1,{bh},{bw},{bn}]>", "q_desc": f"tensordesc<{x}[1,{bh},{bw},{bn}]>",
           **POINTERS, **{p: "i32" for p in ("N", "OH", "OW", "OC", "C", "pad_h", "pad_w", "stride_ws")},
           "p0": "fp32", "p1": "fp32"}
    cx = dict(KH=3, KW=3, STRIDE=stride, HAS_BIAS=True, HAS_Z=True, ACT="Relu", QUANT=quant, Y_QUANTIZED=out8,
              COPY=out8 and copy, Z_SCALED=bool(quant), RELU=out8, BLOCK_H=bh, BLOCK_W=bw, BLOCK_N=bn, BLOCK_K=bk,
              PROGRAMS=132)
    return ASTSource(fn=tma_conv._tma_conv_kernel, signature={**sig, **{k: "constexpr" for k in cx}}, constexprs=cx)


def gemm_source(quant: str, out8: bool, bm=128, bn=128, bk=128, one_k=False, stages=4, copy=True):
    """The TMA GEMM with bias, residual and ReLU; out8 and copy as in `conv_source`."""
    x = DTYPES[quant]
    sig = {"x_desc": f"tensordesc<{x}[{bm},{bk}]>", "w_desc": f"tensordesc<{x}[{bn},{bk}]>",
           "y_desc": f"tensordesc<{x if out8 else 'fp16'}[{bm},{bn}]>", "z_desc": f"tensordesc<{x}[{bm},{bn}]>",
           "q_desc": f"tensordesc<{x}[{bm},{bn}]>",
           **POINTERS, **{p: "i32" for p in ("M", "N", "K", "stride_ws")}, "p0": "fp32", "p1": "fp32"}
    cx = dict(HAS_BIAS=True, HAS_Z=True, ACT="Relu", QUANT=quant, Y_QUANTIZED=out8, COPY=out8 and copy,
              Z_SCALED=bool(quant), RELU=out8, W_KMAJOR=True, ONE_K=one_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
              GROUP_M=8, PROGRAMS=132, NUM_STAGES=stages, PDL=True)
    return ASTSource(fn=tma_gemm._tma_gemm_kernel, signature={**sig, **{k: "constexpr" for k in cx}}, constexprs=cx)


def flash_source(quant: str, fp8_inputs: bool = False):
    """Flash attention writing 8-bit output (the quantized projection's input), optionally reading FP8 q, k, v
    (an FP8 engine's merged QKV codes): pointer loads, no TMA."""
    strides = "sqb sqh sqm sqd skb skh skn skd svb svh svn svd smb smw MW smh smm smn sob soh som sod".split()
    qkv = "*fp8e4nv" if fp8_inputs else "*fp16"
    sig = {**{p: qkv for p in ("q_ptr", "k_ptr", "v_ptr")}, "m_ptr": "*fp16", "o_ptr": f"*{DTYPES[quant]}",
           "ys_ptr": "*fp32", "qs_ptr": "*fp32", **{p: "i32" for p in ("H", "SQ", "SK", "D", "DV")},
           "qk_scale": "fp32", **{p: "i32" for p in strides}}
    cx = dict(HAS_MASK=True, MASK_ROW=True, EVEN_M=True, EVEN_N=True, EVEN_D=True, NAN_GUARD=False, PREC="tf32",
              QUANT=quant, QKV_SCALED=fp8_inputs, CDT=tl.float16,
              QK_DT=tl.float8e4nv if fp8_inputs else tl.float16, BLOCK_M=128, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64,
              PDL=True)
    return ASTSource(fn=attention._flash_fwd_kernel, signature={**sig, **{k: "constexpr" for k in cx}},
                     constexprs=cx)


def _compiles(name: str, src, options: dict, quiet: bool = False) -> int:
    """Compile src for sm_90 and say whether it did (quiet: only if it did not); 1 if it failed, else 0."""
    try:
        _compiled(src, options)
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
        return 1
    if not quiet:
        print(f"{name}: compiles")
    return 0


def _compiled(src, options: dict):
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def spilled_bytes(kernel) -> int:
    """Bytes a compiled kernel spills to local memory, from Triton's bundled ptxas (-v) on its PTX; -1 if unknown."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    ptxas = Path(nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                             text=True)
    found = re.search(r"(\d+) bytes spill stores", run.stdout + run.stderr)
    return int(found.group(1)) if found else -1


def flash_compiles() -> int:
    """Compile the flash kernel's 8-bit outputs; the number that failed. The interpreter ran one that the
    compiler refused (a variable of the key loop read after it), which only a GPU run had found."""
    return sum(_compiles(f"flash attention, {quant} output" + (", fp8 q/k/v" if fp8_inputs else ""),
                         flash_source(quant, fp8_inputs), {"num_warps": 4, "num_stages": 3})
               for quant, fp8_inputs in (("int8", False), ("fp8", False), ("fp8", True)))


def norm_compiles() -> int:
    """Compile the add + LayerNorm kernel with its FP8 copy, with and without the add, with a third addend, at one and
    two rows a program; the number that failed."""
    from kiln.kernels import layernorm

    sig = {**{p: "*fp16" for p in ("a_ptr", "b_ptr", "c_ptr", "g_ptr", "beta_ptr", "y_ptr", "s_ptr", "bias_ptr")},
           "qs_ptr": "*fp32", "q_ptr": "*fp8e4nv", "n_cols": "i32", "eps": "fp32",
           **{p: "i32" for p in ("rows1", "n_rows", "sa0", "sa1", "sb0", "sb1", "sc0", "sc1")}}
    failed = 0
    for skip, rows, third in ((True, 1, False), (False, 1, False), (True, 2, False), (True, 1, True)):
        cx = dict(HAS_SKIP=skip, HAS_SKIP2=third, HAS_BETA=True, WRITE_SUM=False, QUANT="fp8", RMS=False, PARTS=0,
                  HAS_BIAS=False, BLOCK=1024, ROWS=rows, PDL=True)
        add = "a third addend" if third else "the add" if skip else "no add"
        failed += _compiles(f"layernorm, fp8 copy, {add}, {rows} row(s) a program",
                            ASTSource(fn=layernorm._skip_layernorm_kernel,
                                      signature={**sig, **{k: "constexpr" for k in cx}}, constexprs=cx),
                            {"num_warps": 2})
    return failed


def pool_compiles() -> int:
    """Compile the max pool writing its quantized readers' int8 / FP8 input, from FP16 values or from 8-bit ones
    (an 8-bit stem's); the number that failed."""
    from kiln.kernels import pool

    sig = {"ys_ptr": "*fp32",
           **{p: "i32" for p in ("C", "H", "W", "OH", "OW", "P", "sxn", "sxc", "sxh", "sxw", "stride_h", "stride_w",
                                 "pad_h", "pad_w", "dil_h", "dil_w")}}
    failed = 0
    for quant in ("int8", "fp8"):
        for source in ("", quant):  # "": FP16
            eight_bit_in = source == quant
            cx = dict(KH=3, KW=3, QUANT="" if eight_bit_in else quant, INT8_IN=source == "int8", BLOCK_P=32,
                      BLOCK_C=64, PDL=True)
            signature = {**sig, "x_ptr": f"*{DTYPES[source]}", "y_ptr": f"*{DTYPES[quant]}",
                         **{k: "constexpr" for k in cx}}
            failed += _compiles(f"max pool, {quant} output from {source or 'fp16'} values",
                                ASTSource(fn=pool._max_pool_kernel, signature=signature, constexprs=cx),
                                {"num_warps": 4})
    return failed


def stem_patches_compiles() -> int:
    """Compile the stem patches kernel writing int8 / FP8 patches of an FP32 image; the number that failed."""
    from kiln.kernels import stem_patches

    failed = 0
    for quant in ("int8", "fp8"):
        cx = dict(K=64, CELL_C=4, QUANT=quant, BLOCK_P=128, BLOCK_K=64)
        signature = {"x_ptr": "*fp32", "y_ptr": f"*{DTYPES[quant]}", "ys_ptr": "*fp32",
                     **{p: "i32" for p in ("P", "C", "H", "W", "HC", "OW", "FIRST", "sxn", "sxc", "sxh", "sxw")},
                     **{k: "constexpr" for k in cx}}
        failed += _compiles(f"stem patches, {quant}",
                            ASTSource(fn=stem_patches._stem_patches_kernel, signature=signature, constexprs=cx),
                            {"num_warps": 4})
    return failed


def gather_compiles() -> int:
    """Compile the row gather (an embedding lookup) for FP16 tables and int64 indices; 1 if it failed."""
    from kiln.kernels import gather_rows

    sig = {"t_ptr": "*fp16", "i_ptr": "*i64", "y_ptr": "*fp16", "n_idx": "i32", "n_rows": "i32", "n_cols": "i32",
           "stride_t": "i32", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
    return _compiles("row gather, fp16 table", ASTSource(fn=gather_rows._gather_rows_kernel, signature=sig,
                                                         constexprs={"BLOCK_R": 16, "BLOCK_C": 256}),
                     {"num_warps": 4})


def gemm_tiles_compile() -> int:
    """Compile the TMA GEMM at every tile the builder offers (CONFIGS in FP16, QUANT_CONFIGS in INT8 and FP8), in
    both of its loops, with a residual, and say which spill registers; the number that failed. Every tile, not
    only square ones: a helper that broke the other shapes passed the interpreter and square tiles."""
    tiles = [("", c) for c, _ in tma_gemm.CONFIGS]
    tiles += [(q, c) for q in ("int8", "fp8") for c, _ in tma_gemm.QUANT_CONFIGS]
    failed, spills = 0, []
    for quant, c in tiles:
        for one_k in (False, True):
            name = f"{quant or 'fp16'} {c.name}{' K in one tile' if one_k else ''}"
            src = gemm_source(quant, bool(quant), c.block_m, c.block_n, c.block_k, one_k, c.num_stages)
            try:
                spilled = spilled_bytes(_compiled(src, {"num_warps": c.num_warps, "num_stages": c.num_stages}))
            except Exception as e:
                failed += 1
                print(f"TMA GEMM tile {name}: FAILED {type(e).__name__}: {str(e)[:400]}")
                continue
            if spilled:
                spills.append(f"{name} ({spilled} bytes)")
    print(f"every TMA GEMM tile, both loops: {2 * len(tiles) - failed} of {2 * len(tiles)} compile")
    # with a residual, an 8-bit output and its copy: the widest epilogue
    print(f"tiles of the TMA GEMM that spill registers: {', '.join(spills) or 'none'}")
    return failed


def conv_tiles_compile() -> int:
    """Compile the TMA convolution at every tile the builder offers (CONFIGS in FP16, QUANT_CONFIGS in INT8), stride
    1, with a residual (and in INT8 an 8-bit output and copy); the number that failed."""
    tiles = [("", c) for c, _ in tma_conv.CONFIGS] + [("int8", c) for c, _ in tma_conv.QUANT_CONFIGS]
    failed = 0
    for quant, c in tiles:
        src = conv_source(1, quant, bool(quant), c.block_h, c.block_w, c.block_n, c.block_k)
        failed += _compiles(f"TMA convolution tile {quant or 'fp16'} {c.name}", src,
                            {"num_warps": c.num_warps, "num_stages": c.num_stages}, quiet=True)
    print(f"every TMA convolution tile: {len(tiles) - failed} of {len(tiles)} compile")
    return failed


def main() -> int:
    cases = {}
    for quant in ("int8", "fp8"):
        cases[f"TMA GEMM {quant}, 8-bit output and copy"] = (gemm_source(quant, True), 4, 4)
        cases[f"TMA GEMM {quant}, K in one tile, 8-bit output and copy"] = (
            gemm_source(quant, True, one_k=True, stages=3), 4, 3)
        cases[f"TMA GEMM {quant}, K in one tile, 8-bit output alone"] = (
            gemm_source(quant, True, one_k=True, stages=3, copy=False), 4, 3)
        for stride in (1, 2):
            cases[f"TMA convolution {quant} stride {stride}, 8-bit output and copy"] = (
                conv_source(stride, quant, True), 8, 3)
        cases[f"TMA convolution {quant} stride 1, 8-bit output alone"] = (
            conv_source(1, quant, True, copy=False), 8, 3)
    cases["TMA convolution fp16 stride 1"] = (conv_source(1, "", False, bk=64), 8, 3)
    print(f"triton {triton.__version__}, target sm_90")
    failed = (flash_compiles() + norm_compiles() + pool_compiles() + stem_patches_compiles() + gather_compiles()
              + gemm_tiles_compile())
    failed += conv_tiles_compile()
    for name, (src, warps, stages) in cases.items():
        try:
            k = _compiled(src, {"num_warps": warps, "num_stages": stages})
        except Exception as e:  # a kernel that does not compile for Hopper
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
            continue
        ir = k.asm["ttgir"]
        ptx = k.asm["ptx"]
        if "wgmma.mma_async" not in ptx or "cp.async.bulk.tensor" not in ptx:
            failed += 1
            print(f"{name}: compiled without wgmma or TMA loads")
            continue
        pipelined = "pendings = 1" in ir
        # the convolution's box, read out of shared memory into registers to be reshaped into the left tile
        a_in_registers = bool(re.search(r"%a\w* = ttg\.local_load [^\n]*memdesc<1x", ir))
        # the residual's TMA load waited for where it is issued, or issued tiles ahead by the pipeliner
        z_waited = bool(re.search(r"async_tma_copy_global_to_local %z_desc[^\n]*\n\s*ttng\.wait_barrier", ir))
        print(f"{name}: TMA loads, wgmma {'pipelined' if pipelined else 'waits after every dot'}; left tile "
              f"{'through registers' if a_in_registers else 'from shared memory'}; residual "
              f"{'waited for where loaded' if z_waited else 'prefetched'}; shared memory {k.metadata.shared} bytes")
    return failed


if __name__ == "__main__":
    sys.exit(main())
