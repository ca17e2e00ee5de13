"""The whole model zoo at BF16, INT8 and FP8 on the GPU, at the tiny sizes: one test per model and precision.

BF16 rows pass within BF16's tolerance or 1.5x eager PyTorch's own BF16 error; INT8/FP8 rows within the 8-bit
tolerance or 1.5x a fake-quantized PyTorch reference's error at the same type (bench/zoo.py says how each row
is judged). The FP16 rows are tests/zoo/test_zoo_gpu.py's.
"""

import pytest

from bench import zoo
from bench.zoo_models import ZOO

from .test_zoo_cpu import KNOWN_FAILURES, prepared_tiny
from .test_zoo_gpu import RUNS_LAYER_BY_LAYER


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("precision", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_model_matches_its_reference_at_bf16_and_8bit_on_the_gpu(entry, precision):
    if entry.name in KNOWN_FAILURES:
        pytest.skip(KNOWN_FAILURES[entry.name])
    prep, batch = prepared_tiny(entry)
    row = zoo.run_case(entry, prep, precision, batch, "cuda", timing=False, torch_compile=False)
    assert row.status.startswith("ok"), row
    assert row.cuda_graph == "yes" or entry.name in RUNS_LAYER_BY_LAYER, row.cuda_graph
