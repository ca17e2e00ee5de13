"""Editing a saved engine's manifest, to make foreign or mismatched engines for the refusal tests."""

import json
import zipfile

from kiln.engine import serialize


def read_members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_zip(path, members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        for n, d in members.items():
            z.writestr(n, d)


def rewrite_manifest(path, edit, reseal: bool = True) -> None:
    """Apply edit(manifest dict) to the engine file at path, keeping the other members as they are.
    reseal: recompute checksums.json, as a build that wrote such a manifest would have (the refusal under
    test is then the one for the manifest's content, not for a checksum that no longer matches)."""
    members = read_members(path)
    m = json.loads(members["manifest.json"])
    edit(m)
    members["manifest.json"] = json.dumps(m).encode()
    if reseal:
        members = serialize.write_members(members)
    write_zip(path, members)
