"""The whole model zoo at FP16 on the GPU against the FP32 reference, at the tiny sizes: one test per model.
Run with the GPU suite whenever kernels or tactics change (a tactic that breaks a model shows up here)."""

import pytest

from bench import zoo
from bench.zoo_models import ZOO

from .test_zoo_cpu import KNOWN_FAILURES, prepared_tiny


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_model_matches_fp32_at_fp16_on_the_gpu(entry):
    if entry.name in KNOWN_FAILURES:
        pytest.skip(KNOWN_FAILURES[entry.name])
    prep, batch = prepared_tiny(entry)
    row = zoo.run_case(entry, prep, "fp16", batch, "cuda", timing=False, torch_compile=False)
    assert row.status == "ok", row  # within FP16's tolerance, or 1.5x eager PyTorch's own FP16 error
    # No silent layer-by-layer fallback: a layer that breaks capture costs every call its host time
    assert row.cuda_graph == "yes" or entry.name in RUNS_LAYER_BY_LAYER, row.cuda_graph


# Models whose engines have host layers between device layers (data-dependent shapes): no single graph.
RUNS_LAYER_BY_LAYER = {"nms_postprocess"}
