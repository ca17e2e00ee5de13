"""The engine file: one uncompressed zip, no pickle.

    manifest.json        format, versions, target GPU, build config, profiles,
                         bindings, per-layer placement/precision/tactic
    graph.onnx           the optimized graph (weights stripped), openable with any ONNX tool
    weights.safetensors  the weights, in the precision each layer uses
    checksums.json       SHA-256 and size of each member above (the manifest included),
                         and an optional HMAC signature over them (engine/signing.py)

Written to a temporary file in the same folder and renamed into place, so a
crash never leaves a half-written engine. Loading reads only these members, each
stored uncompressed at the size checksums.json records (so a crafted file cannot
make the loader allocate more than the file's size), verifies every checksum,
validates the manifest's schema (engine/manifest.py), and refuses an engine built
for another GPU architecture or software version.
"""

from __future__ import annotations

import hashlib
import json
import re
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
from ..ir.graph import set_body_precision
from ..ir.to_onnx import graph_to_model
from . import manifest as schema
from . import signing
from .engine import Engine
from .profile import Profile
from .target import Target, resolve, versions

FORMAT = "kiln-engine"
FORMAT_VERSION = 2  # 2: checksums.json covers every member, the manifest included
MANIFEST, GRAPH, WEIGHTS, CHECKSUMS = "manifest.json", "graph.onnx", "weights.safetensors", "checksums.json"
MEMBERS = (MANIFEST, GRAPH, WEIGHTS)  # the members checksums.json covers, in the order they are written
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_CHECKSUMS_BYTES = 64 * 2**10
MAX_ENTRIES = 64  # an engine has 4 members; a zip with thousands of entries is not one
_LAYER_FIELDS = ("precision", "placement", "tactic", "profile_tactics", "sources", "note")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ForeignEngineError(EngineFileError):
    """An intact engine built for another GPU, software version or installation: it cannot run here, but its
    manifest can still be inspected (every other EngineFileError means the file itself cannot be trusted)."""


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


def checksums_of(members: dict[str, bytes], sign_key: bytes | None = None, names=MEMBERS) -> bytes:
    """The checksums.json member over `names` of `members` (by default this format's manifest, graph and weights;
    the LLM engine file passes its own), signed when a key is given."""
    digests = {name: {"sha256": _sha(members[name]), "size": len(members[name])} for name in names}
    doc = {"format": "kiln-checksums", "algorithm": "sha256", "members": digests}
    if sign_key is not None:
        doc["signature"] = signing.sign(digests, sign_key)
    return json.dumps(doc, indent=2).encode()


def to_bytes(engine: Engine, sign_key: bytes | None = None) -> dict[str, bytes]:
    graph = engine.graph
    weights, as_bytes = {}, {}
    for k, t in graph.initializers.items():
        t = t.detach().cpu().contiguous().clone()
        if t.dtype in _STORED_AS_BYTES:
            as_bytes[k], t = dtypes.name_of(t.dtype), t.view(torch.uint8)
        weights[k] = t
    manifest = manifest_of(engine)
    manifest["weights_stored_as_bytes"] = as_bytes
    members = {
        MANIFEST: json.dumps(manifest, indent=2).encode(),
        GRAPH: graph_to_model(graph, with_initializers=False).SerializeToString(),
        WEIGHTS: st_save(weights) if weights else b"",
    }
    return write_members(members, sign_key)


def write_members(members: dict[str, bytes], sign_key: bytes | None = None) -> dict[str, bytes]:
    """manifest, graph and weights plus their checksums.json: the members of an engine file."""
    return {**{n: members[n] for n in MEMBERS}, CHECKSUMS: checksums_of(members, sign_key)}


def save(engine: Engine, path, sign_key: bytes | None = None) -> None:
    save_members(to_bytes(engine, sign_key), path)


def save_members(members: dict[str, bytes], path) -> None:
    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
            for name, data in members.items():
                z.writestr(name, data)

    atomic_write(path, write, EngineFileError)


def _rebuild(path, why: str, command: str = "kiln build") -> EngineFileError:
    return EngineFileError(f"'{path}' {why}. Rebuild it with `{command}`.")


def _member(z: zipfile.ZipFile, path, name: str, size: int | None, limit: int, command: str = "kiln build") -> bytes:
    """One member, read only if it is stored uncompressed and no larger than `size` (when known) and `limit`."""
    info = z.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise _rebuild(path, f"is not a Kiln engine as written: member {name} is compressed (Kiln stores every "
                             "member uncompressed, and does not inflate members of untrusted files)", command)
    if size is not None and info.file_size != size:
        raise _rebuild(path, f"is corrupted: member {name} holds {info.file_size} bytes, checksums.json records "
                             f"{size}", command)
    if info.file_size > limit:
        raise _rebuild(path, f"is corrupted: member {name} holds {info.file_size} bytes, more than the "
                             f"{limit} bytes a {name} may have", command)
    return z.read(name)


def _digests(path, raw: bytes, names=MEMBERS, command: str = "kiln build") -> tuple[dict, object]:
    """checksums.json's member digests (validated) and its signature (None when unsigned)."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _rebuild(path, "is corrupted: checksums.json is not JSON", command) from None
    members = doc.get("members") if isinstance(doc, dict) else None
    if not isinstance(members, dict) or doc.get("algorithm") != "sha256":
        raise _rebuild(path, "is corrupted: checksums.json does not list the members' SHA-256 digests", command)
    for name in names:
        d = members.get(name)
        if not isinstance(d, dict) or not isinstance(d.get("sha256"), str) or not _HEX64.fullmatch(d["sha256"]) \
                or not isinstance(d.get("size"), int) or isinstance(d.get("size"), bool) or d["size"] < 0:
            raise _rebuild(path, f"cannot be trusted: checksums.json has no valid SHA-256 digest and size for {name}", command)
    return {n: members[n] for n in names}, doc.get("signature")


def read_members(path: Path, verify_key: bytes | None = None, names=MEMBERS,
                 command: str = "kiln build", expect: dict | None = None,
                 verified: dict | None = None) -> dict[str, bytes]:
    """The members `names` of the engine at `path` (by default a compiled engine's; the LLM engine file passes
    its own and its build command), each checked against checksums.json (and the signature).
    expect: the member digests (as `verified` returns them) another read of this engine checked, e.g. rank 0's
    for a tensor-parallel worker: an engine whose checksums.json lists others is refused before any member is
    read. verified: filled with the digests the members were checked against."""
    if not path.is_file():
        raise EngineFileError(f"engine file '{path}' does not exist." if not path.exists()
                              else f"engine path '{path}' is not a file.")
    on_disk = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            listed = [i.filename for i in infos]
            if len(infos) > MAX_ENTRIES or len(set(listed)) != len(listed):
                raise _rebuild(path, f"is not a Kiln engine: its zip directory has {len(infos)} entries"
                               + (", some of them twice" if len(set(listed)) != len(listed) else ""), command)
            if MANIFEST not in listed:
                raise EngineFileError(f"'{path}' is a zip file but not a Kiln engine (no manifest.json).")
            if CHECKSUMS not in listed:
                raise _old_or_unsealed(path, _member(z, path, MANIFEST, None, MAX_MANIFEST_BYTES, command), command)
            raw = _member(z, path, CHECKSUMS, None, MAX_CHECKSUMS_BYTES, command)
            digests, signature = _digests(path, raw, names, command)
            if verify_key is not None:
                why = signing.verify(digests, signature, verify_key)
                if why is not None:
                    raise EngineFileError(f"'{path}' is refused: --verifyKey was given and {why}. Only engines "
                                          f"signed with this key ({command} --sign KEYFILE) are accepted.")
            digests = {n: {"sha256": d["sha256"], "size": d["size"]} for n, d in digests.items()}
            if expect is not None and digests != expect:
                changed = [n for n in names if digests.get(n) != expect.get(n)] or sorted(expect)
                raise EngineFileError(f"'{path}' is not the engine that was checked before: {', '.join(changed)} "
                                      "changed on disk since (its checksums.json lists other contents), so it is "
                                      "refused.")
            out = {}
            for name in names:
                if name not in listed:
                    raise _rebuild(path, f"is incomplete: member {name} is missing", command)
                size = digests[name]["size"]
                if size > on_disk:
                    raise _rebuild(path, f"is corrupted: checksums.json says {name} holds {size} bytes, more than "
                                         f"the whole file ({on_disk} bytes)", command)
                data = _member(z, path, name, size, MAX_MANIFEST_BYTES if name == MANIFEST else on_disk, command)
                if _sha(data) != digests[name]["sha256"]:
                    raise _rebuild(path, f"is corrupted or was modified: checksum of {name} does not match "
                                         "checksums.json", command)
                out[name] = data
            if verified is not None:
                verified.update(digests)
            return out
    except zipfile.BadZipFile:
        raise EngineFileError(
            f"'{path}' is not a Kiln engine: the file is truncated, corrupted, or of another format "
            f"(a Kiln engine is a zip archive). Rebuild it with `{command}`."
        ) from None
    except (zipfile.LargeZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as e:
        raise EngineFileError(f"'{path}' cannot be read as a Kiln engine: {e}.") from None


def _old_or_unsealed(path, raw: bytes, command: str = "kiln build") -> EngineFileError:
    try:
        version = json.loads(raw).get("format_version")
    except (ValueError, AttributeError):
        version = None
    if version == 1:
        return _rebuild(path, "uses engine format 1, whose checksums do not cover its manifest, so its integrity "
                              f"cannot be established; this Kiln reads format {FORMAT_VERSION}", command)
    return _rebuild(path, "has no checksums.json, so its integrity cannot be established", command)


def _parse_manifest(path, members: dict[str, bytes]) -> dict:
    try:
        m = json.loads(members[MANIFEST])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise EngineFileError(f"'{path}': manifest.json is corrupted (not JSON).") from None
    if isinstance(m, dict) and m.get("format") != FORMAT:
        raise EngineFileError(f"'{path}' is not a Kiln engine (format {str(m.get('format'))[:40]!r}).")
    if isinstance(m, dict) and m.get("format_version") != FORMAT_VERSION:
        raise EngineFileError(
            f"'{path}' uses engine format {str(m.get('format_version'))[:20]}, "
            f"this Kiln reads format {FORMAT_VERSION}; rebuild it."
        )
    return schema.validate(path, m)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,3})?")


def check_device(device: str, flag: str = "--device") -> str:
    """`device` if it is auto, cpu, cuda or cuda:N, else a ConfigError naming it."""
    from ..errors import ConfigError

    if not isinstance(device, str) or not _DEVICE.fullmatch(device.lower()):
        raise ConfigError(f"{flag}: '{str(device)[:40]}' is not a device Kiln runs on; give auto (the GPU if there "
                          "is one), cpu, cuda or cuda:N.")
    return device.lower()


def _check_versions(path: Path, m: dict, keys) -> None:
    ours, theirs = m.get("versions") or {}, versions()
    for key in keys:
        if ours.get(key) != theirs.get(key):
            raise ForeignEngineError(
                f"'{path}' was built with {key} {ours.get(key)}, but this machine runs {key} "
                f"{theirs.get(key)}. Kernel choices and tactics are only valid for the versions they were "
                "timed with: rebuild the engine here."
            )


def _check_compatible(path: Path, m: dict, device: str) -> Target:
    device = check_device(device)
    built = m.get("target") if isinstance(m.get("target"), dict) else {}
    if built.get("kind") == "cuda":
        if device == "cpu":
            raise ForeignEngineError(f"'{path}' was built for {built.get('name')} (compute capability "
                                     f"{built.get('capability')}); it cannot run on the CPU. Rebuild it with "
                                     "--device=cpu.")
        try:
            here = resolve(device if device != "auto" else "cuda")
        except Exception:
            raise ForeignEngineError(
                f"'{path}' was built for {built.get('name')} (compute capability {built.get('capability')}), "
                "but this machine has no CUDA GPU. Rebuild the engine here (kiln build builds for the CPU "
                "target when there is no GPU)."
            ) from None
        if here.capability != built.get("capability"):
            raise ForeignEngineError(
                f"'{path}' was built for {built.get('name')} (compute capability {built.get('capability')}) but "
                f"this GPU is {here.name} (compute capability {here.capability}). Engines do not port across "
                "GPU architectures: rebuild it on this GPU."
            )
        _check_versions(path, m, ("kiln", "torch", "cuda"))
        return here
    if built.get("kind") != "cpu":
        raise EngineFileError(f"'{path}' names an unknown target {str(built)[:80]}.")
    if device.startswith("cuda"):
        raise ForeignEngineError(f"'{path}' was built for the CPU target; rebuild it for the GPU.")
    _check_versions(path, m, ("kiln", "torch"))  # as TensorRT: an engine runs only on the versions that built it
    return resolve("cpu")


def load(path, device: str = "auto", verify_key: bytes | None = None) -> Engine:
    """The engine at `path`. verify_key: refuse it unless it is signed with this key (engine/signing.py)."""
    path = Path(path)
    m = _parse_manifest(path, members := read_members(path, verify_key))
    target = _check_compatible(path, m, device)
    try:
        graph = model_to_graph(onnx.load_from_string(members[GRAPH]))
        weights = st_load(members[WEIGHTS]) if members[WEIGHTS] else {}
    except Exception as e:
        raise EngineFileError(f"'{path}' cannot be decoded: {e}") from None
    for k, name in m.get("weights_stored_as_bytes", {}).items():
        if k not in weights:
            raise EngineFileError(f"'{path}': manifest field 'weights_stored_as_bytes' names '{k[:60]}', which is not "
                                  "a weight of the engine. Rebuild it.")
        try:
            weights[k] = weights[k].view(dtypes.from_name(name))
        except Exception:
            raise EngineFileError(f"'{path}': manifest field 'weights_stored_as_bytes.{k[:60]}' names a type "
                                  f"'{name[:40]}' this Kiln cannot view the weight as. Rebuild it.") from None
    graph.initializers = dict(weights)
    layers = m["layers"]
    if len(layers) != len(graph.nodes):
        raise EngineFileError(f"'{path}' is inconsistent: manifest lists {len(layers)} layers, "
                              f"graph has {len(graph.nodes)}.")
    names = sorted(v.name for v in graph.inputs)
    for i, p in enumerate(m["profiles"]):
        if sorted(p) != names:
            raise EngineFileError(f"'{path}' is inconsistent: manifest field 'profiles[{i}]' covers inputs "
                                  f"{sorted(p)[:8]}, the graph's inputs are {names[:8]}. Rebuild it.")
    _check_programs(path, graph)
    for node, info in zip(graph.nodes, layers):
        for f in _LAYER_FIELDS:
            if f in info:  # engines saved before per-profile tactics have no profile_tactics
                setattr(node, f, info[f])
        set_body_precision(node, node.precision)  # control-flow bodies run in their layer's precision
    _check_tactics(path, graph)
    return Engine(
        graph=graph, profiles=[Profile.from_json(p) for p in m["profiles"]], target=target,
        build_config=m["build_config"], capturable=m["capturable"], arena_bytes=m.get("arena_bytes", []),
        versions=m["versions"], build_seconds=m.get("build_seconds"), findings=m.get("findings", []),
        tactics=m.get("tactics", []), channels_last=m.get("channels_last", []),
        padded_channels=m.get("padded_channels", []), column_major=m.get("column_major", []),
    )


def _check_programs(path, graph) -> None:
    """Every generated-kernel program must parse as one (kernels/elementwise.py): refused at load, by layer,
    not when a GPU first runs it."""
    from ..kernels.elementwise import parse

    for node in graph.walk():
        if node.domain == "kiln" and node.op_type == "Elementwise":
            parse(node.attr("program"), len(node.inputs), f"'{path}': layer '{str(node.name)[:80]}'")


def _check_tactics(path, graph) -> None:
    """Refuse an engine whose layers run tactics this installation lacks (one from an optional package):
    those layers would fall back to the slow reference without a word."""
    from ..tactics import offered

    for node in graph.nodes:
        for name in {node.tactic, *node.profile_tactics}:
            if not offered(node, name):
                raise ForeignEngineError(
                    f"'{path}': layer '{node.name}' ({node.op_type}) was built to run tactic '{name}', which this "
                    "installation of Kiln does not offer (cudnn_graph_* tactics need the optional cudnn-frontend "
                    "package: pip install 'kiln[cudnn]'; triton_tma_* ones a Triton with TMA descriptors). Install "
                    "what the building machine had, or rebuild the engine here.")


def read_manifest(path, verify_key: bytes | None = None) -> dict:
    """The manifest alone (for inspect), with the same integrity and schema checks as load."""
    path = Path(path)
    return _parse_manifest(path, read_members(path, verify_key))
