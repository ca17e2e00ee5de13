"""The engine file: one uncompressed zip, no pickle.

    manifest.json        format, versions, target GPU, build config, profiles,
                         bindings, per-layer placement/precision/tactic, checksums
    graph.onnx           the optimized graph (weights stripped), openable with any ONNX tool
    weights.safetensors  the weights, in the precision each layer uses

Written to a temporary file in the same folder and renamed into place, so a
crash never leaves a half-written engine. Loading verifies every checksum and
refuses an engine built for another GPU architecture or software version.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import onnx
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import EngineFileError
from ..fileio import atomic_write
from ..ir import dtypes
from ..ir.from_onnx import model_to_graph
from ..ir.to_onnx import graph_to_model
from . import precision
from .config import Profile
from .engine import Engine
from .target import Target, resolve, versions

FORMAT = "kiln-engine"
FORMAT_VERSION = 1
_LAYER_FIELDS = ("precision", "placement", "tactic", "profile_tactics", "sources", "note")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_of(engine: Engine) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": engine.versions,
        "target": engine.target.to_json(),
        "build_config": engine.build_config,
        "build_seconds": engine.build_seconds,
        "capturable": engine.capturable,
        "profiles": [p.to_json() for p in engine.profiles],
        "arena_bytes": engine.arena_bytes,
        "findings": engine.findings,
        "tactics": engine.tactics,
        "channels_last": engine.channels_last,
        "padded_channels": engine.padded_channels,
        "column_major": engine.column_major,
        "bindings": engine.bindings(),
        "layers": [
            {"name": n.name, "op_type": n.op_type, "domain": n.domain, **{f: getattr(n, f) for f in _LAYER_FIELDS}}
            for n in engine.graph.nodes
        ],
    }


# safetensors cannot read these back: stored as raw bytes, the manifest remembers the type.
_STORED_AS_BYTES = (torch.float8_e8m0fnu,)


def to_bytes(engine: Engine) -> dict[str, bytes]:
    graph = engine.graph
    weights, as_bytes = {}, {}
    for k, t in graph.initializers.items():
        t = t.detach().cpu().contiguous().clone()
        if t.dtype in _STORED_AS_BYTES:
            as_bytes[k], t = dtypes.name_of(t.dtype), t.view(torch.uint8)
        weights[k] = t
    members = {
        "graph.onnx": graph_to_model(graph, with_initializers=False).SerializeToString(),
        "weights.safetensors": st_save(weights) if weights else b"",
    }
    manifest = manifest_of(engine)
    manifest["weights_stored_as_bytes"] = as_bytes
    manifest["checksums"] = {k: _sha(v) for k, v in members.items()}
    return {"manifest.json": json.dumps(manifest, indent=2).encode(), **members}


def save(engine: Engine, path) -> None:
    members = to_bytes(engine)

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
            for name, data in members.items():
                z.writestr(name, data)

    atomic_write(path, write, EngineFileError)


def _read(path: Path) -> dict[str, bytes]:
    if not path.is_file():
        raise EngineFileError(f"engine file '{path}' does not exist.")
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            if "manifest.json" not in names:
                raise EngineFileError(f"'{path}' is a zip file but not a Kiln engine (no manifest.json).")
            return {n: z.read(n) for n in names}
    except zipfile.BadZipFile:
        raise EngineFileError(
            f"'{path}' is not a Kiln engine: the file is truncated, corrupted, or of another format "
            "(a Kiln engine is a zip archive). Rebuild it with `kiln build`."
        ) from None
    except (zipfile.LargeZipFile, OSError, EOFError) as e:
        raise EngineFileError(f"'{path}' cannot be read as a Kiln engine: {e}.") from None


def _check_compatible(path: Path, m: dict, device: str) -> Target:
    built = m.get("target", {})
    here_versions = versions()
    if built.get("kind") == "cuda":
        try:
            here = resolve(device if device != "auto" else "cuda")
        except Exception:
            raise EngineFileError(
                f"'{path}' was built for {built.get('name')} (compute capability {built.get('capability')}), "
                "but this machine has no CUDA GPU. Rebuild the engine here (kiln build builds for the CPU "
                "target when there is no GPU)."
            ) from None
        if here.capability != built.get("capability"):
            raise EngineFileError(
                f"'{path}' was built for {built.get('name')} (compute capability {built.get('capability')}) but "
                f"this GPU is {here.name} (compute capability {here.capability}). Engines do not port across "
                "GPU architectures: rebuild it on this GPU."
            )
        ours, theirs = m.get("versions", {}), here_versions
        for key in ("kiln", "torch", "cuda"):
            if ours.get(key) != theirs.get(key):
                raise EngineFileError(
                    f"'{path}' was built with {key} {ours.get(key)}, but this machine runs {key} "
                    f"{theirs.get(key)}. Kernel choices and tactics are only valid for the versions they were "
                    "timed with: rebuild the engine here."
                )
        return here
    if built.get("kind") == "cpu":
        if device.startswith("cuda"):
            raise EngineFileError(f"'{path}' was built for the CPU target; rebuild it for the GPU.")
        return resolve("cpu")
    raise EngineFileError(f"'{path}' names an unknown target {built!r}.")


def load(path, device: str = "auto") -> Engine:
    path = Path(path)
    members = _read(path)
    try:
        m = json.loads(members["manifest.json"])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EngineFileError(f"'{path}': manifest.json is corrupted (not JSON).") from None
    if m.get("format") != FORMAT:
        raise EngineFileError(f"'{path}' is not a Kiln engine (format {m.get('format')!r}).")
    if m.get("format_version") != FORMAT_VERSION:
        raise EngineFileError(
            f"'{path}' uses engine format {m.get('format_version')}, "
            f"this Kiln reads format {FORMAT_VERSION}; rebuild it."
        )
    for name, digest in m.get("checksums", {}).items():
        if name not in members or _sha(members[name]) != digest:
            raise EngineFileError(f"'{path}' is corrupted: checksum of {name} does not match its manifest. Rebuild it.")
    target = _check_compatible(path, m, device)
    try:
        graph = model_to_graph(onnx.load_from_string(members["graph.onnx"]))
        weights = st_load(members["weights.safetensors"]) if members["weights.safetensors"] else {}
    except Exception as e:
        raise EngineFileError(f"'{path}' cannot be decoded: {e}") from None
    for k, name in m.get("weights_stored_as_bytes", {}).items():
        weights[k] = weights[k].view(dtypes.from_name(name))
    graph.initializers = dict(weights)
    layers = m["layers"]
    if len(layers) != len(graph.nodes):
        raise EngineFileError(f"'{path}' is inconsistent: manifest lists {len(layers)} layers, "
                              f"graph has {len(graph.nodes)}.")
    for node, info in zip(graph.nodes, layers):
        for f in _LAYER_FIELDS:
            if f in info:  # engines saved before per-profile tactics have no profile_tactics
                setattr(node, f, info[f])
        precision.set_body(node, node.precision)  # control-flow bodies run in their layer's precision
    _check_tactics(path, graph)
    return Engine(
        graph=graph, profiles=[Profile.from_json(p) for p in m["profiles"]], target=target,
        build_config=m["build_config"], capturable=m["capturable"], arena_bytes=m.get("arena_bytes", []),
        versions=m["versions"], build_seconds=m.get("build_seconds"), findings=m.get("findings", []),
        tactics=m.get("tactics", []), channels_last=m.get("channels_last", []),
        padded_channels=m.get("padded_channels", []), column_major=m.get("column_major", []),
    )


def _check_tactics(path, graph) -> None:
    """Refuse an engine whose layers run tactics this installation lacks (one from an optional package):
    those layers would fall back to the slow reference without a word."""
    from ..tactics import offered

    for node in graph.nodes:
        for name in {node.tactic, *node.profile_tactics}:
            if not offered(node, name):
                raise EngineFileError(
                    f"'{path}': layer '{node.name}' ({node.op_type}) was built to run tactic '{name}', which this "
                    "installation of Kiln does not offer (cudnn_graph_* tactics need the optional cudnn-frontend "
                    "package: pip install 'kiln[cudnn]'; triton_tma_* ones a Triton with TMA descriptors). Install "
                    "what the building machine had, or rebuild the engine here.")


def read_manifest(path) -> dict:
    """The manifest alone (for inspect), with the same integrity checks as load."""
    members = _read(Path(path))
    return json.loads(members["manifest.json"])
