"""The weight-only FP8 GEMV (kiln.kernels.fp8_gemv) against its torch reference: tiny shapes under
TRITON_INTERPRET=1 without a GPU, Llama-sized ones on the GPU."""

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import fp8_gemv as fg

FP8 = torch.float8_e4m3fn
INTERPRETED = DEV == "cpu"


def operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different ranges
    scale = (w.abs().amax(dim=1) / 448).clamp_min(1e-12)
    codes = (w / scale[:, None]).clamp(-448, 448).to(FP8)
    x = torch.randn(m, k, generator=g)
    return x.to(DEV, dtype), codes.to(DEV), scale.to(DEV)


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# (BF16 runs on the GPU only: Triton's interpreter multiplies bf16 operands as raw uint16.)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if not INTERPRETED else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 64, 256, fg.GemvConfig(64, 64, 1, 4, 2)),  # whole tiles, one split
    (3, 80, 200, fg.GemvConfig(32, 64, 1, 4, 2)),  # ragged N and K: masked tiles
    (5, 64, 512, fg.GemvConfig(32, 64, 4, 4, 2)),  # split-K, each split whole tiles
    (16, 48, 328, fg.GemvConfig(16, 32, 3, 4, 2)),  # split-K with a short last split, full 16 rows
    (33, 32, 64, fg.GemvConfig(32, 32, 1, 4, 2)),  # 64-row tile
    (3, 64, 256, fg.GemvConfig(32, 64, 2, 4, 2, block_m=8)),  # 8 activation columns
])
def test_matches_reference(dtype, m, n, k, cfg):
    x, codes, scale = operands(m, n, k, dtype)
    got = fg.fp8_gemv(x, codes, scale, cfg)
    want = fg.reference(x, codes, scale)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("cfg", [fg.GemvConfig(8, 64, 1, 4, 1, row=True), fg.GemvConfig(16, 64, 3, 4, 1, row=True)])
def test_single_row_kernel(cfg):
    """M = 1 without the tensor cores (FP32 products summed per tile position), ragged N and K, split-K."""
    x, codes, scale = operands(1, 40, 300, torch.float16, seed=4)
    assert rel_err(fg.fp8_gemv(x, codes, scale, cfg), fg.reference(x, codes, scale)) < 1e-3
    with pytest.raises(ValueError, match="takes one row"):
        fg.fp8_gemv(torch.cat([x, x]), codes, scale, cfg)


def test_int8_codes():
    x, codes, scale = operands(4, 64, 128, torch.float32, seed=2)
    w = codes.float() * scale[:, None]
    s8 = w.abs().amax(dim=1) / 127
    c8 = torch.round(w / s8[:, None]).to(torch.int8)
    got = fg.fp8_gemv(x, c8, s8, fg.GemvConfig(32, 64, 2, 4, 2))
    assert rel_err(got, fg.reference(x, c8, s8)) < 1e-5


def test_rows_do_not_depend_on_the_batch():
    """Row r of a 7-row product equals the 1-row product of x[r] bit for bit (same tile, same split order)."""
    x, codes, scale = operands(7, 64, 256, torch.float32, seed=1)
    cfg = fg.GemvConfig(32, 64, 2, 4, 2)
    full = fg.fp8_gemv(x, codes, scale, cfg)
    for r in (0, 6):
        assert torch.equal(fg.fp8_gemv(x[r:r + 1], codes, scale, cfg)[0], full[r])


def test_out_and_bad_operands():
    x, codes, scale = operands(2, 32, 64, torch.float32)
    out = torch.full((2, 32), float("nan"), device=DEV)
    assert fg.fp8_gemv(x, codes, scale, fg.GemvConfig(32, 64, 1, 4, 2), out=out) is out
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="at most 64 rows"):
        fg.fp8_gemv(torch.zeros(65, 64, device=DEV), codes, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn, int8, bfloat16 or float16"):
        fg.fp8_gemv(x, codes.float(), scale)
    with pytest.raises(ValueError, match="scale must have N = 32"):
        fg.fp8_gemv(x, codes, scale[:31])


def test_split_heuristic_fills_the_sms():
    # Llama-3-8B's o projection: 64 tiles of 64 rows; the K splits make about two programs per SM.
    assert fg.split_for(4096, 4096, 64, 128, 132) == 4
    assert fg.split_for(28672, 4096, 64, 128, 132) == 1  # enough tiles already
    assert fg.split_for(4096, 256, 64, 128, 132) == 1  # too short to split
    for codes in (fg.FP8, torch.bfloat16):
        cands = fg.candidate_configs(4096, 14336, 132, codes)
        assert len(set(cands)) == len(cands) and fg.heuristic_config(4096, 14336, 132, codes) in cands
        assert set(cands) <= set(fg.candidate_configs(4096, 14336, 132, codes, full=True))


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (6144, 4096)])
def test_llama_shapes_on_the_gpu(m, n, k):
    x, codes, scale = operands(m, n, k, torch.bfloat16)
    got = fg.fp8_gemv(x, codes, scale)
    assert rel_err(got, fg.reference(x, codes, scale)) < 1e-2


# The compiler's view without a GPU: sm_90 code from Triton's bundled ptxas, in a fresh process (kernels defined
# under TRITON_INTERPRET cannot be compiled). Catches what only the compiler refuses.
_SM90_COMPILE = r"""
import inspect, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import fp8_gemv as fg

def source(kernel, types, cx):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in cx else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in cx and (n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "k_per_split"))}
    return ASTSource(fn=kernel, signature=sig, constexprs=cx, attrs=attrs)

def gemv(codes, cfg, block_m, even=True, x="*bf16", act=""):
    elem = 2 if codes in ("*bf16", "*fp16") else 1
    types = dict(x_ptr=x, w_ptr=codes, s_ptr="*fp32", y_ptr=x, part_ptr="*fp32", count_ptr="*i32")
    cdt = {"*bf16": tl.bfloat16, "*fp16": tl.float16}[codes] if elem == 2 else tl.float16
    cx = dict(X_SCALE=fg.X_SCALE_BF16 if (elem == 1 and x == "*bf16") else 1.0, CDT=cdt, PREC="tf32",
              HAS_SCALE=elem == 1, EVEN=even, PDL=True, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
              ACT=act, ONE_ROW=act != "" and block_m == 8)
    return source(fg._gemv_kernel, types, cx), cfg

def row(codes, cfg, act=""):
    elem = 2 if codes in ("*bf16", "*fp16") else 1
    types = dict(x_ptr="*bf16", w_ptr=codes, s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
    cx = dict(HAS_SCALE=elem == 1, EVEN=True, PDL=True, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ACT=act)
    return source(fg._gemv_row_kernel, types, cx), cfg

for codes, cd in (("*fp8e4nv", fg.FP8), ("*bf16", fg.torch.bfloat16)):
    cfg = fg.row_candidate_configs(4096, 4096, 132, cd)[0]
    src, cfg = row(codes, cfg)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)).asm["ptx"]
    print(f"single-row {codes[1:]}: fma {'fma.rn.f32' in ptx}, pdl wait {'griddepcontrol.wait' in ptx}")

cases = [("heuristic m16", *gemv("*fp8e4nv", fg.heuristic_config(4096, 4096), 16)),
         ("widest tile m64", *gemv("*fp8e4nv", fg.GemvConfig(128, 128, 1, 4, 4), 64)),
         ("split", *gemv("*fp8e4nv", fg.GemvConfig(64, 256, 4, 4, 4), 16)),
         ("bf16 weights", *gemv("*bf16", fg.GemvConfig(64, 128, 2, 4, 4), 16)),
         ("int8 ragged", *gemv("*i8", fg.GemvConfig(64, 128), 16, False)),
         ("8 columns", *gemv("*fp8e4nv", fg.GemvConfig(64, 256, 2, 4, 4, block_m=8), 8)),
         ("silu in the input load", *gemv("*fp8e4nv", fg.GemvConfig(64, 256, 2, 4, 4, block_m=8), 8, act="silu")),
         ("bf16 gelu in the input load", *gemv("*bf16", fg.GemvConfig(64, 128, 4, 4, 4), 16, act="gelu_tanh"))]
src, cfg = row("*fp8e4nv", fg.row_candidate_configs(4096, 4096, 132)[0], act="silu")
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)).asm["ptx"]
print(f"single-row silu: ex2 {'ex2.approx' in ptx}")
for name, src, cfg in cases:
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)).asm["ptx"]
    print(name, "mma:", len(re.findall(r"\b(?:wgmma|mma)\.", ptx)))
    if name.startswith("split"):
        print("fp8 cvt to fp16:", ptx.count("cvt.rn.f16x2.e4m3x2"),
              "griddep:", ptx.count("griddepcontrol"), "atom:", ptx.count("atom."))
for x, magic, gps, act in (("*bf16", 0x4300, 1, ""), ("*fp16", 0x6400, 1, ""), ("*bf16", 0x4300, 2, "silu")):
    types = dict(x_ptr=x, p_ptr="*u8", s_ptr="*fp32", z_ptr="*u8", xs_ptr="*fp32", y_ptr=x, part_ptr="*fp32",
                 count_ptr="*i32")
    cx = dict(CDT=tl.bfloat16 if x == "*bf16" else tl.float16, PREC="tf32", HAS_XS=True, MAGIC=magic, PRMT=True,
              PDL=True, BLOCK_M=16, BLOCK_N=64, GROUP=128, GPS=gps, ACT=act, ONE_ROW=act != "")
    ptx = triton.compile(source(fg._int4_gemv_kernel, types, cx), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    print(f"int4 {x[1:]}{' groups ' + str(gps) + ' ' + act if act else ''} mma:", len(re.findall(r"\b(?:wgmma|mma)\.", ptx)))
from kiln.kernels import fp8_rows  # the activation quantizer that feeds _scaled_mm above GEMV_MAX_M rows
s = source(fp8_rows._quantize_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(BLOCK=4096))
ptx = triton.compile(s, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
print("quantize rows mma:", 0 if "cvt.rn.satfinite.e4m3x2.f32" in ptx else "no fp8 cvt")
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above compile and run the kernels")
def test_kernels_compile_for_hopper_on_the_tensor_cores():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], check=False, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "single-row fp8e4nv: fma True, pdl wait True" in lines and "single-row bf16: fma True, pdl wait True" in lines
    counts = dict(line.rsplit(" mma: ", 1) for line in lines if " mma: " in line)
    assert len(counts) == 12, run.stdout
    assert "single-row silu: ex2 True" in lines
    assert all(int(v) > 0 for k, v in counts.items() if k != "quantize rows"), run.stdout
    assert counts["quantize rows"] == "0", run.stdout  # converted by the hardware's saturating FP8 cvt
    # E4M3 codes go to FP16 by the hardware's pair conversion; the PDL wait and trigger, and the split-K arrival
    # count (atomic add, reset) are all in the code
    info = next(ln for ln in lines if ln.startswith("fp8 cvt to fp16:")).split()
    cvt, griddep, atom = int(info[4]), int(info[6]), int(info[8])
    assert cvt > 0 and griddep == 2 and atom == 2, run.stdout


@pytest.mark.parametrize("m,n,k,split,xs", [(1, 64, 256, 1, True), (5, 80, 300, 2, False), (16, 32, 640, 3, True)])
def test_int4_gemv_matches_dequantized_weights(m, n, k, split, xs):
    """kiln.llm.quantize's INT4 layout (groups of 128, a short last group in K = 300 and 640 / 3 splits)."""
    from kiln.llm.quantize import dequantize_int4, quantize_int4

    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g)
    packed, scale, zero = quantize_int4(w)
    x = torch.randn(m, k, generator=g)
    in_scale = torch.rand(k, generator=g) + 0.5 if xs else None
    want = (x if in_scale is None else x * in_scale) @ dequantize_int4(packed, scale, zero, k).t()
    got = fg.int4_gemv(x.to(DEV), packed.to(DEV), scale.to(DEV), zero.to(DEV),
                       None if in_scale is None else in_scale.to(DEV), config=fg.GemvConfig(32, 128, split, 4, 2))
    assert rel_err(got.cpu(), want) < 1e-5 * 8  # the group's scale rounds its partial sums


@pytest.mark.parametrize("block_m", [16, 8])
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if not INTERPRETED else []))
def test_int4_gemv_16_bit_codes_by_their_bits(dtype, block_m):
    """16-bit activations: the codes enter the dot as the floats B + q made from their bits (B = 1024 in FP16,
    128 in BF16) and B leaves with the zero point; the result is the dequantized product within 16-bit rounding."""
    from kiln.llm.quantize import dequantize_int4, quantize_int4

    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 384, generator=g)
    packed, scale, zero = quantize_int4(w)
    x = torch.randn(3, 384, generator=g).to(dtype)
    in_scale = torch.rand(384, generator=g) + 0.5
    want = (x.float() * in_scale) @ dequantize_int4(packed, scale, zero, 384).t()
    got = fg.int4_gemv(x.to(DEV), packed.to(DEV), scale.to(DEV), zero.to(DEV), in_scale.to(DEV),
                       config=fg.GemvConfig(16, 128, 2, 4, 2, block_m=block_m))
    assert got.dtype == dtype and rel_err(got.cpu(), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="inline PTX: CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prmt,block_k", [(1, 128), (2, 128), (1, 256)])  # a PTX piece a nibble, or one for both
def test_int4_nibbles_in_ptx_equal_the_elementwise_form(dtype, prmt, block_k):
    from kiln.llm.quantize import quantize_int4

    g = torch.Generator().manual_seed(7)
    packed, scale, zero = (t.to(DEV) for t in quantize_int4(torch.randn(4096, 4096, generator=g)))
    x = torch.randn(4, 4096, generator=g).to(DEV, dtype)
    fast = fg.int4_gemv(x, packed, scale, zero, None, config=fg.GemvConfig(64, block_k, 2, 4, 4, prmt=prmt))
    assert torch.equal(fast, fg.int4_gemv(x, packed, scale, zero, None, config=fg.GemvConfig(64, block_k, 2, 4, 4)))


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4])
def test_activation_in_the_input_load_on_the_gpu(m):
    """SiLU(gate) * up inside the down projection's GEMV against act_and_mul then the GEMV: the same bits for FP8
    codes and INT4; BF16 weights to BF16 rounding (the H200 run's BF16 step differed, the FP8 and INT4 steps did
    not: the dot's operand then comes from registers, which may change the tensor cores' summation order)."""
    from kiln.llm.fused_ops import act_and_mul
    from kiln.llm.quantize import quantize_int4

    k = 14336
    x, codes, scale = operands(m, 4096, k, torch.bfloat16, seed=3)
    gate_up = torch.randn(m, 2 * k, device=DEV).to(torch.bfloat16)
    a = act_and_mul(gate_up)
    assert torch.equal(fg.fp8_gemv(gate_up, codes, scale, act="silu"), fg.fp8_gemv(a, codes, scale))
    packed, s4, z4 = quantize_int4(torch.randn(4096, k, device=DEV))
    assert torch.equal(fg.int4_gemv(gate_up, packed, s4, z4, None, act="silu"), fg.int4_gemv(a, packed, s4, z4, None))
    w16 = (torch.randn(4096, k, device=DEV) * 0.02).to(torch.bfloat16)
    torch.testing.assert_close(fg.fp8_gemv(gate_up, w16, None, act="silu"), fg.fp8_gemv(a, w16, None),
                               atol=1e-2, rtol=1e-2)


def test_launches_pass_only_the_kernels_parameters(monkeypatch):
    """Triton's interpreter ignores a keyword a kernel does not take; the GPU launcher refuses it. Every launch
    of the module's kernels passes exactly the kernel's parameters (positional + keyword)."""
    import inspect

    seen = []

    class Checked:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names = list(inspect.signature(self.kernel.fn).parameters)
                given = set(names[:len(args)]) | {k for k in kwargs
                                                   if k not in ("num_warps", "num_stages", "launch_pdl")}
                assert given == set(names), (self.kernel.fn.__name__, sorted(given ^ set(names)))
                seen.append(self.kernel.fn.__name__)
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_gemv_kernel", "_int4_gemv_kernel"):
        monkeypatch.setattr(fg, name, Checked(getattr(fg, name)))
    x, codes, scale = operands(2, 64, 256, torch.float32)
    fg.fp8_gemv(x, codes, scale, fg.GemvConfig(32, 64, 2, 4, 2))
    from kiln.llm.quantize import quantize_int4

    packed, s4, z4 = quantize_int4(torch.randn(64, 256))
    fg.int4_gemv(x, packed.to(DEV), s4.to(DEV), z4.to(DEV), None, config=fg.GemvConfig(32, 128, 2, 4, 2))
    assert set(seen) == {"_gemv_kernel", "_int4_gemv_kernel"}
