"""Spec to and from msgpack and JSON, without loss, and canonical: equal specs give equal bytes.

A record becomes a map with a ``"kind"`` tag (its class name) and every field; the top level also
carries ``"schema"`` (the spec's ``version``). Keys are sorted, floats are float64 and fields
declared float are written as floats even when built from an int. Decoding is the reverse, led by
the field annotations: arrays become tuples, ints in float fields become floats, and a map
becomes the record its ``"kind"`` names (which may be left out where only one kind fits). Fields at
their defaults may be left out of a file.

Decoding is for untrusted input, so it collects every problem (unknown kinds, unknown or missing
keys) and then validates what it could build: :func:`decode` returns only valid specs and otherwise
raises one :class:`SpecError` listing everything found.
"""

import hashlib
import json
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import msgpack
import numpy as np

from flow.errors import Problem, SpecError, did_you_mean
from flow.spec import READABLE_SCHEMAS, SCHEMA_VERSION, Spec, file_key
from flow.spec_data import Function, NDArray, Readable
from flow.validation import alternatives, validate

_JSON = (".json",)
_MSGPACK = (".msgpack", ".mpk")
_IN_MEMORY = (
    "holds an array in memory, which a spec file cannot hold: write the data with "
    "np.savez('data.npz', x=x, y=y) and use Arrays(path='data.npz')"
)
_IN_PYTHON = (
    "holds a Python {what}, which a spec file cannot hold (run this spec with flow.run from Python): "
    "{fix}"
)
_FIXES = {
    "object": "for a file, write the data with np.savez('data.npz', x=x, y=y), use Arrays(path='data.npz')",
    "function": "for a file, use built-in transforms (Normalize, Scale, RandomCrop, HorizontalFlip, Resize)",
}


def _declared_float(annotation: Any) -> bool:
    options = alternatives(annotation)
    return float in options and int not in options


def _item(annotation: Any, index: int) -> Any:
    """The annotation of a tuple field's item at ``index`` (Any where none is declared)."""
    tuples = [o for o in alternatives(annotation) if get_origin(o) is tuple]
    args = get_args(tuples[0]) if tuples else ()
    if args[-1:] == (Ellipsis,):
        return args[0]
    return args[index] if index < len(args) else Any


def encode(spec: Spec) -> dict[str, Any]:
    """A spec as plain maps, lists and scalars, keys sorted.

    Args:
        spec: the spec (encoded as it is; see flow.validation to check it).

    Returns:
        The tree that dumps and save write.

    Raises:
        SpecError: a value no file format can hold, named by its path.
    """
    return _encode(spec, Spec, "")


def digest(spec: Spec) -> str:
    """A SHA-256 of the spec's canonical encoding, in-memory arrays by their bytes (a ``repr``
    elides the middle of a large array, so two different data sets could compare equal): what
    the ranks of an MPI job compare to know they train the same run.

    Returns:
        64 hex digits.
    """
    return hashlib.sha256(msgpack.packb(_encode(spec, Spec, "", arrays=True))).hexdigest()


def _encode(value: Any, annotation: Any, path: str, arrays: bool = False) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        tree = {"kind": cls.__name__}
        for f in fields(value):
            if f.metadata.get("omit_when_default") and getattr(value, f.name) == f.default:
                continue
            key = file_key(cls, f.name)
            tree[key] = _encode(getattr(value, f.name), f.type, f"{path}.{key}" if path else key, arrays)
        return dict(sorted(tree.items()))
    if isinstance(value, tuple):
        return [_encode(item, _item(annotation, i), f"{path}[{i}]", arrays) for i, item in enumerate(value)]
    if isinstance(value, int) and not isinstance(value, bool) and _declared_float(annotation):
        return float(value)
    if isinstance(value, float):
        return value + 0.0  # -0.0 == 0.0, so it must encode the same
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, NDArray):
        if arrays:  # for digest(): the array by its type, shape and bytes
            data = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
            return {"array": str(value.dtype), "shape": list(value.shape), "sha256": data}
        raise SpecError([Problem(path, _IN_MEMORY)])
    if isinstance(value, Readable | Function):
        what = "object" if isinstance(value, Readable) else "function"
        if arrays:  # for digest(): only its kind can be compared
            return {"python": f"{type(value).__module__}.{type(value).__qualname__}"}
        raise SpecError([Problem(path, _IN_PYTHON.format(what=f"{what} ({value!r:.60})", fix=_FIXES[what]))])
    raise SpecError([Problem(path, f"cannot encode a {type(value).__name__}: {value!r}")])


def decode(tree: Any) -> Spec:
    """A valid spec from plain maps, lists and scalars.

    Args:
        tree: what msgpack or JSON parsing gave.

    Returns:
        The spec, valid.

    Raises:
        SpecError: every problem found, decoding and validation together, each with its path.
    """
    try:
        return _decode_spec(tree)
    except RecursionError as error:  # only hostile input nests this deep; it must still be a SpecError
        raise SpecError("the document is nested too deeply to be a spec") from error


def _decode_spec(tree: Any) -> Spec:
    if not isinstance(tree, dict):
        raise SpecError(f"a spec must be a map, got {type(tree).__name__}")
    schema = tree.get("schema")
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        found = "no schema" if schema is None else f"schema {schema!r}"
        readable = ", ".join(map(str, READABLE_SCHEMAS))
        raise SpecError([Problem("schema", f"found {found}; this vkflow reads schemas {readable}")])
    # An older file is read as what it means today (the version a spec carries is the current one).
    tree = {**tree, "schema": SCHEMA_VERSION}
    problems: list[Problem] = []
    spec = _decode(tree, Spec, "", problems)
    if not problems:
        found_later = validate(spec)
        if found_later:
            raise SpecError(found_later)
        return spec
    # Also report what validation finds in the parts that decoded, so one pass shows everything;
    # where decoding failed it already said why, and a placeholder None would only repeat it.
    if isinstance(spec, Spec):
        problems += [p for p in validate(spec) if not any(p.within(d.path) for d in problems)]
    raise SpecError(problems)


def _decode(raw: Any, annotation: Any, path: str, problems: list[Problem]) -> Any:
    options = alternatives(annotation)
    records = [o for o in options if is_dataclass(o)]
    if isinstance(raw, dict) and records:
        return _decode_record(raw, records, path, problems)
    if isinstance(raw, list):
        return tuple(_decode(v, _item(annotation, i), f"{path}[{i}]", problems) for i, v in enumerate(raw))
    if isinstance(raw, int) and not isinstance(raw, bool) and _declared_float(annotation):
        return float(raw)
    return raw  # a value of the wrong type stays as it is, for validation to name


def _decode_record(raw: dict, classes: list[type], path: str, problems: list[Problem]) -> Any:
    names = [c.__name__ for c in classes]
    kind = raw.get("kind")
    if kind is None and len(classes) == 1:
        cls = classes[0]
    elif kind in names:
        cls = classes[names.index(kind)]
    else:
        what = "missing kind" if kind is None else f"unknown kind {kind!r}"
        hint = did_you_mean(kind, names)
        problems.append(Problem(path, f"{what}; expected one of {', '.join(names)}{hint}"))
        return None
    declared = {file_key(cls, f.name): f for f in fields(cls)}
    for key in raw:
        if key != "kind" and key not in declared:
            hint = did_you_mean(key, declared)
            problems.append(Problem(f"{path}.{key}" if path else str(key), f"unknown key{hint}"))
    values = {}
    for key, f in declared.items():
        where = f"{path}.{key}" if path else key
        if key in raw:
            values[f.name] = _decode(raw[key], f.type, where, problems)
        elif f.default is MISSING:
            problems.append(Problem(where, "missing required key"))
            values[f.name] = None
    return cls(**values)


def dumps(spec: Spec) -> bytes:
    """A spec as msgpack bytes, canonical.

    Args:
        spec: the spec.

    Returns:
        The bytes; equal specs give equal bytes.
    """
    return msgpack.packb(encode(spec), use_bin_type=True)


def loads(data: bytes) -> Spec:
    """A valid spec from msgpack bytes.

    Args:
        data: what dumps wrote, or any bytes.

    Returns:
        The spec.

    Raises:
        SpecError: the bytes are not msgpack, or every problem with the spec they hold.
    """
    try:
        tree = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises many types on bad bytes; all mean "not a spec"
        raise SpecError(f"not a msgpack document: {error}") from error
    return decode(tree)


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in _JSON + _MSGPACK:
        return "json" if suffix in _JSON else "msgpack"
    raise SpecError(f"{path}: unknown spec file type {suffix or '(none)'!r}; use .json, .msgpack or .mpk")


def save(spec: Spec, path: str | Path) -> None:
    """Write a spec, as JSON (pretty, sorted keys) for .json and as msgpack for .msgpack or .mpk.

    Args:
        spec: the spec.
        path: the file to write.

    Raises:
        SpecError: the extension is neither.
    """
    path = Path(path)
    if _format(path) == "json":
        path.write_text(
            json.dumps(encode(spec), indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8"
        )
    else:
        path.write_bytes(dumps(spec))


def load(path: str | Path) -> Spec:
    """Read a valid spec, choosing JSON or msgpack by the file's extension.

    Args:
        path: a .json, .msgpack or .mpk file.

    Returns:
        The spec.

    Raises:
        SpecError: an unknown extension, a file that does not parse, or every problem with the spec.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if _format(path) == "msgpack":
        return loads(path.read_bytes())
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise SpecError(f"{path}: not a JSON document: {error}") from error
    return decode(tree)
