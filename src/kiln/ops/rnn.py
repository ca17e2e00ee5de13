"""Recurrent layers: RNN, GRU, LSTM.

One generic driver runs every direction: the input projection of all time steps
is one matmul, then a Python loop issues one small step per time step (the
same device work every run, so an engine can capture it). sequence_lens stays
on the device: shorter sequences are masked, and reverse directions reverse
each sequence within its own length, so nothing is read back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.graph import Node
from .registry import register

# name (lower case: names match case-insensitively, as in onnxruntime) -> (fn(x, alpha, beta),
# default alpha, default beta). A None default means the function takes no such parameter and
# consumes no value from activation_alpha/beta. Defaults are those of the ONNX operators of the
# same name, as the spec says (onnxruntime's RNNs use 0 for Affine and ScaledTanh instead).
_ACTIVATIONS = {
    "relu": (lambda x, a, b: torch.relu(x), None, None),
    "tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: F.leaky_relu(x, a), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0), 0.2, 0.5),
    "elu": (lambda x, a, b: F.elu(x, a), 1.0, None),
    "softsign": (lambda x, a, b: F.softsign(x), None, None),
    "softplus": (lambda x, a, b: F.softplus(x), None, None),
}

_DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}

# Gate activations per direction and their defaults: RNN f; GRU f, g; LSTM f, g, h.
_DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _num_directions(node: Node) -> int:
    return _DIRECTIONS[node.attr("direction", "forward")]


def _activation_names(node: Node) -> list[str]:
    return node.attr("activations") or _DEFAULT_ACTS[node.op_type] * _num_directions(node)


def _activations(node: Node) -> list:
    """Callables x -> f(x), alpha/beta taken in order by the functions that use them."""
    alphas = list(node.attr("activation_alpha") or [])
    betas = list(node.attr("activation_beta") or [])
    out = []
    for name in _activation_names(node):
        fn, a, b = _ACTIVATIONS[name.lower()]
        if a is not None and alphas:
            a = alphas.pop(0)
        if b is not None and betas:
            b = betas.pop(0)
        out.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    return out


def _check(node: Node) -> str | None:
    direction = node.attr("direction", "forward")
    if direction not in _DIRECTIONS:
        return f"direction '{direction}' is not forward, reverse or bidirectional"
    names = _activation_names(node)
    unknown = [n for n in names if n.lower() not in _ACTIVATIONS]
    if unknown:
        return f"activation(s) {unknown} are not supported (supported: {sorted(_ACTIVATIONS)})"
    per_dir = len(_DEFAULT_ACTS[node.op_type])
    if len(names) != per_dir * _num_directions(node):
        return f"{len(names)} activations given, expected {per_dir} per direction ({direction})"
    return None


def _reverse_within(x: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    """Reverse [T, B, ...] along time, each batch entry within its own length."""
    if lens is None:
        return x.flip(0)
    t = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    idx = torch.where(t < lens, lens - 1 - t, t)  # padding steps stay in place
    return x.gather(0, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x))


def _run(node: Node, X, W, R, B, sequence_lens, states, gates: int, step):
    """Drive `step` over time for each direction.

    step(gx_t, states, R, Rb, P-slice, acts) -> new states (hidden first), for one
    time step of one direction; gx_t already holds X_t @ W^T + Wb.
    Returns Y and the final value of each state, ONNX-shaped (layout honoured).
    """
    layout = node.attr("layout", 0)
    if layout:
        X = X.transpose(0, 1)
        states = [s.transpose(0, 1) if s is not None else None for s in states]
    T, batch = X.shape[0], X.shape[1]
    hidden = node.attr("hidden_size") or R.shape[-1]
    dirs = _num_directions(node)
    acts = _activations(node)
    per_dir = len(acts) // dirs
    lens = sequence_lens.to(device=X.device, dtype=torch.long) if sequence_lens is not None else None
    ys, finals = [], [[] for _ in states]
    for d in range(dirs):
        reverse = node.attr("direction", "forward") == "reverse" or d == 1
        x = _reverse_within(X, lens) if reverse else X
        Wb, Rb = (B[d, : gates * hidden], B[d, gates * hidden:]) if B is not None else (None, None)
        gx = torch.matmul(x, W[d].t())
        if Wb is not None:
            gx = gx + Wb
        hs = [s[d] if s is not None else X.new_zeros(batch, hidden) for s in states]
        out = []
        for t in range(T):
            new = step(gx[t], hs, R[d], Rb, d, acts[d * per_dir:(d + 1) * per_dir])
            if lens is None:
                hs = new
                out.append(new[0])
            else:
                valid = (lens > t).unsqueeze(1)
                hs = [torch.where(valid, n, h) for n, h in zip(new, hs)]
                out.append(torch.where(valid, new[0], torch.zeros_like(new[0])))
        y = torch.stack(out) if out else X.new_zeros(0, batch, hidden)
        ys.append(_reverse_within(y, lens) if reverse else y)
        for acc, h in zip(finals, hs):
            acc.append(h)
    Y = torch.stack(ys, 1)  # [T, dirs, B, H]
    finals = [torch.stack(f) for f in finals]  # [dirs, B, H]
    if layout:
        Y = Y.permute(2, 0, 1, 3)
        finals = [f.transpose(0, 1) for f in finals]
    return (Y, *finals)


def _clipper(node: Node):
    clip = node.attr("clip")
    if clip is None:
        return lambda x: x
    return lambda x: torch.clamp(x, -clip, clip)


@register("RNN", check=_check)
def rnn(node, X, W, R, B=None, sequence_lens=None, initial_h=None):
    clip = _clipper(node)

    def step(gx, hs, R, Rb, d, acts):
        g = gx + torch.matmul(hs[0], R.t())
        if Rb is not None:
            g = g + Rb
        return [acts[0](clip(g))]

    return _run(node, X, W, R, B, sequence_lens, [initial_h], 1, step)


@register("GRU", check=_check)
def gru(node, X, W, R, B=None, sequence_lens=None, initial_h=None):
    clip = _clipper(node)
    before_reset = node.attr("linear_before_reset", 0)

    def step(gx, hs, R, Rb, d, acts):
        f, g = acts
        h = hs[0]
        H = h.shape[-1]
        gx_zr, gx_h = gx[:, : 2 * H], gx[:, 2 * H:]
        Rb_zr, Rb_h = (Rb[: 2 * H], Rb[2 * H:]) if Rb is not None else (0, 0)
        z, r = f(clip(gx_zr + torch.matmul(h, R[: 2 * H].t()) + Rb_zr)).chunk(2, -1)
        if before_reset:
            cand = gx_h + r * (torch.matmul(h, R[2 * H:].t()) + Rb_h)
        else:
            cand = gx_h + torch.matmul(r * h, R[2 * H:].t()) + Rb_h
        hh = g(clip(cand))
        return [(1 - z) * hh + z * h]

    return _run(node, X, W, R, B, sequence_lens, [initial_h], 3, step)


@register("LSTM", check=_check)
def lstm(node, X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None):
    clip = _clipper(node)
    input_forget = node.attr("input_forget", 0)

    def step(gx, hs, R, Rb, d, acts):
        f, g, h_act = acts
        h, c = hs
        gates = gx + torch.matmul(h, R.t())
        if Rb is not None:
            gates = gates + Rb
        i, o, fg, cand = gates.chunk(4, -1)  # ONNX order: input, output, forget, cell
        if P is not None:
            p_i, p_o, p_f = P[d].chunk(3)
            i = i + p_i * c
            fg = fg + p_f * c
        i = f(clip(i))
        fg = 1 - i if input_forget else f(clip(fg))
        c_new = fg * c + i * g(clip(cand))
        if P is not None:
            o = o + p_o * c_new
        return [f(clip(o)) * h_act(c_new), c_new]

    return _run(node, X, W, R, B, sequence_lens, [initial_h, initial_c], 4, step)
