"""Optional values: Optional, OptionalHasElement, OptionalGetElement.

An optional (ONNX optional(tensor) or optional(sequence)) is at run time what it holds, a tensor or a list of
tensors (ops/sequence.py), or None when empty: the same None an omitted optional input arrives as, so an
op reading an empty optional sees no input.
"""

from __future__ import annotations

import torch

from ..errors import KilnError
from .registry import register


@register("Optional", since=15)
def optional(node, value=None):
    return (value,)  # a 1-tuple: the value may be a sequence (a list) or None


@register("OptionalHasElement", since=15)
def optional_has_element(node, value=None):
    return torch.tensor(value is not None, device=node.device)


@register("OptionalGetElement", since=15)
def optional_get_element(node, value=None):
    if value is None:
        name = node.inputs[0] if node.inputs else ""
        raise KilnError(f"node '{node.label}' (OptionalGetElement): the optional '{name}' is empty; "
                        "there is no element to get.")
    return (value,)
