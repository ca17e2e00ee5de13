"""Every bad input of the corpus (corpus.py), each through the real CLI in its own process.

For every case: a non-zero exit, no traceback, a message naming the file, node, input, axis, flag or field
at fault, and no file left behind (the case's working folder and the corpus files are as they were). The
cases run two at a time (CI has two cores); each is a fresh `python -P -m kiln` process, as the installed
`kiln` script runs (-P: the current directory is not on the import path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kiln
from kiln.engine import serialize

from ..models import mlp
from .corpus import Case, make_corpus

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
CASE_TIMEOUT_S = 180


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), COLUMNS="200",
                PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")


def _prepare(case: Case, work: Path) -> Path:
    cwd = work / case.id
    cwd.mkdir()
    (cwd / "cwd_model.py").write_text("raise SystemExit('cwd_model.py was imported from the working folder')\n")
    return cwd


def _problems(case: Case, returncode, text: str, left: list[str]) -> list[str]:
    why = []
    if returncode is None:
        return [f"no answer within {CASE_TIMEOUT_S} s"]
    if returncode == 0:
        why.append("exit status 0")
    if returncode < 0:
        why.append(f"killed by signal {-returncode}")
    if "Traceback" in text:
        why.append("a traceback")
    if not any(n in text for n in case.names):
        why.append(f"no mention of any of {list(case.names)}")
    if "cwd_model.py was imported" in text:
        why.append("imported a module from the working folder")
    if left:
        why.append(f"left {left} behind")
    return why


def run_forked(cases: list[Case], work: Path) -> list[tuple[Case, int | None, str, list[str], float]]:
    """Every case in its own forked process (forkrun.py): a fresh process per case at a fork's cost."""
    logs = work / "logs"
    logs.mkdir()
    spec = {"workers": WORKERS, "timeout_s": CASE_TIMEOUT_S, "cases": []}
    for c in cases:
        spec["cases"].append({"id": c.id, "argv": c.argv, "cwd": str(_prepare(c, work)),
                              "stdout": str(logs / f"{c.id}.out"), "stderr": str(logs / f"{c.id}.err")})
    (logs / "cases.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, "-P", "-m", "tests.robustness.forkrun", str(logs / "cases.json"),
                        str(logs / "results.json")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=CASE_TIMEOUT_S * len(cases))
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((logs / "results.json").read_text())
    out = []
    for c in cases:
        r = results[c.id]
        text = (logs / f"{c.id}.out").read_text(errors="replace") + (logs / f"{c.id}.err").read_text(errors="replace")
        left = sorted({q.name for q in (work / c.id).iterdir()} - {"cwd_model.py"})
        out.append((c, None if r.get("timeout") else r["returncode"], text, left, r.get("seconds", 0.0)))
    return out


def run_process(case: Case, work: Path) -> tuple[Case, int | None, str, list[str], float]:
    """One case as the installed `kiln` script runs: a fresh interpreter (-P: no working folder on the path)."""
    cwd = _prepare(case, work)
    start = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-P", "-m", "kiln", *case.argv], cwd=cwd, env=_env(),
                           capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        code, text = None, ""
    left = sorted({q.name for q in cwd.iterdir()} - {"cwd_model.py"})
    return case, code, text, left, time.perf_counter() - start


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    good_onnx = root / "good.onnx"
    good_onnx.write_bytes(mlp().SerializeToString())
    engine = kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})],
                                               device="cpu", progress=False))
    good_engine = root / "good.kiln"
    engine.save(good_engine)
    key, other_key = root / "deploy.key", root / "other.key"
    key.write_text("a" * 64 + "\n")
    other_key.write_text("b" * 64 + "\n")
    serialize.save(engine, root / "signed.kiln", sign_key=key.read_bytes().strip())
    cases = make_corpus(root, good_onnx, good_engine, root / "signed.kiln", key, other_key)
    return root, cases


def _report(results) -> list[str]:
    problems = []
    for case, code, text, left, _ in results:
        why = _problems(case, code, text, left)
        if why:
            problems.append(f"{case.id} (kiln {' '.join(case.argv)}): {', '.join(why)}\n    " + text.strip()[-1500:])
    return problems


def test_every_bad_input_fails_cleanly(corpus, tmp_path):
    root, cases = corpus
    assert len(cases) >= 200
    files_before = _snapshot(root)
    start = time.perf_counter()
    results = run_forked(cases, tmp_path)
    elapsed = time.perf_counter() - start
    problems = _report(results)
    assert _snapshot(root) == files_before, "a case changed or added corpus files"
    assert not list(root.rglob("pwned")) and not list(tmp_path.rglob("pwned"))
    print(f"\n{len(cases)} cases in {elapsed:.1f} s, {WORKERS} at a time "
          f"(slowest: {max(r[4] for r in results):.1f} s)")
    assert not problems, f"{len(problems)} of {len(cases)} cases failed:\n" + "\n".join(problems)


# A few cases as fresh interpreters, as the installed script runs them: the entry point and its imports.
SAMPLE = ("build-missing_initializer", "run-engine-no_checksums", "calib-not_a_zip", "flag-bench-torch-cwd-module")


def test_a_sample_in_fresh_interpreters(corpus, tmp_path):
    root, cases = corpus
    sample = [c for c in cases if c.id in SAMPLE]
    assert len(sample) == len(SAMPLE)
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda c: run_process(c, tmp_path), sample))
    problems = _report(results)
    assert not problems, "\n".join(problems)
