"""Layer precision: which compute precision each layer runs in.

FP16/BF16 builds run every layer in the requested precision except ops whose
registry entry says why they must stay FP32 (e.g. large sums overflow FP16);
those stay FP32 and the engine records the reason. Shape arithmetic (host
nodes) always keeps its original types. Weights low-precision layers read are
stored in that precision (in a copy where other layers read them as stored). A
layer that computes a model's FP32 output from FP32 sums can write it in FP32
(attribute output_type): the engine then ends without a cast kernel, one launch fewer
at batch 1 (docs/design/small-kernels.md).

The precision guard (guard()) runs before any weight is narrowed: each FP16/BF16 layer
is compared with its FP32 self on the same inputs at the profiles' opt shapes, and a
layer that overflows or drifts is kept in FP32 with the reason in its note (a real
classifier's FP16 engine went to relative error 1.03 through one sum of squares).
"""

from __future__ import annotations

import torch

from ..engine.interpreter import saturating_cast
from ..ir.graph import Graph, reads, set_body_precision
from ..ops.registry import lookup

_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}
INT8_LAYERS = ("QGemm", "QConv")  # int8 math with float epilogues, whatever the build's float precision
WEIGHT_ONLY = ("Int4Gemm",)  # int4 weights, activations in the build's float precision
# Every tactic of these honours attribute output_type="float32" (its first output in FP32): a CNN's head, a
# transformer's last norm, an LM head.
WRITES_FP32_OUTPUT = ("PooledGemm", "SkipLayerNorm", "GemmSkipLayerNorm", "FusedGemm")
# Ops that pass a layer's output on as a view (pad_gemm_columns' Slice back to the true width): a layer before
# one writes the model's FP32 output through it, and the view, given FP32, keeps it FP32.
_VIEWS = ("Slice", "Reshape")
PINNED = "pinned by --layerPrecisions"
_PIN_NAMES = {"fp32": "float32", "float32": "float32", "tf32": "tf32", "fp16": "float16", "float16": "float16",
              "bf16": "bfloat16", "bfloat16": "bfloat16"}


def pin(graph: Graph, pins: dict[str, str]) -> None:
    """--layerPrecisions=name:fp16,...: mark ONNX nodes (before fusion) to run in a given float precision.
    Pinned layers are not quantized, and a fused layer keeps the pin of its sources."""
    from ..errors import ConfigError

    by_name = {n.name: n for n in graph.nodes}
    for name, prec in pins.items():
        if name not in by_name:
            close = [n for n in by_name if name.lower() in n.lower()][:5]
            raise ConfigError(f"--layerPrecisions names layer '{name}', which the model does not have"
                              + (f" (similar: {close})." if close else "."))
        if prec.lower() not in _PIN_NAMES:
            raise ConfigError(f"--layerPrecisions: '{prec}' for layer '{name}' is not one of {sorted(_PIN_NAMES)}.")
        by_name[name].precision, by_name[name].note = _PIN_NAMES[prec.lower()], PINNED


def assign(graph: Graph, precision: str, guard_feeds: list[dict] | None = None, device=None) -> None:
    """Each layer's precision. guard_feeds (FP16/BF16 builds): inputs at the profiles' shapes on which
    guard() keeps the layers that overflow or drift in FP32, before any weight is narrowed."""
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        if node.placement == "host":
            node.precision = "float32"
        elif node.note == PINNED:
            pass
        elif node.domain == "kiln" and node.op_type in INT8_LAYERS:
            node.precision = node.attr("qtype", "int8")
        elif node.domain == "kiln" and node.op_type in WEIGHT_ONLY:
            node.precision, node.note = precision, "INT4 weights"
        elif precision in _LOW and entry.keep_fp32:
            node.precision, node.note = "float32", f"kept FP32: {entry.keep_fp32}"
        else:
            node.precision = precision
        set_body_precision(node, node.precision)
    if guard_feeds and precision in _LOW:
        graph.findings.extend(guard(graph, precision, guard_feeds, device or torch.device("cpu")))
    _cast_weights(graph)
    _fp32_outputs(graph)


# A layer whose FP16/BF16 result, on the FP32 run's own inputs, differs from its FP32 result by more than
# this relative L2 error is kept in FP32. Rounding alone leaves a layer near 1e-3 (FP16) and 8e-3 (BF16).
DRIFT_LIMIT = {"float16": 2e-2, "bfloat16": 8e-2}
GUARDED = "kept FP32 by the precision guard: "  # interpreter.compute_type reads "kept FP32" as FP32 inputs


def guard(graph: Graph, precision: str, feeds_per_profile: list[dict], device) -> list[dict]:
    """Run the graph in FP32 layer by layer on each profile's inputs and, beside it, every low-precision
    layer on the same FP32 inputs. A layer whose low-precision output is infinite or NaN where FP32's is
    finite (an overflow past 65504 in FP16), or drifts beyond DRIFT_LIMIT, is kept in FP32 (node.note says
    why; the build's precision findings list it). Each layer is judged on exact inputs, so one layer's
    error does not condemn the layers after it. Returns one finding summing up what was kept."""
    from ..engine.interpreter import call_node, run_node

    if not any(n.precision in (precision, "int8", "fp8") and n.placement == "device" for n in graph.nodes):
        return []
    device = torch.device(device)
    last = {name: i for i, node in enumerate(graph.nodes) for name in reads(node)}
    keep = set(graph.initializers) | {v.name for v in graph.outputs}
    uploads: dict[str, torch.Tensor] = {}  # weights on the target, once
    judged = 0
    for feeds in feeds_per_profile:
        env: dict = dict(graph.initializers)
        env.update({k: v.to(device) for k, v in feeds.items()})
        for i, node in enumerate(graph.nodes):
            if node.placement == "host":
                run_node(node, env)
                continue
            entry = lookup(node.op_type, node.domain)
            args = []
            for pos, name in enumerate(node.inputs):
                t = env[name] if name else None
                if isinstance(t, torch.Tensor) and t.device != device and pos not in entry.host_inputs:
                    if name not in graph.initializers:
                        t = t.to(device)
                    else:
                        if name not in uploads:
                            uploads[name] = t.to(device)
                        t = uploads[name]
                args.append(t)
            kept = node.precision
            # Judged: every layer in the low type but those the user pinned there (and INT4 GEMMs, whose type
            # is their weights'); a layer an 8-bit build left in float ("kept in float") is judged too.
            judge = kept == precision and not node.note.startswith((PINNED, "INT4")) and not entry.uses_scope
            exact_args = args
            if judge:
                node.precision = "float32"
                # An 8-bit layer's output is FP16 in the FP32 run too: widen it, or a MatMul of it and an FP32
                # softmax (Swin's attention in an INT8 build) would mix types.
                exact_args = [a.float() if isinstance(a, torch.Tensor) and a.dtype in _LOW.values()
                              and entry.narrows(pos) else a for pos, a in enumerate(args)]
            try:
                exact = call_node(node, exact_args, env)
                if kept in ("int8", "fp8") and node.domain == "kiln" and node.op_type in INT8_LAYERS:
                    _widen_8_bit_output(node, exact, precision)
                if judge:
                    judged += 1
                    node.precision = kept
                    reason = _input_overflow(node, entry, args, precision) or _judge(
                        call_node(node, args, env), exact, precision)
                    if reason:
                        kept, node.note = "float32", GUARDED + reason
            finally:
                node.precision = kept
            for name, t in zip(node.outputs, exact):
                if name:
                    env[name] = t
            for name in [n for n in reads(node) if last.get(n) == i and n not in keep]:
                env.pop(name, None)
    kept_fp32 = [n.name for n in graph.nodes if n.note.startswith(GUARDED)]
    widened = [n.name for n in graph.nodes if n.note.startswith(WIDENED)]
    label = {"float16": "FP16", "bfloat16": "BF16"}[precision]
    return [{"kind": "precision-guard", "layers_checked": judged // max(1, len(feeds_per_profile)),
             "kept_fp32": kept_fp32, "fp32_outputs": widened, "reason": f"each {label} layer compared with FP32 "
             f"on the same inputs at the profiles' opt shapes; kept in FP32 where it overflowed or drifted past "
             f"{DRIFT_LIMIT[precision]:g} relative L2; 8-bit layers whose output {label} cannot hold write it in "
             "FP32"}] if kept_fp32 or widened else []


# An 8-bit layer computes in integers (or FP8) and writes its result in the engine's float type (attribute
# float_type, builder/quantized_io.py): FP32 instead where that type cannot hold it.
WIDENED = "writes FP32 (precision guard): "


def _widen_8_bit_output(node, exact, precision: str) -> None:
    """An 8-bit layer whose FP32-run output overflows or loses itself when stored in the build's float type
    (a random-weight depth head's 1e-10 values under FP16's smallest subnormal) writes FP32 (float_type)."""
    low = _LOW[precision]
    stored = [t.to(low) if isinstance(t, torch.Tensor) and t.dtype in _FLOATS else t for t in exact]
    reason = _judge(stored, exact, precision)
    if reason:
        node.attrs["float_type"] = "float32"
        node.note = WIDENED + reason.replace("drifts in", "its output drifts when stored in", 1)


def sample_inputs(values, shapes: dict) -> dict[str, torch.Tensor]:
    """Seeded inputs at `shapes` as Engine.random_inputs draws them: floats standard normal, integers 0/1,
    booleans random."""
    g = torch.Generator().manual_seed(0)
    feeds = {}
    for v in values:
        dtype, shape = v.dtype or torch.float32, tuple(shapes[v.name])
        if dtype.is_floating_point:
            feeds[v.name] = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            feeds[v.name] = torch.rand(shape, generator=g) > 0.5
        else:
            feeds[v.name] = torch.randint(0, 2, shape, generator=g).to(dtype)
    return feeds


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# Values within this factor of the low type's largest (65504 in FP16) count as overflowing: the engine's own
# inputs carry the earlier layers' rounding, and a value at 5.5e4 in FP32 became inf in a random-weight
# EfficientNet-B0's FP16 engine although every layer was finite on FP32 inputs.
HEADROOM = 2.0


def _input_overflow(node, entry, args, precision: str) -> str | None:
    """Why the layer's inputs cannot be narrowed: a finite value beyond the low type's range (with HEADROOM)."""
    big = torch.finfo(_LOW[precision]).max / HEADROOM
    for pos, (name, t) in enumerate(zip(node.inputs, args)):
        if (isinstance(t, torch.Tensor) and t.dtype in _FLOATS and t.numel() and entry.narrows(pos)
                and pos not in entry.saturating_inputs):
            finite = t[torch.isfinite(t)]
            peak = float(finite.abs().max()) if finite.numel() else 0.0
            if peak > big:
                return (f"its input '{name}' reaches |x| = {peak:.3g}, within {HEADROOM:g}x of or beyond "
                        f"{'FP16' if precision == 'float16' else 'BF16'}'s largest value "
                        f"{torch.finfo(_LOW[precision]).max:.6g}")
    return None


def _judge(outs, exact, precision: str) -> str | None:
    """Why a layer's low-precision outputs cannot stand in for its FP32 ones, or None."""
    name = {"float16": "FP16", "bfloat16": "BF16"}[precision]
    for o, r in zip(outs, exact):
        if not (isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor)) or r.dtype not in _FLOATS:
            continue
        if o.shape != r.shape or not r.numel():
            continue
        o, r = o.double(), r.double()
        finite = torch.isfinite(r)
        if (finite & ~torch.isfinite(o)).any():
            peak = float(r[finite].abs().max()) if finite.any() else float("inf")
            return f"overflows {name}: inf/NaN where FP32 is finite (FP32's output reaches |x| = {peak:.3g})"
        big = torch.finfo(_LOW[precision]).max / HEADROOM
        peak = float(r[finite].abs().max()) if finite.any() else 0.0
        if peak > big:
            return (f"its output reaches |x| = {peak:.3g} in FP32, within {HEADROOM:g}x of or beyond {name}'s "
                    f"largest value {torch.finfo(_LOW[precision]).max:.6g}")
        norm = float(r[finite].norm())
        if norm == 0.0:
            continue
        err = float((o - r)[finite].norm()) / norm
        if err > DRIFT_LIMIT[precision]:
            return (f"drifts in {name} (relative L2 error {err:.2g} against FP32 on the same inputs, "
                    f"limit {DRIFT_LIMIT[precision]:g})")
    return None


def _fp32_outputs(graph: Graph) -> None:
    """Low-precision layers of WRITES_FP32_OUTPUT producing an FP32 model output that no layer reads (or passing
    it on through a view, _VIEWS) write it in FP32 themselves."""
    fp32 = {v.name for v in graph.outputs if v.dtype == torch.float32}
    read = graph.consumers()

    def output_view(value: str):
        """The view that alone reads `value` and is itself an FP32 model output no layer reads, else None."""
        readers = read.get(value, [])
        v = readers[0] if len(readers) == 1 and value not in fp32 else None
        ok = (v is not None and v.op_type in _VIEWS and not v.domain and v.inputs[0] == value
              and v.placement == "device" and v.outputs[0] in fp32 and v.outputs[0] not in read)
        return v if ok else None

    for node in graph.nodes:
        if not (node.domain == "kiln" and node.op_type in WRITES_FP32_OUTPUT and node.precision in _LOW):
            continue
        out, view = node.outputs[0], output_view(node.outputs[0])
        if view is not None:
            view.precision = "float32"  # passes the FP32 result on as it is (interpreter.compute_type)
        elif out not in fp32 or out in read:
            continue
        node.attrs["output_type"] = "float32"


def _cast_weights(graph: Graph) -> None:
    """FP16/BF16 layers' weights are stored in that type, so that no replay casts them. A weight that other
    layers read as it is (host layers, quantized layers, scale inputs) or in another precision gets a cast
    copy for each low precision's readers. Exported models share identical constants (a freshly initialized
    BERT's zero biases are one initializer, read by its LayerNorms and by its 8-bit GEMMs), and such a beta,
    left FP32, cost every replay one copy kernel per norm."""
    uses: dict[str, dict] = {}  # weight -> its readers' precision (None: read as stored) -> [(node, input position)]
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        for pos, name in enumerate(node.inputs):
            if name in graph.initializers:
                keep = node.placement == "host" or not entry.narrows(pos)
                uses.setdefault(name, {}).setdefault(None if keep else node.precision, []).append((node, pos))
    outputs = {v.name for v in graph.outputs}
    for name, readers in uses.items():
        w = graph.initializers[name]
        if w.dtype != torch.float32 or name in outputs:
            continue
        for p in [p for p in readers if p in _LOW]:
            if len(readers) == 1:  # every reader in this precision: cast in place
                graph.initializers[name] = saturating_cast(w, _LOW[p])
                continue
            copy = f"{name}.{p}"
            while copy in graph.initializers:  # a name the model already uses
                copy += "_"
            graph.initializers[copy] = saturating_cast(w, _LOW[p])
            for node, pos in readers[p]:
                node.inputs[pos] = copy
