"""Engine files that were tampered with, are malformed or are bombs: every one is refused by name, cheaply."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import pytest

import kiln
from kiln import fileio
from kiln.engine import serialize
from kiln.errors import ConfigError, EngineFileError

from ..models import mlp
from .util import read_members, rewrite_manifest, write_zip

CPU = dict(device="cpu", progress=False)
KEY = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def engine():
    return kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})], **CPU))


@pytest.fixture
def path(engine, tmp_path):
    p = tmp_path / "mlp.kiln"
    engine.save(p)
    return p


# --- checksums cover every member -------------------------------------------------------------------------------
def test_an_edited_manifest_fails_its_checksum(path):
    members = read_members(path)
    raw = members["manifest.json"]
    assert b'"precision": "float32"' in raw
    members["manifest.json"] = raw.replace(b'"precision": "float32"', b'"precision": "float16"', 1)  # same size
    write_zip(path, members)
    with pytest.raises(EngineFileError, match="checksum of manifest.json does not match"):
        kiln.load(path)
    with pytest.raises(EngineFileError, match="checksum of manifest.json does not match"):
        serialize.read_manifest(path)


def test_removing_the_checksums_is_a_refusal_not_a_pass(path):
    members = read_members(path)
    w = bytearray(members["weights.safetensors"])
    w[-1] ^= 0xFF  # a flipped weight ...
    members["weights.safetensors"] = bytes(w)
    del members["checksums.json"]  # ... and the checksums that would catch it removed
    write_zip(path, members)
    with pytest.raises(EngineFileError, match="no checksums.json, so its integrity cannot be established"):
        kiln.load(path)


def test_a_missing_digest_is_a_refusal(path):
    members = read_members(path)
    doc = json.loads(members["checksums.json"])
    del doc["members"]["weights.safetensors"]
    members["checksums.json"] = json.dumps(doc).encode()
    write_zip(path, members)
    with pytest.raises(EngineFileError, match="no valid SHA-256 digest and size for weights.safetensors"):
        kiln.load(path)


def test_a_format_1_engine_is_refused_with_rebuild(path):
    members = read_members(path)
    m = json.loads(members["manifest.json"])
    m["format_version"] = 1
    m["checksums"] = {}
    write_zip(path, {"manifest.json": json.dumps(m).encode(), "graph.onnx": members["graph.onnx"],
                     "weights.safetensors": members["weights.safetensors"]})
    with pytest.raises(EngineFileError, match="format 1.*integrity cannot be established.*Rebuild it"):
        kiln.load(path)


# --- signatures ----------------------------------------------------------------------------------------------------
def test_signed_engine_loads_with_its_key_and_is_refused_otherwise(engine, tmp_path, path):
    signed = tmp_path / "signed.kiln"
    serialize.save(engine, signed, sign_key=KEY)
    assert kiln.load(signed, verify_key=KEY).graph.nodes
    with pytest.raises(EngineFileError, match="signed with another key"):
        kiln.load(signed, verify_key=b"another key, sixteen bytes+")
    with pytest.raises(EngineFileError, match="--verifyKey was given and it is not signed"):
        kiln.load(path, verify_key=KEY)
    # Re-sealed checksums after an edit (what a tamperer without the key can do): the signature no longer fits.
    members = read_members(signed)
    m = json.loads(members["manifest.json"])
    m["layers"][0]["note"] = "edited"
    members["manifest.json"] = json.dumps(m).encode()
    sig = json.loads(members["checksums.json"])["signature"]
    members = serialize.write_members(members)
    doc = json.loads(members["checksums.json"])
    doc["signature"] = sig
    members["checksums.json"] = json.dumps(doc).encode()
    write_zip(signed, members)
    assert kiln.load(signed).graph.nodes  # still intact as a file ...
    with pytest.raises(EngineFileError, match="signature does not match its contents"):
        kiln.load(signed, verify_key=KEY)  # ... but not what the key holder built


def test_short_or_missing_key_files_are_config_errors(tmp_path):
    from kiln.engine import signing

    (tmp_path / "short.key").write_bytes(b"abc\n")
    with pytest.raises(ConfigError, match="holds 3 bytes; a key needs at least 16"):
        signing.load_key(tmp_path / "short.key")
    with pytest.raises(ConfigError, match="does not exist"):
        signing.load_key(tmp_path / "none.key")


# --- only the named members, stored, at their recorded size ---------------------------------------------------------
def _bomb(path, name: str, mib: int) -> None:
    """Add member `name`: `mib` MiB of zeros, deflated to a few hundred KiB."""
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as z, z.open(name, "w", force_zip64=True) as f:
        chunk = bytes(2**20)
        for _ in range(mib):
            f.write(chunk)


def test_an_unknown_deflated_member_is_never_read(path):
    _bomb(path, "extra.bin", 256)
    assert path.stat().st_size < 2 * 2**20
    tracemalloc.start()
    try:
        kiln.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, peak  # the 256 MiB member was not inflated


def test_a_compressed_member_is_refused(path):
    members = read_members(path)
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d, compress_type=zipfile.ZIP_DEFLATED if n == "weights.safetensors" else None)
    with pytest.raises(EngineFileError, match="member weights.safetensors is compressed"):
        kiln.load(path)


def test_a_member_larger_than_recorded_is_refused_before_reading(path):
    members = read_members(path)
    doc = json.loads(members["checksums.json"])
    doc["members"]["weights.safetensors"]["size"] = 10
    members["checksums.json"] = json.dumps(doc).encode()
    write_zip(path, members)
    with pytest.raises(EngineFileError, match=r"member weights.safetensors holds \d+ bytes, checksums.json records 10"):
        kiln.load(path)


def test_a_recorded_size_larger_than_the_file_is_refused(path):
    members = read_members(path)
    doc = json.loads(members["checksums.json"])
    doc["members"]["graph.onnx"]["size"] = 3 * 2**30
    members["checksums.json"] = json.dumps(doc).encode()
    write_zip(path, members)
    with pytest.raises(EngineFileError, match="says graph.onnx holds 3221225472 bytes, more than the whole file"):
        kiln.load(path)


# --- manifest schema, on load and read_manifest -----------------------------------------------------------------------
def _reseal_raw(path, manifest_bytes: bytes) -> None:
    members = read_members(path)
    members["manifest.json"] = manifest_bytes
    write_zip(path, serialize.write_members(members))


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.pop("layers"), "layers"),
    (lambda m: m.pop("profiles"), "profiles"),
    (lambda m: m.update(layers="many"), "layers"),
    (lambda m: m.update(profiles=[{"x": {"min": [1, 8], "opt": [4, 8], "max": ["16", 8]}}]),
     r"profiles\[0\].x.max\[0\]"),
    (lambda m: m.update(profiles=[]), "profiles"),
    (lambda m: m["layers"][0].update(tactic=7), r"layers\[0\].tactic"),
    (lambda m: m["layers"][1].pop("op_type"), r"layers\[1\].op_type"),
    (lambda m: m.update(target={"kind": "tpu", "name": "x"}), "target.kind"),
    (lambda m: m.update(capturable="yes"), "capturable"),
    (lambda m: m.update(bindings=[1]), r"bindings\[0\]"),
])
def test_a_structurally_wrong_manifest_names_the_field(path, edit, field):
    rewrite_manifest(path, edit)
    for read in (kiln.load, serialize.read_manifest):
        with pytest.raises(EngineFileError, match=f"manifest field '{field}'|no field '{field}'"):
            read(path)


def test_a_manifest_that_is_a_json_list_is_refused(path):
    _reseal_raw(path, b"[1, 2, 3]")
    for read in (kiln.load, serialize.read_manifest):
        with pytest.raises(EngineFileError, match="manifest.json holds a JSON list, not an object"):
            read(path)


def test_a_cpu_engine_from_another_kiln_or_torch_version_is_refused(path):
    rewrite_manifest(path, lambda m: m["versions"].update(kiln="0.0.1"))
    with pytest.raises(EngineFileError, match="built with kiln 0.0.1, but this machine runs kiln"):
        kiln.load(path)
    rewrite_manifest(path, lambda m: m["versions"].update(kiln=kiln.__version__, torch="1.0.0"))
    with pytest.raises(EngineFileError, match="built with torch 1.0.0"):
        kiln.load(path)


def test_an_unknown_device_is_refused(path):
    with pytest.raises(ConfigError, match="'tpu:7' is not a device Kiln runs on"):
        kiln.load(path, device="tpu:7")


# --- saving: destination checks, OSError, SIGTERM, stale temporaries -------------------------------------------------
def test_destination_checks_name_the_path(tmp_path):
    (tmp_path / "file").write_text("x")
    for bad, why in ((tmp_path, "it is a directory"), (tmp_path / "no" / "e.kiln", "does not exist"),
                     (tmp_path / "file" / "e.kiln", "is not a folder")):
        with pytest.raises(EngineFileError, match=why):
            fileio.check_destination(bad, EngineFileError)


def test_a_write_error_is_a_clear_error_and_leaves_nothing(engine, tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE) in a child process, not a patched function."""
    code = textwrap.dedent(f"""
        import resource, kiln
        from kiln.errors import KilnError
        from tests.models import mlp
        e = kiln.build(mlp(), kiln.BuildConfig(shapes={{'x': (1, 8)}}, device='cpu', progress=False))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            e.save({str(tmp_path / 'e.kiln')!r})
        except KilnError as err:
            print('ERR', err)
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert "ERR cannot write" in p.stdout and "e.kiln" in p.stdout, p.stdout + p.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_save_removes_the_temporary(tmp_path):
    target = tmp_path / "e.kiln"
    code = textwrap.dedent(f"""
        import os, signal, sys
        from kiln.fileio import atomic_write
        def write(f):
            f.write(b'x' * 1000)
            f.flush()
            print('writing', flush=True)
            signal.pause()  # the parent sends SIGTERM now
        atomic_write({str(target)!r}, write)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert len(list(tmp_path.glob(".e.kiln.*.tmp"))) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_the_next_save_sweeps_temporaries_of_killed_writers(engine, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".mlp.kiln.{dead}.abc123.tmp"
    stale.write_bytes(b"half an engine")
    live = tmp_path / f".mlp.kiln.{os.getpid()}.def456.tmp"  # a write in progress (this process): kept
    live.write_bytes(b"in progress")
    other = tmp_path / f".other.kiln.{dead}.abc123.tmp"  # another file's temporary: not ours to remove
    other.write_bytes(b"x")
    engine.save(tmp_path / "mlp.kiln")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mlp.kiln", live.name, other.name])
