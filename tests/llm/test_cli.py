"""`kiln llm generate|bench` in process: output, JSON, bad input as a clear error and a non-zero exit."""

import json

import pytest

from kiln.cli import main


def test_generate_json_and_stream(tiny_llama, capsys):
    assert main(["llm", "generate", str(tiny_llama), "--prompt", "Hello world", "--max-tokens", "5",
                 "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    assert main(["llm", "generate", str(tiny_llama), "--prompt", "Hello world", "--max-tokens", "5",
                 "--ignore-eos"]) == 0
    assert capsys.readouterr().out == out["text"] + "\n"


@pytest.mark.parametrize("args, words", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt-ids", "1,2,5000"], "outside the vocabulary"),
    (["--prompt", "hi", "--sampling", "beam_width=4"], "unknown sampling parameter"),
    (["--prompt", "hello " * 300, "--max-model-len", "64"], "max_model_len"),
    (["--prompt", "hi", "--kv-cache-dtype", "fp4"], "kv_cache_dtype 'fp4'"),
])
def test_bad_input_exits_nonzero(tiny_llama, capsys, args, words):
    assert main(["llm", "generate", str(tiny_llama), *args]) == 2
    err = capsys.readouterr().err
    assert words in " ".join(err.split()) and "Traceback" not in err


def test_bench_json(tiny_llama, capsys):
    assert main(["llm", "bench", str(tiny_llama), "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                 "--num-prompts", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    k = r["kiln"]
    assert k["requests"] == 3 and k["output_tokens"] == 12 and k["output_tok_s"] > 0
    assert k["ttft_ms_p50"] <= k["e2e_ms_p50"] and k["tpot_ms_p50"] > 0


def test_bench_time_limit_and_static_cache_baseline(tiny_llama, capsys):
    assert main(["llm", "bench", str(tiny_llama), "--input-len", "8", "--output-len", "50", "--batch-size", "2",
                 "--time-limit", "0", "--baseline", "hf-compile", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kiln"]["cut"] and r["kiln"]["finished"] == 0
    assert r["hf"]["mode"] == "static cache, torch.compile" and r["hf"]["output_tokens"] == 100
    assert main(["llm", "bench", str(tiny_llama), "--input-len", "8", "--output-len", "3", "--time-limit", "60"]) == 0
    assert "cut" not in capsys.readouterr().out
