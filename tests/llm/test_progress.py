"""Progress bars of LLM work: drawn on stderr only when it is a terminal, never touching stdout.

A terminal is forced through rich's own switch, TTY_COMPATIBLE=1 (kiln.progress.terminal_progress asks
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


def test_llm_build_reports_each_calibration_pass_and_matrix(tiny_llama):
    from kiln.llm import engine_file

    from .test_engine_file import CALIB

    steps = []
    engine_file.prepare_model(tiny_llama, dtype="fp32", device="cpu", weights="w8a8", kv_cache_dtype="int8",
                              calib=CALIB, calib_tokens=256, on_step=steps.append)
    assert steps[0].startswith("calibrating w8a8: activations over ")
    quantized = [s for s in steps if s.startswith("quantized ")]
    assert quantized == [f"quantized layers.{n}.{k} to w8a8 ({4 * n + i + 1}/8)"
                         for n in range(2) for i, k in enumerate(("qkv", "o", "gate_up", "down"))]
    assert steps[-1].startswith("calibrating int8 KV scales over ")


def test_llm_build_and_engine_loading_draw_on_a_terminal_stderr_only(tiny_llama, tmp_path, monkeypatch, capsys):
    engine = tmp_path / "tiny.kiln"
    args = ["llm", "build", str(tiny_llama), f"--saveEngine={engine}", "--weights", "fp8", "--dtype", "fp32",
            "--device", "cpu"]
    assert main(args) == 0
    plain = capsys.readouterr()
    assert plain.err == ""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert main(args) == 0
    drawn = capsys.readouterr()
    assert drawn.out.split(" built in ")[0] == plain.out.split(" built in ")[0]  # the same report on stdout
    assert "loading" in drawn.err and "21/21" in drawn.err  # the model's tensors
    assert "kiln llm build" in drawn.err and "writing tiny.kiln" in drawn.err
    LLM(engine, device="cpu")  # the engine file: its steps, ending with the dequantized float copy
    err = capsys.readouterr().err
    assert "tiny.kiln: dequantizing 8 quantized matrices" in err
