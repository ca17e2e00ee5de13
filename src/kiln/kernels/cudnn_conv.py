"""INT8 / FP8 convolutions on cuDNN's graph API, through the cudnn-frontend package (optional: `pip install
'kiln[cudnn]'`; without it these tactics are not offered). Torch reaches cuDNN only for float convolutions;
the graph API also runs 8-bit ones on Hopper, with the layer's epilogue fused into the same kernel:

    y = act(conv(x8, w8) * x_scale * w_scale[k] + bias[k])      then / y_scale into 8 bits, or in float

Its 8-bit 3x3 convolutions beat torch's FP16 cuDNN ones by up to 2x, so they are offered at the default level
(see docs/design/tactic-levels.md). A residual operand in the graph makes it several times slower, so layers that
add one keep Kiln's own kernels, as do those that write a second 8-bit copy.

Building a graph compiles its kernel (the probe built a graph's 9-11 plans in 1.4-8 s), so graphs are kept
per shape and plan; a plan is one of cuDNN's heuristic choices in order (`plan` 0 is its first).
"""

from __future__ import annotations

import torch

try:
    import cudnn
except ImportError:  # the optional package is not installed: supports() is False
    cudnn = None

PLANS = 2  # cuDNN's first heuristic choices offered as tactics
_QTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_graphs: dict[tuple, tuple] = {}
_handles: dict[int, object] = {}


def supports(node, x: torch.Tensor, w: torch.Tensor, b, z, q_scale, qtype: str, w_scale) -> bool:
    """An ungrouped 2-D convolution of channels-last x (8-bit or float) and channels-last `qtype` weights, both
    channel counts multiples of 16, no residual and no second 8-bit output, ReLU or no activation, on a Hopper
    or newer GPU with cudnn-frontend installed."""
    from .conv import geometry

    if cudnn is None or not x.is_cuda or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    if qtype not in _QTYPES or w.dtype != _QTYPES[qtype] or x.dim() != 4 or w.dim() != 4:
        return False
    if z is not None or q_scale is not None or node.attr("activation", "") not in ("", "Relu"):
        return False
    if node.attr("group", 1) != 1 or x.shape[1] != w.shape[1] or x.shape[1] % 16 or w.shape[0] % 16:
        return False
    if not x.permute(0, 2, 3, 1).is_contiguous() or not w.permute(0, 2, 3, 1).is_contiguous():
        return False
    if w_scale.numel() not in (1, w.shape[0]) or (b is not None and b.numel() != w.shape[0]):
        return False
    geo = geometry(node, x, w)
    return geo is not None and geo[1] == [1, 1]


def _nhwc_tensor(g, name: str, n: int, c: int, h: int, w: int, dtype):
    return g.tensor(name=name, dim=[n, c, h, w], stride=[c * h * w, 1, c * w, c], data_type=dtype)


def _vector(g, name: str, k: int, dtype):
    return g.tensor(name=name, dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=dtype)


_DT = {torch.float32: "FLOAT", torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.int8: "INT8",
       torch.float8_e4m3fn: "FP8_E4M3"}


def _graph(key: tuple, handle):
    """(the built graph for a layer signature `key`, its tensors by role, its workspace bytes, the plan built)."""
    (n, c, h, w_, k, kh, kw, strides, pads, qtype, x_scale_n, w_scale_n, bias_dtype, act, out_dtype, plan) = key
    dt = cudnn.data_type
    g = cudnn.pygraph(io_data_type=dt.HALF, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                      handle=handle)
    q = getattr(dt, _DT[_QTYPES[qtype]])
    t = {"x": _nhwc_tensor(g, "x", n, c, h, w_, q), "w": _nhwc_tensor(g, "w", k, c, kh, kw, q)}
    y = g.conv_fprop(image=t["x"], weight=t["w"], pre_padding=[pads[0], pads[1]], post_padding=[pads[2], pads[3]],
                     stride=list(strides), dilation=[1, 1], compute_data_type=dt.INT32 if qtype == "int8" else dt.FLOAT)
    t["xs"] = _vector(g, "xs", x_scale_n, dt.FLOAT)
    t["ws"] = _vector(g, "ws", w_scale_n, dt.FLOAT)
    y = g.mul(a=g.mul(a=y, b=t["xs"]), b=t["ws"])
    if bias_dtype is not None:
        t["b"] = _vector(g, "b", k, getattr(dt, _DT[bias_dtype]))
        y = g.add(a=y, b=t["b"])
    if act == "Relu":
        y = g.relu(input=y)
    if out_dtype in _QTYPES.values():
        t["ys"] = _vector(g, "ys", 1, dt.FLOAT)
        y = g.div(a=y, b=t["ys"])
    y.set_output(True).set_data_type(getattr(dt, _DT[out_dtype]))
    t["y"] = y
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    plan = min(plan, g.get_execution_plan_count() - 1)  # a shape with fewer plans runs its last
    g.build_plan_at_index(plan)
    return g, t, g.get_workspace_size_plan_at_index(plan), plan


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    return _handles[index]


def _y_dtype(node, y_scale, out_dtype) -> torch.dtype:
    """The layer's output type: its 8-bit type where it writes 8-bit values (a y_scale), else out_dtype."""
    return _QTYPES[node.attr("qtype", "int8")] if y_scale is not None else out_dtype


def _key(node, x, w, b, x_scale, w_scale, out_dtype, plan: int) -> tuple:
    """The layer's signature as _graph reads it."""
    from .conv import geometry

    strides, _, pads, _ = geometry(node, x, w)
    return (*x.shape, w.shape[0], w.shape[2], w.shape[3], tuple(strides), tuple(pads), node.attr("qtype", "int8"),
            x_scale.numel(), w_scale.numel(), b.dtype if b is not None else None, node.attr("activation", ""),
            out_dtype, plan)


def _built(node, x, w, b, x_scale, w_scale, y_scale, out_dtype, plan: int) -> tuple:
    """The layer's graph as _graph returns it, built on first use and kept."""
    key = _key(node, x, w, b, x_scale, w_scale, _y_dtype(node, y_scale, out_dtype), plan)
    if key not in _graphs:
        _graphs[key] = _graph(key, _handle(x.device))
    return _graphs[key]


def conv2d(node, x: torch.Tensor, w: torch.Tensor, b, x_scale: torch.Tensor, w_scale: torch.Tensor,
           y_scale: torch.Tensor | None, out_dtype: torch.dtype, plan: int = 0) -> torch.Tensor:
    """The layer for a `supports` convolution: 8-bit output with y_scale, else out_dtype; channels-last, returned
    as an NCHW-shaped view as kernels/conv.conv2d returns it."""
    from .conv import geometry
    from .rescale import to_8bit
    from .workspace import scratch

    g, t, ws_bytes, plan = _built(node, x, w, b, x_scale, w_scale, y_scale, out_dtype, plan)
    x8 = to_8bit(x, x_scale, node.attr("qtype", "int8"))
    if not x8.permute(0, 2, 3, 1).is_contiguous():  # quantized here from a layout the graph does not read
        x8 = x8.contiguous(memory_format=torch.channels_last)
    oh, ow = geometry(node, x, w)[3]
    y = torch.empty((x.shape[0], oh, ow, w.shape[0]), dtype=_y_dtype(node, y_scale, out_dtype), device=x.device)
    pack = {t["x"]: x8, t["w"]: w, t["xs"]: x_scale.float(), t["ws"]: w_scale.float(), t["y"]: y}
    if b is not None:
        pack[t["b"]] = b
    if y_scale is not None:
        pack[t["ys"]] = y_scale.float()
    handle = _handle(x.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(x.device).cuda_stream)
    g.execute_plan_at_index(pack, scratch(x.device, ws_bytes), plan, handle=handle)
    return y.permute(0, 3, 1, 2)


def buildable(node, x, w, b, x_scale, w_scale, y_scale, out_dtype, plan: int = 0) -> bool:
    """Whether cuDNN builds this layer's graph (it is then kept): checked where a tactic's applicability is, so
    that a runtime shape cuDNN refuses runs the reference instead of failing."""
    try:
        _built(node, x, w, b, x_scale, w_scale, y_scale, out_dtype, plan)
    except Exception:  # cudnnGraphNotSupportedError and the like: no kernel for this shape
        return False
    return True


def workspace_bytes(node, x, w, b, x_scale, w_scale, y_scale, out_dtype, plan: int = 0) -> int:
    """The scratch the plan needs (builds and keeps its graph)."""
    return _built(node, x, w, b, x_scale, w_scale, y_scale, out_dtype, plan)[2]
