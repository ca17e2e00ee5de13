"""Library tactics' CPU-checkable parts (the tactics themselves need CUDA: tests/gpu)."""

import torch

from kiln.tactics.library import storage_order


def test_storage_order_undoes_a_permutation_of_leading_axes():
    x = torch.randn(3, 5, 7)
    for view in (x.transpose(0, 1), x.permute(1, 0, 2)):
        base, perm = storage_order(view)
        assert base.is_contiguous() and base.data_ptr() == x.data_ptr()
        assert torch.equal(base.permute(perm), view)


def test_storage_order_leaves_other_layouts_alone():
    x = torch.randn(3, 5, 7)
    assert storage_order(x)[1] is None  # already contiguous
    assert storage_order(x.transpose(1, 2))[1] is None  # the GEMM axis itself moved
    assert storage_order(x[:, ::2])[1] is None  # strided, not a permutation
