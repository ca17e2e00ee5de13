"""The engine manifest's schema, checked on every read of an engine file.

A manifest is JSON from a file anyone may have edited: before any field is used,
its structure is checked here and a wrong one is refused with an EngineFileError
that names the field (`layers[3].tactic`, `profiles[0].x.max`), never a KeyError
or TypeError from deep inside the loader.
"""

from __future__ import annotations

from ..errors import EngineFileError

_STR, _INT, _BOOL, _DICT, _LIST = str, int, bool, dict, list
_NUM = (int, float)

# field -> (types, required). Optional fields exist in some engines only (absent ones take defaults).
_TOP = {
    "format": (_STR, True),
    "format_version": (_INT, True),
    "versions": (_DICT, True),
    "target": (_DICT, True),
    "build_config": (_DICT, True),
    "build_seconds": ((*_NUM, type(None)), False),
    "capturable": (_BOOL, True),
    "profiles": (_LIST, True),
    "arena_bytes": (_LIST, False),
    "findings": (_LIST, False),
    "tactics": (_LIST, False),
    "channels_last": (_LIST, False),
    "padded_channels": (_LIST, False),
    "column_major": (_LIST, False),
    "bindings": (_LIST, True),
    "layers": (_LIST, True),
    "weights_stored_as_bytes": (_DICT, False),
}
_LAYER = {
    "name": (_STR, True), "op_type": (_STR, True), "domain": (_STR, True), "precision": (_STR, True),
    "placement": (_STR, True), "tactic": (_STR, True), "profile_tactics": (_LIST, False), "sources": (_LIST, False),
    "note": (_STR, False),
}
_PLACEMENTS = ("device", "host")
MAX_DIM = 2**40  # no real tensor axis is larger; bounds what random_inputs could be asked to allocate


def _type_name(t) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    names = {str: "a string", int: "an integer", bool: "true/false", dict: "an object", list: "a list",
             float: "a number", type(None): "null"}
    return " or ".join(names.get(x, x.__name__) for x in ts)


def _is(value, types) -> bool:
    ts = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in ts:  # JSON true is not an integer
        return False
    return isinstance(value, ts)


def _fields(path, where: str, obj, schema: dict) -> None:
    for key, (types, required) in schema.items():
        if key not in obj:
            if required:
                raise EngineFileError(f"'{path}': the manifest has no field '{where}{key}'; the engine file is "
                                      "damaged or was not written by Kiln. Rebuild it.")
            continue
        if not _is(obj[key], types):
            raise EngineFileError(f"'{path}': manifest field '{where}{key}' should be {_type_name(types)}, not "
                                  f"{type(obj[key]).__name__} ({str(obj[key])[:60]!r}). Rebuild the engine.")


def _bad(path, field: str, why: str) -> EngineFileError:
    return EngineFileError(f"'{path}': manifest field '{field}' {why}. Rebuild the engine.")


def _list_of(path, field: str, values, types) -> None:
    for i, v in enumerate(values):
        if not _is(v, types):
            raise _bad(path, f"{field}[{i}]", f"should be {_type_name(types)}, not {type(v).__name__}")


def validate(path, m) -> dict:
    """Raise EngineFileError naming the first field of `m` that does not fit the schema; returns m."""
    if not isinstance(m, dict):
        raise EngineFileError(f"'{path}': manifest.json holds a JSON {type(m).__name__}, not an object; the engine "
                              "file is damaged or was not written by Kiln. Rebuild it.")
    _fields(path, "", m, _TOP)
    for key in ("versions",):
        for k, v in m[key].items():
            if not _is(v, (str, int, type(None))):
                raise _bad(path, f"{key}.{k}", f"should be a version string, not {type(v).__name__}")
    t = m["target"]
    _fields(path, "target.", t, {"kind": (_STR, True), "name": (_STR, True),
                                 "capability": ((str, type(None)), t.get("kind") == "cuda")})
    if t["kind"] not in ("cpu", "cuda"):
        raise _bad(path, "target.kind", f"is '{t['kind'][:40]}', not 'cpu' or 'cuda'")
    if not m["profiles"]:
        raise _bad(path, "profiles", "is empty (an engine has at least one optimization profile)")
    for i, prof in enumerate(m["profiles"]):
        if not isinstance(prof, dict):
            raise _bad(path, f"profiles[{i}]", f"should be an object, not {type(prof).__name__}")
        for name, mm in prof.items():
            where = f"profiles[{i}].{name}"
            if not isinstance(mm, dict):
                raise _bad(path, where, f"should be an object with min/opt/max, not {type(mm).__name__}")
            for k in ("min", "opt", "max"):
                dims = mm.get(k)
                if not isinstance(dims, list):
                    raise _bad(path, f"{where}.{k}", "is missing or not a list of dimensions")
                for a, d in enumerate(dims):
                    if not _is(d, int) or not 0 <= d <= MAX_DIM:
                        raise _bad(path, f"{where}.{k}[{a}]", f"is {str(d)[:40]}, not a dimension in 0..2**40")
            if not len(mm["min"]) == len(mm["opt"]) == len(mm["max"]):
                raise _bad(path, where, "has min/opt/max of different ranks")
            if any(not lo <= o <= hi for lo, o, hi in zip(mm["min"], mm["opt"], mm["max"])):
                raise _bad(path, where, "does not satisfy min <= opt <= max on every axis")
    for key in ("arena_bytes",):
        _list_of(path, key, m.get(key, []), (int, type(None)))
    for key in ("channels_last", "padded_channels", "column_major"):
        _list_of(path, key, m.get(key, []), str)
    for key in ("findings", "tactics", "bindings"):
        _list_of(path, key, m.get(key, []), dict)
    for i, b in enumerate(m["bindings"]):
        _fields(path, f"bindings[{i}].", b, {"name": (_STR, True), "io": (_STR, True)})
    for i, layer in enumerate(m["layers"]):
        if not isinstance(layer, dict):
            raise _bad(path, f"layers[{i}]", f"should be an object, not {type(layer).__name__}")
        _fields(path, f"layers[{i}].", layer, _LAYER)
        for key in ("profile_tactics", "sources"):
            _list_of(path, f"layers[{i}].{key}", layer.get(key, []), str)
        if layer["placement"] not in _PLACEMENTS:
            raise _bad(path, f"layers[{i}].placement", f"is '{layer['placement'][:40]}', not 'device' or 'host'")
    for k, v in m.get("weights_stored_as_bytes", {}).items():
        if not isinstance(v, str):
            raise _bad(path, f"weights_stored_as_bytes.{k}", "should be a dtype name")
    return m
