"""A Triton Inference Server model repository for one Kiln engine.

    DIR/NAME/config.pbtxt     inputs, outputs (TYPE_* dtypes, dims), max_batch_size, dynamic batching,
                              instance groups: all read from the engine's bindings and profiles
    DIR/NAME/1/model.py       Triton's Python backend: loads the engine once per instance (kiln.load, so the
                              GPU, version and checksum checks apply at load) and runs it
    DIR/NAME/1/model.kiln     the engine file, copied

Batching follows Triton's convention: when every input and output has a dynamic first axis (the batch), the
dims leave it out and `max_batch_size` is the largest batch the engine's profiles accept; Triton's dynamic
batcher then merges requests up to it, preferring the profile's opt batch. An engine without such an axis is
exported with max_batch_size 0 and full dims.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..engine.serialize import FORMAT, read_manifest
from ..errors import ConfigError, EngineFileError
from .batching import batch_range

ENGINE_FILE = "model.kiln"
MODEL_PY = Path(__file__).with_name("triton_model.py")

# Kiln binding dtype names -> Triton's data types. FP8 has no Triton type: such engines are refused.
TRITON_TYPES = {
    "bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64", "int8": "TYPE_INT8", "int16": "TYPE_INT16", "int32": "TYPE_INT32",
    "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32", "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
}
# How long the dynamic batcher waits for more requests before running a partial batch.
QUEUE_DELAY_US = 100


@dataclass
class TensorSpec:
    name: str
    data_type: str
    dims: list[int]  # without the batch axis when the model batches


@dataclass
class TritonConfig:
    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    preferred_batch_size: int | None
    instance_kind: str  # KIND_GPU or KIND_CPU
    instances: int

    def to_pbtxt(self) -> str:
        lines = [f'name: "{self.name}"', 'backend: "python"', f"max_batch_size: {self.max_batch_size}"]
        for key, specs in (("input", self.inputs), ("output", self.outputs)):
            for s in specs:
                lines += [f"{key} [", "  {", f'    name: "{s.name}"', f"    data_type: {s.data_type}",
                          f"    dims: [ {', '.join(str(d) for d in s.dims)} ]", "  }", "]"]
        if self.max_batch_size > 0:
            lines.append("dynamic_batching {")
            if self.preferred_batch_size:
                lines.append(f"  preferred_batch_size: [ {self.preferred_batch_size} ]")
            lines += [f"  max_queue_delay_microseconds: {QUEUE_DELAY_US}", "}"]
        lines += ["instance_group [", "  {", f"    count: {self.instances}", f"    kind: {self.instance_kind}",
                  "  }", "]"]
        # GPU instances take inputs where Triton holds them (device memory included): no forced host copy.
        gpu = "no" if self.instance_kind == "KIND_GPU" else "yes"
        lines += ["parameters {", '  key: "FORCE_CPU_ONLY_INPUT_TENSORS"', f'  value: {{ string_value: "{gpu}" }}',
                  "}", "parameters {", '  key: "KILN_ENGINE"', f'  value: {{ string_value: "{ENGINE_FILE}" }}', "}"]
        return "\n".join(lines) + "\n"


def _triton_type(binding: dict, engine: Path) -> str:
    try:
        return TRITON_TYPES[binding["dtype"]]
    except KeyError:
        raise ConfigError(
            f"'{engine}': {binding['io']} '{binding['name']}' is {binding['dtype']}, which Triton Inference Server "
            f"has no data type for (it has {', '.join(sorted(TRITON_TYPES))}). Rebuild the engine with that "
            "binding in one of these types (a Cast at the model's edge).") from None


def _input_dims(name: str, binding: dict, profiles: list[dict], skip: int) -> list[int]:
    """A dim is fixed where the binding is static or every profile fixes it to one value, else -1."""
    dims = []
    for axis, d in enumerate(binding["shape"]):
        if axis < skip:
            continue
        seen = {v for p in profiles for v in (p[name]["min"][axis], p[name]["max"][axis])}
        dims.append(d if d != -1 else (seen.pop() if len(seen) == 1 else -1))
    return dims


def triton_config(engine: Path, name: str, instances: int = 1, max_batch: int | None = None) -> TritonConfig:
    manifest = read_manifest(engine)
    if manifest.get("format") != FORMAT:
        raise EngineFileError(f"'{engine}' is not a Kiln engine (format {manifest.get('format')!r}).")
    if "bindings" not in manifest or "profiles" not in manifest:
        raise EngineFileError(f"'{engine}' is a Kiln LLM engine or is incomplete: its manifest has no bindings "
                              "and profiles. Serve LLM engines with `kiln llm serve`.")
    if instances < 1:
        raise ConfigError(f"--instances must be at least 1, not {instances}.")
    for b in manifest["bindings"]:
        if b["shape"] is None:
            raise ConfigError(f"'{engine}': {b['io']} '{b['name']}' has no known rank, which a Triton config needs.")
    batch = batch_range(manifest)
    if max_batch is not None and max_batch < 0:
        raise ConfigError(f"--maxBatch must be 0 (no batching) or more, not {max_batch}.")
    if max_batch and batch is None:
        raise ConfigError(
            f"--maxBatch {max_batch}: '{engine}' has no batch axis Triton can batch on (every input and output "
            "needs a dynamic first axis with one range across inputs in each profile); export with --maxBatch 0.")
    if max_batch and max_batch > batch[0]:
        raise ConfigError(f"--maxBatch {max_batch} is beyond the engine's profiles, which accept batches up to "
                          f"{batch[0]}; rebuild with a larger --maxShapes or lower --maxBatch.")
    batching = batch is not None and max_batch != 0
    skip = 1 if batching else 0
    profiles = manifest["profiles"]
    inputs = [TensorSpec(b["name"], _triton_type(b, engine), _input_dims(b["name"], b, profiles, skip))
              for b in manifest["bindings"] if b["io"] == "input"]
    outputs = [TensorSpec(b["name"], _triton_type(b, engine), list(b["shape"][skip:]))
               for b in manifest["bindings"] if b["io"] == "output"]
    mbs = (max_batch or batch[0]) if batching else 0
    preferred = min(batch[1], mbs) if batching and batch[1] > 1 else None
    kind = "KIND_GPU" if manifest.get("target", {}).get("kind") == "cuda" else "KIND_CPU"
    return TritonConfig(name, inputs, outputs, mbs, preferred, kind, instances)


def export_triton(engine, repo, name: str | None = None, instances: int = 1, max_batch: int | None = None) -> Path:
    """Write DIR/NAME/{config.pbtxt, 1/model.py, 1/model.kiln}; returns the model's folder."""
    engine, repo = Path(engine), Path(repo)
    name = name or engine.stem
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"--name '{name}' is not a valid Triton model name (one folder name).")
    config = triton_config(engine, name, instances, max_batch)
    folder = repo / name
    version = folder / "1"
    try:
        version.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(engine, version / ENGINE_FILE)
        shutil.copyfile(MODEL_PY, version / "model.py")
        (folder / "config.pbtxt").write_text(config.to_pbtxt())
    except OSError as e:
        raise ConfigError(f"cannot write the Triton model repository at '{folder}': {e}.") from None
    return folder
