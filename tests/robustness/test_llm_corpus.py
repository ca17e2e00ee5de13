"""The LLM command line's bad inputs (llm_corpus.py), each through the real CLI in its own forked process.

Same contract as test_corpus.py: a non-zero exit, no traceback, a message naming the file, field or flag at
fault, nothing left in the working folder and the corpus files unchanged. Plus the signed path working: an
engine built with `kiln llm build --sign` generates under `--verify-key` with its key.
"""

from __future__ import annotations

import time

import pytest

from kiln.errors import EngineFileError
from kiln.llm import engine_file as ef

from ..llm.tiny import make_tiny_llama
from .corpus import Case
from .llm_corpus import make_llm_corpus
from .test_corpus import _report, _snapshot, run_forked


@pytest.fixture(scope="module")
def llm_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-corpus")
    model = make_tiny_llama(root / "tiny")
    other = make_tiny_llama(root / "other", vocab=512)
    key, other_key = root / "deploy.key", root / "other.key"
    key.write_text("a" * 64 + "\n")
    other_key.write_text("b" * 64 + "\n")
    quiet = {"dtype": "fp32", "device": "cpu", "log": lambda *a: None}
    ef.build_llm_engine(model, root / "tiny.kiln", **quiet)
    ef.build_llm_engine(model, root / "signed.kiln", sign_key=key.read_bytes().strip(), **quiet)
    cases = make_llm_corpus(root, model, root / "tiny.kiln", root / "signed.kiln", key, other_key, other)
    return root, cases, key


def test_every_bad_llm_input_fails_cleanly(llm_corpus, tmp_path):
    root, cases, _ = llm_corpus
    before = _snapshot(root)
    start = time.perf_counter()
    results = run_forked(cases, tmp_path)
    print(f"\n{len(cases)} LLM cases in {time.perf_counter() - start:.1f} s")
    problems = _report(results)
    assert _snapshot(root) == before, "a case changed or added corpus files"
    assert not problems, f"{len(problems)} of {len(cases)} cases failed:\n" + "\n".join(problems)


def test_a_signed_llm_engine_runs_under_its_key(llm_corpus, tmp_path):
    root, _, key = llm_corpus
    ok = Case("llm-generate-signed", ["llm", "generate", str(root / "signed.kiln"), "--device=cpu",
                                      "--prompt-ids=1,5,6", "--max-tokens=2", "--json", f"--verify-key={key}"], ())
    inspect = Case("llm-inspect-signed", ["inspect", str(root / "signed.kiln"), f"--verifyKey={key}"], ())
    for case, code, text, _, _ in run_forked([ok, inspect], tmp_path):
        assert code == 0, f"{case.id}: {text[-2000:]}"
    assert ef.read_manifest(root / "signed.kiln", key.read_bytes().strip())["format"] == ef.FORMAT


def test_a_pinned_engine_swapped_after_the_check_is_refused_at_load(llm_corpus, tmp_path):
    root, _, key = llm_corpus
    path = tmp_path / "served.kiln"
    path.write_bytes((root / "signed.kiln").read_bytes())
    ef.require_signed(path, key.read_bytes().strip())
    path.write_bytes((root / "tiny.kiln").read_bytes())  # replaced by an unsigned engine between check and load
    with pytest.raises(EngineFileError, match="--verifyKey was given and it is not signed"):
        ef.load_llm_engine(path)
