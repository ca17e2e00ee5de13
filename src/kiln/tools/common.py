"""Helpers shared by the proof tools (inspect, compare, verify, bench, report).

Loading engines, building or loading input samples, the onnxruntime / PyTorch
references, binding checks between a reference and an engine, and atomic file
writes. onnxruntime is only ever a *reference* here: it never runs Kiln's work.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import ConfigError, InputError, KilnError, ModelError, ShapeError
from ..fileio import atomic_write_bytes
from ..ir import dtypes

# --- output ---------------------------------------------------------------------------------------


def console(stderr: bool = False):
    from rich.console import Console

    con = Console(stderr=stderr, highlight=False, soft_wrap=True, markup=False, emoji=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con.width = 200  # files and pipes: room for the layer tables
    return con


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _finite_json(o):
    """JSON has no NaN/Infinity: write them as strings so any parser reads the file."""
    if isinstance(o, float) and not np.isfinite(o):
        return "NaN" if np.isnan(o) else ("Infinity" if o > 0 else "-Infinity")
    if isinstance(o, dict):
        return {k: _finite_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite_json(v) for v in o]
    return o


def to_json_text(obj) -> str:
    return json.dumps(_finite_json(json.loads(json.dumps(obj, default=_json_default))), indent=2) + "\n"


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, to_json_text(obj))


# --- engines --------------------------------------------------------------------------------------


def add_verify_key_flag(p) -> None:
    """--verifyKey / --verify-key KEYFILE on a command that loads an engine (engine/signing.py)."""
    p.add_argument("--verifyKey", "--verify-key", dest="verifyKey", metavar="KEYFILE", default=None,
                   help="refuse the engine unless it was signed with this key (`kiln build --sign KEYFILE`)")


def verify_key_of(args) -> bytes | None:
    """The key --verifyKey names (None without the flag); a missing or short key file is a ConfigError."""
    from ..engine.signing import load_key

    path = getattr(args, "verifyKey", None)
    return load_key(path) if path else None


def load_engine(engine, device: str = "auto", verify_key: bytes | None = None):
    """An Engine object, or the path of a .kiln file (refused unless signed with verify_key, when given)."""
    from ..engine.engine import Engine
    from ..engine.serialize import load

    if isinstance(engine, Engine):
        return engine
    path = Path(engine)
    if path.suffix == ".onnx":
        raise ConfigError(
            f"'{path}' is an ONNX model, not an engine: build one first with "
            f"`kiln build --onnx={path} --saveEngine=model.kiln`."
        )
    return load(path, device=device, verify_key=verify_key)


def fmt_shape(shape) -> str:
    shape = list(shape)
    return "x".join(str(d) for d in shape) if shape else "scalar"


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def device_note(target) -> str:
    """Says which device a measurement comes from (a CPU figure is not a GPU figure)."""
    if target.kind == "cuda":
        return f"measured on {target.describe()}"
    return (f"measured on {target.describe()}: a CPU figure from the reference kernels, "
            "not a latency on the target GPU")


# --- inputs ---------------------------------------------------------------------------------------


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


def _read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
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


def load_samples(spec: str, input_names: list[str], what: str = "--loadInputs",
                 ignore: tuple[str, ...] = ("labels",)) -> list[dict[str, np.ndarray]]:
    """Input samples from: a .npz keyed by input name, a folder of such .npz files (one sample each,
    in name order), or NAME:FILE.npy,... Keys in `ignore` (e.g. labels) are dropped."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise InputError(f"{what}: folder '{spec}' holds no .npz files.")
        samples = [(f, _read_npz(f, what)) for f in files]
    elif spec.endswith(".npz") and ":" not in path.name:
        if not path.is_file():
            raise InputError(f"{what}: file '{spec}' does not exist.")
        samples = [(path, _read_npz(path, what))]
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


def parse_shapes_arg(text: str, engine, flag: str = "--shapes") -> dict[str, tuple]:
    from ..engine.config import parse_shapes

    shapes = parse_shapes(text or "", flag)
    names = [v.name for v in engine.inputs]
    unknown = [k for k in shapes if k not in names]
    if unknown:
        raise InputError(f"{flag}: {unknown} are not inputs of this engine; its inputs are {names}.")
    return shapes


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


# --- user callables ---------------------------------------------------------------------------------


def load_callable(spec: str, what: str) -> Callable:
    """'package.module:function' or 'path/to/file.py:function'."""
    if ":" not in spec:
        raise ConfigError(f"{what}: '{spec}' should be MODULE:FUNCTION (e.g. mypkg.models:make_model).")
    mod_name, fn_name = spec.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):
            file = Path(mod_name)
            if not file.is_file():
                raise ConfigError(f"{what}: file '{mod_name}' does not exist.")
            name = f"_kiln_user_{file.stem}"
            s = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(s)
            sys.modules[name] = module
            s.loader.exec_module(module)
        else:  # from sys.path as it is: the current directory is not added (code there is not run unasked)
            module = importlib.import_module(mod_name)
    except KilnError:
        raise
    except ImportError as e:
        here = Path(mod_name.split(".")[0] + ".py")
        in_cwd = here.is_file() or Path(here.stem).is_dir()
        hint = (f" '{here}' is in the current directory, which Kiln does not add to the import path: give the file "
                f"itself ({Path('.') / here}:{fn_name}) or set PYTHONPATH." if in_cwd else "")
        raise ConfigError(f"{what}: cannot import module '{mod_name}' ({e}).{hint}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while being imported
        raise ConfigError(f"{what}: importing '{mod_name}' failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{what}: module '{mod_name}' has no callable '{fn_name}'.")
    return fn


def load_torch_module(spec: str, what: str = "--torch") -> torch.nn.Module:
    factory = load_callable(spec, what)
    try:
        module = factory() if not isinstance(factory, torch.nn.Module) else factory
    except Exception as e:  # noqa: BLE001 - the user's factory raised
        raise ConfigError(f"{what}: calling '{spec}' raised {type(e).__name__}: {e}") from None
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"{what}: '{spec}' returned a {type(module).__name__}, not a torch.nn.Module.")
    return module.eval()


# --- references -----------------------------------------------------------------------------------


@dataclass
class Binding:
    name: str
    dtype: str | None  # short name, e.g. "float32"
    shape: tuple | None  # ints for static axes, str/None for dynamic ones


def engine_bindings(engine) -> tuple[list[Binding], list[Binding]]:
    def conv(values):
        return [Binding(v.name, dtypes.name_of(v.dtype) if v.dtype is not None else None,
                        tuple(v.shape) if v.shape is not None else None) for v in values]

    return conv(engine.inputs), conv(engine.outputs)


def _vi_binding(vi) -> Binding:
    t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    dtype = None
    shape = None
    if t is not None:
        if t.elem_type:
            try:
                dtype = dtypes.name_of(dtypes.onnx_to_torch(t.elem_type))
            except KeyError:
                dtype = dtypes.onnx_type_name(t.elem_type).lower()
        if t.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return Binding(vi.name, dtype, shape)


class OnnxReference:
    """An ONNX model run by onnxruntime on the CPU: the reference Kiln's engines are checked against."""

    kind = "onnxruntime"

    def __init__(self, model, extra_outputs=None):
        """model: path or onnx.ModelProto. extra_outputs: intermediate tensor names to return too, or a
        callable proto -> names (so the model is read once)."""
        import onnx

        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("the ONNX reference needs onnxruntime: pip install 'kiln[reference]'.") from None
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not path.is_file():
                raise ModelError(f"reference model '{path}' does not exist.")
            self.source = str(path)
            try:
                proto = onnx.load(str(path))
            except Exception as e:
                raise ModelError(f"reference model '{path}' cannot be read as ONNX ({e}).") from None
        else:
            proto = model
            self.source = "ONNX model (in memory)"
        self.model = proto
        inits = {t.name for t in proto.graph.initializer}
        self.inputs = [_vi_binding(vi) for vi in proto.graph.input if vi.name not in inits]
        self.outputs = [_vi_binding(vi) for vi in proto.graph.output]
        if callable(extra_outputs):
            extra_outputs = extra_outputs(proto)
        self.extra_outputs = [n for n in (extra_outputs or []) if n not in {o.name for o in self.outputs}]
        if self.extra_outputs:
            proto = _with_outputs(proto, self.extra_outputs)
        opts = ort.SessionOptions()
        # Numerically neutral rewrites only: the reference should compute what the graph says.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.log_severity_level = 3
        try:
            self.session = _ort_session(ort, proto, opts)
        except Exception as e:
            raise ModelError(f"onnxruntime cannot load the reference model {self.source}: {e}") from None

    def describe(self) -> str:
        return f"onnxruntime {__import__('onnxruntime').__version__} (CPU) on {self.source}"

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = names or [o.name for o in self.outputs]
        ort_feeds = {}
        for k, x in feeds.items():
            x = np.asarray(x.float().numpy() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x)
            ort_feeds[k] = x
        try:
            outs = self.session.run(names, ort_feeds)
        except Exception as e:
            raise InputError(f"onnxruntime could not run the reference on these inputs: {e}") from None
        return dict(zip(names, (np.asarray(o) for o in outs)))


def _ort_session(ort, proto, opts):
    if proto.ByteSize() < 1_800_000_000:
        return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    import onnx

    folder = tempfile.mkdtemp(prefix="kiln-ref-")
    path = os.path.join(folder, "model.onnx")
    onnx.save(proto, path, save_as_external_data=True, location="weights.bin")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _with_outputs(proto, names: list[str]):
    """A copy of the model that also returns the intermediate tensors `names`."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    known = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {vi.name: vi for vi in inferred.graph.value_info}
    except Exception:
        pass
    for name in names:
        vi = known.get(name)
        if vi is not None:
            model.graph.output.append(vi)
        else:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return model


def onnx_node_outputs(proto) -> list[str]:
    """Tensors computed by the main graph's nodes (what --layerwise can mark as outputs)."""
    return [o for n in proto.graph.node for o in n.output if o]


class TorchReference:
    """A PyTorch module as the reference (API): called with the engine's inputs in binding order."""

    kind = "pytorch"

    def __init__(self, module: torch.nn.Module, input_names: list[str], output_names: list[str],
                 device: str | torch.device = "cpu"):
        self.module = module.eval()
        self.device = torch.device(device)
        self.inputs = [Binding(n, None, None) for n in input_names]
        self.outputs = [Binding(n, None, None) for n in output_names]
        self.extra_outputs: list[str] = []
        self.source = type(module).__name__

    def describe(self) -> str:
        return f"PyTorch {torch.__version__.split('+')[0]} eager ({self.source}, {self.device})"

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        args = [torch.as_tensor(np.asarray(feeds[b.name])).to(self.device) for b in self.inputs]
        with torch.inference_mode():
            out = self.module(*args)
        if isinstance(out, torch.Tensor):
            out = [out]
        elif isinstance(out, dict):
            out = list(out.values())
        else:
            out = list(out)
        if len(out) != len(self.outputs):
            raise InputError(
                f"the PyTorch reference returns {len(out)} output(s) but the engine has {len(self.outputs)} "
                f"({[b.name for b in self.outputs]}); they are matched by position."
            )
        res = {b.name: dtypes.to_numpy(t) for b, t in zip(self.outputs, out)}
        return {k: res[k] for k in (names or res)}


def make_reference(ref: Any, engine, extra_outputs: list[str] | None = None):
    """REF as a path to .onnx, an onnx.ModelProto, a torch.nn.Module, 'module:factory', or a ready reference."""
    import onnx

    if isinstance(ref, (OnnxReference, TorchReference)):
        return ref
    names_in = [v.name for v in engine.inputs]
    names_out = [v.name for v in engine.outputs]
    if isinstance(ref, torch.nn.Module):
        return TorchReference(ref, names_in, names_out)
    if isinstance(ref, onnx.ModelProto):
        return OnnxReference(ref, extra_outputs)
    ref = str(ref)
    if not Path(ref).exists() and ":" in ref and not ref.endswith(".onnx"):
        return TorchReference(load_torch_module(ref, "reference"), names_in, names_out)
    if Path(ref).suffix == ".kiln":
        raise ConfigError(f"the reference '{ref}' is an engine; the reference must be the ONNX model "
                          "(run by onnxruntime) or a PyTorch module (MODULE:FACTORY).")
    return OnnxReference(ref, extra_outputs)


def check_bindings(reference, engine) -> None:
    """Raise one InputError that names every binding that differs between reference and engine."""
    e_in, e_out = engine_bindings(engine)
    problems = []
    for what, refs, engs in (("input", reference.inputs, e_in), ("output", reference.outputs, e_out)):
        rn, en = [b.name for b in refs], [b.name for b in engs]
        if isinstance(reference, TorchReference):
            continue
        only_ref = [n for n in rn if n not in en]
        only_eng = [n for n in en if n not in rn]
        if only_ref or only_eng:
            problems.append(
                f"{what} names differ: the reference has {rn}, the engine has {en}"
                + (f" (only in the reference: {only_ref}" if only_ref else " (")
                + (f"{'; ' if only_ref else ''}only in the engine: {only_eng})" if only_eng else ")")
            )
        byname = {b.name: b for b in engs}
        for r in refs:
            e = byname.get(r.name)
            if e is None:
                continue
            if r.dtype and e.dtype and r.dtype != e.dtype:
                problems.append(f"{what} '{r.name}' is {r.dtype} in the reference but {e.dtype} in the engine")
            if r.shape is not None and e.shape is not None:
                if len(r.shape) != len(e.shape):
                    problems.append(f"{what} '{r.name}' has rank {len(r.shape)} ({_dims(r.shape)}) in the reference "
                                    f"but rank {len(e.shape)} ({_dims(e.shape)}) in the engine")
                else:
                    bad = [a for a, (x, y) in enumerate(zip(r.shape, e.shape))
                           if isinstance(x, int) and isinstance(y, int) and x != y and x > 0 and y > 0]
                    if bad:
                        problems.append(f"{what} '{r.name}' has shape {_dims(r.shape)} in the reference but "
                                        f"{_dims(e.shape)} in the engine (axis {', '.join(map(str, bad))})")
    if problems:
        raise InputError("the reference and the engine do not have the same bindings: " + "; ".join(problems)
                         + ". Compare the engine with the model it was built from.")


def _dims(shape) -> str:
    return "x".join(str(d) if isinstance(d, int) else (d or "?") for d in shape) if shape else "scalar"


def parse_named_floats(values: list[str] | None, flag: str) -> tuple[float | None, dict[str, float]]:
    """['1e-3', 'out:1e-2'] -> (1e-3, {'out': 1e-2}); comma lists allowed in each value."""
    default, per = None, {}
    for item in [x for v in (values or []) for x in v.split(",") if x.strip()]:
        name, _, num = item.rpartition(":")
        try:
            val = float(num)
        except ValueError:
            raise ConfigError(f"{flag}: '{item}' should be a number or OUTPUT:NUMBER (e.g. {flag} 1e-3 or "
                              f"{flag} logits:1e-2).") from None
        if val < 0:
            raise ConfigError(f"{flag}: '{item}' is negative.")
        if name:
            per[name] = val
        else:
            default = val
    return default, per
