"""Optimization profiles: min/opt/max shape per input, and the shape flags that give them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ConfigError

Shape = tuple[int, ...]


@dataclass
class Profile:
    """min/opt/max shape per input. Kernels are tuned for opt; runs outside min..max are refused."""

    shapes: dict[str, tuple[Shape, Shape, Shape]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: {"min": list(a), "opt": list(b), "max": list(c)} for k, (a, b, c) in self.shapes.items()}

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        return cls({k: (tuple(v["min"]), tuple(v["opt"]), tuple(v["max"])) for k, v in d.items()})


def parse_dims(text: str, what: str) -> Shape:
    text = text.strip()
    if text == "":
        return ()  # a scalar input
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"{what}: '{text}' is not a shape; write dimensions joined by 'x', "
                          "e.g. 1x3x224x224.") from None
    if any(d < 0 for d in dims):
        raise ConfigError(f"{what}: '{text}' has a negative dimension.")
    return dims


def parse_shapes(text: str, flag: str) -> dict[str, Shape]:
    """'x:1x3x224x224,mask:1x128' -> {'x': (1, 3, 224, 224), 'mask': (1, 128)}."""
    out: dict[str, Shape] = {}
    if not text:
        return out
    for item in re.split(r",(?=[^,]*:)", text):
        if ":" not in item:
            raise ConfigError(f"{flag}: '{item}' should be NAME:DIMS, e.g. input:1x3x224x224.")
        name, dims = item.rsplit(":", 1)
        name = name.strip().strip("'\"")
        out[name] = parse_dims(dims, f"{flag} for input '{name}'")
    return out


def profile_from_flags(min_s: str, opt_s: str, max_s: str,
                       flags: tuple[str, str, str] = ("--minShapes", "--optShapes", "--maxShapes")) -> Profile:
    """The profile the three shape flags give; `flags` names them in errors (--shapes when it stands for all three)."""
    mins, opts, maxs = (parse_shapes(min_s, flags[0]), parse_shapes(opt_s, flags[1]), parse_shapes(max_s, flags[2]))
    names = list(dict.fromkeys([*mins, *opts, *maxs]))
    shapes = {}
    for n in names:
        given = [s for s in (mins.get(n), opts.get(n), maxs.get(n)) if s is not None]
        lo, mid, hi = mins.get(n, given[0]), opts.get(n), maxs.get(n, given[-1])
        shapes[n] = (lo, mid if mid is not None else hi, hi)
    return Profile(shapes)
