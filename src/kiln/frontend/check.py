"""`kiln check`: validate a model and report what Kiln can build, before a long build.

    check_model(model_or_path, upgrade_opset=None) -> CheckReport

1. load (a bad file is a ModelError right away; external data is validated, not read)
2. opsets: recommend >= 17; with upgrade_opset=N convert with onnx.version_converter
3. onnx.checker, then strict shape inference (check_type, strict_mode, data_prop).
   Together they are onnx's "full check"; inference runs as its own step so its
   error is reported once and names the node. Models with external data (any
   model over 2 GB) are checked through their path (onnx.checker.check_model(path),
   infer_shapes_path), as one protobuf cannot hold them. Data propagation is
   switched off, and the report says so, when a 1-D tensor exceeds
   DATA_PROP_MAX_ELEMENTS (onnx would need ~70 bytes per element).
4. structure: node inputs nothing provides, graph inputs/outputs (dynamic axes
   are the axes a build profile must cover), element types Kiln lacks
5. the operator table: every node (subgraphs too) against the op registry
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import AttributeProto, TensorProto

from ..errors import ConfigError, KilnError, ModelError, UnsupportedError
from ..ir import dtypes
from ..ir.graph import Node
from . import external_data
from .onnx_loader import PROTOBUF_LIMIT, read_model
from .opset import opset_advice, opset_versions
from .opset import upgrade_opset as convert_opset
from .report import CheckReport, MissingInput, OpSupport, Step, TensorInfo


def check_model(model, upgrade_opset: int | None = None, *, base_dir=None) -> CheckReport:
    """Check an ONNX model (a path, bytes or onnx.ModelProto) and report whether Kiln can build it.

    Raises ModelError when the model cannot be loaded at all (missing file, not
    ONNX, bad external data); everything else is reported in the CheckReport.
    The caller's ModelProto is never modified.
    """
    loaded = read_model(model, base_dir=base_dir, load_external_data=False)
    proto = loaded.model
    report = CheckReport(
        model=loaded.name,
        ir_version=proto.ir_version,
        producer=" ".join(p for p in (proto.producer_name, proto.producer_version) if p),
        opsets=opset_versions(proto),
        base_dir=loaded.base_dir,
    )
    report.warnings += opset_advice(proto)
    converted = False
    if upgrade_opset is not None:
        report.upgrade = convert_opset(proto, upgrade_opset)
        if report.upgrade.ok and report.upgrade.model is not proto:
            proto, converted = report.upgrade.model, True
            report.opsets = opset_versions(proto)
            report.ir_version = proto.ir_version
            report.warnings = opset_advice(proto)
    report.checked_model = proto

    inferred = None
    with _checkable(loaded, proto, converted) as (mem, path):
        report.checker = _run_checker(mem, path)
        report.shape_inference, inferred = _run_shape_inference(mem, path, proto)

    # Attribute and subgraph tensors are decoded for the op checks; weights are not read.
    if any(external_data.is_external(s.tensor) and not s.top_level_initializer
           for s in external_data.iter_tensors(proto)):
        proto = _copy(proto)
        external_data.load(proto, loaded.base_dir, loaded.label, skip_top_level_initializers=True)

    _structure(report, proto, inferred)
    report.operators = _operator_table(proto, report)
    return report


# ---------------------------------------------------------------- onnx.checker and shape inference


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _too_big(model: onnx.ModelProto) -> bool:
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except Exception:  # protobuf refuses to even measure a message over 2 GB
        return True


@contextlib.contextmanager
def _checkable(loaded, proto: onnx.ModelProto, converted: bool) -> Iterator[tuple[onnx.ModelProto | None, Path | None]]:
    """Yield (model, None) for in-memory checks or (None, path) when onnx must read a file."""
    if external_data.has_external_data(proto):
        if loaded.path is not None and not converted:
            yield None, loaded.path  # the original file: onnx reads it and its external data itself
            return
        # An upgraded model, or an in-memory one with external data: stage it with its data files.
        with tempfile.TemporaryDirectory(prefix="kiln-check-") as tmp:
            yield None, _stage(proto, loaded, Path(tmp))
        return
    if not _too_big(proto):
        yield proto, None
        return
    with tempfile.TemporaryDirectory(prefix="kiln-check-") as tmp:
        yield None, save_with_external_data(proto, Path(tmp) / "model.onnx")


def _stage(proto: onnx.ModelProto, loaded, folder: Path) -> Path:
    """Write the (small) model file into `folder` with copies of its external data files beside it."""
    for ref in external_data.validate(proto, loaded.base_dir, loaded.label):
        dst = folder / ref.location
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ref.path, dst)  # streams, never holds the weights in memory (onnx refuses hard links)
    path = folder / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def save_with_external_data(model: onnx.ModelProto, path: Path, threshold: int = 1024) -> Path:
    """Write the model with its large tensors in `<name>.data` beside it, without copying it in memory.

    The model is left as it was (its tensors get their bytes back after the write).
    """
    data_name = path.name + ".data"
    moved: list[tuple[TensorProto, bytes, bool]] = []
    try:
        with open(path.parent / data_name, "wb") as f:
            for site in external_data.iter_tensors(model):
                t = site.tensor
                if external_data.is_external(t):
                    continue
                data = t.raw_data  # read once: protobuf makes a new bytes object per access
                if len(data) < threshold:
                    continue
                offset = f.tell()
                f.write(data)
                moved.append((t, data, t.HasField("data_location")))
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(data)))):
                    e = t.external_data.add()
                    e.key, e.value = k, v
        try:
            path.write_bytes(model.SerializeToString())
        except Exception as e:
            raise ModelError(f"the model cannot be serialized even with its weights moved out: {e}") from None
    finally:
        for t, data, had_location in moved:
            del t.external_data[:]
            t.ClearField("data_location")
            if had_location:
                t.data_location = TensorProto.DEFAULT
            t.raw_data = data
    return path


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


_NODE_PATTERNS = (
    re.compile(r"node name: ([^)\n]+)\)"),
    re.compile(r"[Nn]ame: (\S+) OpType: "),
    re.compile(r"node name (\S+?)\.(?:\s|$)"),
    re.compile(r"node '([^']+)'"),
)


def node_in_message(msg: str) -> str | None:
    """The node an onnx checker / shape inference message names, if any."""
    for pat in _NODE_PATTERNS:
        m = pat.search(msg)
        if m and m.group(1).strip():
            return m.group(1).strip()
    return None


def _run_checker(mem: onnx.ModelProto | None, path: Path | None) -> Step:
    try:
        onnx.checker.check_model(mem if path is None else str(path), full_check=False)
    except Exception as e:  # ValidationError, or a C++ error for very broken models
        msg = _one_line(e)
        return Step("onnx.checker", False, msg, node_in_message(msg))
    return Step("onnx.checker", True, "passed")


# onnx's data propagation costs ~70 bytes per element of a 1-D tensor fed to elementwise ops
# (measured with onnx 1.23): a 275M-element bias would need ~20 GB. Past this size it is turned off.
DATA_PROP_MAX_ELEMENTS = 1 << 20


def _data_prop_blocker(model: onnx.ModelProto) -> str | None:
    """The first 1-D tensor too large for data propagation, if any."""
    for site in external_data.iter_tensors(model):
        t = site.tensor
        if len(t.dims) == 1 and t.dims[0] > DATA_PROP_MAX_ELEMENTS:
            return f"{site.where} has {t.dims[0]:,} elements"
    return None


def _run_shape_inference(mem: onnx.ModelProto | None, path: Path | None,
                         skeleton: onnx.ModelProto) -> tuple[Step, onnx.ModelProto | None]:
    name = "shape inference (strict)"
    blocker = _data_prop_blocker(skeleton)
    data_prop = blocker is None
    try:
        if path is None:
            inferred = onnx.shape_inference.infer_shapes(mem, check_type=True, strict_mode=True, data_prop=data_prop)
        else:
            with tempfile.TemporaryDirectory(prefix="kiln-infer-") as tmp:
                out = Path(tmp) / "inferred.onnx"
                onnx.shape_inference.infer_shapes_path(str(path), str(out), check_type=True, strict_mode=True,
                                                       data_prop=data_prop)
                inferred = onnx.load(str(out), load_external_data=False)
    except Exception as e:  # InferenceError, or a ValidationError for malformed models
        msg = _one_line(e)
        return Step(name, False, msg, node_in_message(msg)), None
    note = ("passed" if data_prop
            else f"passed without data propagation ({blocker}; onnx would need ~70 bytes per element)")
    return Step(name, True, note), inferred


# ---------------------------------------------------------------- graph structure


def _type_name(elem_type: int) -> str:
    try:
        return dtypes.name_of(dtypes.onnx_to_torch(elem_type))
    except KeyError:
        return onnx.TensorProto.DataType.Name(elem_type).lower()


_BIND = {"sequence_type": "kiln.frontend.bind_sequence_inputs gives each element its own input",
         "optional_type": "kiln.frontend.bind_optional_inputs binds it as given or empty"}


def _held_tensor(t: onnx.TypeProto) -> onnx.TypeProto | None:
    """The tensor type of a tensor, a sequence of tensors, or an optional of either; None for other types."""
    if t.WhichOneof("value") == "optional_type":
        t = t.optional_type.elem_type
    if t.WhichOneof("value") == "sequence_type":
        t = t.sequence_type.elem_type
    return t if t.WhichOneof("value") == "tensor_type" else None


def _tensor_info(vi: onnx.ValueInfoProto, is_input: bool = True) -> tuple[TensorInfo, str | None]:
    """The value's info, and the reason Kiln cannot bind it (None when it can). Sequence and optional outputs
    are returned as lists and None; as inputs they must be bound as tensors first."""
    kind = vi.type.WhichOneof("value") or "untyped"
    held = _held_tensor(vi.type)
    if kind != "tensor_type" and (held is None or is_input):
        how = f" ({_BIND[kind]})" if held is not None else ""
        return TensorInfo(vi.name, None, None), (f"is a {kind.replace('_type', '')} value; an engine binds tensors "
                                                 f"only{how}")
    tt = held.tensor_type
    dtype = _type_name(tt.elem_type) if tt.elem_type else None
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
    reason = None
    if tt.elem_type and not _kiln_type(tt.elem_type):
        reason = f"has element type {dtype}, which Kiln does not support"
    return TensorInfo(vi.name, dtype, shape), reason


def _structure(report: CheckReport, model: onnx.ModelProto, inferred: onnx.ModelProto | None) -> None:
    g = model.graph
    inits = {t.name for t in g.initializer} | {s.values.name for s in g.sparse_initializer}
    for vi in g.input:
        if vi.name in inits:  # old exporters list weights among the inputs; they are not bindings
            continue
        info, bad = _tensor_info(vi)
        report.inputs.append(info)
        if bad:
            report.other_problems.append(f"graph input '{vi.name}' {bad}.")
        elif info.shape is None:
            report.warnings.append(f"graph input '{vi.name}' has no shape; "
                                   "give one at build time (--shapes or a profile).")
        elif info.dynamic_axes:
            report.warnings.append(
                f"graph input '{vi.name}' ({info.dims}) has dynamic axes {info.dynamic_axes}: give them a profile "
                "(--minShapes/--optShapes/--maxShapes) when building, or they are built at size 1."
            )
    outputs = inferred.graph.output if inferred is not None else g.output
    for vi in outputs:
        info, bad = _tensor_info(vi, is_input=False)
        report.outputs.append(info)
        if bad:
            report.other_problems.append(f"graph output '{vi.name}' {bad}.")
    for t in g.initializer:
        if t.data_type == TensorProto.STRING:
            report.other_problems.append(f"initializer '{t.name}' is a string tensor; "
                                         "Kiln supports numeric tensors only.")
        elif t.data_type != TensorProto.UNDEFINED and not _kiln_type(t.data_type):
            report.other_problems.append(
                f"initializer '{t.name}' has element type {_type_name(t.data_type)}, which Kiln does not support."
            )
    if len(g.sparse_initializer):
        names = ", ".join(f"'{s.values.name}'" for s in g.sparse_initializer[:5])
        report.other_problems.append(f"the graph has sparse initializers ({names}), which Kiln does not support.")
    report.missing_inputs = missing_inputs(g)
    problem = opset_problem(model)
    if problem:
        report.other_problems.append(f"the model {problem}")


def _kiln_type(elem_type: int) -> bool:
    try:
        dtypes.onnx_to_torch(elem_type)
    except KeyError:
        return False
    return True


def _walk(graph: onnx.GraphProto, outer: frozenset[str],
          prefix: str = "") -> Iterator[tuple[onnx.NodeProto, str, frozenset[str]]]:
    """(node, label, names visible to it) for every node, subgraphs included.

    A node's label is its name, or op_type_index as kiln.ir names unnamed nodes;
    subgraph nodes are prefixed with their parent's label and attribute.
    """
    visible = set(outer)
    visible.update(v.name for v in graph.input)
    visible.update(t.name for t in graph.initializer)
    visible.update(s.values.name for s in graph.sparse_initializer)
    visible.update(o for n in graph.node for o in n.output if o)
    scope = frozenset(visible)
    for i, n in enumerate(graph.node):
        label = prefix + (n.name or f"{n.op_type}_{i}")
        yield n, label, scope
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _walk(a.g, scope, f"{label}/{a.name}/")
            elif a.type == AttributeProto.GRAPHS:
                for j, sub in enumerate(a.graphs):
                    yield from _walk(sub, scope, f"{label}/{a.name}[{j}]/")


def missing_inputs(graph: onnx.GraphProto) -> list[MissingInput]:
    """Node inputs (and graph outputs) that no node, graph input or initializer provides."""
    out = []
    for node, label, scope in _walk(graph, frozenset()):
        out += [MissingInput(label, i) for i in node.input if i and i not in scope]
    top = ({v.name for v in graph.input} | {t.name for t in graph.initializer}
           | {o for n in graph.node for o in n.output})
    out += [MissingInput("graph output", o.name) for o in graph.output if o.name not in top]
    return out


# ---------------------------------------------------------------- operator support


def _kiln_node(n: onnx.NodeProto, label: str, opsets: dict[str, int]) -> tuple[Node | None, str | None]:
    """The kiln Node for an ONNX node (attributes decoded), or the reason it cannot be decoded."""
    from ..ir.from_onnx import (
        _attr,  # attribute decoding shared with the builder's importer
    )

    domain = "" if n.domain == "ai.onnx" else n.domain
    try:
        attrs = {a.name: _attr(a, label, opsets) for a in n.attribute}
    except KilnError as e:
        return None, str(e)
    node = Node(op_type=n.op_type, inputs=list(n.input), outputs=list(n.output), attrs=attrs, name=label, domain=domain)
    node.opset = opsets.get(domain, opsets.get("", 17))
    return node, None


def _operator_table(model: onnx.ModelProto, report: CheckReport) -> list[OpSupport]:
    from ..ops.registry import unsupported_reason

    opsets = dict(report.opsets)
    opsets.setdefault("", 1)
    functions = {(f.domain, f.name) for f in model.functions}
    rows: dict[tuple[str, str], OpSupport] = {}
    for n, label, _ in _walk(model.graph, frozenset()):
        domain = "" if n.domain == "ai.onnx" else n.domain
        row = rows.setdefault((domain, n.op_type), OpSupport(domain, n.op_type))
        row.count += 1
        node, reason = _kiln_node(n, label, opsets)
        if node is not None:
            try:
                reason = unsupported_reason(node)
            except Exception as e:  # an op's capability check crashed: report, don't hide the node
                reason = f"{n.op_type}: Kiln's support check failed ({type(e).__name__}: {e})"
        if reason and (n.domain, n.op_type) in functions:
            reason = (f"{domain or 'ai.onnx'}::{n.op_type} is a function defined in the model; "
                      "Kiln does not inline model-local functions")
        if reason:
            row.blocking_nodes.append(label)
            if reason not in row.restrictions:
                row.restrictions.append(reason)
    return sorted(rows.values(), key=lambda r: (r.supported, r.domain, r.op_type))


# ---------------------------------------------------------------- the CLI subcommand


def add_check_command(subparsers) -> argparse.ArgumentParser:
    """Register `kiln check` on an argparse subparsers object; the handler is run_check."""
    p = subparsers.add_parser(
        "check",
        help="validate an ONNX model and report which operators Kiln can build",
        description=(
            "Runs onnx.checker, strict shape inference and Kiln's operator-support report on an ONNX model, "
            "and lists its inputs with their dynamic axes (the axes a build profile must cover). "
            "Exit status: 0 buildable, 1 not buildable (or the requested opset upgrade failed), "
            "2 the model could not be loaded."
        ),
    )
    p.add_argument("model", help="path to the .onnx file (external data is read from its folder)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--upgrade-opset", type=int, metavar="N", default=None,
                   help="convert the model to ai.onnx opset N with onnx.version_converter, then check the result")
    p.add_argument("--output", "-o", metavar="PATH", default=None,
                   help="with --upgradeOpset: write the converted model here")
    p.set_defaults(func=run_check)
    return p


def run_check(args: argparse.Namespace) -> int:
    """Handler of `kiln check`. Load errors are raised as KilnError (the CLI prints them), or printed as JSON
    with --json."""
    from rich.console import Console

    if getattr(args, "output", None) and args.upgrade_opset is None:
        raise ConfigError("--output writes the upgraded model, so it needs --upgradeOpset N.")
    try:
        report = check_model(args.model, upgrade_opset=args.upgrade_opset)
    except KilnError as e:
        if args.json:
            print(json.dumps({"model": str(args.model), "buildable": False, "error": str(e)}, indent=2))
            return e.exit_code
        raise
    saved = None
    if getattr(args, "output", None) and report.upgrade is not None and report.upgrade.ok:
        saved = save_model(report, args.output)
    if args.json:
        out = report.to_json()
        if saved is not None:
            out["opset"]["upgrade"]["saved_to"] = str(saved)
        print(json.dumps(out, indent=2))
    else:
        console = Console()
        report.render(console)
        if saved is not None:
            console.print(f"upgraded model written to {saved}")
    upgrade_failed = report.upgrade is not None and not report.upgrade.ok
    return 0 if report.buildable and not upgrade_failed else 1


def save_model(report: CheckReport, path) -> Path:
    """Write the model the report checked (the upgraded one) to `path`, weights included.

    A model that kept its weights in external files (or is over 2 GB) is written
    with them in `<name>.data` beside it, one tensor at a time.
    """
    path = Path(path)
    model = report.checked_model
    if model is None:
        raise ConfigError("this report holds no model to save.")
    if path.is_dir():
        raise ConfigError(f"--output '{path}' is a folder; give a file name such as model.opset17.onnx.")
    label = f"'{report.model}'"
    refs = external_data.validate(model, report.base_dir, label)
    data_path = path.with_name(path.name + ".data")
    sources = {os.path.realpath(r.path) for r in refs}
    if Path(report.model).is_file():
        sources.add(os.path.realpath(report.model))
    if {os.path.realpath(path), os.path.realpath(data_path)} & sources:
        raise ConfigError(f"--output '{path}' would overwrite the model being read; choose another file name.")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if refs:
            _save_restreamed(model, path, data_path, report.base_dir, label)
        elif _too_big(model):
            save_with_external_data(model, path)
        else:
            onnx.save_model(model, str(path))
    except OSError as e:
        raise ConfigError(f"cannot write '{path}': {e.strerror or e}.") from None
    return path


def _save_restreamed(model: onnx.ModelProto, path: Path, data_path: Path, base_dir, label: str) -> None:
    """Copy each external tensor's bytes into `data_path` and point a copy of the model at them."""
    model = _copy(model)  # small: its weights are external
    with open(data_path, "wb") as f:
        for site in external_data.iter_tensors(model):
            if not external_data.is_external(site.tensor):
                continue
            data = external_data.read(external_data.resolve(site, base_dir, label))
            offset = f.tell()
            f.write(data)
            del site.tensor.external_data[:]
            for k, v in (("location", data_path.name), ("offset", str(offset)), ("length", str(len(data)))):
                e = site.tensor.external_data.add()
                e.key, e.value = k, v
    path.write_bytes(model.SerializeToString())


# ---------------------------------------------------------------- the builder's pre-flight


_TYPE_ERRORS = ("TypeInferenceError", "inconsistent type", "elem type", "type mismatch", "Type Error")
TYPE_CHECK_MAX_BYTES = 256 * 2**20  # larger models skip the type check (onnx would copy them whole)


def preflight(model: onnx.ModelProto, label: str) -> None:
    """What `kiln check` reports as a problem and a build must refuse up front, naming the node: an opset newer
    than onnx knows, node inputs nothing provides (a missing initializer), values read before they are computed
    (a cycle), a value computed twice, and type errors (Add(float32, int64), a declared output type that
    differs from what the graph computes) that onnx's strict type inference finds."""
    problem = opset_problem(model)
    if problem:
        raise UnsupportedError(f"{label} {problem}")
    g = model.graph
    missing = missing_inputs(g)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelError(f"{label}: {missing[0].describe()}{more}; a build cannot compute it. "
                         "`kiln check` lists every such problem.")
    _check_order_and_ssa(g, label)
    opset = next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), None)
    if opset is not None:
        for node, node_label, _ in _walk(g, frozenset()):
            _check_schema(node, node_label, opset, label)
    if not external_data.has_external_data(model) and not _too_big_to_type_check(model):
        try:
            onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except Exception as e:  # noqa: BLE001 - onnx raises InferenceError, ValidationError or RuntimeError
            msg = _one_line(str(e))
            if any(t in msg for t in _TYPE_ERRORS):
                msg = re.sub(r"\((\d+)\) vs \((\d+)\)",  # onnx writes element types as numbers
                             lambda m: f"{_type_name(int(m.group(1)))} vs {_type_name(int(m.group(2)))}", msg)
                node = node_in_message(msg)
                where = f"node '{node}'" if node else "a node"
                raise ModelError(f"{label}: {where} has inconsistent element types ({msg[:400]}). onnxruntime "
                                 "refuses such a model too; fix the types (a Cast) in the exporter.") from None


def _check_schema(node: onnx.NodeProto, node_label: str, opset: int, label: str) -> None:
    """The node's input/output counts and attribute names against its ONNX schema (what onnx.checker checks
    of a node; its other demands, such as every value_info carrying a shape, a build does not need)."""
    if node.domain not in ("", "ai.onnx"):
        return
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except Exception:  # noqa: BLE001 - no such op at this opset: the operator report names it
        return
    n_in = len(node.input)
    while n_in and not node.input[n_in - 1]:
        n_in -= 1  # trailing optional inputs left empty
    if not schema.min_input <= n_in <= schema.max_input:
        want = (f"{schema.min_input}" if schema.min_input == schema.max_input
                else f"{schema.min_input} to {schema.max_input}")
        raise ModelError(f"{label}: node '{node_label}' ({node.op_type}) has {n_in} input(s); {node.op_type} at "
                         f"opset {schema.since_version} takes {want}.")
    if not schema.min_output <= len(node.output) <= schema.max_output:
        raise ModelError(f"{label}: node '{node_label}' ({node.op_type}) has {len(node.output)} output(s); "
                         f"{node.op_type} has {schema.min_output} to {schema.max_output}.")
    unknown = [a.name for a in node.attribute if a.name not in schema.attributes]
    if unknown:
        raise ModelError(f"{label}: node '{node_label}' ({node.op_type}) has attribute(s) {unknown}, which "
                         f"{node.op_type} does not have (its attributes: {sorted(schema.attributes) or 'none'}).")


def opset_problem(model: onnx.ModelProto) -> str | None:
    """Why the model's ONNX operator set cannot be built, or None."""
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and not 1 <= imp.version <= newest:
            return (f"imports the ONNX operator set version {imp.version}; the operator sets run from 1 to {newest} "
                    f"(onnx {onnx.__version__}). Export the model at a real opset (17 or newer).")
    return None


def _too_big_to_type_check(model: onnx.ModelProto) -> bool:
    try:
        return model.ByteSize() > TYPE_CHECK_MAX_BYTES
    except Exception:  # noqa: BLE001 - over 2 GB, protobuf cannot even measure it
        return True


def _check_order_and_ssa(graph: onnx.GraphProto, label: str, outer: frozenset[str] = frozenset()) -> None:
    """Every value is computed once, before any node reads it (ONNX's topological order)."""
    known = set(outer) | {v.name for v in graph.input} | {t.name for t in graph.initializer} \
        | {s.values.name for s in graph.sparse_initializer}
    producer: dict[str, str] = {}
    names = [n.name or f"{n.op_type}_{i}" for i, n in enumerate(graph.node)]
    for i, n in enumerate(graph.node):
        for o in n.output:
            if not o:
                continue
            if o in producer or (o in known and o not in outer):
                first = f"node '{producer[o]}'" if o in producer else "a graph input or initializer"
                raise ModelError(f"{label}: node '{names[i]}' computes '{o}', which {first} already provides; each "
                                 "value must be computed once (ONNX's single-assignment form), as onnx.checker and "
                                 "onnxruntime require.")
            producer[o] = names[i]
    done = set(known)
    for i, n in enumerate(graph.node):
        for name in n.input:
            if name and name not in done:
                cycle = _cycle(graph, names)
                why = (f"the graph has a cycle ({' -> '.join(cycle)})" if cycle else
                       "the nodes are not in topological order, which ONNX requires")
                raise ModelError(f"{label}: node '{names[i]}' reads '{name}' before node "
                                 f"'{producer.get(name, '?')}' computes it: {why}.")
        done.update(o for o in n.output if o)
        for a in n.attribute:
            subs = ([a.g] if a.type == AttributeProto.GRAPH
                    else list(a.graphs) if a.type == AttributeProto.GRAPHS else [])
            for sub in subs:
                _check_order_and_ssa(sub, f"{label} (node '{names[i]}', attribute {a.name})", frozenset(done | outer))


def _cycle(graph: onnx.GraphProto, names: list[str]) -> list[str]:
    """The nodes of one cycle, or [] when the graph is acyclic (only out of order)."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    reads = [[producer[x] for x in n.input if x in producer] for n in graph.node]
    state = [0] * len(reads)  # 0 new, 1 on the stack, 2 done
    for start in range(len(reads)):
        if state[start]:
            continue
        stack = [(start, iter(reads[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state[nxt] == 1:
                loop = path[path.index(nxt):] + [nxt]
                return [names[k] for k in reversed(loop)]
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(reads[nxt])))
                path.append(nxt)
    return []
