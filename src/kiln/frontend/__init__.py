"""Model frontends: ONNX files and PyTorch modules, and `kiln check`.

    load_onnx(path | bytes | ModelProto) -> onnx.ModelProto     (external data loaded, validated)
    check_model(model, upgrade_opset=None) -> CheckReport        (checker, shape inference, op support)
    from_torch(module, example_inputs, dynamic_shapes=...) -> (onnx.ModelProto, ProfileHints)
    bind_sequence_inputs(model, {name: length}) -> onnx.ModelProto  (sequence inputs as tensor inputs)
    bind_optional_inputs(model, {name: given}) -> onnx.ModelProto   (optional inputs as what they hold)
"""

from .check import add_check_command, check_model, run_check
from .onnx_loader import load_onnx
from .opset import RECOMMENDED_OPSET, upgrade_opset
from .optional_inputs import bind_optional_inputs
from .report import CheckReport
from .sequence_inputs import bind_sequence_inputs
from .torch_export import DynamicAxis, ProfileHints, from_torch

__all__ = [
    "RECOMMENDED_OPSET", "CheckReport", "DynamicAxis", "ProfileHints", "add_check_command", "bind_optional_inputs",
    "bind_sequence_inputs", "check_model", "from_torch", "load_onnx", "run_check", "upgrade_opset",
]
