import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run through Triton's interpreter (set before any kernel is defined).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-check on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
