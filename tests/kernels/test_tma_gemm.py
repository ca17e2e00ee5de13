"""The TMA GEMM (kernels/tma_gemm.py) against gemm.py's kernel and the FP32 reference, under TRITON_INTERPRET=1
on the CPU (the interpreter runs tensor descriptors, zero-filling reads past the edge)."""

import pytest
import torch

from kiln.kernels import gemm, tma_gemm
from kiln.kernels.gemm import TileConfig

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = TileConfig(16, 16, 32, 4, 2)  # small tiles: the test shapes span several, with ragged edges


@pytest.mark.parametrize("M", [1, 37])  # not a multiple of the tile
@pytest.mark.parametrize("act, residual", [("", False), ("Relu", True), ("GeluErf", False)])
@pytest.mark.parametrize("K", [80, 32, 16])  # several K tiles; K in one tile (the loop over tiles alone), part of one
def test_float_gemm_matches_the_reference(M, act, residual, K):
    g = torch.Generator().manual_seed(M)
    N = 48
    x = torch.randn(M, K, generator=g).half().to(DEV)
    w = (torch.randn(K, N, generator=g) / 8).half().to(DEV)
    b = torch.randn(N, generator=g).half().to(DEV)
    z = torch.randn(M, N, generator=g).half().to(DEV) if residual else None
    assert tma_gemm.supports(x, w, b, act, z=z)
    y = poisoned(lambda: tma_gemm.gemm(x, w, b, act, config=SMALL, z=z))
    want = gemm.reference(x, w, b, act).float() if z is None else torch.relu(x.float() @ w.float() + b.float()
                                                                              + z.float())
    torch.testing.assert_close(y.float(), want, atol=2e-3, rtol=2e-3)


def _int8_operands(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 30).round().clamp(-128, 127).to(torch.int8).to(DEV)
    w = (torch.randn(N, K, generator=g) * 30).round().clamp(-127, 127).to(torch.int8).to(DEV).t()  # K-major [K, N]
    sx = torch.tensor(0.05, device=DEV)
    sw = (torch.rand(N, generator=g) * 0.01 + 0.001).to(DEV)
    return x, w, sx, sw, torch.randn(N, generator=g).half().to(DEV)


@pytest.mark.parametrize("outputs", ["float", "int8", "float and int8 copy", "int8 from an int8 residual",
                                     "int8 and int8 copy"])
@pytest.mark.parametrize("K", [96, 32])  # three K tiles; one (ResNet-50's K = 64 and 128 layers)
# the epilogue's column vectors loaded before the K loop (16 columns) or after it (128: EARLY_COLUMNS)
@pytest.mark.parametrize("config", [SMALL, TileConfig(16, 128, 32, 4, 2)])
def test_int8_gemm_matches_the_pointer_kernel(outputs, K, config):
    # gemm.py's quantized GEMM is the tested reference for the epilogue: identical integer sums, same FP32 math
    M, N = 37, 48
    x, w, sx, sw, b = _int8_operands(M, K, N)
    z = torch.randn(M, N).half().to(DEV)
    if "residual" in outputs:  # a block output written once as int8, scaled back in the epilogue
        z = (torch.randn(M, N) * 40).round().clamp(-128, 127).to(torch.int8).to(DEV)
    kw = dict(qtype="int8", x_scale=sx, w_scale=sw, out_dtype=torch.float16, z=z,
              z_scale=torch.tensor(0.02, device=DEV) if "residual" in outputs else None,
              y_scale=torch.tensor(0.03, device=DEV) if outputs.startswith("int8") else None,
              q_scale=torch.tensor(0.02, device=DEV) if "copy" in outputs else None)
    assert tma_gemm.supports(x, w, b, "Relu", "int8", z=z)
    got = poisoned(lambda: tma_gemm.gemm(x, w, b, "Relu", config=config, **kw))
    want = gemm.gemm(x, w, b, "Relu", config=gemm.TileConfig(16, 16, 32, 4, 2), **kw)
    for g_, w_ in zip(*(((t,) if isinstance(t, torch.Tensor) else t) for t in (got, want))):
        assert g_.dtype == w_.dtype and torch.equal(g_, w_)


def test_programs_per_sm_follow_shared_memory_and_registers():
    """The rule the H200 sweeps gave (bench/results/H200-int8-1x1-sweep.log, H200-int8-1x1-latency.log); the 8-bit
    test above runs it, its 4-warp SMALL tile getting four programs per SM."""
    def per_sm(cfg, qtype):
        return tma_gemm.resident_programs(cfg.num_warps, cfg.smem_bytes(1 if qtype else 2),
                                          cfg.block_m * cfg.block_n, qtype)

    assert per_sm(TileConfig(128, 128, 64, 4, 4), "int8") == 2  # 64 KB pipeline
    assert per_sm(TileConfig(128, 128, 64, 4, 2), "int8") == 2  # room for three, but 128 accumulator registers
    assert per_sm(TileConfig(64, 128, 128, 4, 4), "fp8") == 2  # 96 KB
    assert per_sm(TileConfig(64, 128, 128, 4, 2), "int8") == 3  # 48 KB
    assert per_sm(TileConfig(64, 128, 64, 4, 2), "int8") == 4  # 24 KB
    assert per_sm(TileConfig(128, 128, 128, 4, 4), "int8") == 1  # 128 KB: two would not fit
    assert per_sm(TileConfig(128, 256, 128, 8, 3), "int8") == 1  # 8 warps
    assert per_sm(TileConfig(128, 64, 64, 4, 4), "") == 1  # 16-bit tiles: not measured, one
    assert per_sm(SMALL, "int8") == 4


def test_float_input_to_a_quantized_gemm_is_quantized_first():
    M, K, N = 20, 64, 32
    _, w, sx, sw, b = _int8_operands(M, K, N, seed=1)
    x = torch.randn(M, K).half().to(DEV)
    kw = dict(qtype="int8", x_scale=sx, w_scale=sw, out_dtype=torch.float16)
    torch.testing.assert_close(tma_gemm.gemm(x, w, b, config=SMALL, **kw),
                               gemm.gemm(x, w, b, config=gemm.TileConfig(16, 16, 32, 4, 2), **kw))


def test_what_tma_cannot_read_is_refused():
    x, w = torch.randn(8, 64).half(), torch.randn(64, 32).half()
    assert tma_gemm.supports(x, w, None, "")
    assert not tma_gemm.supports(torch.randn(8, 72).half(), torch.randn(72, 40).half(), None, "")  # N % 16
    assert not tma_gemm.supports(x[:, 1:33], torch.randn(32, 32).half(), None, "")  # base off the 16-byte grid
    assert not tma_gemm.supports(x.float(), w.float(), None, "")  # FP32: not a TMA tactic
    w8 = torch.zeros(64, 32, dtype=torch.int8)  # row-major [K, N]: 8-bit Tensor Cores read w K-major only
    assert not tma_gemm.supports(x, w8, None, "", "int8") and tma_gemm.supports(x, w8.t().contiguous().t(), None,
                                                                                 "", "int8")


def test_tactics_are_registered_and_refuse_cpu_tensors():
    from kiln.ir.graph import Node
    from kiln.tactics import _TACTICS, load_all

    load_all()
    for op in ("FusedGemm", "FusedConv", "QGemm", "QConv"):
        names = [t.name for t in _TACTICS[("kiln", op)] if t.name.startswith("triton_tma_")]
        assert names, op
    t = next(t for t in _TACTICS[("kiln", "FusedGemm")] if t.name.startswith("triton_tma_gemm_"))
    node = Node("FusedGemm", ["x", "w", "b"], ["y"], {}, domain="kiln")
    assert not t.applies(node, [torch.randn(8, 64).half(), torch.randn(64, 32).half(), torch.randn(32).half()])


def test_the_single_loop_runs_where_k_fits_one_tile_and_its_prefetched_residual_fits():
    """K in one tile runs the loop over tiles alone, whose residual takes num_stages - 1 tiles of shared memory;
    where those would not fit (16-bit residual, four stages of 128x128x64 16-bit tiles) the nested loop runs."""
    int8_s4 = TileConfig(128, 128, 64, 4, 4)
    assert tma_gemm.one_loop(int8_s4, 64, 1, 1) and not tma_gemm.one_loop(int8_s4, 128, 1, 1)  # K = 128: two tiles
    assert tma_gemm.residual_bytes(int8_s4, 1, True) == 3 * 128 * 128
    assert tma_gemm.residual_bytes(int8_s4, 1, False) == 128 * 128
    assert tma_gemm.one_loop(int8_s4, 64, 2) and not tma_gemm.one_loop(int8_s4, 64, 2, 2)  # 128 KB + 96 KB


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_a_relu_left_to_the_quantization_gives_the_same_codes(qtype):
    """A ReLU before an 8-bit output is the quantization's lower clamp (gemm.relu_in_quantize, one instruction less
    per value): the same codes as the ReLU and then the quantization."""
    assert gemm.relu_in_quantize("Relu", True) and not gemm.relu_in_quantize("Relu", False)
    assert not gemm.relu_in_quantize("GeluErf", True)
    M, K, N = 37, 32, 48
    x, w, sx, sw, b = _int8_operands(M, K, N)
    if qtype == "fp8":
        x, w, sw = x.float().to(torch.float8_e4m3fn), w.float().to(torch.float8_e4m3fn), sw[:1]
    kw = dict(qtype=qtype, x_scale=sx, w_scale=sw, out_dtype=torch.float16, y_scale=torch.tensor(0.03, device=DEV),
              q_scale=torch.tensor(0.02, device=DEV))
    folded = tma_gemm.gemm(x, w, b, "Relu", config=SMALL, **kw)
    separate = tma_gemm.gemm(x, w, b, "Relu", config=SMALL, relu_in_quantization=False, **kw)
    for f, s in zip(folded, separate):
        assert f.dtype == s.dtype and torch.equal(f.float(), s.float()) and (s.float() == 0).any()
