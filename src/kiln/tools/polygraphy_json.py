"""Input and output files in the JSON shapes Polygraphy writes and reads.

`polygraphy run --save-inputs inputs.json` writes a list of feed dicts, one per iteration, each array
an object {"array": base64 of numpy's .npy bytes, "polygraphy_class": "ndarray"}. `--save-outputs`
writes a RunResults: {"lst": [[runner name, [IterationResult, ...]], ...], "polygraphy_class":
"RunResults"}, an IterationResult being {"outputs": {name: {"values": <ndarray>, "polygraphy_class":
"LazyArray"}}, "runtime": seconds, "runner_name": name, "polygraphy_class": "IterationResult"}.

Arrays are read with numpy's allow_pickle=False. Polygraphy's torch.Tensor payloads (torch.save bytes)
are refused: Kiln never unpickles a file it is given.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..fileio import atomic_write_text
from ..samples import npy_header_bytes

MARKER = "polygraphy_class"


def encode_array(x) -> dict:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    buf = io.BytesIO()
    np.save(buf, np.asarray(x), allow_pickle=False)
    return {"array": base64.b64encode(buf.getvalue()).decode(), MARKER: "ndarray"}


def decode_array(obj, where: str) -> np.ndarray:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected an encoded array (an object with \"{MARKER}\": \"ndarray\"), "
                         f"found {type(obj).__name__}.")
    kind = obj.get(MARKER)
    if kind in ("LazyArray", "LazyNumpyArray"):
        return decode_array(obj.get("values"), where)
    if kind == "Tensor":
        raise InputError(f"{where}: a torch.Tensor payload (torch.save bytes, a pickle); Kiln does not unpickle "
                         "files. Save the inputs as numpy arrays (Polygraphy writes those for numpy data loaders).")
    if kind != "ndarray" or not isinstance(obj.get("array"), str):
        raise InputError(f"{where}: expected an encoded array ({MARKER} 'ndarray' with an 'array' field), found "
                         f"{MARKER} {kind!r}.")
    try:
        data = base64.b64decode(obj["array"].encode(), validate=True)
        buf = io.BytesIO(data)
        # numpy allocates what a header declares before reading: a few bytes could ask for terabytes.
        need = npy_header_bytes(buf) if data[:6] == b"\x93NUMPY" else 0
        held = len(data) - buf.tell()
        buf.seek(0)
        if need <= held:
            arr = np.load(buf, allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise InputError(f"{where}: the array cannot be decoded ({e}).") from None
    if need > held:
        raise InputError(f"{where}: the array's header declares {need} bytes but the payload holds {held}; it is "
                         "refused without being read.")
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{where}: the payload is an .npz archive, not one array.")
    return arr


def save_inputs(path, samples: list[dict]) -> None:
    """Polygraphy's --save-inputs: a list of {input name: encoded array}."""
    atomic_write_text(path, json.dumps([{k: encode_array(v) for k, v in s.items()} for s in samples]))


def load_inputs(path, input_names: list[str], what: str = "--load-inputs") -> list[dict[str, np.ndarray]]:
    """Polygraphy's --save-inputs file (a list of feed dicts), checked against the model's inputs."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what}: file '{path}' does not exist.")
    try:
        data = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{what}: '{path}' is not JSON ({e}).") from None
    if not isinstance(data, list) or not data or not all(isinstance(s, dict) for s in data):
        raise InputError(f"{what}: '{path}' should hold a non-empty list of feed dicts (Polygraphy's "
                         "--save-inputs format).")
    out = []
    for i, sample in enumerate(data):
        unknown = [k for k in sample if k not in input_names]
        missing = [k for k in input_names if k not in sample]
        if unknown or missing:
            raise InputError(f"{what}: iteration {i} of '{path}' has inputs {sorted(sample)}; the model's inputs are "
                             f"{input_names} (unknown: {unknown}, missing: {missing}).")
        out.append({k: decode_array(v, f"{what}: '{path}' iteration {i} input '{k}'") for k, v in sample.items()})
    return out


def save_outputs(path, results: dict[str, list[dict]], runtimes: dict[str, list[float]] | None = None) -> None:
    """Polygraphy's --save-outputs: a RunResults of every runner's per-iteration outputs."""
    runtimes = runtimes or {}
    lst = []
    for runner, iterations in results.items():
        its = []
        for i, outs in enumerate(iterations):
            times = runtimes.get(runner, [])
            its.append({"outputs": {k: {"values": encode_array(v), MARKER: "LazyArray"} for k, v in outs.items()},
                        "runtime": times[i] if i < len(times) else None, "runner_name": runner,
                        MARKER: "IterationResult"})
        lst.append([runner, its])
    atomic_write_text(path, json.dumps({"lst": lst, MARKER: "RunResults"}))


def load_outputs(path) -> dict[str, list[dict[str, np.ndarray]]]:
    """A RunResults file back as {runner: [{output: array} per iteration]}."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"'{path}' cannot be read as Polygraphy RunResults JSON ({e}).") from None
    if not isinstance(data, dict) or data.get(MARKER) != "RunResults":
        raise InputError(f"'{path}' is not a Polygraphy RunResults file ({MARKER} 'RunResults').")
    return {runner: [{k: decode_array(v, f"'{path}' runner '{runner}' output '{k}'")
                      for k, v in it["outputs"].items()} for it in its] for runner, its in data["lst"]}
