"""cuBLASLt's GEMM called directly, for the epilogues and choices torch's calls leave out.

torch._scaled_mm reaches cuBLASLt's FP8 GEMM with its scales and a bias, but not its activation
epilogues nor an FP8 output scale. A GELU or ReLU after it, or quantizing its output for the next 8-bit
layer, then cost one more pass over the output (kernels/rescale.py): at BERT-base batch 32 that pass
is a 25 MB FP16 read and write after each FFN1 GEMM. cuBLASLt does all of it in the GEMM's epilogue:

    y = saturate(y_scale_inverse * act(x_scale * w_scale * (x8 @ w8) + bias))

For FP16/BF16 GEMMs torch's addmm reaches the same epilogues, but always offers cuBLASLt a workspace, and
with one cuBLASLt picks kernels that clear a buffer before every call (see MAX_WORKSPACE); `gemm` here
asks for the kernels that need none.

This module calls cuBLASLt through ctypes, over the library torch itself loaded (no build step, no new
dependency), or through NVIDIA's nvmath-python bindings where that is installed (`pip install 'kiln[nvmath]'`;
KILN_CUBLASLT_BINDINGS=ctypes or nvmath chooses), with Hopper's fast FP8 accumulation (as Triton's FP8 dot on
sm_90 does). Both call the same functions with the same values (tests/kernels/test_cublaslt.py checks the enum
values written here against nvmath's) and run the same kernels. cuBLASLt's GELU is the tanh form: it differs
from the erf form by at most 4.7e-4 (at |x| = 2.7, where FP16's step is
2e-3), and the builder checks every tactic's output against the exact reference.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .workspace import scratch

# cublasLt.h / library_types.h values (stable across CUDA 12 and 13)
_R_32F, _R_16F, _R_16BF, _R_8F_E4M3 = 0, 2, 14, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_A_SCALE, _DESC_B_SCALE, _DESC_D_SCALE, _DESC_FAST_ACCUM, _DESC_BIAS_TYPE = 17, 18, 20, 25, 26
_PREF_MAX_WORKSPACE = 1
ALGOS = 4  # heuristic choices offered as tactics: the first is not always the fastest in an engine
# Offered with 32 MiB of scratch and with none: allowed scratch, the heuristic mostly picks kernels that clear a
# buffer with a memset before every call, which delays the next kernel of a CUDA graph; allowed none, it offers
# the same tiles statically scheduled, as fast or faster (see docs/design/cublaslt.md).
EPILOGUES = {("", False): 1, ("", True): 4, ("Relu", False): 2, ("Relu", True): 6,
             ("GeluErf", False): 32, ("GeluErf", True): 36, ("GeluTanh", False): 32, ("GeluTanh", True): 36}
_TYPES = {torch.float16: _R_16F, torch.bfloat16: _R_16BF, torch.float8_e4m3fn: _R_8F_E4M3}
MAX_WORKSPACE = 32 << 20


class CublasLtError(RuntimeError):
    pass


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_paths() -> list[str]:
    """The libcublasLt torch loaded (from /proc/self/maps), else the pip wheels' copies, else the soname."""
    major = (torch.version.cuda or "0").split(".")[0]
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    except OSError:
        pass
    for root in sys.path:
        paths += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", f"libcublasLt.so.{major}")))
    return paths + [f"libcublasLt.so.{major}"]


@functools.cache
def _lib():
    for path in _library_paths():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError:
            continue
    else:
        raise CublasLtError("libcublasLt was not found next to torch")
    p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    pp = ctypes.POINTER(ctypes.c_void_p)
    for name, args in [("cublasLtCreate", [pp]), ("cublasLtMatmulDescCreate", [pp, i, i]),
                       ("cublasLtMatmulDescSetAttribute", [p, i, p, sz]),
                       ("cublasLtMatrixLayoutCreate", [pp, i, u64, u64, i64]),
                       ("cublasLtMatmulPreferenceCreate", [pp]),
                       ("cublasLtMatmulPreferenceSetAttribute", [p, i, p, sz]),
                       ("cublasLtMatmulAlgoGetHeuristic", [p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic),
                                                           ctypes.POINTER(i)]),
                       ("cublasLtMatmul", [p, p, p, p, p, p, p, p, p, p, p, p, p, p, sz, p])]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.cublasLtGetStatusName.argtypes, lib.cublasLtGetStatusName.restype = [i], ctypes.c_char_p
    return lib


class CtypesBindings:
    """cuBLASLt's C functions through ctypes, over the libcublasLt torch loaded. Handles, descriptors and
    addresses are ints throughout, as in nvmath's bindings."""

    name = "ctypes"

    @functools.cached_property
    def lib(self):
        return _lib()

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise CublasLtError(f"{what}: {self.lib.cublasLtGetStatusName(status).decode()}")

    def _created(self, fn, what: str, *args) -> int:
        out = ctypes.c_void_p()
        self._check(fn(ctypes.byref(out), *args), what)
        return out.value

    def create(self) -> int:
        return self._created(self.lib.cublasLtCreate, "cublasLtCreate")

    def desc_create(self, compute: int, scale: int) -> int:
        return self._created(self.lib.cublasLtMatmulDescCreate, "cublasLtMatmulDescCreate", compute, scale)

    def desc_set(self, desc: int, attr: int, address: int, size: int) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, address, size),
                    f"cublasLtMatmulDescSetAttribute({attr})")

    def layout_create(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        return self._created(self.lib.cublasLtMatrixLayoutCreate, "cublasLtMatrixLayoutCreate", dtype, rows, cols, ld)

    def preference_create(self) -> int:
        return self._created(self.lib.cublasLtMatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate")

    def preference_set(self, pref: int, attr: int, address: int, size: int) -> None:
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, address, size),
                    "cublasLtMatmulPreferenceSetAttribute")

    def heuristic(self, handle: int, desc: int, layouts: tuple, pref: int, count: int):
        """(the results' storage, [(address of a usable result's algo, its workspace bytes)]); an empty list
        where cuBLASLt declines the GEMM."""
        results, found = (_Heuristic * count)(), ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, *layouts, pref, count, results,
                                                         ctypes.byref(found))
        if status != 0:
            return results, []
        return results, [(ctypes.addressof(r.algo), r.workspace) for r in results[:found.value] if r.state == 0]

    def matmul(self, *args) -> None:
        self._check(self.lib.cublasLtMatmul(*args), "cublasLtMatmul")


class NvmathBindings:
    """cuBLASLt's C functions through nvmath-python (nvmath.bindings.cublasLt, maintained by NVIDIA), its
    heuristic results laid out by nvmath's own struct dtype."""

    name = "nvmath"

    def __init__(self):
        try:
            from nvmath.bindings import cublasLt
        except Exception as e:  # noqa: BLE001 - missing, or its CUDA libraries not loadable here: not usable
            raise CublasLtError(f"the nvmath cuBLASLt bindings need nvmath-python: pip install 'kiln[nvmath]' ({e})")
        self.lt = cublasLt

    def _call(self, fn, what: str, *args):
        try:
            return fn(*args)
        except self.lt.cuBLASLtError as e:
            raise CublasLtError(f"{what}: {e}") from None

    def create(self) -> int:
        return self._call(self.lt.create, "cublasLtCreate")

    def desc_create(self, compute: int, scale: int) -> int:
        return self._call(self.lt.matmul_desc_create, "cublasLtMatmulDescCreate", compute, scale)

    def desc_set(self, desc: int, attr: int, address: int, size: int) -> None:
        self._call(self.lt.matmul_desc_set_attribute, f"cublasLtMatmulDescSetAttribute({attr})", desc, attr,
                   address, size)

    def layout_create(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        return self._call(self.lt.matrix_layout_create, "cublasLtMatrixLayoutCreate", dtype, rows, cols, ld)

    def preference_create(self) -> int:
        return self._call(self.lt.matmul_preference_create, "cublasLtMatmulPreferenceCreate")

    def preference_set(self, pref: int, attr: int, address: int, size: int) -> None:
        self._call(self.lt.matmul_preference_set_attribute, "cublasLtMatmulPreferenceSetAttribute", pref, attr,
                   address, size)

    def heuristic(self, handle: int, desc: int, layouts: tuple, pref: int, count: int):
        import numpy as np

        results, found = np.zeros(count, dtype=self.lt.matmul_heuristic_result_dtype), np.zeros(1, np.int32)
        try:
            self.lt.matmul_algo_get_heuristic(handle, desc, *layouts, pref, count, results.ctypes.data,
                                              found.ctypes.data)
        except self.lt.cuBLASLtError:
            return results, []
        base, step = results.ctypes.data, results.dtype.itemsize
        offset = results.dtype.fields["algo"][1]
        return results, [(base + j * step + offset, int(results[j]["workspace_size"])) for j in range(int(found[0]))
                         if results[j]["state"] == 0]

    def matmul(self, *args) -> None:
        self._call(self.lt.matmul, "cublasLtMatmul", *args)

    def values(self) -> dict[str, int]:
        """nvmath's values of the constants this module writes by hand, by their names here (tests compare)."""
        from nvmath import CudaDataType
        from nvmath.bindings import cublas

        d, ep = self.lt.MatmulDescAttribute, self.lt.Epilogue
        return {"_R_32F": CudaDataType.CUDA_R_32F, "_R_16F": CudaDataType.CUDA_R_16F,
                "_R_16BF": CudaDataType.CUDA_R_16BF, "_R_8F_E4M3": CudaDataType.CUDA_R_8F_E4M3,
                "_COMPUTE_32F": cublas.ComputeType.COMPUTE_32F, "_OP_N": cublas.Operation.N,
                "_OP_T": cublas.Operation.T, "_DESC_TRANSA": d.TRANSA, "_DESC_TRANSB": d.TRANSB,
                "_DESC_EPILOGUE": d.EPILOGUE, "_DESC_BIAS_POINTER": d.BIAS_POINTER,
                "_DESC_A_SCALE": d.A_SCALE_POINTER, "_DESC_B_SCALE": d.B_SCALE_POINTER,
                "_DESC_D_SCALE": d.D_SCALE_POINTER, "_DESC_FAST_ACCUM": d.FAST_ACCUM,
                "_DESC_BIAS_TYPE": d.BIAS_DATA_TYPE,
                "_PREF_MAX_WORKSPACE": self.lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                "EPILOGUES": {("", False): ep.DEFAULT, ("", True): ep.BIAS, ("Relu", False): ep.RELU,
                              ("Relu", True): ep.RELU_BIAS, ("GeluErf", False): ep.GELU,
                              ("GeluErf", True): ep.GELU_BIAS, ("GeluTanh", False): ep.GELU,
                              ("GeluTanh", True): ep.GELU_BIAS}}


_BINDINGS = {"ctypes": CtypesBindings, "nvmath": NvmathBindings}


def bindings(name: str | None = None):
    """The cuBLASLt bindings by name ('ctypes' or 'nvmath'); by default KILN_CUBLASLT_BINDINGS's, else nvmath's
    where nvmath-python imports, else ctypes. Both run the same kernels (docs/design/cublaslt.md)."""
    name = name or os.environ.get("KILN_CUBLASLT_BINDINGS") or _default_bindings()
    if name not in _BINDINGS:
        raise CublasLtError(f"KILN_CUBLASLT_BINDINGS: '{name}' should be one of {sorted(_BINDINGS)}")
    return _bindings(name)


@functools.cache
def _default_bindings() -> str:
    try:
        _bindings("nvmath")
        return "nvmath"
    except CublasLtError:  # not installed, or not importable here
        return "ctypes"


@functools.cache
def _bindings(name: str):
    return _BINDINGS[name]()


@functools.cache
def _handle(device: int, api) -> int:
    with torch.cuda.device(device):
        return api.create()


def _set(api, desc: int, attr: int, value) -> None:
    api.desc_set(desc, attr, ctypes.addressof(value), ctypes.sizeof(value))


@dataclass(frozen=True)
class Spec:
    """One GEMM y[m, n] = act(x[m, k] @ w[k, n] * scales + bias) as cuBLASLt sees it: FP8 inputs with scales, or
    FP16/BF16 inputs without."""
    m: int
    n: int
    k: int
    out: torch.dtype  # FP16, BF16, or FP8 E4M3 (re-quantized with y_scale); a float GEMM's is its inputs' type
    bias: torch.dtype | None  # the bias's type (the output's float type), None without one
    act: str = ""
    inputs: torch.dtype = torch.float8_e4m3fn  # x's and w's type
    k_major: bool = True  # w stored K-major (w.t() contiguous, FP8 engines' layout), else row-major [K, N]

    @property
    def fp8(self) -> bool:
        return self.inputs == torch.float8_e4m3fn


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one plan per heuristic choice
class _Plan:
    api: CtypesBindings | NvmathBindings
    desc: int
    layouts: tuple  # A (weights), B (activations), C, D
    algo: int  # the address of cuBLASLt's algo struct, inside `results`
    workspace: int
    results: object = field(repr=False)  # the heuristic's results, which hold the algo


@functools.lru_cache(maxsize=512)
def _plans(device: int, spec: Spec, count: int, max_workspace: int, api) -> tuple[_Plan, ...]:
    """cuBLASLt's heuristic choices (best first, up to `count`, each needing at most `max_workspace` bytes) for
    the spec in column-major terms: y^T = w^T x^T, w^T read transposed from K-major weights (cuBLASLt's FP8
    GEMM takes only that "TN" form) or as it is from row-major ones. Empty when cuBLASLt has no kernel for it."""
    desc = api.desc_create(_COMPUTE_32F, _R_32F)
    _set(api, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T if spec.k_major else _OP_N))
    _set(api, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
    _set(api, desc, _DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[(spec.act, spec.bias is not None)]))
    if spec.fp8:
        _set(api, desc, _DESC_FAST_ACCUM, ctypes.c_int8(1))
    c_type = _TYPES[spec.bias or (spec.out if spec.out != torch.float8_e4m3fn else torch.float16)]
    if spec.bias is not None:
        _set(api, desc, _DESC_BIAS_TYPE, ctypes.c_int32(_TYPES[spec.bias]))
    # Every pointer attribute is set to a placeholder of the right alignment (the heuristic reads their
    # alignment); _matmul sets the real ones before each call.
    aligned = ctypes.c_void_p(256)
    for attr in ((_DESC_A_SCALE, _DESC_B_SCALE) if spec.fp8 else ()) + (
            (_DESC_D_SCALE,) if spec.out == torch.float8_e4m3fn else ()) + (
            (_DESC_BIAS_POINTER,) if spec.bias is not None else ()):
        _set(api, desc, attr, aligned)
    m, n, k, a_type = spec.m, spec.n, spec.k, _TYPES[spec.inputs]
    layouts = (api.layout_create(a_type, k, n, k) if spec.k_major else api.layout_create(a_type, n, k, n),
               api.layout_create(a_type, k, m, k), api.layout_create(c_type, n, m, n),
               api.layout_create(_TYPES[spec.out], n, m, n))
    pref = api.preference_create()
    cap = ctypes.c_uint64(max_workspace)
    api.preference_set(pref, _PREF_MAX_WORKSPACE, ctypes.addressof(cap), 8)
    results, usable = api.heuristic(_handle(device, api), desc, layouts, pref, count)
    return tuple(_Plan(api, desc, layouts, algo, workspace, results) for algo, workspace in usable)


def supported(spec: Spec, device: torch.device, algo: int = 0, workspace_cap: int = MAX_WORKSPACE) -> bool:
    """Whether cuBLASLt has a kernel (its heuristic's choice number `algo` among those needing at most
    `workspace_cap` bytes of scratch) for this GEMM and epilogue on `device`: FP8 on compute capability 8.9 or
    higher, K and N multiples of 16; FP16/BF16 (output and bias of the inputs' type) on 8.0 or higher, K and N
    multiples of 8 (rows of 16 bytes)."""
    if ((spec.act, spec.bias is not None) not in EPILOGUES or spec.out not in _TYPES
            or (spec.bias is not None and spec.bias not in _TYPES) or spec.inputs not in _TYPES):
        return False
    if not spec.fp8 and (spec.out != spec.inputs or spec.bias not in (None, spec.inputs)):
        return False
    if spec.fp8 and not spec.k_major:
        return False
    step = 16 if spec.fp8 else 8
    if (device.type != "cuda" or torch.cuda.get_device_capability(device) < ((8, 9) if spec.fp8 else (8, 0))
            or spec.k % step or spec.n % step or spec.m < 1):
        return False
    try:
        return len(_plans(device.index or 0, spec, ALGOS, workspace_cap, bindings())) > algo
    except CublasLtError:
        return False


def _plan(device: torch.device, spec: Spec, algo: int, workspace_cap: int) -> _Plan:
    """cuBLASLt's choice `algo`, or its last one where it has fewer (a runtime shape may have fewer choices than
    the opt shape had)."""
    plans = _plans(device.index or 0, spec, ALGOS, workspace_cap, bindings())
    if not plans:
        raise CublasLtError(f"cuBLASLt has no kernel for {spec}")
    return plans[min(algo, len(plans) - 1)]


def choices(spec: Spec, device: torch.device, count: int, max_workspace: int = MAX_WORKSPACE,
            api=None) -> tuple[_Plan, ...]:
    """Up to `count` of cuBLASLt's heuristic choices for the spec, each needing at most `max_workspace` bytes of
    scratch (bench/cublaslt_choices.py compares them), through `api` (bindings(), by default)."""
    return _plans(device.index or 0, spec, count, max_workspace, api or bindings())


def workspace_bytes(spec: Spec, device: torch.device, algo: int = 0, workspace_cap: int = MAX_WORKSPACE) -> int:
    """The scratch cuBLASLt's choice `algo` needs (at most workspace_cap); call where `supported` is True."""
    return _plan(device, spec, algo, workspace_cap).workspace


_CONSTANTS: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
_MADE_IN_CAPTURES: list[torch.Tensor] = []


def _constant(t: torch.Tensor, dtype: torch.dtype, reciprocal: bool = False) -> torch.Tensor:
    """t as a contiguous dtype tensor (or its reciprocal), made once per tensor: scales and biases are engine
    constants, and a conversion kernel per call would cost more than a small GEMM's epilogue. Not reused when
    first made inside a CUDA graph capture, where its kernel runs only when the graph does."""
    key = (t.data_ptr(), t.device, dtype, reciprocal)
    hit = _CONSTANTS.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    v = t.detach().to(dtype)
    v = (1.0 / v if reciprocal else v).contiguous()
    if v.data_ptr() == t.data_ptr():  # already so: nothing to keep
        return v
    if v.is_cuda and torch.cuda.is_current_stream_capturing():
        _MADE_IN_CAPTURES.append(v)  # the graph reads it on every replay: never free it
    else:
        _CONSTANTS[key] = (weakref.ref(t), v)
    return v


_LAUNCH = threading.Lock()  # engines may run in several threads; each call sets its pointers, then launches


def fp8_gemm(x8: torch.Tensor, w8: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, act: str = "", y_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float16, algo: int = 0, workspace_cap: int = MAX_WORKSPACE,
             plan: _Plan | None = None) -> torch.Tensor:
    """act(x8 @ w8 * x_scale * w_scale + bias) as out_dtype, or as FP8 E4M3 quantized with y_scale.

    x8: [M, K] FP8 E4M3, row-major; w8: [K, N] FP8 E4M3 stored K-major (w8.t() contiguous, the engine's
    weight layout); scales: one value each (cuBLASLt's FP8 GEMM takes no per-channel ones on Hopper: its
    heuristic offers none on Hopper, as outer-vector scales or as a vector alpha); bias: [N], used in
    out_dtype (FP16 or BF16); algo: which of cuBLASLt's heuristic choices among those needing at most
    workspace_cap bytes of scratch (its last one where it has fewer), or `plan`, one of `choices` for this GEMM.
    Raises CublasLtError where `supported` is False for choice 0."""
    spec = spec_of(x8, w8, bias is not None, act, y_scale is not None, out_dtype)
    if not x8.is_contiguous() or not w8.t().is_contiguous():
        raise CublasLtError("fp8_gemm takes a row-major x and K-major weights")
    # A is the weights, B the activations: A's scale is the weights'
    pointers = [(_DESC_A_SCALE, _constant(w_scale, torch.float32)), (_DESC_B_SCALE, _constant(x_scale, torch.float32))]
    if y_scale is not None:
        pointers.append((_DESC_D_SCALE, _constant(y_scale, torch.float32, reciprocal=True)))
    if bias is not None:
        pointers.append((_DESC_BIAS_POINTER, _constant(bias, out_dtype)))
    return _matmul(spec, plan or _plan(x8.device, spec, algo, workspace_cap), x8, w8, pointers)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: str = "", algo: int = 0,
         workspace_cap: int = 0, plan: _Plan | None = None) -> torch.Tensor:
    """act(x @ w + bias) for FP16/BF16 x [M, K] (row-major) and w [K, N] (row-major or K-major), in x's type, with
    cuBLASLt's choice `algo` among the kernels needing at most workspace_cap bytes of scratch (none by default:
    torch's addmm covers the others), or `plan`. Raises CublasLtError where `supported` is False for choice 0."""
    spec = spec_of(x, w, bias is not None, act, False, x.dtype)
    if not aligned(x, w):
        raise CublasLtError("gemm takes a row-major x and row-major or K-major weights, both 256-byte aligned")
    pointers = [] if bias is None else [(_DESC_BIAS_POINTER, _constant(bias, x.dtype))]
    return _matmul(spec, plan or _plan(x.device, spec, algo, workspace_cap), x, w, pointers)


def aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemm` takes x and w as they are: the heuristic's kernels may assume 256-byte aligned operands
    (its default preference), which fresh tensors are and a view into another may not be."""
    return (x.is_contiguous() and (w.is_contiguous() or w.t().is_contiguous()) and x.data_ptr() % 256 == 0
            and w.data_ptr() % 256 == 0)


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha and beta, read by every call


def _matmul(spec: Spec, plan: _Plan, x: torch.Tensor, w: torch.Tensor, pointers: list) -> torch.Tensor:
    """One cublasLtMatmul of a plan for `spec`, with its per-call pointers (scales, bias) set first."""
    y = torch.empty(spec.m, spec.n, dtype=spec.out, device=x.device)
    ws, dev, api = scratch(x.device, plan.workspace), x.device.index or 0, plan.api
    with _LAUNCH:  # the pointers live in the plan's shared descriptor until cublasLtMatmul has read them
        for attr, t in pointers:
            _set(api, plan.desc, attr, ctypes.c_void_p(t.data_ptr()))
        api.matmul(_handle(dev, api), plan.desc, ctypes.addressof(_ONE), w.data_ptr(), plan.layouts[0],
                   x.data_ptr(), plan.layouts[1], ctypes.addressof(_ZERO), 0, plan.layouts[2], y.data_ptr(),
                   plan.layouts[3], plan.algo, ws.data_ptr(), plan.workspace,
                   torch.cuda.current_stream(x.device).cuda_stream)
    return y


def spec_of(x: torch.Tensor, w: torch.Tensor, has_bias: bool, act: str, fp8_out: bool, out_dtype: torch.dtype) -> Spec:
    """The Spec of x[..., K] @ w[K, N] (x's leading axes flattened)."""
    k, n = w.shape
    # The weights' type, not x's: the FP8 tactics quantize a float x themselves. FP8 weights are made K-major,
    # the one form cuBLASLt's FP8 GEMM takes.
    fp8 = w.dtype == torch.float8_e4m3fn
    k_major = fp8 or (w.t().is_contiguous() and not w.is_contiguous())
    return Spec(x.numel() // k, n, k, torch.float8_e4m3fn if fp8_out else out_dtype, out_dtype if has_bias else None,
                act, w.dtype, k_major)
