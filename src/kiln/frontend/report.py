"""The result of `kiln check`: what a user must know before a long build.

CheckReport is plain data: `.buildable`, `.to_json()` (what `kiln check --json`
prints) and `.render(console)` (rich tables for humans).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .opset import RECOMMENDED_OPSET, UpgradeResult, domain_name

Dim = int | str | None  # int: fixed; str: named dynamic axis; None: unnamed dynamic axis


@dataclass
class Step:
    """One validation step (onnx.checker, shape inference)."""

    name: str
    passed: bool
    message: str = ""
    node: str | None = None  # the node the failure names, when it names one

    def to_json(self) -> dict:
        return {"passed": self.passed, "message": self.message, "node": self.node}


@dataclass
class TensorInfo:
    """A graph input or output. Dynamic axes of inputs become optimization-profile axes."""

    name: str
    dtype: str | None
    shape: list[Dim] | None  # None: rank unknown

    @property
    def dynamic_axes(self) -> list[int]:
        return [] if self.shape is None else [i for i, d in enumerate(self.shape) if not isinstance(d, int)]

    @property
    def dims(self) -> str:
        if self.shape is None:
            return "unknown rank"
        if not self.shape:
            return "scalar"
        return " x ".join(str(d) if d is not None else "?" for d in self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape, "dynamic_axes": self.dynamic_axes}


@dataclass
class OpSupport:
    """One row of the operator table: an op type, its node count, and the nodes that block a build."""

    domain: str
    op_type: str
    count: int = 0
    restrictions: list[str] = field(default_factory=list)  # distinct reasons from unsupported_reason
    blocking_nodes: list[str] = field(default_factory=list)

    @property
    def supported(self) -> bool:
        return not self.blocking_nodes

    @property
    def status(self) -> str:
        if self.supported:
            return "yes"
        if len(self.blocking_nodes) == self.count:
            return "no"
        return f"partial ({len(self.blocking_nodes)} of {self.count} blocked)"

    def to_json(self) -> dict:
        return {
            "domain": domain_name(self.domain), "op_type": self.op_type, "count": self.count,
            "supported": self.supported, "restrictions": self.restrictions, "blocking_nodes": self.blocking_nodes,
        }


@dataclass
class MissingInput:
    node: str  # node label, or "graph output" for an output nothing produces
    input: str

    def describe(self) -> str:
        if self.node == "graph output":
            return f"graph output '{self.input}' is produced by no node, graph input or initializer"
        return f"node '{self.node}' reads '{self.input}', which no node, graph input or initializer provides"


@dataclass
class CheckReport:
    model: str  # the path, or a phrase for in-memory models
    ir_version: int = 0
    producer: str = ""
    opsets: dict[str, int] = field(default_factory=dict)
    checker: Step | None = None
    shape_inference: Step | None = None
    upgrade: UpgradeResult | None = None
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    operators: list[OpSupport] = field(default_factory=list)
    missing_inputs: list[MissingInput] = field(default_factory=list)
    other_problems: list[str] = field(default_factory=list)  # e.g. unsupported input types, string initializers
    warnings: list[str] = field(default_factory=list)
    # The model that was checked (the upgraded one when an upgrade succeeded), and the
    # folder its external data is relative to. Not part of the JSON.
    checked_model: onnx.ModelProto | None = field(default=None, repr=False)
    base_dir: Path | None = field(default=None, repr=False)

    @property
    def blocking_nodes(self) -> list[str]:
        return [n for op in self.operators for n in op.blocking_nodes]

    @property
    def problems(self) -> list[str]:
        """Everything that makes the model unbuildable, one sentence each, naming the culprit."""
        out = []
        if self.checker and not self.checker.passed:
            out.append(f"onnx.checker rejects the model: {self.checker.message}")
        if self.shape_inference and not self.shape_inference.passed:
            at = f" at node '{self.shape_inference.node}'" if self.shape_inference.node else ""
            out.append(f"strict shape inference fails{at}: {self.shape_inference.message}")
        out += [m.describe() for m in self.missing_inputs]
        for op in self.operators:
            if not op.supported:
                nodes = ", ".join(f"'{n}'" for n in op.blocking_nodes[:5])
                more = f" and {len(op.blocking_nodes) - 5} more" if len(op.blocking_nodes) > 5 else ""
                out.append(f"{'; '.join(op.restrictions)} (node(s) {nodes}{more})")
        out += self.other_problems
        return out

    @property
    def buildable(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "buildable": self.buildable,
            "ir_version": self.ir_version,
            "producer": self.producer,
            "opsets": {domain_name(d): v for d, v in self.opsets.items()},
            "checks": {
                "checker": self.checker.to_json() if self.checker else None,
                "shape_inference": self.shape_inference.to_json() if self.shape_inference else None,
            },
            "opset": {
                "recommended": RECOMMENDED_OPSET,
                "meets_recommendation": self.opsets.get("", 0) >= RECOMMENDED_OPSET,
                "upgrade": self.upgrade.to_json() if self.upgrade else None,
            },
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": [o.to_json() for o in self.outputs],
            "operators": [op.to_json() for op in self.operators],
            "missing_inputs": [{"node": m.node, "input": m.input} for m in self.missing_inputs],
            "blocking_nodes": self.blocking_nodes,
            "problems": self.problems,
            "warnings": self.warnings,
        }

    # ------------------------------------------------------------------ rendering
    def render(self, console: Console | None = None) -> None:
        console = console or Console()
        opsets = ", ".join(f"{domain_name(d)} {v}" for d, v in self.opsets.items()) or "none"
        head = Text.assemble(("kiln check ", "bold"), (self.model, "cyan"))
        console.print(head)
        console.print(Text(f"IR version {self.ir_version}, opsets: {opsets}"
                           + (f", producer {self.producer}" if self.producer else ""), style="dim"))

        checks = Table(title="Checks", title_justify="left", show_lines=False)
        checks.add_column("check")
        checks.add_column("result")
        checks.add_column("detail", overflow="fold")
        for step in (self.checker, self.shape_inference):
            if step is not None:
                detail = step.message if not step.passed else ""
                if step.node and not step.passed:
                    detail = f"node '{step.node}': {detail}"
                checks.add_row(step.name, _verdict(step.passed), Text(detail))
        if self.upgrade is not None:
            u = self.upgrade
            detail = "\n".join(u.changes) if u.ok else (u.error or "")
            checks.add_row(f"upgrade to opset {u.target}", _verdict(u.ok, "converted", "failed"), Text(detail))
        console.print(checks)

        for title, values in (("Inputs", self.inputs), ("Outputs", self.outputs)):
            t = Table(title=title, title_justify="left")
            t.add_column("name")
            t.add_column("dtype")
            t.add_column("shape")
            if title == "Inputs":
                t.add_column("dynamic axes (need a profile)")
            for v in values:
                row = [Text(v.name), Text(v.dtype or "?"), Text(v.dims)]
                if title == "Inputs":
                    row.append(Text(", ".join(map(str, v.dynamic_axes)) or "-"))
                t.add_row(*row)
            console.print(t)

        ops = Table(title="Operators", title_justify="left")
        ops.add_column("operator")
        ops.add_column("count", justify="right")
        ops.add_column("supported")
        ops.add_column("restrictions / blocking nodes", overflow="fold")
        for op in self.operators:
            name = op.op_type if not op.domain else f"{op.domain}::{op.op_type}"
            detail = ""
            if not op.supported:
                nodes = ", ".join(op.blocking_nodes[:5]) + (
                    f" (+{len(op.blocking_nodes) - 5} more)" if len(op.blocking_nodes) > 5 else "")
                detail = f"{'; '.join(op.restrictions)} -- {nodes}"
            status = Text(op.status, style="green" if op.supported else "red")
            ops.add_row(Text(name), str(op.count), status, Text(detail))
        console.print(ops)

        for w in self.warnings:
            console.print(Text.assemble(("warning: ", "yellow bold"), w))
        problems = self.problems
        for p in problems:
            console.print(Text.assemble(("problem: ", "red bold"), p))
        if problems:
            console.print(Text(f"NOT BUILDABLE: {len(problems)} problem(s).", style="red bold"))
        else:
            console.print(Text("BUILDABLE: every node maps to a Kiln operator.", style="green bold"))


def _verdict(ok: bool, yes: str = "passed", no: str = "FAILED") -> Text:
    return Text(yes, style="green") if ok else Text(no, style="red bold")
