import pytest
import torch

from kiln.ir.graph import Node
from kiln.kernels import gather_rows
from kiln.ops.indexing import gather

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, cols, index_shape, dtype", [
    (50, 24, (3, 7), torch.float16),  # an embedding table read by [batch, seq] ids
    (9, 300, (5,), torch.float32),  # columns over more than one block
    (17, 8, (2, 2, 3), torch.int64),
])
def test_gather_rows_matches_the_reference(rows, cols, index_shape, dtype):
    g = torch.Generator().manual_seed(0)
    table = (torch.randn(rows, cols, generator=g) * 10).to(dtype).to(DEV)
    idx = torch.randint(-rows, rows, index_shape, generator=g).to(DEV)  # negatives count from the end
    want = gather(Node("Gather", ["t", "i"], ["y"], {"axis": 0}), table, idx)
    got = gather_rows.gather_rows(table, idx)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gather_rows_takes_only_a_2d_table_with_unit_stride_rows_and_integer_indices():
    t, i = torch.zeros(4, 8), torch.zeros(3, dtype=torch.int64)
    assert gather_rows.supports(t, i)
    assert not gather_rows.supports(t.t(), i) and not gather_rows.supports(torch.zeros(2, 4, 8), i)
    assert not gather_rows.supports(t, i.float()) and not gather_rows.supports(t, i[:0])
