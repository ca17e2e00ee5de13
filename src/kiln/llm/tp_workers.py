"""The processes of a tensor-parallel engine: rank 0 is the caller's process, ranks 1..N-1 are started here.

Workers are fresh interpreters (running `kiln.llm.tp_workers.main`), not multiprocessing children: nothing of the
caller's main script runs again in them, so `LLM(..., tensor_parallel_size=N)` needs no `if __name__ ==
"__main__"` guard. Each connects back to rank 0 over a local socket (127.0.0.1, an HMAC handshake with a key
passed in the environment). The socket carries raw bytes only (JSON and int64 arrays; weights given in memory go
through a safetensors file), never pickled objects.

Rank 0 keeps the scheduler, the block manager and the sampler. Each step it sends the step's inputs (token ids,
positions, slots, block tables, ...; `StepInputs`) to every worker, then all ranks run the model: the
all-reduces and the LM head's all-gather go over torch.distributed (NCCL on CUDA, gloo on the CPU). A worker
waits for the next step on its socket, not in a collective, so an idle engine can stay idle.

Start-up, in order: each worker loads the model and keeps its shard (a .kiln engine only if its member digests
are those rank 0 checked when it loaded the file, signature included under --verifyKey: a file replaced or
modified since is refused before its weights are read), then reports how many KV blocks fit beside it; rank 0
picks the smallest count and sends it; all ranks join the process group and build their runners (CUDA-graph
capture included: collective, so on every rank together). A worker that fails reports its error and
exits; rank 0 raises it (a KilnError stays a KilnError). `shutdown()` stops and reaps every worker.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from multiprocessing import connection

import numpy as np
import torch

from kiln import errors
from kiln.llm.runner import StepInputs

STOP = b"stop"
_HEADER = 8  # int64 words before a step's arrays


def encode_step(x: StepInputs) -> bytes:
    n_seq, width = len(x.seq_lens), len(x.tables[0]) if x.tables else 0
    head = [len(x.ids), n_seq, width, len(x.sample_rows), x.max_query_len, int(x.decode_only), 0, 0]
    flat = [t for row in x.tables for t in row]
    parts = head + x.ids + x.positions + x.slots + x.starts + x.seq_lens + flat + x.sample_rows
    return np.asarray(parts, dtype=np.int64).tobytes()


def decode_step(data: bytes) -> StepInputs:
    a = np.frombuffer(data, dtype=np.int64)
    n_tok, n_seq, width, n_sample, max_q, decode_only = (int(v) for v in a[:6])
    pos = _HEADER

    def take(n):
        nonlocal pos
        out = a[pos:pos + n].tolist()
        pos += n
        return out

    ids, positions, slots = take(n_tok), take(n_tok), take(n_tok)
    starts, seq_lens = take(n_seq + 1), take(n_seq)
    flat = take(n_seq * width)
    tables = [flat[i * width:(i + 1) * width] for i in range(n_seq)]
    return StepInputs(ids, positions, slots, starts, seq_lens, tables, take(n_sample), max_q, bool(decode_only))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_devices(device: torch.device, world_size: int) -> list[str]:
    """One device per rank: cuda:K..cuda:K+N-1 from the engine's cuda:K, or the CPU for all."""
    if device.type != "cuda":
        return ["cpu"] * world_size
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + world_size > count:
        raise errors.ConfigError(f"tensor_parallel_size = {world_size} from {device} needs GPUs {first}.."
                                 f"{first + world_size - 1}; this machine has {count}.")
    return [f"cuda:{first + r}" for r in range(world_size)]


def init_group(rank: int, world_size: int, init_method: str, device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise errors.ConfigError("a torch.distributed process group already exists in this process; a "
                                 "tensor-parallel engine starts its own (one such engine per process).")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kw)


def _send(conn, obj: dict) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _error_message(e: BaseException) -> dict:
    return {"status": "error", "type": type(e).__name__, "message": str(e),
            "kiln": isinstance(e, errors.KilnError), "traceback": traceback.format_exc(limit=8)}


def _tensors_to_json(scales):
    return None if scales is None else [[k.tolist(), v.tolist()] for k, v in scales]


def _tensors_from_json(scales):
    if scales is None:
        return None
    return [(torch.tensor(k, dtype=torch.float32), torch.tensor(v, dtype=torch.float32)) for k, v in scales]


class LazySafetensors(Mapping):
    """transformers-named tensors of an HF directory, each read from its safetensors file when asked for: a
    worker cuts its shard from one tensor at a time instead of holding the whole checkpoint in host memory
    (rank 0 has already checked the directory's names and shapes)."""

    def __init__(self, directory):
        from pathlib import Path

        from safetensors import safe_open

        from kiln.llm.loader import safetensors_files

        self._files = {}
        for f in safetensors_files(Path(directory)):
            with safe_open(str(f), framework="pt") as h:
                self._files.update({name: str(f) for name in h.keys()})  # noqa: SIM118 - a safe_open handle, not a dict

    def __getitem__(self, name):
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self):
        return len(self._files)


def engine_digests(source) -> dict | None:
    """For a .kiln engine: the member digests rank 0 checked (its signature too, under --verifyKey), which every
    worker's read of the file must find; None for other sources (an HF directory or a GGUF file)."""
    from pathlib import Path

    if source is None or Path(source).suffix != ".kiln":
        return None
    from kiln.llm.engine_file import checked_digests

    return checked_digests(source)


def _load_source(rank: int, source: str, engine_weights: bool, digests: dict | None):
    """(hf_config, tensors, quantized weights) of the model rank 0 loaded from `source`. digests (a .kiln engine):
    what rank 0 checked; a file whose members differ (replaced or modified on disk since) is refused before its
    weights are read, so no rank runs weights rank 0 did not verify."""
    from pathlib import Path

    if Path(source).is_dir():
        from kiln.llm.loader import read_json

        return read_json(Path(source) / "config.json"), LazySafetensors(source), None
    from kiln.llm.engine import load_model

    if digests is not None:
        from kiln.llm.engine_file import expect_digests

        expect_digests(source, digests)
    try:
        hf_config, tensors, _, extras = load_model(source)
    except errors.EngineFileError as e:
        raise errors.EngineFileError(f"tensor-parallel rank {rank} refused the engine rank 0 loaded: {e}") from None
    return hf_config, tensors, extras.get("quantized_weights") if engine_weights else None


def worker_main(rank: int, world_size: int, address: tuple[str, int], key: bytes) -> None:
    """A worker rank: build the shard, then run every step rank 0 sends until it says stop (or goes away)."""
    conn = connection.Client(address, authkey=key)
    try:
        _send(conn, {"status": "hello", "rank": rank})
        spec = json.loads(conn.recv_bytes())
        from kiln.llm.config import ModelConfig
        from kiln.llm.engine import build_rank_model, kv_blocks_that_fit
        from kiln.llm.parallel import Shard
        from kiln.llm.runner import ModelRunner

        device = spec["devices"][rank]
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        else:  # ranks share the CPU's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        quantized = None
        if spec.get("weights_file"):  # weights the caller held in memory
            from safetensors.torch import load_file

            hf_config, tensors = spec["hf_config"], load_file(spec["weights_file"])
            if spec.get("quantized"):
                from kiln.llm.quantize import QuantizedWeight

                quantized = {k: QuantizedWeight.from_tensors(m, i, {p: tensors.pop(f"{k}.{p}") for p in parts})
                             for k, (m, i, parts) in spec["quantized"].items()}
        else:
            hf_config, tensors, quantized = _load_source(rank, spec["source"], spec["engine_weights"],
                                                         spec.get("engine_digests"))
        cfg = ModelConfig.from_hf(hf_config)
        dtype, kv_dtype = getattr(torch, spec["dtype"]), getattr(torch, spec["kv_dtype"])
        model = build_rank_model(cfg, tensors, dtype, torch.device(device), Shard(rank, world_size),
                                 spec["quantization"], quantized)
        del tensors
        fit = None
        if spec["num_kv_blocks"] is None:
            fit = kv_blocks_that_fit(model, kv_dtype, spec["block_size"], spec["max_model_len"],
                                     spec["gpu_memory_utilization"], spec["max_num_batched_tokens"],
                                     spec["max_num_seqs"])
        _send(conn, {"status": "loaded", "kv_blocks": fit})
        start = json.loads(conn.recv_bytes())
        init_group(rank, world_size, start["init_method"], device)
        runner = ModelRunner(model, num_blocks=start["num_kv_blocks"], block_size=spec["block_size"],
                             kv_dtype=kv_dtype, kv_scales=_tensors_from_json(spec["kv_scales"]),
                             max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
                             use_cuda_graphs=spec["use_cuda_graphs"])
        _send(conn, {"status": "ready", "graphs": sorted(runner.graphs)})
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):  # rank 0 went away
                break
            if data == STOP:
                break
            runner.run_inputs(decode_step(data))
    except BaseException as e:  # noqa: BLE001 - whatever it is, rank 0 must hear of it and raise it
        try:
            _send(conn, _error_message(e))
        except (OSError, ValueError):
            pass
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - exiting anyway; the group may be broken by a dead peer
                pass
        conn.close()


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed with an error that is not the user's (a bug, a crash, the GPU)."""


class Workers:
    """Ranks 1..N-1 of a tensor-parallel engine: their processes, their connections, their shutdown.

    spec: what every worker builds (JSON-able; see worker_main); `tensors` / `quantized`, when given, are written
    to a safetensors file in a private temporary directory that the workers read and rank 0 then deletes."""

    CONNECT_TIMEOUT = 300.0

    def __init__(self, world_size: int, spec: dict, tensors: dict | None = None, quantized: dict | None = None):
        import tempfile

        self.world_size = world_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self._closed = False
        self._tmp = None
        try:
            spec = dict(spec)
            spec["kv_scales"] = _tensors_to_json(spec.get("kv_scales"))
            if tensors is not None:
                from safetensors.torch import save_file

                self._tmp = tempfile.TemporaryDirectory(prefix="kiln-tp-")
                flat = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
                spec["quantized"] = {}
                for k, q in (quantized or {}).items():
                    parts = q.tensors()
                    spec["quantized"][k] = [q.method, q.in_features, sorted(parts)]
                    flat.update({f"{k}.{p}": t.detach().contiguous().cpu() for p, t in parts.items()})
                spec["weights_file"] = os.path.join(self._tmp.name, "weights.safetensors")
                save_file(flat, spec["weights_file"])
            else:  # the workers read the source themselves: a .kiln engine only as rank 0 checked it
                spec["engine_digests"] = engine_digests(spec.get("source"))
            self._start(spec)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, spec: dict) -> None:
        key = secrets.token_bytes(32)
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", 0))
        server.listen(self.world_size)
        server.settimeout(0.1)
        env = dict(os.environ, KILN_TP_KEY=key.hex())
        host, port = server.getsockname()
        try:
            for rank in range(1, self.world_size):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", "import sys; from kiln.llm.tp_workers import main; sys.exit(main(sys.argv[1:]))",
                     str(rank), str(self.world_size), host, str(port)],
                    env=env, stdin=subprocess.DEVNULL))
            by_rank: dict[int, object] = {}
            deadline = time.monotonic() + self.CONNECT_TIMEOUT
            while len(by_rank) < self.world_size - 1:
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    for rank, p in enumerate(self.procs, start=1):
                        if p.poll() is not None and rank not in by_rank:
                            raise WorkerError(f"tensor-parallel rank {rank} exited with code {p.returncode} "
                                              "before connecting (its error is printed above).")
                    if time.monotonic() > deadline:
                        raise WorkerError(f"tensor-parallel workers did not connect within {self.CONNECT_TIMEOUT:.0f} s.")
                    continue
                sock.setblocking(True)  # Connection reads the raw descriptor
                conn = connection.Connection(sock.detach())
                try:
                    connection.deliver_challenge(conn, key)
                    connection.answer_challenge(conn, key)
                    hello = json.loads(conn.recv_bytes())
                except (OSError, EOFError, ValueError, connection.AuthenticationError):
                    conn.close()  # not one of ours
                    continue
                by_rank[hello["rank"]] = conn
        finally:
            server.close()
        self.conns = [by_rank[r] for r in range(1, self.world_size)]
        for conn in self.conns:
            _send(conn, spec)

    # --- start-up ----------------------------------------------------------------------------------------
    def wait(self, status: str, timeout: float | None = None) -> list[dict]:
        """Each worker's next message, which must be `status`; a worker's error is raised here."""
        out = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            deadline = None if timeout is None else time.monotonic() + timeout
            while not conn.poll(0.05):
                if p.poll() is not None and not conn.poll(0):
                    self._fail(rank, f"exited with code {p.returncode} before reporting '{status}'")
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(rank, f"did not report '{status}' within {timeout:.0f} s")
            try:
                msg = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._fail(rank, f"closed its connection (exit code {p.poll()}) before reporting '{status}'")
            if msg.get("status") == "error":
                self._raise(rank, msg)
            out.append(msg)
        if status == "loaded" and self._tmp is not None:  # the weights file has been read by every worker
            self._tmp.cleanup()
            self._tmp = None
        return out

    def start(self, num_kv_blocks: int) -> None:
        for conn in self.conns:
            _send(conn, {"init_method": self.init_method, "num_kv_blocks": num_kv_blocks})

    # --- steps ---------------------------------------------------------------------------------------------
    def send_step(self, inputs: StepInputs) -> None:
        data = encode_step(inputs)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):
                self.raise_failure()
                self._fail(rank, "is gone (its connection is closed)")

    def raise_failure(self) -> None:
        """Raises the error a worker reported, or its death, if any (after a collective failed on rank 0)."""
        if self._closed:
            raise WorkerError("the tensor-parallel engine was shut down.")
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                if conn.poll(0):
                    msg = json.loads(conn.recv_bytes())
                    if msg.get("status") == "error":
                        self._raise(rank, msg)
            except (EOFError, OSError):
                pass
            try:
                p.wait(0.5)
            except subprocess.TimeoutExpired:
                continue
            self._fail(rank, f"exited with code {p.returncode}")

    def _raise(self, rank: int, msg: dict):
        self.shutdown()
        cls = getattr(errors, msg["type"], None)
        if msg.get("kiln") and isinstance(cls, type) and issubclass(cls, errors.KilnError):
            raise cls(msg["message"])
        raise WorkerError(f"tensor-parallel rank {rank} failed: {msg['type']}: {msg['message']}\n"
                          f"{msg.get('traceback', '')}")

    def _fail(self, rank: int, what: str):
        self.shutdown()
        raise WorkerError(f"tensor-parallel rank {rank} {what}.")

    # --- shutdown ------------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops every worker and reaps it: asked first, terminated if it does not exit, killed last."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(STOP)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(2.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for conn in self.conns:
            conn.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def main(argv: list[str]) -> int:
    rank, world_size, host, port = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    key = bytes.fromhex(os.environ.pop("KILN_TP_KEY"))
    worker_main(rank, world_size, (host, port), key)
    return 0
