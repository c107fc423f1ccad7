"""JSON as Go and Python both read it (pure; standard library only).

``loads`` is ``json.loads`` except for an object with a key given twice, which is a
``JSONError``: Go's encoding/json (runc, containerd, CRI-O) merges or overwrites the two
where Python keeps the last, so the runtime and the hook would see different specs. Too
deep nesting is a ``JSONError``, not a crash. ``dumps`` is ``json.dumps``, compact.

Importing ``json`` (with ``re``, ``enum`` and ``functools``) is about half of the hook's
cost at every container creation (docs/enforcement.md, "Cost"): the public library is
worth it over driving the C accelerator ``_json`` by hand.
"""

import json


class JSONError(ValueError):
    """Not one JSON value as Go and Python both read it; the message says where."""


def _one_value_per_key(pairs: list) -> dict:
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


def loads(text: str) -> object:
    """One JSON value from ``text`` (a str: decode bytes as UTF-8 first); JSONError if not."""
    try:
        return json.loads(text, object_pairs_hook=_one_value_per_key)
    except RecursionError:
        raise JSONError("nested too deeply") from None
    except JSONError:
        raise
    except ValueError as e:  # json.JSONDecodeError: what and where
        raise JSONError(str(e)) from None


def dumps(value: object) -> str:
    """Compact ASCII JSON, as ``json.dumps(value, separators=(",", ":"))``."""
    return json.dumps(value, separators=(",", ":"))
