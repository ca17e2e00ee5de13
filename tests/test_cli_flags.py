"""One flag spelling across Kiln's commands (kiln/cli_flags.py): trtexec's camelCase is what usage and --help show,
and the kebab-case spelling parses to the same value, in every command."""

import argparse

import pytest

from kiln.cli import _parser
from kiln.cli_flags import camel_case, camel_case_flags

# command, its positional arguments, then (kebab-case flag, value) pairs; None: a switch
CASES = [
    (["build"], [("--accuracy-budget", "top1=0.5")]),
    (["run"], [("--accuracy-budget", "top1=1"), ("--verify-key", "k.key")]),
    (["check", "m.onnx"], [("--upgrade-opset", "17")]),
    (["inspect", "e.kiln"], [("--no-run", None), ("--device-only", None), ("--verify-key", "k.key")]),
    (["compare", "m.onnx", "e.kiln"], [("--reference-runner", "onnxruntime"), ("--save-inputs", "i.json"),
                                       ("--save-outputs", "o.json"), ("--accept-vacuous", None),
                                       ("--no-histogram", None)]),
    (["verify", "e.kiln", "--data", "d.npz"], [("--verify-key", "k.key")]),
    (["bench", "e.kiln"], [("--verify-key", "k.key")]),
    (["report", "e.kiln"], [("--latency-target", "2.5"), ("--latency-stat", "p99"), ("--no-bench", None)]),
    (["export", "triton", "e.kiln", "--repo", "r"], [("--max-batch", "8"), ("--verify-key", "k.key")]),
    (["serve", "e.kiln"], [("--max-batch", "8"), ("--ray-address", "auto")]),
    (["llm", "build", "m.gguf"], [("--save-engine", "e.kiln"), ("--kv-cache-dtype", "fp8"), ("--max-seq-len", "256"),
                                  ("--tensor-parallel-size", "2")]),
    (["llm", "generate", "m.gguf"], [("--max-tokens", "4"), ("--top-p", "0.9"), ("--no-prefix-caching", None),
                                     ("--prompt-ids", "1,2")]),
    (["llm", "bench", "m.gguf"], [("--input-len", "8"), ("--output-len", "8"), ("--num-prompts", "2")]),
    (["llm", "perplexity", "m.gguf", "--text", "t.txt"], [("--max-tokens", "64"), ("--kv-cache-dtype", "int8")]),
    (["llm", "serve", "m.gguf"], [("--max-model-len", "512"), ("--served-model-name", "m"), ("--api-key", "k")]),
]


def _argv(command, pairs, spell):
    out = list(command)
    for flag, value in pairs:
        out += [spell(flag)] + ([value] if value is not None else [])
    return out


@pytest.mark.parametrize("command,pairs", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_both_spellings_parse_to_the_same_arguments(command, pairs):
    parser = _parser()
    kebab = vars(parser.parse_args(_argv(command, pairs, lambda f: f)))
    camel = vars(parser.parse_args(_argv(command, pairs, camel_case)))
    assert camel == kebab
    assert all(kebab[a.dest] != a.default for a in _actions(parser, command) if set(a.option_strings) & {
        f for f, _ in pairs})  # each flag did set its value


def _actions(parser, command):
    for word in command:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return parser._actions


def test_help_and_usage_show_the_camel_case_spelling_first():
    parser = _parser()
    report = _actions(parser, ["report"])
    (target,) = [a for a in report if "--latency-target" in a.option_strings]
    assert target.option_strings == ["--latencyTarget", "--latency-target"]
    (tp,) = [a for a in _actions(parser, ["llm", "build"]) if "--tp" in a.option_strings]
    assert tp.option_strings == ["--tp", "--tensorParallelSize", "--tensor-parallel-size"]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    usage = sub.choices["report"].format_usage()
    assert "--latencyTarget" in usage and "--latency-target" not in usage and "--noBench" in usage


def test_a_camel_case_name_another_flag_holds_is_left_to_it():
    """A parser that declares --loadInputs and --load-inputs as two flags keeps them apart (and says so); Kiln's
    own commands declare no such pair (compare's --loadInputs reads Polygraphy's JSON too, under both spellings)."""
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--loadInputs")
    p.add_argument("--load-inputs", dest="load_inputs")
    p.add_argument("--max-tokens", type=int)
    assert camel_case_flags(p) == [("t", "--load-inputs")]
    a = p.parse_args(["--loadInputs", "x.npz", "--load-inputs", "y.json", "--maxTokens", "3"])
    assert (a.loadInputs, a.load_inputs, a.max_tokens) == ("x.npz", "y.json", 3)
    assert camel_case("--max-num-batched-tokens") == "--maxNumBatchedTokens" and camel_case("--fp16") == "--fp16"
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    compare = sub.choices["compare"]
    assert compare._option_string_actions["--load-inputs"] is compare._option_string_actions["--loadInputs"]
