"""The corpus of bad inputs: ONNX models, engines, manifests, calibration and input files, flags.

make_corpus(root) writes every file a case needs under `root` and returns the
cases. A case is one `python -m kiln ...` command that must fail cleanly: a
non-zero exit, no traceback, and a message naming at least one of `names` (the
file, node, input, axis, flag or field at fault).
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..models import mlp


@dataclass
class Case:
    id: str
    argv: list[str]
    names: tuple[str, ...]  # the message must name at least one of these


# --- ONNX models ------------------------------------------------------------------------------------------------
def _copy(m: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


def _node(m, name):
    return next(n for n in m.graph.node if n.name == name)


def _init(m, name):
    return next(t for t in m.graph.initializer if t.name == name)


def _drop_init(m):
    m.graph.initializer.remove(_init(m, "w1"))
    return m, ("fc1", "w1")


def _cycle(m):
    _node(m, "fc1").input[0] = "h2"
    return m, ("fc1", "relu", "cycle")


def _unsorted(m):
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    return m, ("fc2_bias", "fc1", "topological")


def _dup_output(m):
    _node(m, "relu").output[0] = "h0"
    _node(m, "fc2").input[0] = "h0"
    return m, ("relu", "h0")


def _output_shadows_input(m):
    _node(m, "fc1").output[0] = "x"
    _node(m, "fc1_bias").input[0] = "x"
    return m, ("fc1", "'x'")


def _mixed_types(m):
    m.graph.input.append(helper.make_tensor_value_info("k", TensorProto.INT64, ["N", 4]))
    _node(m, "fc2_bias").output[0] = "y0"
    m.graph.node.append(helper.make_node("Add", ["y0", "k"], ["y"], name="mixed_add"))
    return m, ("mixed_add",)


def _out_dtype(m):
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    return m, ("fc2_bias", "'y'", "int64")


def _opset(version, domain=""):
    def mutate(m):
        m.opset_import[0].version = version
        m.opset_import[0].domain = domain
        return m, (str(version), "opset", "operator set")
    return mutate


def _unknown_op(m):
    _node(m, "relu").op_type = "FooBar"
    return m, ("relu", "FooBar")


def _foreign_domain(m):
    _node(m, "relu").domain = "com.acme"
    m.opset_import.append(helper.make_opsetid("com.acme", 1))
    return m, ("relu", "com.acme")


def _arity_low(m):
    del _node(m, "fc1_bias").input[1:]
    return m, ("fc1_bias",)


def _arity_high(m):
    _node(m, "relu").input.append("b1")
    return m, ("relu",)


def _bad_matmul_dims(m):
    w = _init(m, "w1")
    w.CopyFrom(numpy_helper.from_array(np.zeros((9, 16), np.float32), "w1"))
    return m, ("fc1", "w1")


def _truncated_raw(m):
    w = _init(m, "w1")
    w.raw_data = w.raw_data[:10]
    return m, ("w1",)


def _string_init(m):
    m.graph.initializer.append(helper.make_tensor("s", TensorProto.STRING, [1], [b"x"]))
    _node(m, "relu").input.append("s")
    return m, ("'s'", "relu")


def _sparse_init(m):
    values = numpy_helper.from_array(np.ones(1, np.float32), "sp")
    idx = numpy_helper.from_array(np.zeros(1, np.int64), "sp_idx")
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(values, idx, [4]))
    return m, ("sp", "sparse")


def _output_not_produced(m):
    m.graph.output[0].name = "nope"
    return m, ("nope",)


def _input_no_shape(m):
    m.graph.input[0].type.tensor_type.ClearField("shape")
    return m, ("'x'", "x")


def _input_no_type(m):
    m.graph.input[0].ClearField("type")
    return m, ("'x'", "x")


def _input_sequence(m):
    vi = helper.make_tensor_sequence_value_info("x", TensorProto.FLOAT, None)
    m.graph.input[0].CopyFrom(vi)
    return m, ("'x'", "x")


def _input_complex(m):
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.COMPLEX128
    return m, ("'x'", "complex128")


def _input_undefined(m):
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED
    return m, ("'x'", "x")


def _unknown_attribute(m):
    _node(m, "relu").attribute.append(helper.make_attribute("foo", 3))
    return m, ("relu", "foo")


def _bad_transpose(m):
    _node(m, "relu").op_type = "Transpose"
    _node(m, "relu").attribute.append(helper.make_attribute("perm", [0, 5]))
    return m, ("relu", "perm")


def _bad_reshape(m):
    m.graph.initializer.append(numpy_helper.from_array(np.array([-1, -1], np.int64), "shape"))
    n = _node(m, "relu")
    n.op_type = "Reshape"
    n.input.append("shape")
    return m, ("relu",)


def _conv_rank(m):
    n = _node(m, "relu")
    n.op_type = "Conv"
    n.input.append("w2")
    return m, ("relu",)


def _dup_initializer(m):
    m.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "b1"))
    return m, ("b1",)


def _huge_declared_init(m):
    t = TensorProto(name="w1", data_type=TensorProto.FLOAT, dims=[2**20, 2**20])
    _init(m, "w1").CopyFrom(t)
    return m, ("w1",)


def _negative_init_dims(m):
    t = _init(m, "b1")
    del t.dims[:]
    t.dims.extend([-16])
    return m, ("b1",)


def _if_subgraph_missing(m):
    then = helper.make_graph([helper.make_node("Relu", ["ghost"], ["t_out"], name="inner_relu")], "then", [],
                             [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    n = _node(m, "relu")
    n.op_type = "If"
    del n.input[:]
    n.input.append("cond")
    n.attribute.extend([helper.make_attribute("then_branch", then), helper.make_attribute("else_branch", then)])
    return m, ("inner_relu", "ghost")


def _external(location, make_file=None):
    def mutate(m, folder: Path):
        t = _init(m, "w1")
        size = len(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", str(size))):
            t.external_data.append(onnx.StringStringEntryProto(key=k, value=v))
        if make_file:
            make_file(folder)
        return m, ("w1", location)
    return mutate


MODEL_MUTATIONS = {
    "missing_initializer": _drop_init, "cycle": _cycle, "unsorted_nodes": _unsorted, "duplicate_output": _dup_output,
    "output_shadows_input": _output_shadows_input, "add_float_int64": _mixed_types, "output_dtype": _out_dtype,
    "opset_99": _opset(99), "opset_0": _opset(0), "ai_onnx_opset_99": _opset(99, "ai.onnx"),
    "unknown_op": _unknown_op, "foreign_domain": _foreign_domain, "add_one_input": _arity_low,
    "relu_two_inputs": _arity_high, "matmul_dims": _bad_matmul_dims, "truncated_raw_data": _truncated_raw,
    "string_initializer": _string_init, "sparse_initializer": _sparse_init,
    "output_not_produced": _output_not_produced, "input_sequence": _input_sequence,
    "input_complex128": _input_complex, "input_undefined_type": _input_undefined,
    "input_no_type": _input_no_type, "unknown_attribute": _unknown_attribute, "transpose_perm": _bad_transpose,
    "reshape_two_minus_one": _bad_reshape, "conv_rank": _conv_rank, "duplicate_initializer": _dup_initializer,
    "huge_declared_initializer": _huge_declared_init, "negative_initializer_dims": _negative_init_dims,
    "if_branch_missing_input": _if_subgraph_missing,
}
EXTERNAL_MUTATIONS = {
    "external_escape": _external("../../etc/passwd"),
    "external_absolute": _external("/etc/passwd"),
    "external_missing": _external("weights.bin"),
    "external_short": _external("short.bin", lambda d: (d / "short.bin").write_bytes(b"\0" * 8)),
}
RAW_MODELS = {
    "empty_file": b"",
    "random_bytes": bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
    "text_file": b"this is not an onnx model\n" * 10,
    "truncated_protobuf": None,  # filled in from the good model
    "no_graph": onnx.ModelProto(ir_version=8).SerializeToString(),
}


def _models(root: Path) -> list[Case]:
    cases = []
    good = mlp()
    folder = root / "models"
    folder.mkdir()
    files: list[tuple[str, Path, tuple]] = []
    for name, mutate in MODEL_MUTATIONS.items():
        m, names = mutate(_copy(good))
        path = folder / f"{name}.onnx"
        path.write_bytes(m.SerializeToString())
        files.append((name, path, names))
    for name, mutate in EXTERNAL_MUTATIONS.items():
        sub = folder / name
        sub.mkdir()
        m, names = mutate(_copy(good), sub)
        path = sub / "model.onnx"
        path.write_bytes(m.SerializeToString())
        files.append((name, path, names))
    raw = dict(RAW_MODELS, truncated_protobuf=good.SerializeToString()[:150])
    for name, data in raw.items():
        path = folder / f"{name}.onnx"
        path.write_bytes(data)
        files.append((name, path, (path.name,)))
    files.append(("missing_file", folder / "absent.onnx", ("absent.onnx",)))
    files.append(("a_directory", folder, (str(folder.name),)))
    for name, path, names in files:
        p = str(path)
        cases.append(Case(f"build-{name}", ["build", f"--onnx={p}", "--device=cpu", "--skipInference",
                                             "--saveEngine=out.kiln"], names + (path.name,)))
        cases.append(Case(f"check-{name}", ["check", p], names + (path.name,)))
    # A few through `kiln run --onnx` too (the build inside run must fail the same way).
    for name, path, names in files[:12]:
        cases.append(Case(f"run-onnx-{name}", ["run", f"--onnx={path}", "--device=cpu", "--iterations=1"],
                          names + (path.name,)))
    return cases


# --- engines -----------------------------------------------------------------------------------------------------
def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _zip(path: Path, members: dict[str, bytes], deflate: tuple[str, ...] = ()) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d, compress_type=zipfile.ZIP_DEFLATED if n in deflate else zipfile.ZIP_STORED)


def _resealed(good: dict, edit) -> dict:
    """The members with the manifest edited and checksums.json recomputed (so the content check is reached)."""
    from kiln.engine import serialize

    m = json.loads(good["manifest.json"])
    m = edit(m) or m
    out = dict(good, **{"manifest.json": json.dumps(m).encode()})
    return serialize.write_members(out)


def _flip(data: bytes, at: int = -1) -> bytes:
    b = bytearray(data)
    b[at] ^= 0xFF
    return bytes(b)


def _engines(root: Path, good_engine: Path, key: Path, other_key: Path) -> list[Case]:
    from kiln.engine import serialize

    good = _members(good_engine)
    folder = root / "engines"
    folder.mkdir()
    variants: dict[str, tuple[object, tuple]] = {}

    def layer0(field, value):
        def edit(m):
            m["layers"][0][field] = value
        return edit

    manifest_edits = {
        "manifest_list": (lambda m: [1, 2], ("manifest.json", "list")),
        "no_layers": (lambda m: m.pop("layers") and None, ("layers",)),
        "no_profiles": (lambda m: m.pop("profiles") and None, ("profiles",)),
        "empty_profiles": (lambda m: m.update(profiles=[]), ("profiles",)),
        "layers_string": (lambda m: m.update(layers="x"), ("layers",)),
        "layer_tactic_int": (layer0("tactic", 5), ("layers[0].tactic",)),
        "layer_placement": (layer0("placement", "moon"), ("layers[0].placement",)),
        "profile_dim_string": (lambda m: m["profiles"][0]["x"].update(max=["16", 8]), ("profiles[0].x.max[0]",)),
        "profile_dim_huge": (lambda m: m["profiles"][0]["x"].update(max=[2**50, 8]), ("profiles[0].x.max[0]",)),
        "profile_dim_negative": (lambda m: m["profiles"][0]["x"].update(min=[-3, 8]), ("profiles[0].x.min[0]",)),
        "profile_unknown_input": (lambda m: m["profiles"][0].update(z=m["profiles"][0]["x"]), ("profiles[0]",)),
        "profile_min_gt_max": (lambda m: m["profiles"][0]["x"].update(min=[32, 8]), ("profiles[0].x",)),
        "target_tpu": (lambda m: m.update(target={"kind": "tpu", "name": "v5"}), ("target.kind",)),
        "target_missing": (lambda m: m.pop("target") and None, ("target",)),
        "versions_list": (lambda m: m.update(versions=[1]), ("versions",)),
        "other_kiln_version": (lambda m: m["versions"].update(kiln="9.9.9"), ("kiln 9.9.9",)),
        "other_torch_version": (lambda m: m["versions"].update(torch="1.0.0"), ("torch 1.0.0",)),
        "format_99": (lambda m: m.update(format_version=99), ("format 99",)),
        "format_string": (lambda m: m.update(format_version="2"), ("format",)),
        "foreign_format": (lambda m: m.update(format="onnx"), ("format 'onnx'",)),
        "layer_count": (lambda m: m["layers"].pop() and None, ("layers",)),
        "bytes_weight_unknown": (lambda m: m.update(weights_stored_as_bytes={"nope": "float8_e8m0fnu"}), ("nope",)),
        "capturable_string": (lambda m: m.update(capturable="yes"), ("capturable",)),
        "bindings_ints": (lambda m: m.update(bindings=[1, 2]), ("bindings[0]",)),
    }
    for name, (edit, names) in manifest_edits.items():
        variants[name] = (_resealed(good, edit), names)
    no_sums = {k: v for k, v in good.items() if k != "checksums.json"}
    flipped = dict(good, **{"weights.safetensors": _flip(good["weights.safetensors"])})
    sums = json.loads(good["checksums.json"])
    no_weight_digest = json.loads(good["checksums.json"])
    del no_weight_digest["members"]["weights.safetensors"]
    small_size = json.loads(good["checksums.json"])
    small_size["members"]["weights.safetensors"]["size"] = 3
    big_size = json.loads(good["checksums.json"])
    big_size["members"]["graph.onnx"]["size"] = 3 * 2**30
    same_size_edit = good["manifest.json"].replace(b'"placement": "device"', b'"placement": "host  "', 1)
    v1 = json.loads(good["manifest.json"])
    v1.update(format_version=1, checksums={})
    program = _crafted_program(folder)
    variants.update({
        "no_checksums": (no_sums, ("checksums.json", "integrity")),
        "flipped_weight": (flipped, ("weights.safetensors",)),
        "flipped_weight_no_checksums": ({k: v for k, v in flipped.items() if k != "checksums.json"},
                                        ("checksums.json",)),
        "edited_manifest": (dict(good, **{"manifest.json": same_size_edit}), ("manifest.json",)),
        "no_weight_digest": (dict(good, **{"checksums.json": json.dumps(no_weight_digest).encode()}),
                             ("weights.safetensors",)),
        "size_smaller_than_member": (dict(good, **{"checksums.json": json.dumps(small_size).encode()}),
                                     ("weights.safetensors",)),
        "size_larger_than_file": (dict(good, **{"checksums.json": json.dumps(big_size).encode()}), ("graph.onnx",)),
        "checksums_garbage": (dict(good, **{"checksums.json": b"\xff\xfe garbage"}), ("checksums.json",)),
        "checksums_list": (dict(good, **{"checksums.json": b"[]"}), ("checksums.json",)),
        "format_1": ({"manifest.json": json.dumps(v1).encode(), "graph.onnx": good["graph.onnx"],
                      "weights.safetensors": good["weights.safetensors"]}, ("format 1",)),
        "manifest_not_json": (serialize.write_members(dict(good, **{"manifest.json": b"{not json"})),
                              ("manifest.json",)),
        "graph_garbage": (serialize.write_members(dict(good, **{"graph.onnx": b"\x08\x99garbage"})),
                          ("cannot be decoded", "graph")),
        "weights_garbage": (serialize.write_members(dict(good, **{"weights.safetensors": b"garbage!"})),
                            ("cannot be decoded", "weights")),
        "missing_graph_member": ({k: v for k, v in good.items() if k != "graph.onnx"}, ("graph.onnx",)),
        "only_manifest": ({"manifest.json": good["manifest.json"]}, ("checksums.json",)),
        "crafted_program": (program, ("program", "layer")),
    })
    forged = dict(good, **{"checksums.json": json.dumps(dict(sums, signature={
        "algorithm": "hmac-sha256", "value": "00" * 32})).encode()})
    # Intact engines from another Kiln or torch: `kiln run` refuses them, `kiln inspect` shows their manifest.
    foreign = {"other_kiln_version", "other_torch_version"}
    cases = []
    for name, (members, names) in variants.items():
        path = folder / f"{name}.kiln"
        _zip(path, members)
        names = names + (path.name,)
        cases.append(Case(f"run-engine-{name}", ["run", f"--loadEngine={path}", "--device=cpu", "--iterations=1"],
                          names))
        if name not in foreign:
            cases.append(Case(f"inspect-engine-{name}", ["inspect", str(path), "--no-run"], names))
    _zip(folder / "forged_signature.kiln", forged)
    compressed = folder / "compressed.kiln"
    _zip(compressed, good, deflate=("weights.safetensors",))
    raw_files = {"not_a_zip.kiln": b"hello", "empty.kiln": b"", "truncated.kiln": good_engine.read_bytes()[:500]}
    for fname, data in raw_files.items():
        (folder / fname).write_bytes(data)
    other = folder / "other.zip"
    _zip(other, {"hello.txt": b"hi"})
    for path, names in [(compressed, ("compressed",)), *((folder / f, (f,)) for f in raw_files),
                        (other, ("manifest.json",)), (folder / "absent.kiln", ("absent.kiln",)),
                        (folder, ("engines",))]:
        cases.append(Case(f"run-engine-{path.name}", ["run", f"--loadEngine={path}", "--device=cpu"], names))
        cases.append(Case(f"inspect-engine-{path.name}", ["inspect", str(path)], names))
    good_s = str(good_engine)
    cases += [
        Case("run-unsigned-with-verify-key", ["run", f"--loadEngine={good_s}", f"--verify-key={key}"],
             ("not signed",)),
        Case("inspect-unsigned-with-verify-key", ["inspect", good_s, f"--verify-key={key}"], ("not signed",)),
        Case("run-signed-other-key", ["run", f"--loadEngine={root / 'signed.kiln'}", f"--verify-key={other_key}"],
             ("another key",)),
        Case("inspect-signed-other-key", ["inspect", str(root / "signed.kiln"), f"--verify-key={other_key}"],
             ("another key",)),
        *_verify_key_cases(root, good_s, key, other_key),
        Case("run-verify-key-missing", ["run", f"--loadEngine={good_s}", "--verify-key=absent.key"],
             ("absent.key",)),
        Case("run-verify-key-short", ["run", f"--loadEngine={good_s}", f"--verify-key={root / 'short.key'}"],
             ("short.key",)),
        Case("run-device-tpu", ["run", f"--loadEngine={good_s}", "--device=tpu:7"], ("tpu:7",)),
        Case("run-device-cuda-x", ["run", f"--loadEngine={good_s}", "--device=cuda:x"], ("cuda:x",)),
        Case("run-device-cpu-1", ["run", f"--loadEngine={good_s}", "--device=cpu:1"], ("cpu:1",)),
        Case("inspect-device-tpu", ["inspect", good_s, "--device=tpu:7"], ("tpu:7",)),
        Case("run-forged-signature", ["run", f"--loadEngine={folder / 'forged_signature.kiln'}",
                                      f"--verify-key={key}"], ("signature does not match",)),
        Case("inspect-forged-signature", ["inspect", str(folder / "forged_signature.kiln"), f"--verify-key={key}"],
             ("signature does not match",)),
    ]
    return cases


def _crafted_program(folder: Path) -> dict:
    """A resealed engine whose Elementwise layer's program carries Python."""
    import kiln
    from kiln.engine import serialize

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Exp", ["r"], ["y"], name="exp")],
        "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "elementwise.kiln"
    kiln.build(model, kiln.BuildConfig(device="cpu", progress=False)).save(path)
    good = _members(path)
    path.unlink()
    graph = onnx.load_from_string(good["graph.onnx"])
    for n in graph.graph.node:
        for a in n.attribute:
            if a.name == "program":
                a.strings[0] = b"Relu t0 __import__('os').system('touch\\x20pwned')"
                return serialize.write_members(dict(good, **{"graph.onnx": graph.SerializeToString()}))
    raise AssertionError("the engine has no Elementwise layer to craft a program into")


# --- data files: --calib, --loadInputs, verify --data ----------------------------------------------------------
def _npy_claiming(shape: tuple, data_bytes: int = 16) -> bytes:
    """A .npy whose header declares `shape` (float32) followed by only `data_bytes` bytes of data."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return f.getvalue() + b"\x00" * data_bytes


def _zip_bytes(members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> bytes:
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return f.getvalue()


def _declaring_sizes(data: bytes, size: int) -> bytes:
    """The zip with every central-directory entry declaring `size` uncompressed bytes (a zip bomb's directory)."""
    out = bytearray(data)
    at = out.find(b"PK\x01\x02")
    while at >= 0:
        out[at + 24:at + 28] = size.to_bytes(4, "little")
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


def _data_files(root: Path) -> dict[str, tuple[Path, tuple]]:
    folder = root / "data"
    folder.mkdir()
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    files = {}

    def put(name, data: bytes | None = None, arrays: dict | None = None, names=()):
        p = folder / name
        if arrays is not None:
            np.savez(p, **arrays)
        elif data is not None:
            p.write_bytes(data)
        files[name.split(".")[0]] = (p, names + (name,))

    put("not_a_zip.npz", b"hello, not a zip")
    put("pk_garbage.npz", b"PK\x03\x04" + b"\x00" * 60)
    put("truncated.npz", None, None)
    np.savez(folder / "full.npz", x=x)
    (folder / "truncated.npz").write_bytes((folder / "full.npz").read_bytes()[:100])
    put("pickled.npz", arrays={"x": np.array([{"a": 1}], dtype=object)})
    put("wrong_name.npz", arrays={"z": x}, names=("'z'", "z"))
    put("strings.npz", arrays={"x": np.array(["a", "b"])}, names=("'x'",))
    put("wrong_rank.npz", arrays={"x": x.reshape(4, 2, 4)}, names=("'x'",))
    put("wrong_width.npz", arrays={"x": np.zeros((4, 9), np.float32)}, names=("'x'",))
    put("too_big_batch.npz", arrays={"x": np.zeros((64, 8), np.float32)}, names=("'x'",))
    put("npy_as_npz.npz", data=None)
    np.save(folder / "npy_as_npz.npy", x)
    (folder / "npy_as_npz.npy").rename(folder / "npy_as_npz.npz")
    put("bad.npy", b"\x93NUMPY\x01\x00garbage")
    put("header_bomb.npz", _zip_bytes({"x.npy": _npy_claiming((2**36, 8))}, zipfile.ZIP_DEFLATED),
        names=("x.npy",))
    put("inflate_bomb.npz", _declaring_sizes(_zip_bytes({"x.npy": _npy_claiming((4, 8), 128),
                                                         "y.npy": _npy_claiming((4, 8), 128)}), 0xF0000000),
        names=())
    files["inflate_bomb"] = (folder / "inflate_bomb.npz", ("would inflate to more than",))  # not a naming error
    empty = folder / "empty_dir"
    empty.mkdir()
    files["empty_dir"] = (empty, ("empty_dir",))
    bad_dir = folder / "bad_dir"
    bad_dir.mkdir()
    (bad_dir / "a.npz").write_bytes(b"nonsense")
    files["bad_dir"] = (bad_dir, ("a.npz",))
    files["absent"] = (folder / "absent.npz", ("absent.npz",))
    return files


def _data_cases(root: Path, good_onnx: Path, good_engine: Path) -> list[Case]:
    cases = []
    files = _data_files(root)
    for name, (path, names) in files.items():
        if name != "too_big_batch":  # calibration takes any batch; an engine's profile does not
            cases.append(Case(f"calib-{name}", ["build", f"--onnx={good_onnx}", "--device=cpu", "--int8",
                                                 f"--calib={path}", "--skipInference", "--saveEngine=out.kiln",
                                                 "--shapes=x:4x8"], names))
        if name == "bad":
            continue
        cases.append(Case(f"loadInputs-{name}", ["run", f"--loadEngine={good_engine}", f"--loadInputs={path}",
                                                 "--iterations=1"], names))
        if path.suffix == ".npz" or name == "absent":
            cases.append(Case(f"verify-data-{name}", ["verify", str(good_engine), f"--data={path}",
                                                      f"--reference={good_onnx}", "--metric=mae"], names + ("--data",)))
    bad_npy = files["bad"][0]
    cases.append(Case("loadInputs-name-bad-npy", ["run", f"--loadEngine={good_engine}",
                                                   f"--loadInputs=x:{bad_npy}", "--iterations=1"], ("bad.npy",)))
    (root / "data" / "header_bomb.npy").write_bytes(_npy_claiming((2**36, 8)))
    cases.append(Case("loadInputs-name-header-bomb-npy", ["run", f"--loadEngine={good_engine}",
                                                          f"--loadInputs=x:{root / 'data' / 'header_bomb.npy'}",
                                                          "--iterations=1"], ("header_bomb.npy",)))
    bomb_json = root / "data" / "header_bomb_inputs.json"
    bomb_json.write_text(json.dumps([{"x": {"array": base64.b64encode(_npy_claiming((2**36, 8))).decode(),
                                             "polygraphy_class": "ndarray"}}]))
    cases.append(Case("compare-load-inputs-header-bomb", ["compare", "absent.onnx", str(good_engine),
                                                          f"--load-inputs={bomb_json}", "--device=cpu"],
                      ("header_bomb_inputs.json", "declares")))
    cases.append(Case("loadInputs-name-absent-npy", ["run", f"--loadEngine={good_engine}",
                                                      "--loadInputs=x:absent.npy", "--iterations=1"], ("absent.npy",)))
    cases.append(Case("calib-name-bad-npy", ["build", f"--onnx={good_onnx}", "--device=cpu", "--int8",
                                              f"--calib=x:{bad_npy}", "--shapes=x:4x8", "--skipInference"],
                      ("bad.npy",)))
    return cases


def _verify_key_cases(root: Path, unsigned: str, key: Path, other_key: Path) -> list[Case]:
    """--verifyKey on every command that loads an engine: an unsigned engine, or one signed with another key."""
    signed = str(root / "signed.kiln")
    commands = {"compare": lambda e: ["compare", "absent.onnx", e],
                "verify": lambda e: ["verify", e, "--data=absent.npz", "--metric=mae"],
                "bench": lambda e: ["bench", e, "--baseline=eager"],
                "report": lambda e: ["report", e, "--out=r"],
                "export-triton": lambda e: ["export", "triton", e, "--repo=repo"]}
    cases = []
    for name, argv in commands.items():
        flag = "--verify-key" if name in ("bench", "export-triton") else "--verifyKey"
        cases.append(Case(f"{name}-unsigned-with-verify-key", [*argv(unsigned), f"{flag}={key}", "--device=cpu"]
                          if name != "export-triton" else [*argv(unsigned), f"{flag}={key}"], ("not signed",)))
        cases.append(Case(f"{name}-signed-other-key", [*argv(signed), f"{flag}={other_key}"], ("another key",)))
    cases.append(Case("compare-runners-verify-key", ["compare", "absent.onnx", "--runners=kiln",
                                                     f"--verifyKey={key}"], ("--verifyKey",)))
    return cases


# --- flags -------------------------------------------------------------------------------------------------------
def _flag_cases(root: Path, good_onnx: Path, good_engine: Path, key: Path) -> list[Case]:
    onnx_ = f"--onnx={good_onnx}"
    eng = f"--loadEngine={good_engine}"
    build = ["build", onnx_, "--device=cpu"]
    (root / "a_file").write_text("x")
    (root / "garbage.json").write_text("{not json")
    (root / "garbage.cache").write_text("\x00\x01 not a calibration cache")
    flags = [
        ("iterations-0", ["run", eng, "--iterations=0"], ("--iterations",)),
        ("iterations-negative", ["run", eng, "--iterations=-5"], ("--iterations",)),
        ("build-iterations-0", [*build, "--iterations=0"], ("--iterations",)),
        ("duration-negative", ["run", eng, "--duration=-1"], ("--duration",)),
        ("warmup-nan", ["run", eng, "--warmUp=nan"], ("--warmUp",)),
        ("iterations-text", ["run", eng, "--iterations=many"], ("--iterations",)),
        ("device-tpu-build", [*build[:2], "--device=tpu:7"], ("tpu:7",)),
        ("device-empty", [*build[:2], "--device="], ("--device",)),
        ("shapes-syntax", ["run", eng, "--shapes=x:1by8"], ("1by8",)),
        ("shapes-unknown-input", ["run", eng, "--shapes=z:1x8"], ("'z'", "z")),
        ("shapes-outside-profile", ["run", eng, "--shapes=x:64x8"], ("'x'", "x")),
        ("shapes-rank", ["run", eng, "--shapes=x:1x8x1"], ("'x'",)),
        ("shapes-negative", [*build, "--shapes=x:-3x8"], ("-3",)),
        ("shapes-2-40", [*build, "--shapes=x:1099511627776x8"], ("'x'",)),
        ("shapes-no-colon", [*build, "--shapes=1x8"], ("1x8",)),
        ("profile-2-40", [*build, "--minShapes=x:1x8", "--optShapes=x:1x8", "--maxShapes=x:1099511627776x8"],
         ("'x'",)),
        ("profile-min-gt-max", [*build, "--minShapes=x:8x8", "--optShapes=x:4x8", "--maxShapes=x:2x8"], ("'x'",)),
        ("profile-rank-mismatch", [*build, "--minShapes=x:1x8", "--optShapes=x:1x8", "--maxShapes=x:1x8x1"],
         ("'x'",)),
        ("profile-counts", [*build, "--minShapes=x:1x8", "--minShapes=x:2x8", "--optShapes=x:1x8",
                            "--maxShapes=x:4x8"], ("--minShapes",)),
        ("profile-fixed-axis", [*build, "--minShapes=x:1x4", "--optShapes=x:1x4", "--maxShapes=x:1x4"],
         ("'x'",)),
        ("profile-unknown-input", [*build, "--shapes=q:1x8"], ("q",)),
        ("run-profile-index", ["run", eng, "--profile=5"], ("profile",)),
        ("mem-pool-syntax", [*build, "--memPoolSize=lots"], ("--memPoolSize", "lots")),
        ("layer-precisions-unknown", [*build, "--layerPrecisions=nolayer:fp16"], ("nolayer",)),
        ("layer-precisions-syntax", [*build, "--layerPrecisions=fc1"], ("fc1",)),
        ("exclude-tactics-unknown", [*build, "--excludeTactics=nonsense_tactic"], ("nonsense_tactic",)),
        ("save-engine-directory", [*build, f"--saveEngine={root}"], (str(root.name),)),
        ("save-engine-missing-folder", [*build, "--saveEngine=nope/e.kiln"], ("nope",)),
        ("save-engine-under-file", [*build, f"--saveEngine={root / 'a_file' / 'e.kiln'}"], ("a_file",)),
        ("export-output-directory", ["run", eng, f"--exportOutput={root}", "--iterations=1"], (root.name,)),
        ("sign-missing-key", [*build, "--saveEngine=out.kiln", "--sign=absent.key"], ("absent.key",)),
        ("sign-short-key", [*build, "--saveEngine=out.kiln", f"--sign={root / 'short.key'}"], ("short.key",)),
        ("sign-without-save", [*build, f"--sign={key}"], ("--saveEngine",)),
        ("verify-key-with-onnx", ["run", onnx_, "--device=cpu", f"--verify-key={key}"], ("--loadEngine",)),
        ("run-neither", ["run", "--device=cpu"], ("--loadEngine",)),
        ("run-both", ["run", onnx_, eng], ("--loadEngine",)),
        ("int8-without-calibration", [*build, "--int8"], ("--calib",)),
        ("calib-cache-garbage", [*build, "--int8", f"--calibCache={root / 'garbage.cache'}"], ("garbage.cache",)),
        ("accuracy-budget-syntax", [*build, "--int8", "--accuracy-budget=top1"], ("--accuracy-budget", "top1")),
        ("optimization-level", [*build, "--builderOptimizationLevel=9"], ("--builderOptimizationLevel",)),
        ("calib-method", [*build, "--calibMethod=guess"], ("--calibMethod",)),
        ("unknown-flag", [*build, "--fp64"], ("--fp64",)),
        ("unknown-command", ["frobnicate"], ("frobnicate",)),
        ("compare-torch-missing-module", ["compare", "no_such_module_kiln:make", str(good_engine)],
         ("no_such_module_kiln",)),
        ("compare-torch-no-colon", ["compare", "no_such_thing", str(good_engine)], ("no_such_thing",)),
        ("verify-metric-missing-module", ["verify", str(good_engine), "--data=" + str(root / "data" / "full.npz"),
                                          f"--reference={good_onnx}", "--metric=no_such_module_kiln:fn"],
         ("no_such_module_kiln",)),
        ("bench-torch-cwd-module", ["bench", str(good_engine), "--baseline=eager", "--torch=cwd_model:make"],
         ("cwd_model",)),
        ("inspect-json-directory", ["inspect", str(good_engine), f"--json={root}", "--no-run"], (root.name,)),
        ("check-upgrade-opset-99", ["check", str(good_onnx), "--upgrade-opset=99"], ("99",)),
    ]
    return [Case(f"flag-{name}", argv, names) for name, argv, names in flags]


# --- runtime inputs ------------------------------------------------------------------------------------------------
def _runtime_cases(root: Path, good_engine: Path) -> list[Case]:
    folder = root / "inputs"
    folder.mkdir()
    x = np.zeros((2, 8), np.float32)
    arrays = {
        "float64": ({"x": x.astype(np.float64)}, ("'x'",)),
        "int32": ({"x": x.astype(np.int32)}, ("'x'",)),
        "bool": ({"x": x.astype(bool)}, ("'x'",)),
        "rank1": ({"x": np.zeros(8, np.float32)}, ("'x'",)),
        "rank3": ({"x": np.zeros((2, 8, 1), np.float32)}, ("'x'",)),
        "width": ({"x": np.zeros((2, 7), np.float32)}, ("'x'",)),
        "batch_zero": ({"x": np.zeros((0, 8), np.float32)}, ("'x'",)),
        "batch_over": ({"x": np.zeros((17, 8), np.float32)}, ("'x'",)),
        "scalar": ({"x": np.float32(1.0)}, ("'x'",)),
        "extra_input": ({"x": x, "extra": x}, ("extra",)),
        "missing_input": ({"other": x}, ("'x'", "other")),
        "complex": ({"x": x.astype(np.complex64)}, ("'x'",)),
    }
    cases = []
    for name, (data, names) in arrays.items():
        p = folder / f"{name}.npz"
        np.savez(p, **data)
        cases.append(Case(f"input-{name}", ["run", f"--loadEngine={good_engine}", f"--loadInputs={p}",
                                            "--iterations=1"], names + (p.name,)))
    return cases


def make_corpus(root: Path, good_onnx: Path, good_engine: Path, signed_engine: Path, key: Path,
                other_key: Path) -> list[Case]:
    (root / "short.key").write_bytes(b"abc\n")
    (root / "cwd_model.py").write_text("raise SystemExit('this file must never be imported')\n")
    cases = (_models(root) + _engines(root, good_engine, key, other_key) + _data_cases(root, good_onnx, good_engine)
             + _flag_cases(root, good_onnx, good_engine, key) + _runtime_cases(root, good_engine))
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    return cases
