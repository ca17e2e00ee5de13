"""kiln.kernels.argmax (each row's first maximal column in one launch over the GPU) against torch.argmax: tiny
vocabularies under TRITON_INTERPRET=1 without a GPU (several chunks a row, ties, NaN, -inf rows, a ragged last
chunk), Llama-3's vocabulary on the GPU inside a CUDA graph replayed twice (the counters reset themselves)."""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import argmax as am  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch(dtype, monkeypatch):
    monkeypatch.setattr(am, "BLOCK", 64)  # several chunks a row at a tiny vocabulary
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g)
    x[1, 17] = x[1, 250] = x[1].max() + 1  # a tie across chunks: the first column wins
    x[2, 70] = x[2, 71] = x[2].max() + 1  # a tie in one chunk
    x[3, 200] = float("nan")  # NaN above every number
    x[3, 5] = float("inf")
    x[4] = float("-inf")  # nothing above -inf: column 0
    x[5, 299] = x[5].max() + 1  # in the ragged last chunk
    x = x.to(DEV, dtype)
    assert torch.equal(am.argmax_rows(x), torch.argmax(x, dim=-1))
    assert not am._counters(torch.device(DEV)).any()  # every row's counter reset for the next launch


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_vocabulary_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 128256, device="cuda", generator=g)
    out = am.argmax_rows(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = am.argmax_rows(x)
    for _ in range(2):
        x.copy_(torch.randn(8, 128256, device="cuda", generator=g))
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
