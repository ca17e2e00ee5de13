"""Synthetic inputs that look like data, when the user gives none.

A random input should exercise the engine the way real inputs do, or a comparison
on it proves little. Per input, in this order:

- `--valRange NAME:LO,HI` (Polygraphy's spelling; a range without a name applies to
  every input): uniform in [LO, HI]; integers inclusive of HI.
- An integer input whose values index an embedding table (a Gather that reads rows of a
  weight by it, possibly through Cast/Reshape/Unsqueeze): token ids uniform over the
  table's rows, so a BERT sees its vocabulary, not two tokens.
- An input named like a mask (`attention_mask`, `mask`, ...): a mask, ones with a tail
  of zeros per row (each row a random valid length, at least half the sequence; the
  first row has no padding).
- Other floats: standard normal (never zeros: they hide unwritten outputs); other
  integers 0 or 1 (valid as indices, flags and small counts); booleans random.

`describe` says, per input, which rule produced it: reports print it, because a check
on synthetic inputs is weaker than one on data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError

# Ops an index travels through unchanged on its way to a Gather (dtype or layout only).
_PASS_THROUGH = ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity")
_MASK_NAME = re.compile(r"(^|[_.\-])(attention_?)?mask($|[_.\-])|attn_?mask|padding_?mask", re.I)
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
# NAME:LO,HI or NAME:[LO,HI]; a name may hold colons itself (TensorFlow's "input_1:0")
_RANGE = re.compile(rf"(?:([^\s,\[\]]+):)?\[?\s*({_NUM})\s*,\s*({_NUM})\s*\]?")


@dataclass(frozen=True)
class InputRule:
    """How one synthetic input is drawn."""

    kind: str  # "range", "token-ids", "mask", "normal", "binary", "bool"
    lo: float = 0.0
    hi: float = 1.0
    source: str = ""  # the embedding table or flag behind the rule

    def describe(self) -> str:
        if self.kind == "range":
            return f"uniform in [{self.lo:g}, {self.hi:g}] (--valRange)"
        if self.kind == "token-ids":
            return f"token ids uniform over 0..{int(self.hi)} (the rows of embedding '{self.source}')"
        if self.kind == "mask":
            return "a mask: ones, then a random tail of zeros per row (first row unpadded)"
        if self.kind == "normal":
            return "standard normal"
        if self.kind == "bool":
            return "random booleans"
        return "random 0/1 (an integer input of no known range: pass --valRange to widen it)"


def parse_val_range(text: str | list[str] | None, input_names: list[str] | None = None) -> dict:
    """'ids:0,30521 mask:0,1' or 'ids:[0,30521],x:[-1,1]' or '0,1' -> {name or None: (lo, hi)}.

    None keys a range for every input without its own."""
    if not text:
        return {}
    if isinstance(text, (list, tuple)):
        text = " ".join(text)
    out, pos = {}, 0
    text = text.strip()
    while pos < len(text):
        if text[pos] in " ,":
            pos += 1
            continue
        m = _RANGE.match(text, pos)
        if not m:
            raise ConfigError(f"--valRange: cannot read '{text[pos:]}'; write NAME:LO,HI (e.g. input_ids:0,30521 or "
                              "x:[-1,1]), several separated by spaces or commas, or LO,HI for every input.")
        name, lo, hi = m.group(1), float(m.group(2)), float(m.group(3))
        if hi < lo:
            raise ConfigError(f"--valRange: for {name or 'every input'} the range [{lo:g}, {hi:g}] is empty "
                              "(LO must not exceed HI).")
        out[name] = (lo, hi)
        pos = m.end()
    if input_names is not None:
        unknown = [k for k in out if k is not None and k not in input_names]
        if unknown:
            raise ConfigError(f"--valRange: {unknown} are not inputs of the engine; its inputs are {input_names}.")
    return out


def embedding_rows(graph, name: str) -> tuple[int, str] | None:
    """(rows, table name) of the smallest embedding table the integer input `name` indexes, or None."""
    consumers = graph.consumers()
    constants = {o: n.attr("value") for n in graph.nodes if n.op_type == "Constant" for o in n.outputs}
    found, seen, todo = [], set(), [name]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        for node in consumers.get(t, []):
            if node.op_type in _PASS_THROUGH and node.inputs and node.inputs[0] == t:
                todo += list(node.outputs[:1])
            elif node.op_type == "Gather" and len(node.inputs) > 1 and node.inputs[1] == t:
                table = graph.initializers.get(node.inputs[0])
                if table is None:
                    table = constants.get(node.inputs[0])
                axis = int(node.attr("axis", 0))
                if isinstance(table, torch.Tensor) and table.dim() > 0:
                    found.append((int(table.shape[axis]), node.inputs[0]))
    return min(found) if found else None


def input_rules(engine, val_range: dict | None = None) -> dict[str, InputRule]:
    """The rule each engine input is drawn by (see the module docstring)."""
    val_range = val_range or {}
    rules = {}
    for v in engine.inputs:
        dtype = v.dtype or torch.float32
        rng = val_range.get(v.name, val_range.get(None))
        if rng is not None:
            rules[v.name] = InputRule("range", *rng)
        elif dtype == torch.bool:
            rules[v.name] = InputRule("mask") if _MASK_NAME.search(v.name) else InputRule("bool")
        elif _MASK_NAME.search(v.name):
            rules[v.name] = InputRule("mask")
        elif dtype.is_floating_point:
            rules[v.name] = InputRule("normal")
        else:
            emb = embedding_rows(engine.graph, v.name)
            rules[v.name] = InputRule("token-ids", 0, emb[0] - 1, emb[1]) if emb else InputRule("binary")
    return rules


def _mask(shape: tuple, g: torch.Generator) -> torch.Tensor:
    """Ones with a random tail of zeros along the last axis, per row; the first row unpadded."""
    if len(shape) == 0 or shape[-1] == 0:
        return torch.ones(shape)
    seq = shape[-1]
    rows = torch.Size(shape[:-1]).numel()
    lengths = torch.randint((seq + 1) // 2, seq + 1, (rows,), generator=g)
    if rows:
        lengths[0] = seq
    m = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    return m.reshape(shape)


def draw(rule: InputRule, shape: tuple, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """One input tensor drawn by `rule`."""
    if rule.kind == "mask":
        x = _mask(shape, g)
        return x.bool() if dtype == torch.bool else x.to(dtype)
    if rule.kind in ("range", "token-ids"):
        if dtype.is_floating_point:
            return (torch.rand(shape, generator=g, dtype=torch.float64) * (rule.hi - rule.lo) + rule.lo).to(dtype)
        if dtype == torch.bool:
            return torch.randint(int(rule.lo), int(rule.hi) + 1, shape, generator=g) != 0
        return torch.randint(int(rule.lo), int(rule.hi) + 1, shape, generator=g).to(dtype)
    if rule.kind == "normal":
        return torch.randn(shape, generator=g).to(dtype)
    if rule.kind == "bool":
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(0, 2, shape, generator=g).to(dtype)


def synthetic_inputs(engine, profile: int = 0, pick: int = 1, shapes: dict | None = None, seed: int = 0,
                     device=None, val_range: dict | None = None) -> dict[str, torch.Tensor]:
    """Seeded inputs at a profile's min (pick=0), opt (1) or max (2) shape, or at `shapes`."""
    g = torch.Generator().manual_seed(seed)
    rules = input_rules(engine, val_range)
    feeds = {}
    for v in engine.inputs:
        shape = tuple((shapes or {}).get(v.name, engine.get_profile_shape(profile, v.name)[pick]))
        x = draw(rules[v.name], shape, v.dtype or torch.float32, g)
        feeds[v.name] = x.to(device) if device is not None else x
    return feeds


def describe(engine, val_range: dict | None = None) -> dict[str, str]:
    """{input: how its synthetic values are drawn}."""
    return {name: rule.describe() for name, rule in input_rules(engine, val_range).items()}
