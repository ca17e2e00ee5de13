"""Engine signatures: HMAC-SHA256 with a key the deployment keeps, over the member digests.

`kiln build --sign KEYFILE` stores the signature in the engine's checksums.json;
`kiln run|inspect --verifyKey KEYFILE` refuses an engine that is unsigned or
signed with another key. The digests cover every member (manifest included), so
a valid signature means the whole file is what the key holder built.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from ..errors import ConfigError

ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
_DOMAIN = b"kiln-engine-signature-v1\n"  # a signature of an engine is never valid for any other message


def load_key(path) -> bytes:
    """The key file's bytes (at least 16 of them; a trailing newline is not part of the key)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"signing key file '{p}' does not exist (make one with e.g. "
                          f"`python -c \"import secrets; print(secrets.token_hex(32))\" > {p}`).")
    try:
        key = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"signing key file '{p}' cannot be read: {e.strerror or e}.") from None
    key = key.rstrip(b"\r\n")
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"signing key file '{p}' holds {len(key)} bytes; a key needs at least {MIN_KEY_BYTES} "
                          "(use 32 random bytes or 64 hex digits).")
    return key


def key_id(key: bytes) -> str:
    """A short public name for the key (shown in errors; reveals nothing about the key)."""
    return hashlib.sha256(b"kiln-key-id\n" + key).hexdigest()[:16]


def _message(digests: dict) -> bytes:
    return _DOMAIN + json.dumps(digests, sort_keys=True, separators=(",", ":")).encode()


def sign(digests: dict, key: bytes) -> dict:
    return {"algorithm": ALGORITHM, "key_id": key_id(key),
            "value": hmac.new(key, _message(digests), hashlib.sha256).hexdigest()}


def verify(digests: dict, signature, key: bytes) -> str | None:
    """None when `signature` is a valid signature of `digests` by `key`, else the reason it is not."""
    if signature is None:
        return "it is not signed"
    if not isinstance(signature, dict) or signature.get("algorithm") != ALGORITHM:
        return "its signature is not an hmac-sha256 signature"
    want = hmac.new(key, _message(digests), hashlib.sha256).hexdigest()
    if not isinstance(signature.get("value"), str) or not hmac.compare_digest(want, signature["value"]):
        theirs = signature.get("key_id")
        if isinstance(theirs, str) and theirs != key_id(key):
            return f"it was signed with another key (key id {theirs[:16]}, this key's id is {key_id(key)})"
        return "its signature does not match its contents (the file was changed after it was signed)"
    return None
