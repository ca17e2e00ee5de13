"""kiln build --accuracyBudget: one progress display for the whole search, findings in the user's terms."""

import numpy as np

from kiln.cli import main


def test_search_shows_one_progress_and_says_what_it_kept_in_float(digits, tmp_path, capsys):
    # Calibration on images scaled to 2% of their range: INT8 scales clip real inputs, so the fully quantized
    # engine misses the budget and the search must keep layers in float.
    x = np.load(digits.ex.calib_path)["image"]
    np.savez(tmp_path / "narrow_calib.npz", image=(x * 0.02).astype(np.float32))
    rc = main(["build", f"--onnx={digits.ex.onnx_path}", "--int8", f"--calib={tmp_path / 'narrow_calib.npz'}",
               "--accuracy-budget", "top1=0.5", f"--budgetData={digits.ex.data_path}", "--device=cpu",
               "--minShapes=image:1x1x8x8", "--optShapes=image:32x1x8x8", "--maxShapes=image:360x1x8x8",
               "--skipInference"])
    assert rc == 0
    cap = capsys.readouterr()
    out, err = cap.out, cap.err
    assert "--layerPrecisions" not in out + err  # the user never passed it
    progress = [line for line in err.splitlines() if line.startswith("kiln build [")]
    assert progress and all("precision search, engine" in line for line in progress)  # no inner build's steps
    assert "loading model" not in err and "pass: " not in err
    assert "precision search for top1 <= 0.5" in out
    assert "every quantizable layer INT8: top1" in out and "over budget" in out
    assert "within budget" in out and "result: kept in float: " in out
    assert "pinned in float by the --accuracyBudget search" in out and "quantized alone it costs top1" in out
