"""The target an engine is built for, and the version stamp it carries."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Target:
    kind: str  # "cuda" or "cpu"
    name: str  # GPU name, or the CPU architecture
    capability: str | None = None  # CUDA compute capability, e.g. "9.0"
    index: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"{self.name} (compute capability {self.capability})"
        return f"CPU ({self.name}, reference kernels)"

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "index"}


def resolve(device: str = "auto") -> Target:
    device = device.lower()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device '{device}' was requested but this machine has no CUDA GPU visible to torch.")
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return Target("cuda", torch.cuda.get_device_name(index), f"{major}.{minor}", index)
    if device == "cpu":
        return Target("cpu", platform.machine() or "unknown")
    raise ConfigError(f"device '{device}' is not one of auto, cpu, cuda, cuda:N.")


def versions() -> dict:
    from ..version import __version__

    v = {"kiln": __version__, "torch": torch.__version__.split("+")[0], "python": platform.python_version()}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    v["cuda"] = torch.version.cuda
    v["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    import onnx

    v["onnx"] = onnx.__version__
    return v
