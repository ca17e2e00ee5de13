"""Opset report and upgrade.

Kiln recommends ai.onnx opset 17 or newer (the version PyTorch's exporter
targets and the one op implementations are written against). An older model
can be converted with onnx.version_converter; the result says what changed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import onnx
import onnx.version_converter
from onnx import AttributeProto

RECOMMENDED_OPSET = 17


def opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    """{domain: version}; the default domain is "" (ai.onnx)."""
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def domain_name(domain: str) -> str:
    return domain or "ai.onnx"


def opset_advice(model: onnx.ModelProto) -> list[str]:
    """Warnings about the model's opsets (empty when they are fine)."""
    versions = opset_versions(model)
    if "" not in versions:
        if any(n.domain in ("", "ai.onnx") for n in _walk_nodes(model.graph)):
            return ["the model imports no ai.onnx opset, yet uses ai.onnx operators; onnx.checker rejects it."]
        return []
    v = versions[""]
    if v < RECOMMENDED_OPSET:
        return [
            f"the model uses ai.onnx opset {v}; Kiln recommends opset {RECOMMENDED_OPSET} or newer. "
            f"Convert it with `kiln check --upgradeOpset {RECOMMENDED_OPSET} --output upgraded.onnx`, "
            f"or re-export from the framework at opset {RECOMMENDED_OPSET}+."
        ]
    return []


@dataclass
class UpgradeResult:
    target: int
    source: int | None
    ok: bool
    changes: list[str] = field(default_factory=list)
    error: str | None = None
    model: onnx.ModelProto | None = field(default=None, repr=False)  # the converted model when ok

    def to_json(self) -> dict:
        return {"target": self.target, "from": self.source, "ok": self.ok, "changes": self.changes, "error": self.error}


def upgrade_opset(model: onnx.ModelProto, target: int) -> UpgradeResult:
    """Convert the model's ai.onnx opset to `target` with onnx.version_converter."""
    source = opset_versions(model).get("")
    newest = onnx.defs.onnx_opset_version()
    if source is None:
        return UpgradeResult(target, None, False,
                             error="the model imports no ai.onnx opset, so there is nothing to convert.")
    if not isinstance(target, int) or target < 1 or target > newest:
        return UpgradeResult(
            target, source, False,
            error=f"opset {target} is not a valid target; "
                  f"the installed onnx {onnx.__version__} knows opsets 1..{newest}.",
        )
    if target < source:
        return UpgradeResult(
            target, source, False,
            error=f"the model is already at opset {source}; "
                  f"converting to {target} would be a downgrade, which Kiln does not do.",
        )
    if target == source:
        return UpgradeResult(target, source, True, changes=[f"already at opset {source}: nothing to convert"],
                             model=model)
    unknown = [(n.name or n.op_type, n.op_type) for n in _walk_nodes(model.graph)
               if n.domain in ("", "ai.onnx") and _since(n.op_type, source) is None]
    if unknown:
        listed = ", ".join(f"'{name}' ({op})" for name, op in unknown[:5])
        return UpgradeResult(
            target, source, False,
            error=f"node(s) {listed} use operators that ai.onnx opset {source} does not define, so "
            "onnx.version_converter cannot convert them.",
        )
    try:
        converted = onnx.version_converter.convert_version(model, target)
    except Exception as e:  # the converter raises RuntimeError/ValidationError with C++ assertion text
        return UpgradeResult(target, source, False, error=f"onnx.version_converter failed: {_clean(str(e))}")
    changes = describe_changes(model, converted, source, target)
    need_ir = onnx.helper.find_min_ir_version_for(list(converted.opset_import), ignore_unknown=True)
    if converted.ir_version < need_ir:  # the converter leaves the IR version alone; old IR + new opset is invalid
        changes.insert(1, f"IR version {converted.ir_version} -> {need_ir} (the oldest that supports the new opset)")
        converted.ir_version = need_ir
    return UpgradeResult(target, source, True, changes=changes, model=converted)


def describe_changes(before: onnx.ModelProto, after: onnx.ModelProto, source: int, target: int) -> list[str]:
    changes = [f"ai.onnx opset {source} -> {target}"]
    old_ops = Counter(n.op_type for n in _walk_nodes(before.graph) if n.domain in ("", "ai.onnx"))
    new_ops = Counter(n.op_type for n in _walk_nodes(after.graph) if n.domain in ("", "ai.onnx"))
    for op in sorted(old_ops):
        a, b = _since(op, source), _since(op, target)
        if a is not None and b is not None and a != b:
            changes.append(f"{op} ({old_ops[op]} node(s)): definition changes from version {a} to {b}")
    added, removed = new_ops - old_ops, old_ops - new_ops
    if added:
        changes.append("nodes added by the converter: " + ", ".join(f"{n} {op}" for op, n in sorted(added.items())))
    if removed:
        changes.append("nodes removed by the converter: " + ", ".join(f"{n} {op}" for op, n in sorted(removed.items())))
    return changes


def _since(op: str, version: int) -> int | None:
    try:
        return onnx.defs.get_schema(op, version).since_version
    except Exception:  # no such op at that version
        return None


def _walk_nodes(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _walk_nodes(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _walk_nodes(g)


def _clean(msg: str) -> str:
    """Drop the C++ source location and assertion boilerplate from onnx's converter errors."""
    msg = re.sub(r"^.*?Assertion `.*?` failed:\s*", "", msg.strip(), flags=re.S)
    msg = re.sub(r"^/\S+:\d+: \w+: ", "", msg)
    return " ".join(msg.split())
