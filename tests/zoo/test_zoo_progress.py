"""bench/zoo.py's bar of finished cases: on a terminal's stderr only; the case lines and the table stay on stdout."""

import pytest

from bench import zoo

ARGS = ["--models", "kws_conv1d", "--size", "tiny", "--precisions", "fp32", "--device", "cpu", "--no-timing",
        "--no-torch-compile"]


@pytest.mark.parametrize("terminal", [True, False])
def test_zoo_bar_of_cases_on_a_terminal_stderr_and_nothing_of_it_on_stdout(tmp_path, monkeypatch, capsys, terminal):
    if terminal:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's switch: stderr counts as a terminal
    else:
        monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
        monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert zoo.main(["--out", str(tmp_path), *ARGS]) == 0
    out, err = capsys.readouterr()
    assert "kws_conv1d fp32 b1: ok" in out and "| kws_conv1d | fp32 | 1 |" in out
    assert "\x1b" not in out and "1/1" not in out  # no frame of the bar on stdout
    if terminal:
        assert "zoo" in err and "kws_conv1d fp32 b1: ok" in err and "1/1" in err
    else:
        assert "1/1" not in err and "kws_conv1d" not in err
