"""`kiln llm serve --api-servers N`: N HTTP processes on one port in front of the one engine process, as vLLM's
`--api-server-count`.

One Python process does the HTTP work of every stream (parsing, admission, SSE writes, detokenizing each
step's tokens, the latency histograms) on one interpreter lock; past a few hundred streams of a fast model it
cannot keep the engine's batch full, and the engine process waits for it. N processes share that work; the
engine process still schedules every process's requests together in one batch.

    listen_sockets   N listening sockets bound to the same address with SO_REUSEPORT: the kernel spreads
                     new connections over them by a hash of the client's address and port (where the option
                     is missing, one socket shared by all, each process taking what it accepts)
    ApiServerPool    in the first HTTP process (the one `kiln llm serve` runs): starts the other N-1 while the
                     engine loads, each with its socket, its own pair of pipes to the engine process
                     (engine_process.py) and a control socket, over which it gets its settings (the API key
                     among them, so never in a command line), says when it listens, and sees the first go away;
                     passes SIGTERM on and waits for them to drain before the engine stops
    main             one of the other HTTP processes (`python -m kiln.serve.api_servers FD`)

Admission is bounded globally: each process refuses past max_num_seqs + max_waiting of its own requests, and
the engine process refuses past the same bound of all processes' requests together (both 429). Metrics: every
process's histograms and counters go to prometheus_client's multiprocess files in a temporary folder, so
/metrics of any process sums all of them (kiln/serve/metrics.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from ..errors import ConfigError, KilnError


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on host:port (port 0: a free one, the same for all)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: not an address of this machine ({e}).") from None
    shared = not hasattr(socket, "SO_REUSEPORT")
    out: list[socket.socket] = []
    try:
        for _ in range(1 if shared else count):
            s = socket.socket(family, kind, proto)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if not shared:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr if not out[1:] else out[0].getsockname())
            s.listen(2048)
    except OSError as e:
        for s in out:
            s.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e}).") from None
    return out * count if shared else out


METRICS_PREFIX = "kiln-serve-metrics-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def metrics_folder() -> str:
    """A new folder for the multiprocess metric files, named after this process. A server that was killed
    (SIGKILL, a crash) could not remove its folder: this user's folders whose process is gone go first."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        pid = name[len(METRICS_PREFIX):].split("-")[0]
        path = os.path.join(tmp, name)
        if (name.startswith(METRICS_PREFIX) and pid.isdigit() and not _alive(int(pid)) and os.path.isdir(path)
                and os.stat(path).st_uid == os.getuid()):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")


class ApiServerPool:
    """The other HTTP processes, seen from the first."""

    def __init__(self, count: int, host: str, port: int):
        self.count = count
        self.sockets = listen_sockets(host, port, count)
        self.host, self.port = host, self.sockets[0].getsockname()[1]
        self.metrics_dir = metrics_folder()
        self.procs: list[subprocess.Popen] = []
        self._control: list[socket.socket] = []

    def spawn(self, channels: list[tuple[int, int]], settings: dict) -> None:
        """Starts one HTTP process per engine channel (to_engine, from_engine), process 1, 2, ... in order.
        settings: OpenAIServer's (model_name, api_key, max_waiting, drain_timeout) and `cpus` (None: anywhere)."""
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        for index, (to_engine, from_engine) in enumerate(channels, start=1):
            ours, theirs = socket.socketpair()
            sock = self.sockets[index]
            config = {**settings, "index": index, "host": self.host, "socket": sock.fileno(),
                      "to_engine": to_engine, "from_engine": from_engine, "metrics_dir": self.metrics_dir}
            fds = (sock.fileno(), to_engine, from_engine, theirs.fileno())
            self.procs.append(subprocess.Popen([sys.executable, "-m", "kiln.serve.api_servers", str(theirs.fileno())],
                                               pass_fds=fds, env=env))
            theirs.close()
            ours.sendall(json.dumps(config).encode() + b"\n")
            self._control.append(ours)
        for s in self.sockets[1:]:
            if s is not self.sockets[0]:
                s.close()  # theirs now

    async def started(self) -> None:
        """Returns once every other process listens; raises if one exited first."""
        loop = asyncio.get_running_loop()
        for index, (proc, control) in enumerate(zip(self.procs, self._control), start=1):
            control.setblocking(False)
            said = await loop.sock_recv(control, 64)
            if not said.startswith(b"ready"):
                try:
                    status = proc.wait(5)
                except subprocess.TimeoutExpired:
                    status = None
                raise KilnError(f"kiln llm serve --api-servers {self.count}: HTTP process {index} exited (status "
                                f"{status}) before it listened; its error is printed above.")

    def terminate(self) -> None:
        """SIGTERM to the others: each stops admitting and drains, as this one does."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float) -> bool:
        """Waits for the others to exit (up to timeout s; then they are killed). True if all exited."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(p.poll() is None for p in self.procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        late = [p for p in self.procs if p.poll() is None]
        for p in late:
            p.kill()
            p.wait()
        return not late

    def close(self) -> None:
        """Kills what still runs (the first process failed), and removes the metric files."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in {*self._control, self.sockets[0]}:
            s.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


class _Parent:
    """The first HTTP process, seen from another: told when this one listens; its exit stops this one."""

    def __init__(self, control: socket.socket):
        self.control = control

    def listening(self, stop) -> None:
        self.control.sendall(b"ready\n")
        self.control.setblocking(False)
        loop = asyncio.get_running_loop()

        def readable():
            try:
                data = self.control.recv(64)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the first process is gone (killed): drain and exit, as on SIGTERM
                loop.remove_reader(self.control)
                stop()

        loop.add_reader(self.control, readable)


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def main(argv: list[str]) -> int:
    from . import cpu_placement
    from .engine_process import EngineChannel
    from .llm_cli import run_event_loop
    from .openai_server import OpenAIServer, run_server

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the server's own handler (Ctrl-C reaches the group)
    control = socket.socket(fileno=int(argv[0]))
    line = _read_line(control)
    if not line:
        return 0  # the first process went away before sending the settings
    config = json.loads(line)
    engine = EngineChannel(config["to_engine"], config["from_engine"])
    try:
        engine.connect()
    except KilnError:
        return 2  # the first process got the same error and prints it
    if config.get("cpus"):
        cpu_placement.pin(set(config["cpus"]))
    server = OpenAIServer(engine, model_name=config["model_name"], api_key=config["api_key"],
                          max_waiting=config["max_waiting"], drain_timeout=config["drain_timeout"],
                          metrics_dir=config["metrics_dir"], server_index=config["index"])
    sock = socket.socket(fileno=config["socket"])
    gc.collect()
    gc.freeze()  # as the first process: startup's objects out of the collector's sight
    try:
        run_event_loop(run_server(server, config["host"], sock=sock, parent=_Parent(control)))
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
