"""Input samples: read from the files users give (.npz, folders of .npz, NAME:FILE.npy lists, a bare .npy),
checked against the inputs they are for, made random for an engine, and cut to fit its profiles.

Every array file is checked before numpy reads it: its declared sizes must fit in memory and in the file (numpy
allocates what a header declares before it reads), and pickled data is never loaded. Errors name the file, the
input and the flag the data came from.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from .errors import InputError, ShapeError
from .ir import dtypes


def random_feeds(engine, profile: int = 0, seed: int = 0, shapes: dict | None = None,
                 pick: int = 1) -> dict[str, np.ndarray]:
    """Engine.random_inputs as numpy arrays (bfloat16 stays a torch tensor: numpy has no bfloat16)."""
    feeds = engine.random_inputs(profile, pick=pick, shapes=shapes, seed=seed)
    return {k: x if x.dtype == torch.bfloat16 else dtypes.to_numpy(x) for k, x in feeds.items()}


# What numpy raises for a file that is not what its name says: not a zip, a truncated or damaged zip or .npy,
# pickled (object) arrays, a member that is not an array.
_UNREADABLE = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError)


MAX_ARRAY_FILE_BYTES = 4 * 2**30  # what a .npz / .npy of inputs or calibration data may hold once inflated


def _array_bytes_limit() -> int:
    """MAX_ARRAY_FILE_BYTES, or less when the machine has less memory available."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return min(MAX_ARRAY_FILE_BYTES, avail)
    except (OSError, StopIteration, ValueError, IndexError):
        return MAX_ARRAY_FILE_BYTES


def npy_header_bytes(f) -> int:
    """The bytes the array of a .npy stream's header takes (read from the header only)."""
    version = np.lib.format.read_magic(f)
    shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                       else np.lib.format.read_array_header_2_0(f))
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _check_array_sizes(path: Path, what: str) -> None:
    """Refuse a .npz (or .npy) whose arrays would inflate beyond the limit, or whose .npy headers declare more
    data than the member holds (numpy allocates what a header declares before it reads): checked from the zip
    directory and the headers, before anything is inflated."""
    limit = _array_bytes_limit()
    if not zipfile.is_zipfile(path):  # a .npy, or something np.load will name
        with open(path, "rb") as f:
            try:
                need = npy_header_bytes(f)
            except _UNREADABLE:
                return
            held = path.stat().st_size - f.tell()
        if need > held:
            raise InputError(f"{what}: '{path}' declares an array of {need} bytes but holds only {held}; the file "
                             "is damaged or crafted, and is refused.")
        if need > limit:
            raise InputError(f"{what}: '{path}' holds an array of {need} bytes; Kiln reads at most {limit} bytes "
                             "of arrays from one file.")
        return
    with zipfile.ZipFile(path) as z:
        total = 0
        for info in z.infolist():
            total += info.file_size
            if total > limit:
                raise InputError(f"{what}: '{path}' would inflate to more than {limit} bytes (member "
                                 f"'{info.filename}' declares {info.file_size}); Kiln reads at most {limit} bytes "
                                 "of arrays from one file, so it is refused without being inflated.")
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with z.open(info) as f:
                try:
                    need = npy_header_bytes(f)
                except _UNREADABLE:
                    continue  # np.load names the damage
            if need > info.file_size:
                raise InputError(f"{what}: in '{path}', member '{info.filename}' declares an array of {need} bytes "
                                 f"but holds only {info.file_size}; the file is damaged or crafted, and is refused.")


def read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    """Every array of a .npz file by name, or an InputError naming the file."""
    try:
        _check_array_sizes(Path(path), what)
        z = np.load(path, allow_pickle=False)
        if not hasattr(z, "files"):
            raise ValueError("it holds a single array (.npy), not arrays by name")
        with z:
            return {k: z[k] for k in z.files}
    except _UNREADABLE as e:
        raise InputError(f"{what}: '{path}' cannot be read as a .npz file ({_reason(e)}); give a .npz written by "
                         "numpy.savez, keyed by input name.") from None


def read_npy(path, what: str, name: str | None = None) -> np.ndarray:
    """One array from a .npy file, or an InputError naming the file (and the input it was meant for)."""
    label = f" for input '{name}'" if name else ""
    try:
        _check_array_sizes(Path(path), f"{what}{label}")
        a = np.load(path, allow_pickle=False)
    except _UNREADABLE as e:
        raise InputError(f"{what}: '{path}'{label} cannot be read as a .npy file ({_reason(e)}).") from None
    if not isinstance(a, np.ndarray):
        a.close()
        raise InputError(f"{what}: '{path}'{label} is a .npz archive, not a .npy array; give it as the whole spec "
                         "(a .npz keyed by input name).")
    return a


def _reason(e: Exception) -> str:
    text = str(e)
    if "pickled" in text:
        return "it holds pickled (object) data, which Kiln never loads"
    return (text or type(e).__name__)[:200]


def load_samples(data, input_names: list[str], what: str = "--loadInputs",
                 ignore: tuple[str, ...] = ("labels",)) -> list[dict[str, np.ndarray]]:
    """Input samples, one feed dict each, from:

    - a path: a .npz keyed by input name, a folder of such .npz files (one sample each, in name order),
      NAME:FILE.npy,... or, for a model with one input, a bare .npy. Keys in `ignore` (e.g. labels) are
      dropped; the rest must be exactly the inputs, with numbers in them.
    - a dict {input name: array}, an array (a model with one input) or an iterable of dicts: as given (the
      caller checks them against what it runs).
    """
    if isinstance(data, (str, os.PathLike)):
        return _load_files(os.fspath(data), input_names, what, ignore)
    if isinstance(data, dict):
        return [data]
    if isinstance(data, (np.ndarray, torch.Tensor)):
        if len(input_names) != 1:
            raise InputError(f"{what}: a bare array fits a model with one input, but this one has {input_names}; "
                             "pass {name: array} dicts.")
        return [{input_names[0]: data}]
    try:
        items = iter(data)
    except TypeError:
        raise InputError(f"{what}: expected a .npz/.npy path, a folder of .npz files, or an iterable of "
                         f"{{input name: array}} dicts, not a {type(data).__name__}.") from None
    out = []
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputError(f"{what}: item {k} is a {type(item).__name__}; each item must be a dict "
                             f"{{input name: array}} with the inputs {input_names}.")
        out.append(item)
    return out


def _load_files(spec: str, input_names: list[str], what: str, ignore: tuple[str, ...]) -> list[dict]:
    path = Path(spec)
    if spec.endswith(".npy") and (path.is_file() or (":" not in spec and "," not in spec)):  # one bare array
        if not path.is_file():
            raise InputError(f"{what}: file '{spec}' does not exist.")
        if len(input_names) != 1:
            raise InputError(f"{what}: a bare .npy file fits a model with one input, but this one has "
                             f"{input_names}; give NAME:FILE.npy,... or a .npz keyed by input name.")
        samples = [(path, {input_names[0]: read_npy(spec, what, input_names[0])})]
    elif path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise InputError(f"{what}: folder '{spec}' holds no .npz files.")
        samples = [(f, read_npz(f, what)) for f in files]
    elif spec.endswith(".npz") and ":" not in path.name:
        if not path.is_file():
            raise InputError(f"{what}: file '{spec}' does not exist.")
        samples = [(path, read_npz(path, what))]
    elif not path.exists() and ":" not in spec:
        raise InputError(f"{what}: '{spec}' does not exist.")
    else:
        data = {}
        for item in spec.split(","):
            if ":" not in item:
                raise InputError(f"{what}: '{item}' should be NAME:FILE.npy, a .npz file or a folder of .npz files.")
            name, f = item.rsplit(":", 1)
            if not Path(f).is_file():
                raise InputError(f"{what}: file '{f}' for input '{name}' does not exist.")
            data[name] = read_npy(f, what, name)
        samples = [(Path(spec), data)]
    out = []
    for f, data in samples:
        data = {k: v for k, v in data.items() if k not in ignore}
        for k, v in data.items():
            if not isinstance(v, np.ndarray) or v.dtype.kind not in "biuf":
                kind = v.dtype if isinstance(v, np.ndarray) else type(v).__name__
                raise InputError(f"{what}: in '{f}', input '{k}' holds {kind} values; Kiln's inputs are numbers "
                                 "(bool, integer or floating point).")
        unknown = [k for k in data if k not in input_names]
        missing = [k for k in input_names if k not in data]
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"{unknown} are not inputs of the engine")
            if missing:
                parts.append(f"inputs {missing} are missing")
            raise InputError(f"{what}: in '{f}', {' and '.join(parts)}; the engine's inputs are {input_names}.")
        out.append(data)
    return out


def split_to_profile(engine, samples: list[dict], profile: int) -> list[dict]:
    """Samples whose batch axis exceeds the profile's max batch, cut into chunks that fit (the last one
    padded up to the profile's min batch by repeating its last row). Other axes are left as they are."""
    out = []
    for s in samples:
        lo_b, hi_b = 1, None
        fits_rest = True
        for name, x in s.items():
            lo, _, hi = engine.get_profile_shape(profile, name)
            shape = np.shape(x)
            if len(shape) != len(lo) or not lo:
                fits_rest = False
                break
            lo_b, hi_b = max(lo_b, lo[0]), hi[0] if hi_b is None else min(hi_b, hi[0])
        ns = {np.shape(x)[0] for x in s.values() if np.ndim(x)}
        if not fits_rest or hi_b is None or len(ns) != 1 or next(iter(ns)) <= hi_b:
            out.append(s)
            continue
        n = next(iter(ns))
        for start in range(0, n, hi_b):
            part = {k: x[start:start + hi_b] for k, x in s.items()}
            real = next(iter(part.values())).shape[0]
            if real < lo_b:
                part = {k: np.concatenate([x, np.repeat(x[-1:], lo_b - real, axis=0)]) for k, x in part.items()}
            out.append(part)
    return out


def check_feeds_in_profile(engine, feeds: dict, profile: int, what: str) -> None:
    """The ShapeError the runtime would raise, said up front and naming where the data came from."""
    ctx_like = engine.create_execution_context(profile=profile, cuda_graphs=False)
    for name, x in feeds.items():
        try:
            ctx_like.check_shape(name, tuple(np.shape(x)))
        except ShapeError as e:
            raise ShapeError(f"{what}: {e}") from None
