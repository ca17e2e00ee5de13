"""The engine a proof tool works on: loaded from its .kiln file (refused unless signed with --verifyKey's key,
when given), and --shapes checked against its inputs."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, InputError


def add_verify_key_flag(p) -> None:
    """--verifyKey / --verify-key KEYFILE on a command that loads an engine (engine/signing.py)."""
    p.add_argument("--verifyKey", "--verify-key", dest="verifyKey", metavar="KEYFILE", default=None,
                   help="refuse the engine unless it was signed with this key (`kiln build --sign KEYFILE`)")


def verify_key_of(args) -> bytes | None:
    """The key --verifyKey names (None without the flag); a missing or short key file is a ConfigError."""
    from ..engine.signing import load_key

    path = getattr(args, "verifyKey", None)
    return load_key(path) if path else None


def load_engine(engine, device: str = "auto", verify_key: bytes | None = None):
    """An Engine object, or the path of a .kiln file (refused unless signed with verify_key, when given)."""
    from ..engine.engine import Engine
    from ..engine.serialize import load

    if isinstance(engine, Engine):
        return engine
    path = Path(engine)
    if path.suffix == ".onnx":
        raise ConfigError(
            f"'{path}' is an ONNX model, not an engine: build one first with "
            f"`kiln build --onnx={path} --saveEngine=model.kiln`."
        )
    return load(path, device=device, verify_key=verify_key)


def parse_shapes_arg(text: str, engine, flag: str = "--shapes") -> dict[str, tuple]:
    from ..engine.profile import parse_shapes

    shapes = parse_shapes(text or "", flag)
    names = [v.name for v in engine.inputs]
    unknown = [k for k in shapes if k not in names]
    if unknown:
        raise InputError(f"{flag}: {unknown} are not inputs of this engine; its inputs are {names}.")
    return shapes
