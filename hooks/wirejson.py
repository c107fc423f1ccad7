"""JSON for the runtime hook without the ``json`` package (pure; standard library only).

``import json`` costs as much as the interpreter's start-up (about 10 ms on a busy
2-core node: it imports ``re``, ``enum``, ``functools`` and more), and the hook runs at
every container creation. This module drives json's C accelerator ``_json`` directly;
where it is missing (not CPython), ``json`` does the work with the same rules.

``loads`` reads what ``json.loads`` reads, except an object with a key given twice
(``JSONError``): Go's encoding/json (runc, containerd, CRI-O) merges the two where Python
keeps the last, so the runtime and the hook would see different specs. Too deep nesting
is a ``JSONError``, not a crash. ``dumps`` writes what ``json.dumps`` writes, compact.
"""

import sys

_WHITESPACE = " \t\n\r"  # JSON's only whitespace (RFC 8259)


class JSONError(ValueError):
    """Not one JSON value as Go and Python both read it; the message says where."""


def _object(pairs: list) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONError(
                    f"the key {key!r} appears twice in one object (Go merges or overwrites "
                    "such keys where Python keeps the last, so it cannot be read one way)"
                )
            seen.add(key)
    return value


# json.loads reads these too (runc would refuse a config with them; that is runc's to say).
_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class _Context:
    """The attributes ``_json.make_scanner`` reads (json.JSONDecoder's, with our hooks)."""

    strict = True  # no control characters inside strings
    object_hook = None
    object_pairs_hook = staticmethod(_object)
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_CONSTANTS.__getitem__)


def _accelerated() -> tuple:
    """(scan_once, quote): the C accelerator's, or json's own where it is missing."""
    try:
        import _json

        scan = _json.make_scanner(_Context())  # type: ignore[arg-type]
        return scan, _json.encode_basestring_ascii
    except ImportError:  # not CPython: the slower, equal path
        import json.encoder
        import json.scanner

        decoder = json.JSONDecoder(object_pairs_hook=_object)
        scan = json.scanner.make_scanner(decoder)  # type: ignore[arg-type]
        return scan, json.encoder.encode_basestring_ascii


_scan, _quote = _accelerated()


def loads(text: str) -> object:
    """One JSON value from ``text`` (a str: decode bytes as UTF-8 first); JSONError if not."""
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scan(text, start)
    except StopIteration as e:
        raise JSONError(f"expecting a JSON value at character {e.value}") from None
    except RecursionError:
        raise JSONError("nested too deeply") from None
    except JSONError:
        raise
    except ValueError as e:  # json.decoder.JSONDecodeError, raised by the accelerator
        raise JSONError(str(e)) from None
    except SystemError:
        # The accelerator builds its error from json.decoder.JSONDecodeError, looked up in
        # sys.modules only. Import it (a malformed document is the slow path), read again.
        if "json.decoder" in sys.modules:
            raise
        import json.decoder  # noqa: F401

        return loads(text)
    if text[end:].strip(_WHITESPACE):
        raise JSONError(f"extra data after the JSON value at character {end}")
    return value


def dumps(value: object) -> str:
    """Compact ASCII JSON: what ``json.dumps(value, separators=(",", ":"))`` writes for
    dicts, lists, tuples, str, int, float, bool and None (TypeError for anything else)."""
    parts: list[str] = []
    _encode(value, parts)
    return "".join(parts)


def _encode(value: object, parts: list[str]) -> None:
    if isinstance(value, str):
        parts.append(_quote(value))
    elif value is None:
        parts.append("null")
    elif value is True:
        parts.append("true")
    elif value is False:
        parts.append("false")
    elif isinstance(value, int):
        parts.append(int.__repr__(value))
    elif isinstance(value, float):
        parts.append(_float(value))
    elif isinstance(value, dict):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append("," if i else "")
            parts.append(_quote(_key(key)))
            parts.append(":")
            _encode(item, parts)
        parts.append("}")
    elif isinstance(value, list | tuple):
        parts.append("[")
        for i, item in enumerate(value):
            parts.append("," if i else "")
            _encode(item, parts)
        parts.append("]")
    else:
        raise TypeError(f"{type(value).__name__} is not encoded here")


def _float(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


def _key(key: object) -> str:
    """An object key as json.dumps writes it."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return {True: "true", False: "false", None: "null"}[key]
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        return _float(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
