"""Editing a saved engine's manifest, to make foreign or mismatched engines for the refusal tests."""

import json
import zipfile


def rewrite_manifest(path, edit) -> None:
    """Apply edit(manifest dict) to the engine file at path, keeping the other members as they are."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    m = json.loads(members["manifest.json"])
    edit(m)
    members["manifest.json"] = json.dumps(m).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
