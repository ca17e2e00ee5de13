"""Progress bars of LLM work: drawn on stderr only when it is a terminal, never touching stdout.

A terminal is forced through rich's own switch, TTY_COMPATIBLE=1 (kiln.tools.progress.terminal_progress asks
rich whether stderr is one); pytest's captured stderr is not a terminal otherwise.
"""

import json
import os
import subprocess
import sys

import pytest

from kiln.cli import main
from kiln.llm.engine import LLM, load_model
from kiln.llm.sampling import SamplingParams


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")


def _generate_args(model, *extra):
    return ["llm", "generate", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos",
            "--device", "cpu", *extra]


def test_the_cli_draws_the_loading_bar_on_a_terminal_stderr_and_leaves_stdout_as_it_was(tiny_llama):
    def kiln(*args, tty):
        env = {k: v for k, v in os.environ.items() if k not in ("TTY_COMPATIBLE", "FORCE_COLOR")}
        if tty:
            env["TTY_COMPATIBLE"] = "1"
        p = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout, p.stderr

    out_tty, err_tty = kiln(*_generate_args(tiny_llama), tty=True)
    out_pipe, err_pipe = kiln(*_generate_args(tiny_llama), tty=False)
    assert out_tty == out_pipe and out_tty.strip()  # the generated text, alone
    # The bar's last frame: every tensor of the directory's safetensors file read
    assert "loading" in err_tty and "model.safetensors: " in err_tty and "21/21" in err_tty
    assert err_pipe == ""  # off a terminal, nothing at all


def test_json_output_draws_no_bar_even_on_a_terminal(tiny_llama, terminal, capsys):
    assert main(_generate_args(tiny_llama, "--json")) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["token_ids"]) == 4
    assert captured.err == ""


def test_generate_shows_finished_requests_and_the_output_rate(tiny_llama, terminal, capfd):
    llm = LLM(tiny_llama, device="cpu", progress=False)
    assert capfd.readouterr() == ("", "")
    outs = llm.generate([[1, 2, 3], [4, 5], [6]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    out, err = capfd.readouterr()
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    assert out == "" and "generate" in err and "3/3" in err and "9 tokens out" in err


def test_library_calls_with_progress_off_print_nothing(tiny_llama, terminal, capfd):
    llm = LLM(tiny_llama, device="cpu", progress=False)
    llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert capfd.readouterr() == ("", "")


def test_gguf_loading_bar_names_each_tensor_and_its_storage(tiny_llama, tmp_path, terminal, capfd):
    pytest.importorskip("gguf")
    from .test_gguf import write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama)
    capfd.readouterr()
    _, quiet, _, _ = load_model(path)  # a library call: progress off unless asked
    assert capfd.readouterr() == ("", "")
    _, tensors, _, _ = load_model(path, progress=True)
    err = capfd.readouterr().err
    assert tensors.keys() == quiet.keys()
    assert f"{len(tensors)}/{len(tensors)}" in err and "tiny.gguf: " in err and "(F32)" in err
