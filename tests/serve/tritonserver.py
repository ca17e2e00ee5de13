"""Start the Triton Inference Server that PyPI's nvidia-pytriton wheel bundles, on loopback, for the tests.

The wheel ships tritonserver, the Python backend (libtriton_python.so) and one backend stub per Python
version; like pytriton itself, the test lays out a backend folder with the stub of the running Python. The
stub embeds libpython: the running interpreter's own (its LIBDIR first on LD_LIBRARY_PATH), so that torch and
Kiln import in the backend as they do here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import kiln


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def bundled_server() -> Path | None:
    spec = importlib.util.find_spec("pytriton") if installed("pytriton") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    def __init__(self, repo: Path, workdir: Path):
        root = bundled_server()
        backends = workdir / "backends" / "python"
        backends.mkdir(parents=True, exist_ok=True)
        for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy(root / "backends" / "python" / f, backends / f)
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        shutil.copy(root / "python_backend_stubs" / version / "triton_python_backend_stub", backends)
        self.http_port, self.grpc_port = free_port(), free_port()
        libs = root.parent.parent / "nvidia_pytriton.libs"
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [sysconfig.get_config_var("LIBDIR"), str(libs),
                                                        env.get("LD_LIBRARY_PATH")]))
        src = str(Path(kiln.__file__).resolve().parents[1])
        site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        env["PYTHONPATH"] = ":".join(dict.fromkeys([src, *site, *filter(None, [env.get("PYTHONPATH")])]))
        self.log = workdir / "tritonserver.log"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            [str(root / "bin" / "tritonserver"), f"--model-repository={repo}",
             f"--backend-directory={workdir / 'backends'}", "--http-address=127.0.0.1",
             "--grpc-address=127.0.0.1", f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
             "--allow-metrics=false", "--exit-on-error=false", "--exit-timeout-secs=3"],
            env=env, stdout=self._log_file, stderr=subprocess.STDOUT)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def wait_ready(self, client, models: list[str], timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if all(client.is_model_ready(m) for m in models):
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.3)
        raise RuntimeError(f"tritonserver not ready in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()
