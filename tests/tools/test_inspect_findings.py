"""kiln inspect describes a precision-search finding in the user's terms (quant.search.summary)."""

import numpy as np

from kiln.cli import main


def test_inspect_shows_the_precision_search(digits, tmp_path, capsys):
    # Calibration on images scaled to 2% of their range: the fully quantized engine misses the budget,
    # so the search keeps layers in float and records its steps.
    x = np.load(digits.ex.calib_path)["image"]
    np.savez(tmp_path / "narrow_calib.npz", image=(x * 0.02).astype(np.float32))
    engine = tmp_path / "searched.kiln"
    assert main(["build", f"--onnx={digits.ex.onnx_path}", "--int8", f"--calib={tmp_path / 'narrow_calib.npz'}",
                 "--accuracy-budget", "top1=0.5", f"--budgetData={digits.ex.data_path}", "--device=cpu",
                 "--minShapes=image:1x1x8x8", "--optShapes=image:32x1x8x8", "--maxShapes=image:360x1x8x8",
                 "--skipInference", f"--saveEngine={engine}"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(engine)]) == 0
    out = capsys.readouterr().out
    assert "precision search for top1 <= 0.5" in out
    assert "precision-search: " not in out  # not the generic key=value dump
    assert "result: kept in float: " in out
