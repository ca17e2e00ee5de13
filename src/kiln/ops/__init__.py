"""ONNX operators, one module per family. Importing this package fills the registry."""

from . import (  # noqa: F401  (each import registers its family's ops)
    activation,
    attention,
    cast,
    control_flow,
    elementwise,
    fused,
    image,
    indexing,
    loss,
    nn,
    norm,
    optional,
    quant,
    random,
    reduce,
    rnn,
    rotary,
    sequence,
    shape,
    view_chain,
)
from .registry import (
    OpEntry,
    claimed_ops,
    entries,
    lookup,
    register,
    unsupported_reason,
)

__all__ = ["OpEntry", "claimed_ops", "entries", "lookup", "register", "unsupported_reason"]
