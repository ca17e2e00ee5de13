"""Run CLI cases, each in its own process, without paying torch's import for every one.

    python -P -m tests.robustness.forkrun CASES.json RESULTS.json

This process imports Kiln (and so torch) once, then forks one child per case;
the child changes into the case's folder, points stdout/stderr at its log
files and runs `kiln.cli.main(argv)` exactly as the `kiln` script does (an
exception that escapes is printed with its traceback, as Python would). A child
that crashes, is killed or hangs past the timeout is seen as such by the parent:
the isolation of a fresh process per case, at a fork's cost. Run with -P so the
working folder is not on the import path, as for the installed `kiln` script.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback


def _child(case: dict) -> None:
    try:
        os.chdir(case["cwd"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["kiln", *case["argv"]]
        from kiln.cli import main

        code = main(case["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what Python prints for an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code or 0)


def run(cases: list[dict], workers: int, timeout_s: float) -> dict[str, dict]:
    import kiln.cli  # noqa: F401 - imported once, before the forks
    import torch._dynamo  # noqa: F401 - the build's memory estimate on meta tensors imports it on first use

    queue, running, results = list(cases), {}, {}
    while queue or running:
        while queue and len(running) < workers:
            case = queue.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(case)
            running[pid] = (case, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (case, start) in list(running.items()):
                if now - start > timeout_s:
                    os.kill(p, signal.SIGKILL)
                    results[case["id"]] = {"timeout": True}
            time.sleep(0.01)
            continue
        case, start = running.pop(pid)
        if case["id"] not in results:
            code = os.waitstatus_to_exitcode(status)
            results[case["id"]] = {"returncode": code, "seconds": time.monotonic() - start}
    return results


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("COLUMNS", "200")
    results = run(spec["cases"], spec.get("workers", 2), spec.get("timeout_s", 180))
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
