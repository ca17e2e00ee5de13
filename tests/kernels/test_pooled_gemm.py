import pytest
import torch

from kiln.kernels import pooled_gemm, workspace

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


SMALL = pooled_gemm.GemvConfig(8, 16)  # several output tiles and channel blocks, ragged ends


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("hw", [(3, 5), (9, 9)])  # 81 pixels: two pixel loads of 64
def test_matches_reference(channels_last, hw):
    x = _rand(2, 37, *hw, seed=1)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = _rand(37, 21, seed=2), _rand(21, seed=3)
    y = poisoned(lambda: pooled_gemm.pooled_gemv(x, w, b, config=SMALL))
    assert y.shape == (2, 21) and torch.isfinite(y).all()
    torch.testing.assert_close(y, pooled_gemm.reference(x, w, b), atol=1e-4, rtol=1e-4)


def test_activation_without_bias_and_fp16():
    x, w = _rand(1, 40, 7, 7, seed=4, dtype=torch.float16), _rand(40, 19, seed=5, dtype=torch.float16)
    y = pooled_gemm.pooled_gemv(x, w, None, "LeakyRelu", [0.2], config=SMALL)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, pooled_gemm.reference(x, w, None, "LeakyRelu", [0.2]), atol=2e-3, rtol=2e-3)


def test_fp16_operands_can_write_an_fp32_output():
    """A model's FP32 output, written from the FP32 sums: no cast kernel after the engine's last layer."""
    x, w, b = _rand(2, 40, 5, 5, seed=4, dtype=torch.float16), _rand(40, 19, seed=5, dtype=torch.float16), \
        _rand(19, seed=6, dtype=torch.float16)
    y = poisoned(lambda: pooled_gemm.pooled_gemv(x, w, b, "Relu", config=SMALL, out_dtype=torch.float32))
    assert y.dtype == torch.float32
    want = torch.relu(x.float().mean((2, 3)) @ w.float() + b.float())
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)


def test_the_workspace_is_zero_again_for_the_next_call():
    """The last channel block of each output tile takes the sum and zeroes it and the tile's counter: a second
    call (as a CUDA graph replays it) starts from zeros and gives the same result."""
    x, w, b = _rand(3, 33, 4, 4, seed=6), _rand(33, 10, seed=7), _rand(10, seed=8)
    first = pooled_gemm.pooled_gemv(x, w, b, "Relu", config=SMALL)
    total, counters = workspace.zeroed_workspace(x.device, 1, 1)
    assert int(total.count_nonzero()) == 0 and int(counters.count_nonzero()) == 0
    torch.testing.assert_close(pooled_gemm.pooled_gemv(x, w, b, "Relu", config=SMALL), first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first, pooled_gemm.reference(x, w, b, "Relu"), atol=1e-4, rtol=1e-4)


def test_supports_small_batches_of_matching_operands_only():
    x, w, b = torch.empty(1, 8, 2, 2), torch.empty(8, 4), torch.empty(4)
    assert pooled_gemm.supports(x, w, b, "Relu")
    assert not pooled_gemm.supports(torch.empty(pooled_gemm.MAX_BATCH + 1, 8, 2, 2), w, b)
    assert not pooled_gemm.supports(x, torch.empty(9, 4), b)  # channels disagree
    assert not pooled_gemm.supports(x, w.half(), b)
    assert not pooled_gemm.supports(x, w, b, "Softplus")  # not an epilogue activation


def test_tactic_names_and_level():
    from kiln.ir.graph import Node
    from kiln.tactics import candidates, load_all

    load_all()
    tactics = candidates(Node("PooledGemm", ["x", "w", "b"], ["y"], {}, domain="kiln"))
    assert "mean_then_cublaslt" in {t.name for t in tactics}
    triton = [t for t in tactics if t.name.startswith("triton_")]
    assert [t.name for t in triton] == [f"triton_pooled_gemv_{c.name}" for c in pooled_gemm.CONFIGS]
    assert all(t.level == 3 for t in triton)
