"""`kiln inspect ENGINE`: the engine inspector.

One row per engine layer: its name (a fused layer joins its source ONNX nodes
with " + "), layer type, tactic, input/output shapes for each optimization
profile (min..max, measured by running the engine once at each profile's min,
opt and max shapes), precisions, weight count and activation bytes. Findings:
fusions the pattern catalogue expected that did not fire (and why), and layers
that run in a higher precision than the build requested.

`--json FILE` writes TensorRT's layer-info shape:
    {"Layers": [{"Name", "LayerType", "Inputs": [{"Name", "Dimensions", "Format/Datatype"}],
                 "Outputs": [...], "TacticName", ...}], "Bindings": [...]}
with Kiln's extra facts (precision, placement, per-profile shapes, findings)
beside TensorRT's field names.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ..console import console, fmt_bytes
from ..errors import EngineFileError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from ..json_file import atomic_write_json
from ..samples import random_feeds
from .compare import layer_name
from .engine_args import load_engine

# Compute precisions from narrowest to widest (a layer above the requested one is a finding).
_RANK = {"int4": 0, "int8": 1, "fp8": 2, "float8_e4m3fn": 2, "float8_e5m2": 2, "float16": 3, "bfloat16": 3,
         "tf32": 5, "float32": 5, "float64": 6}

_TRT_TYPE = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int8": "Int8", "int32": "Int32",
             "int64": "Int64", "bool": "Bool", "uint8": "UInt8", "float8_e4m3fn": "FP8", "float64": "FP64"}
_TRT_WEIGHT_TYPE = {"float32": "Float", "float16": "Half", "bfloat16": "BFloat16", "int8": "Int8",
                    "int32": "Int32", "int64": "Int64", "float8_e4m3fn": "FP8"}


def trt_format(dtype: str | None) -> str:
    return f"Row major linear {_TRT_TYPE.get(dtype or '', (dtype or 'unknown').upper())}"


@dataclass
class TensorInfo:
    name: str
    dtype: str | None = None
    # per profile: {"min": [...], "opt": [...], "max": [...]} (None where not measured)
    shapes: list = field(default_factory=list)
    kind: str = "activation"  # "activation", "weight", "input", "host"
    count: int = 0  # elements (weights)

    def to_trt(self, location: str = "Device") -> dict:
        dims = None
        if self.shapes and self.shapes[0]:
            dims = self.shapes[0]["opt"]
        return {"Name": self.name, "Location": location, "Dimensions": dims, "Format/Datatype": trt_format(self.dtype),
                "Profiles": self.shapes}


@dataclass
class LayerInfo:
    index: int
    name: str  # fused source names joined with " + "
    node_name: str
    op_type: str
    domain: str
    tactic: str
    precision: str
    placement: str
    note: str
    sources: list
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    weights: list[TensorInfo]
    activation_bytes: list  # per profile, bytes of this layer's outputs at the profile's max shape
    profile_tactics: list = field(default_factory=list)  # per profile, when the fastest differs between them

    @property
    def tactic_text(self) -> str:
        """The tactic, or each profile's when they differ ("p0 a | p1 b")."""
        return " | ".join(f"p{i} {t}" for i, t in enumerate(self.profile_tactics)) or self.tactic

    @property
    def weight_count(self) -> int:
        return sum(w.count for w in self.weights)

    @property
    def layer_type(self) -> str:
        return self.op_type if self.domain in ("", "ai.onnx") else f"{self.domain}::{self.op_type}"

    def to_trt(self) -> dict:
        loc = "Host" if self.placement == "host" else "Device"
        wtypes = sorted({w.dtype for w in self.weights if w.dtype})
        d = {
            "Name": self.name,
            "LayerType": self.layer_type,
            "Inputs": [t.to_trt("Host" if t.kind == "host" else loc) for t in self.inputs],
            "Outputs": [t.to_trt(loc) for t in self.outputs],
            "TacticName": self.tactic,
            **({"TacticPerProfile": self.profile_tactics} if self.profile_tactics else {}),
            "Precision": self.precision,
            "Placement": self.placement,
            "Origin": self.node_name,
            "Sources": self.sources,
            "ActivationBytes": self.activation_bytes,
        }
        if self.weights:
            d["Weights"] = {"Type": "/".join(_TRT_WEIGHT_TYPE.get(t, t) for t in wtypes), "Count": self.weight_count}
            d["WeightTensors"] = [{"Name": w.name, "Dimensions": w.shapes[0]["opt"] if w.shapes else None,
                                   "Format/Datatype": trt_format(w.dtype)} for w in self.weights]
        if self.note:
            d["Note"] = self.note
        return d


@dataclass
class Inspection:
    source: str
    target: str
    precision: str
    layers: list[LayerInfo]
    bindings: list[dict]
    profiles: list[dict]
    findings: list[dict]
    arena_bytes: list
    weight_bytes: int | None
    versions: dict
    measured: bool  # shapes come from running the engine
    note: str = ""

    def to_json(self) -> dict:
        return {
            "Layers": [layer.to_trt() for layer in self.layers],
            "Bindings": [b["name"] for b in self.bindings],
            "Kiln": {
                "source": self.source, "target": self.target, "precision": self.precision,
                "bindings": self.bindings, "profiles": self.profiles, "findings": self.findings,
                "arena_bytes": self.arena_bytes, "weight_bytes": self.weight_bytes, "versions": self.versions,
                "shapes_measured": self.measured, "note": self.note,
            },
        }


# --- measuring shapes -----------------------------------------------------------------------------------


def measure_tensors(engine) -> dict[str, dict]:
    """{tensor: {"dtype", "shapes": [per profile {"min","opt","max"}]}} by running every profile at its
    min, opt and max input shapes with run_layerwise (device layers and graph inputs)."""
    found: dict[str, dict] = {}
    n = engine.num_optimization_profiles
    picks = ("min", "opt", "max")
    for p in range(n):
        ctx = engine.create_execution_context(profile=p, cuda_graphs=False)
        for k, pick in enumerate(picks):
            feeds = random_feeds(engine, profile=p, seed=k, pick=k)

            def record(name, t, p=p, pick=pick):
                entry = found.setdefault(name, {"dtype": None, "shapes": [None] * n})
                entry["dtype"] = _dtype_name(t.dtype)
                if entry["shapes"][p] is None:
                    entry["shapes"][p] = {}
                entry["shapes"][p][pick] = [int(d) for d in t.shape]

            for name, x in feeds.items():
                record(name, torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x)

            def observer(node, outs):
                if outs is None:
                    return
                for name, t in zip(node.outputs, outs):
                    if name and isinstance(t, torch.Tensor):
                        record(name, t)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ctx.run_layerwise(feeds, observer)
    return found


# --- building the inspection ---------------------------------------------------------------------------


def precision_findings(nodes, requested: str, existing: list[dict]) -> list[dict]:
    """Device layers whose compute precision is wider than the build asked for."""
    have = {f.get("layer") for f in existing if f.get("kind") == "precision"}
    want = _RANK.get(requested, 5)
    out = []
    for n in nodes:
        if n["placement"] != "device" or n["name"] in have:
            continue
        if _RANK.get(n["precision"], 5) > want:
            out.append({"kind": "precision", "layer": n["name"], "requested": requested, "actual": n["precision"],
                        "reason": n.get("note") or "no reason recorded by the builder"})
    return out


def _merge_findings(engine_findings: list[dict], graph_findings: list[dict]) -> list[dict]:
    out, seen = [], set()
    for f in [*engine_findings, *graph_findings]:
        key = repr(sorted(f.items(), key=lambda kv: kv[0]))
        if key not in seen:
            seen.add(key)
            out.append(dict(f))
    return out


def inspect_engine(engine, measure: bool = True, device: str = "auto", verify_key: bytes | None = None) -> Inspection:
    """Inspect an Engine or a .kiln path. An engine that cannot run here (built for another GPU) is
    inspected from its manifest, without shapes."""
    is_path = isinstance(engine, (str, os.PathLike))
    source = str(engine) if is_path else "engine (in memory)"
    try:
        engine = load_engine(engine, device, verify_key=verify_key)
    except EngineFileError as e:
        from ..engine.serialize import ForeignEngineError

        if is_path and isinstance(e, ForeignEngineError):  # intact, built elsewhere: shown from its manifest
            from ..engine.serialize import read_manifest

            try:
                m = read_manifest(engine, verify_key)  # integrity and signature first: a damaged engine fails
            except Exception:
                raise e from None
            if m.get("format") != "kiln-engine":
                raise
            return _from_manifest(m, source, note=f"this engine cannot run here ({e}); shapes are not shown")
        raise
    g = engine.graph
    tensors = measure_tensors(engine) if measure else {}
    n_prof = engine.num_optimization_profiles
    inputs = {v.name: v for v in engine.inputs}
    layers = []
    for i, node in enumerate(g.nodes):
        ins, weights, outs = [], [], []
        for name in node.inputs:
            if not name:
                continue
            if name in g.initializers:
                w = g.initializers[name]
                shp = {"min": list(w.shape), "opt": list(w.shape), "max": list(w.shape)}
                weights.append(TensorInfo(name, dtypes.name_of(w.dtype), [shp] * n_prof, "weight", int(w.numel())))
            else:
                info = tensors.get(name)
                kind = "input" if name in inputs else ("activation" if info else "host")
                dtype = info["dtype"] if info else (dtypes.name_of(inputs[name].dtype) if name in inputs
                                                    and inputs[name].dtype is not None else None)
                ins.append(TensorInfo(name, dtype, info["shapes"] if info else [], kind))
        for name in node.outputs:
            if name:
                info = tensors.get(name)
                outs.append(TensorInfo(name, info["dtype"] if info else None, info["shapes"] if info else [],
                                       "activation" if node.placement == "device" else "host"))
        act = []
        for p in range(n_prof):
            total = 0
            for t in outs:
                s = t.shapes[p] if t.shapes and t.shapes[p] else None
                if s and "max" in s and t.dtype:
                    total += int(np.prod(s["max"])) * _itemsize(t.dtype)
            act.append(total if tensors else None)
        layers.append(LayerInfo(
            index=i, name=layer_name(node), node_name=node.name, op_type=node.op_type, domain=node.domain,
            tactic=node.tactic, profile_tactics=list(node.profile_tactics), precision=node.precision,
            placement=node.placement, note=node.note,
            sources=list(node.sources), inputs=ins, outputs=outs, weights=weights, activation_bytes=act))
    found = _merge_findings(engine.findings, getattr(g, "findings", []) or [])
    node_rows = [{"name": n.name, "placement": n.placement, "precision": n.precision, "note": n.note} for n in g.nodes]
    found += precision_findings(node_rows, engine.precision, found)
    return Inspection(
        source=source, target=engine.target.describe(), precision=engine.precision, layers=layers,
        bindings=engine.bindings(), profiles=[p.to_json() for p in engine.profiles], findings=found,
        arena_bytes=list(engine.arena_bytes), weight_bytes=engine.weight_bytes, versions=dict(engine.versions),
        measured=bool(tensors))


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return dtypes.name_of(dtype)
    except KeyError:
        return str(dtype).removeprefix("torch.")


def _itemsize(dtype: str) -> int:
    try:
        return torch.empty((), dtype=dtypes.from_name(dtype)).element_size()
    except Exception:
        return 4


def _from_manifest(m: dict, source: str, note: str) -> Inspection:
    t = m.get("target", {})
    target = (f"{t.get('name')} (compute capability {t.get('capability')})" if t.get("kind") == "cuda"
              else f"CPU ({t.get('name')}, reference kernels)")
    layers = [LayerInfo(index=i, name=" + ".join(x.get("sources") or []) or x["name"], node_name=x["name"],
                        op_type=x["op_type"], domain=x.get("domain", ""), tactic=x.get("tactic", ""),
                        profile_tactics=x.get("profile_tactics") or [],
                        precision=x.get("precision", ""), placement=x.get("placement", "device"),
                        note=x.get("note", ""), sources=x.get("sources") or [], inputs=[], outputs=[], weights=[],
                        activation_bytes=[])
              for i, x in enumerate(m.get("layers", []))]
    precision = m.get("build_config", {}).get("precision", "float32")
    found = list(m.get("findings", []))
    found += precision_findings([{"name": x["name"], "placement": x.get("placement", "device"),
                                  "precision": x.get("precision", ""), "note": x.get("note", "")}
                                 for x in m.get("layers", [])], precision, found)
    return Inspection(source=source, target=target, precision=precision, layers=layers,
                      bindings=m.get("bindings", []), profiles=m.get("profiles", []), findings=found,
                      arena_bytes=m.get("arena_bytes", []), weight_bytes=None, versions=m.get("versions", {}),
                      measured=False, note=note)


# --- text ------------------------------------------------------------------------------------------------


def compact_range(shapes: list) -> str:
    """Per profile 'min..max' per axis: [{'min': [1,3], 'max': [8,3]}] -> '[1..8]x3'; profiles joined by ' | '."""
    parts = []
    for s in shapes:
        if not s or "min" not in s or "max" not in s:
            parts.append("?")
            continue
        dims = [str(a) if a == b else f"[{a}..{b}]" for a, b in zip(s["min"], s["max"])]
        parts.append("x".join(dims) if dims else "scalar")
    return " | ".join(parts) if parts else "-"


def no_findings(precision: str) -> str:
    """The inspector's verdict when it found nothing (the console, the report's litmus row and its pages)."""
    return f"every expected fusion fired and no layer runs above the requested precision ({precision})"


def describe_finding(f: dict) -> str:
    kind = f.get("kind")
    if kind == "fusion-missed":
        nodes = ", ".join(f"'{n}'" for n in f.get("nodes", []))
        return f"fusion not applied: {f.get('pattern')} on {nodes}: {f.get('reason')}"
    if kind == "precision":
        return (f"layer '{f.get('layer')}' runs in {f.get('actual')}, the build requested {f.get('requested')}: "
                f"{f.get('reason') or 'no reason recorded'}")
    if kind == "precision-search":
        from ..quant import search

        if hasattr(search, "summary"):
            return "\n".join(search.summary(f))
    if kind == "precision-by-speed":
        tried = f.get("kept_in_float") or f.get("tried_in_float") or []
        groups = "; ".join(f"{', '.join(k['layers'])} ({k['float_us']} us in float against {k['quantized_us']})"
                           for k in tried)
        latency = (f"; end to end {f['quantized_latency_us']} us all quantized" if "quantized_latency_us" in f else "")
        latency += f", {f['mixed_latency_us']} us as kept" if "mixed_latency_us" in f else ""
        trials = ", ".join(f"{t['groups']} group(s) {t['latency_us']} us against {t['against_us']}"
                           f" ({'kept' if t['kept'] else 'not kept'})" for t in f.get("trials", []))
        return (f"precision by speed ({f.get('engines_built')} builds{latency}): "
                f"{f.get('result', 'every quantized group timed faster than float')}"
                + (f"; groups faster in float: {groups}" if groups else "")
                + (f"; trials end to end: {trials}" if trials else "")
                + (f"; {len(f['not_tried'])} group(s) faster in float not tried (their class saved under "
                   f"{f.get('min_saving_us')} us)" if f.get("not_tried") else ""))
    rest = ", ".join(f"{k}={v}" for k, v in f.items() if k != "kind")
    return f"{kind}: {rest}"


def render(ins: Inspection, con, show_host: bool = True) -> None:
    from rich.table import Table

    device_layers = [x for x in ins.layers if x.placement == "device"]
    con.print(f"Engine: {ins.source}")
    con.print(f"  target: {ins.target}   precision requested: {ins.precision}   layers: {len(ins.layers)} "
              f"({len(ins.layers) - len(device_layers)} shape-arithmetic layers on the host)"
              + (f"   weights: {fmt_bytes(ins.weight_bytes)}" if ins.weight_bytes is not None else ""))
    for i, p in enumerate(ins.profiles):
        txt = ", ".join(f"{k}: {fmt_shape(v['min'])}..{fmt_shape(v['max'])} "
                        f"(opt {fmt_shape(v['opt'])})"
                        for k, v in p.items())
        arena = ins.arena_bytes[i] if i < len(ins.arena_bytes) else None
        con.print(f"  profile {i}: {txt}" + (f"   activations at max: {fmt_bytes(arena)}" if arena else ""))
    if ins.note:
        con.print(f"  note: {ins.note}")
    table = Table(show_lines=False, pad_edge=False, box=None, header_style="bold")
    for col in ("#", "Name", "Type", "Tactic", "Precision", "Inputs (min..max per profile)", "Outputs", "Weights",
                "Act. (max)"):
        table.add_column(col, overflow="fold")
    for x in ins.layers:
        if x.placement == "host" and not show_host:
            continue
        in_types = sorted({t.dtype for t in x.inputs if t.dtype})
        out_types = sorted({t.dtype for t in x.outputs if t.dtype})
        prec = x.precision if x.placement == "device" else "host"
        if x.placement == "device" and (in_types or out_types):
            prec += f" ({'/'.join(in_types) or '?'} -> {'/'.join(out_types) or '?'})"
        act = max((a for a in x.activation_bytes if a is not None), default=None)
        table.add_row(
            str(x.index), x.name, x.layer_type, x.tactic_text, prec,
            "; ".join(f"{t.name} {'(host)' if t.kind == 'host' else compact_range(t.shapes)}" for t in x.inputs) or "-",
            "; ".join(f"{t.name} {compact_range(t.shapes)}" for t in x.outputs) or "-",
            f"{x.weight_count:,}" if x.weights else "-", fmt_bytes(act) if act else "-")
    con.print(table)
    if ins.findings:
        con.print(f"Findings ({len(ins.findings)}):")
        for f in ins.findings:
            con.print(f"  - {describe_finding(f)}")
    else:
        con.print(f"Findings: none: {no_findings(ins.precision)}.")


# --- command line ------------------------------------------------------------------------------------


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("inspect", help="list an engine's layers, tactics, shapes and precisions; findings",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", metavar="ENGINE", help="the engine file (.kiln)")
    p.add_argument("--json", metavar="FILE", help="write TensorRT's layer-info JSON here")
    p.add_argument("--no-run", action="store_true", help="do not run the engine to measure shapes (faster)")
    p.add_argument("--device-only", action="store_true", help="hide host (shape-arithmetic) layers in the table")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--verify-key", "--verifyKey", dest="verify_key", metavar="KEYFILE",
                   help="refuse the engine unless it was signed with this key (kiln build --sign KEYFILE)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    con = console()
    from ..engine.signing import load_key
    from ..llm import engine_file

    key = load_key(args.verify_key) if args.verify_key else None
    if engine_file.is_llm_engine(args.engine):  # a `kiln llm build` engine: its own manifest and table
        if key is not None:
            engine_file.read_manifest(args.engine, key)
        engine_file.render_inspection(args.engine, con)
        return 0
    ins = inspect_engine(args.engine, measure=not args.no_run, device=args.device, verify_key=key)
    render(ins, con, show_host=not args.device_only)
    if args.json:
        atomic_write_json(args.json, ins.to_json())
        con.print(f"Layer information written to {args.json}")
    return 0
