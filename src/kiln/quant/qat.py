"""Quantization-aware training: fake-quant with learned (LSQ) scales, exported as Q/DQ ONNX.

    net = kiln.quant.qat.prepare(net, bits=8, weight_bits=4, group_size=32,
                                 calib=x_calib)         # optional: input scales from calibration
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)   # after prepare: the scales are parameters
    for x, y in loader:                                 # the user's own loop; without calib, the
        loss = F.cross_entropy(net(x), y)               # first batch initializes the input scales
        opt.zero_grad(); loss.backward(); opt.step()
    model = kiln.quant.qat.export_onnx(net, (x[:2],), "net_qdq.onnx")
    engine = kiln.build(model)

`prepare` swaps every nn.Conv2d / nn.Linear (in place) for a subclass that
fake-quantizes its input (per tensor) and its weight (per output channel, or
group-wise along the input features for Linear, or with `weight_per_channel=False`
one scale per layer, as onnxruntime's quantize_static writes by default and some
deployment targets require) before the float op. The original weight and bias
Parameters are kept, so an optimizer made earlier still updates them.

Fake quantization is LSQ (Esser et al., "Learned Step Size Quantization"):
    y = round(clamp(x / s, Qn, Qp)) * s
with a straight-through estimator for the rounding (gradient 1 inside the range,
0 outside) and the step s a Parameter whose gradient is scaled by
1 / sqrt(n * Qp) (n: the elements one scale covers). Weight scales start at
max|w| / Qp of their channel, group or layer (the naive post-training rounding). Input
scales start at amax / Qp: by default amax = max|x| of the first batch the layer
sees whose max is finite and nonzero (an all-zero input, such as an RNN's state
at step 0, is skipped); with `prepare(..., calib=batches, calib_method=...)` (or
`calibrate_inputs`), the amax that Kiln's post-training calibrator ("entropy",
the default, "minmax" or "percentile") picks from the layer's float inputs over
those batches, so QAT starts from the PTQ scales (on heavy-tailed inputs max|x|
leaves few levels for the bulk of the values). An input with no negative values
(after a ReLU) is quantized unsigned (UINT8 / UINT4, zero point 0); others
signed. Weights are symmetric and narrow-range ([-127, 127], [-7, 7]); all zero
points are 0.

`export_onnx` exports a float copy of the network (torch.onnx.export, dynamo)
and inserts QuantizeLinear -> DequantizeLinear pairs with the learned scales in
front of each quantized layer's input and weight (per-axis, blocked with
`block_size` for group-wise weights, or a scalar scale for per-tensor weights).
INT4 values need ONNX opset 21, which is the default.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ..errors import ConfigError, KilnError

EXPORT_OPSET = 21  # INT4/UINT4 Q/DQ and blocked quantization


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return (torch.round(x) - x).detach() + x


def _grad_scale(s: torch.Tensor, g: float) -> torch.Tensor:
    """s in the forward pass; its gradient multiplied by g in the backward pass."""
    return (s - s * g).detach() + s * g


class FakeQuantize(nn.Module):
    """LSQ fake quantization with a learned step (scale); zero point 0.

    axis=None: one scale (per tensor; `is_weight=True` counts all of x's elements in LSQ's gradient
    scale, otherwise those of one sample, x[0]). axis=a: one scale per index of dimension a
    (per channel). group_size=g (with axis=a): dimension a is cut into groups of g
    consecutive elements and each group of each other row gets its own scale; only
    2-D tensors ([out, in], a=1). `signed=None` decides from the first batch.
    """

    def __init__(self, bits: int = 8, signed: bool | None = True, narrow: bool = False,
                 axis: int | None = None, group_size: int | None = None, scale_shape=(), is_weight: bool = False):
        super().__init__()
        if not 2 <= bits <= 8:
            raise ConfigError(f"fake quantization needs 2 to 8 bits, not {bits}.")
        if group_size is not None and (axis is None or group_size < 1):
            raise ConfigError("group-wise quantization needs an axis and a positive group_size.")
        self.bits, self.narrow, self.axis, self.group_size = bits, narrow, axis, group_size
        self.is_weight = is_weight
        self.scale = nn.Parameter(torch.ones(scale_shape))
        self.register_buffer("initialized", torch.tensor(False))
        self.register_buffer("signed", torch.tensor(bool(signed) if signed is not None else True))
        self.auto_sign = signed is None
        self.enabled = True  # False: forward passes x through unchanged (float calibration passes)

    @property
    def qrange(self) -> tuple[int, int]:
        if bool(self.signed):
            hi = 2 ** (self.bits - 1) - 1
            return (-hi if self.narrow else -hi - 1), hi
        return 0, 2 ** self.bits - 1

    def _layout(self, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The scale shaped to broadcast against x."""
        if self.axis is None:
            return s.reshape(())
        if self.group_size is not None:
            return s.repeat_interleave(self.group_size, dim=self.axis).narrow(self.axis, 0, x.shape[self.axis])
        shape = [1] * x.dim()
        shape[self.axis] = -1
        return s.reshape(shape)

    def _per_scale_elements(self, x: torch.Tensor) -> int:
        if self.axis is None:  # a weight has no batch axis: its one scale covers every element
            per_sample = x.dim() > 1 and not self.is_weight
            return max(x[0].numel() if per_sample else x.numel(), 1)
        if self.group_size is not None:
            return min(self.group_size, x.shape[self.axis]) * (x.numel() // (x.shape[0] * x.shape[self.axis]))
        return max(x.numel() // x.shape[self.axis], 1)

    @torch.no_grad()
    def initialize(self, x: torch.Tensor) -> None:
        """Scales from x's statistics: max|x| / Qp per tensor, channel or group."""
        x = x.detach().float()
        if self.auto_sign:
            self.signed.fill_(bool((x < 0).any()))
        qp = self.qrange[1]
        a = x.abs()
        if self.axis is None:
            m = a.max()
        elif self.group_size is not None:
            if x.dim() != 2 or self.axis != 1:
                raise ConfigError("group-wise fake quantization is for 2-D [out, in] weights (axis 1).")
            n, k = x.shape
            g = self.group_size
            pad = (-k) % g
            m = torch.nn.functional.pad(a, (0, pad)).reshape(n, -1, g).amax(-1)
        else:
            m = a.transpose(0, self.axis).reshape(x.shape[self.axis], -1).amax(1)
        s = (m / qp).clamp(min=1e-8)
        self.scale.data = s.reshape(self.scale.shape) if self.scale.numel() == s.numel() else s
        self.initialized.fill_(True)

    @torch.no_grad()
    def set_amax(self, amax: float, signed: bool | None = None) -> None:
        """A per-tensor scale of amax / Qp (from a calibrator); `signed` overrides the sign (auto_sign only)."""
        if self.axis is not None:
            raise ConfigError("set_amax sets a per-tensor scale; this quantizer has one scale per channel or group.")
        if signed is not None and self.auto_sign:
            self.signed.fill_(bool(signed))
        self.scale.data.fill_(max(float(amax), 1e-8) / self.qrange[1])
        self.initialized.fill_(True)

    def step(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The step in use: |scale|, at least 1e-8. An optimizer step can take the raw parameter below
        zero; clamping it there would leave it stuck (no gradient below the clamp) and the layer's
        output at zero, while its magnitude keeps quantizing and its gradient keeps flowing."""
        return (self.scale if scale is None else scale).abs().clamp(min=1e-8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "enabled", True):
            return x
        if not bool(self.initialized):
            # Only a batch with a positive, finite max sets the scale: an all-zero first input (an RNN's
            # state at step 0) would give a scale of ~1e-8 that no later batch undoes.
            m = x.detach().abs().max() if x.numel() else x.new_zeros(())
            if bool(torch.isfinite(m)) and float(m) > 0:
                self.initialize(x)
        qn, qp = self.qrange
        g = 1.0 / math.sqrt(self._per_scale_elements(x) * qp)
        s = self._layout(self.step(_grad_scale(self.scale, g)), x)
        return _round_ste(torch.clamp(x / s, qn, qp)) * s

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The integers (in x's float dtype) this quantizer maps x to."""
        qn, qp = self.qrange
        return torch.clamp(torch.round(x / self._layout(self.step().detach(), x)), qn, qp)

    def extra_repr(self) -> str:
        kind = "per-tensor" if self.axis is None else (
            f"group {self.group_size} along axis {self.axis}" if self.group_size else f"per-axis {self.axis}")
        sign = ("auto" if self.auto_sign and not bool(self.initialized)
                else "signed" if bool(self.signed) else "unsigned")
        return f"bits={self.bits}, {sign}, {kind}"


class _QuantMixin:
    input_quant: FakeQuantize | None
    weight_quant: FakeQuantize

    def _quantized(self, x):
        if self.input_quant is not None:
            x = self.input_quant(x)
        return x, self.weight_quant(self.weight)


class QuantConv2d(nn.Conv2d, _QuantMixin):
    def forward(self, x):
        x, w = self._quantized(x)
        return self._conv_forward(x, w, self.bias)


class QuantLinear(nn.Linear, _QuantMixin):
    def forward(self, x):
        x, w = self._quantized(x)
        return nn.functional.linear(x, w, self.bias)


_SWAP = {nn.Conv2d: QuantConv2d, nn.Linear: QuantLinear}


def _swap(layer: nn.Module, bits: int | None, weight_bits: int, group_size: int | None,
          weight_per_channel: bool = True) -> nn.Module:
    q = _SWAP[type(layer)].__new__(_SWAP[type(layer)])
    q.__dict__ = layer.__dict__.copy()  # same Parameters, buffers, hooks and settings
    q._modules = dict(layer._modules)
    q._parameters = dict(layer._parameters)
    q._buffers = dict(layer._buffers)
    w = layer.weight
    q.input_quant = FakeQuantize(bits, signed=None) if bits else None
    if not weight_per_channel:
        wq = FakeQuantize(weight_bits, narrow=True, axis=None, is_weight=True)
    elif group_size and isinstance(layer, nn.Linear):
        wq = FakeQuantize(weight_bits, narrow=True, axis=1, group_size=group_size,
                          scale_shape=(w.shape[0], -(-w.shape[1] // group_size)))
    else:
        wq = FakeQuantize(weight_bits, narrow=True, axis=0, scale_shape=(w.shape[0],))
    wq.initialize(w)
    q.weight_quant = wq.to(w.device)
    if q.input_quant is not None:
        q.input_quant.to(w.device)
    return q


def prepare(module: nn.Module, bits: int | None = 8, weight_bits: int = 8, group_size: int | None = None,
            skip: tuple[str, ...] = (), calib=None, calib_method: str = "entropy",
            percentile: float = 99.99, weight_per_channel: bool = True) -> nn.Module:
    """Fake-quantize every nn.Conv2d / nn.Linear of `module` (in place; returns it).

    bits: input (activation) bits, 8 or 4 (None: inputs stay float, weight-only).
    weight_bits: 8 or 4. group_size: group-wise weight scales for Linear layers
    (groups of that many input features; Conv2d keeps per-output-channel scales).
    weight_per_channel: False gives every layer one weight scale (per tensor) instead of one per
    output channel.
    skip: names of layers (as named_modules spells them) to leave in float.
    calib: calibration inputs (see `calibrate_inputs`); the input scales then start from
    `calib_method` ("entropy", "minmax" or "percentile") calibration instead of the first batch.
    Create the optimizer after prepare: the scales are new Parameters.
    """
    for b in (bits, weight_bits):
        if b is not None and b not in (4, 8):
            raise ConfigError(f"Kiln's QAT quantizes to 8 or 4 bits (what Q/DQ ONNX holds), not {b}.")
    if weight_bits is None:
        raise ConfigError("weight_bits must be 8 or 4.")
    if group_size is not None and (group_size < 2 or group_size % 2):
        raise ConfigError(f"group_size must be an even number of input features, not {group_size}.")
    if group_size is not None and not weight_per_channel:
        raise ConfigError("group_size and weight_per_channel=False are exclusive: group-wise scales are finer "
                          "than per-channel ones, per-tensor scales coarser.")
    targets = [(n, m) for n, m in module.named_modules() if type(m) in _SWAP and n not in skip]
    if not targets and type(module) not in _SWAP:
        raise ConfigError(f"{type(module).__name__} has no nn.Conv2d or nn.Linear layer to quantize.")
    if type(module) in _SWAP and "" not in skip:
        module = _swap(module, bits, weight_bits, group_size, weight_per_channel)
    else:
        for name, layer in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, _swap(layer, bits, weight_bits, group_size, weight_per_channel))
    if calib is not None:
        calibrate_inputs(module, calib, calib_method, percentile)
    return module


def quant_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The fake-quantized layers of a prepared module, by name."""
    return {n: m for n, m in module.named_modules() if isinstance(m, _QuantMixin)}


@torch.no_grad()
def calibrate(module: nn.Module, *example_inputs) -> nn.Module:
    """Initialize input scales that are still unset by running one batch (no gradients; eval mode kept)."""
    module(*example_inputs)
    return module


def _batches(data) -> list:
    """Calibration data as a list of forward() arguments: a tensor / array is one batch; otherwise an
    iterable whose items are tensors / arrays (one input), tuples or lists (positional inputs) or dicts
    (keyword inputs)."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        data = [data]
    elif isinstance(data, (dict, str, bytes)) or not hasattr(data, "__iter__"):
        raise ConfigError("calib must be a tensor or an iterable of input batches (tensors, tuples of tensors "
                          f"or dicts of keyword inputs), not {type(data).__name__}.")
    out = list(data)
    if not out:
        raise ConfigError("calib holds no batch.")
    return out


def _run(module: nn.Module, batch, device) -> None:
    def conv(v):
        v = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        return v.to(device) if isinstance(v, torch.Tensor) and device is not None else v

    if isinstance(batch, dict):
        module(**{k: conv(v) for k, v in batch.items()})
    elif isinstance(batch, (tuple, list)):
        module(*[conv(v) for v in batch])
    else:
        module(conv(batch))


@torch.no_grad()
def calibrate_inputs(module: nn.Module, data, method: str = "entropy", percentile: float = 99.99,
                     num_bins: int | None = None) -> dict[str, float]:
    """Set every input scale of a prepared module from Kiln's post-training calibration (overwriting it).

    The module runs in float (fake quantization off, eval mode) over `data`: a tensor (one batch) or an
    iterable of batches, each a tensor, a tuple of positional inputs or a dict of keyword inputs (a
    DataLoader yielding (x, y) pairs must be mapped to x first). Each quantized layer's input gets the
    statistics Kiln's calibrate() takes on an FP32 engine (max |x|, then a histogram of |x| for entropy and
    percentile) and the amax of kiln.quant.calibrators' `method`; scale = amax / Qp, unsigned if no input
    value was negative. A layer whose inputs were all zero (or never seen) is left as it was.
    Returns {layer name: amax}.
    """
    from .calibrate import _Collector
    from .calibrators import DEFAULT_BINS, get_calibrator

    calibrator = get_calibrator(method, percentile)
    layers = {n: m for n, m in quant_layers(module).items() if m.input_quant is not None}
    if not layers:
        raise ConfigError("the module has no fake-quantized input to calibrate; prepare it with bits=8 or 4.")
    batches = _batches(data)
    device = next((p.device for p in module.parameters()), None)
    quantizers = [m for m in module.modules() if isinstance(m, FakeQuantize)]
    was_training = module.training
    bins = num_bins or DEFAULT_BINS
    col = [_Collector(bins)]
    key = {n: n or "<module>" for n in layers}  # the collector skips empty names

    def observe(name):
        def hook(_layer, args):
            col[0].add(name, args[0])
        return hook

    handles = [m.register_forward_pre_hook(observe(key[n])) for n, m in layers.items()]
    try:
        for q in quantizers:
            q.enabled = False
        module.eval()
        for b in batches:  # pass 1: ranges
            _run(module, b, device)
        stats = col[0].stats
        if calibrator.needs_histogram:  # pass 2: histograms of |x| over [0, max |x|], as calibrate() takes
            col[0] = _Collector(bins, ranges=False, stats=stats,
                                hist_ranges={k: s.absmax or 0.0 for k, s in stats.items()})
            for b in batches:
                _run(module, b, device)
    finally:
        for h in handles:
            h.remove()
        for q in quantizers:
            q.enabled = True
        module.train(was_training)
    amax = {}
    for name, layer in layers.items():
        s = stats.get(key[name])
        if s is None or s.absmax is None or not s.absmax > 0:
            continue
        amax[name] = calibrator.amax(s.absmax, s.hist, s.hist_max)
        layer.input_quant.set_amax(amax[name], signed=s.min < 0)
    return amax


def strip(module: nn.Module) -> nn.Module:
    """A float copy of a prepared module: plain nn.Conv2d / nn.Linear with the same (unquantized) weights."""
    out = copy.deepcopy(module)
    for name, layer in list(quant_layers(out).items()):
        plain = (nn.Conv2d if isinstance(layer, nn.Conv2d) else nn.Linear).__new__(
            nn.Conv2d if isinstance(layer, nn.Conv2d) else nn.Linear)
        plain.__dict__ = layer.__dict__.copy()
        plain._modules = {k: v for k, v in layer._modules.items() if k not in ("input_quant", "weight_quant")}
        for k in ("input_quant", "weight_quant"):
            plain.__dict__.pop(k, None)
        if not name:
            return plain
        parent_name, _, attr = name.rpartition(".")
        setattr(out.get_submodule(parent_name) if parent_name else out, attr, plain)
    return out


# --- export -------------------------------------------------------------------------
@dataclass
class _Spec:
    name: str
    fq: FakeQuantize
    weight: np.ndarray


def _onnx_type(fq: FakeQuantize) -> int:
    signed = bool(fq.signed)
    if fq.bits == 8:
        return TensorProto.INT8 if signed else TensorProto.UINT8
    return TensorProto.INT4 if signed else TensorProto.UINT4


def _zeros(name: str, fq: FakeQuantize, shape) -> onnx.TensorProto:
    n = int(np.prod(shape)) if len(shape) else 1
    return helper.make_tensor(name, _onnx_type(fq), list(shape), [0] * n)


def _weight_qparams(fq: FakeQuantize, transposed: bool):
    """(scale array, axis, block_size) for a weight initializer stored as W ([out, in, ...]) or W.T;
    a per-tensor weight gets a scalar scale and axis None."""
    s = fq.step().detach().float().cpu().numpy().astype(np.float32)
    if fq.axis is None:
        return s.reshape(()), None, 0
    if fq.group_size is not None:  # s [N, G] over W [N, K]
        return (np.ascontiguousarray(s.T), 0, fq.group_size) if transposed else (s, 1, fq.group_size)
    return s.reshape(-1), (1 if transposed else 0), 0


def _find_weight(model: onnx.ModelProto, name: str, w: np.ndarray) -> list[tuple[str, bool]]:
    """Initializers holding the layer's weight: (initializer name, stored transposed?)."""
    inits = {t.name: t for t in model.graph.initializer}
    if f"{name}.weight" in inits:
        return [(f"{name}.weight", False)]
    found = []
    for t in model.graph.initializer:
        if tuple(t.dims) == w.shape or (w.ndim == 2 and tuple(t.dims) == w.shape[::-1]):
            a = numpy_helper.to_array(t)
            if a.shape == w.shape and np.array_equal(a, w):
                found.append((t.name, False))
            elif w.ndim == 2 and a.shape == w.shape[::-1] and np.array_equal(a, w.T):
                found.append((t.name, True))
    return found


def _data_input(node: onnx.NodeProto, weight: str) -> int:
    if node.op_type in ("Conv", "Gemm"):
        if list(node.input).index(weight) != 1:
            raise KilnError(f"node '{node.name}' ({node.op_type}) reads the weight '{weight}' as an unexpected input.")
        if node.op_type == "Gemm":
            trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
            if trans_a:
                raise KilnError(f"Gemm node '{node.name}' has transA=1; QAT export expects x @ W^T.")
        return 0
    if node.op_type == "MatMul":
        return 0 if node.input[1] == weight else 1
    raise KilnError(
        f"the exported model feeds a quantized weight ('{weight}') to {node.op_type} node '{node.name}'; "
        "QAT export inserts Q/DQ for Conv, Gemm and MatMul consumers only.")


def _insert_qdq(model: onnx.ModelProto, specs: list[_Spec], inputs: dict[str, FakeQuantize],
                weight_format: str) -> onnx.ModelProto:
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    front: list[onnx.NodeProto] = []  # weight Q/DQ, placed first
    before: dict[int, list[onnx.NodeProto]] = {}  # input Q/DQ, placed before node index
    new_inits: list[onnx.TensorProto] = []
    drop: set[str] = set()
    for spec in specs:
        matches = _find_weight(model, spec.name, spec.weight)
        if not matches:
            raise KilnError(f"could not find the weight of quantized layer '{spec.name}' in the exported ONNX model.")
        for init_name, transposed in matches:
            scale, axis, block = _weight_qparams(spec.fq, transposed)
            tag = init_name.replace("/", "_")
            s_name, z_name, dq_name = f"{tag}_scale", f"{tag}_zero_point", f"{tag}_dequantized"
            new_inits += [numpy_helper.from_array(scale, s_name), _zeros(z_name, spec.fq, scale.shape)]
            attrs = {} if axis is None else {"axis": axis}
            if block:
                attrs["block_size"] = block
            if weight_format == "qdq":
                front += [helper.make_node("QuantizeLinear", [init_name, s_name, z_name], [f"{tag}_quantized"],
                                           name=f"{tag}_QuantizeLinear", **attrs),
                          helper.make_node("DequantizeLinear", [f"{tag}_quantized", s_name, z_name], [dq_name],
                                           name=f"{tag}_DequantizeLinear", **attrs)]
            else:  # integer initializer -> DequantizeLinear
                w = torch.from_numpy(numpy_helper.to_array(inits[init_name]).copy())
                w = w.T if transposed else w
                q = spec.fq.quantize(w).to(torch.int64)
                q = (q.T if transposed else q).contiguous().numpy()
                q_name = f"{tag}_quantized"
                new_inits.append(helper.make_tensor(q_name, _onnx_type(spec.fq), list(q.shape), q.reshape(-1).tolist()))
                drop.add(init_name)
                front.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_name],
                                              name=f"{tag}_DequantizeLinear", **attrs))
            for idx, node in [(i, n) for i, n in enumerate(g.node) if init_name in n.input]:
                data = _data_input(node, init_name)
                for i, v in enumerate(node.input):
                    if v == init_name:
                        node.input[i] = dq_name
                fq = inputs.get(spec.name)
                if fq is None:
                    continue
                x = node.input[data]
                xt = f"{spec.name or 'input'}.{node.name}.input"
                xs = np.asarray(float(fq.step().detach().reshape(())), np.float32)
                new_inits += [numpy_helper.from_array(xs, f"{xt}_scale"), _zeros(f"{xt}_zero_point", fq, ())]
                before.setdefault(idx, []).extend([
                    helper.make_node("QuantizeLinear", [x, f"{xt}_scale", f"{xt}_zero_point"], [f"{xt}_quantized"],
                                     name=f"{xt}_QuantizeLinear"),
                    helper.make_node("DequantizeLinear", [f"{xt}_quantized", f"{xt}_scale", f"{xt}_zero_point"],
                                     [f"{xt}_dequantized"], name=f"{xt}_DequantizeLinear")])
                node.input[data] = f"{xt}_dequantized"
    nodes = list(front)
    for i, n in enumerate(g.node):
        nodes += before.get(i, [])
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    kept = [t for t in g.initializer if t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    return model


def export_onnx(module: nn.Module, example_inputs, path=None, input_names: list[str] | None = None,
                output_names: list[str] | None = None, dynamic_batch: int | None = 4096,
                weight_format: str = "qdq", opset: int = EXPORT_OPSET) -> onnx.ModelProto:
    """Export a prepared (and fine-tuned) module as a Q/DQ ONNX model; write it to `path` if given.

    example_inputs: a tensor or a tuple of tensors (every scale must be initialized:
    run a batch first). dynamic_batch: the upper bound of a dynamic axis 0 of every
    input (None: static shapes). weight_format: "qdq" keeps float weights behind a
    QuantizeLinear -> DequantizeLinear pair (TensorRT's explicit quantization);
    "int" stores the integer weights (INT8/INT4 initializers) behind a
    DequantizeLinear. Returns the onnx.ModelProto (checked with onnx.checker).
    """
    from ..frontend.torch_export import from_torch

    if weight_format not in ("qdq", "int"):
        raise ConfigError(f"weight_format must be 'qdq' or 'int', not {weight_format!r}.")
    if opset < EXPORT_OPSET:
        raise ConfigError(f"Q/DQ export with INT4 and blocked scales needs opset {EXPORT_OPSET} or newer, not {opset}.")
    layers = quant_layers(module)
    if not layers:
        raise ConfigError("the module has no fake-quantized layer; call kiln.quant.qat.prepare first.")
    unset = [n or type(m).__name__ for n, m in layers.items()
             if m.input_quant is not None and not bool(m.input_quant.initialized)]
    if unset:
        raise ConfigError(f"input scales of {', '.join(unset)} are not initialized: run a batch through the module "
                          "(kiln.quant.qat.calibrate) before exporting.")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    plain = strip(module).eval()
    dyn = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1, max=int(dynamic_batch))
        dyn = tuple({0: batch} if isinstance(a, torch.Tensor) else None for a in args)
    model, _ = from_torch(plain, args, dynamic_shapes=dyn, opset=opset, input_names=input_names,
                         output_names=output_names)
    specs = [_Spec(n, m.weight_quant, m.weight.detach().float().cpu().numpy()) for n, m in layers.items()]
    inputs = {n: m.input_quant for n, m in layers.items() if m.input_quant is not None}
    model = _insert_qdq(model, specs, inputs, weight_format)
    onnx.checker.check_model(model)
    if path is not None:
        from ..fileio import atomic_write_bytes

        atomic_write_bytes(Path(path), model.SerializeToString())
    return model
