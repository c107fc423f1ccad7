"""Pins hooks.wirejson, the hook's JSON: it reads what json.loads reads and writes what
json.dumps writes (compact), refuses what Go's encoding/json reads differently from Python (a
key twice in one object), and refuses trailing data, nesting past the recursion limit and
malformed text with a JSONError naming where."""

import json

import pytest

from hooks import wirejson
from hooks.wirejson import JSONError

DOCUMENTS = [
    '{"ociVersion": "1.0.2", "process": {"env": ["A=1", "B=\\u00e9\\n"], "args": []}}',
    '  [1, -2, 3.5, 1e3, true, false, null, "", {}, []]\n',
    '"\\ud83d\\ude00 \\u2028"',
    '{"a": {"b": {"c": [[[0]]]}}}',
    "12345678901234567890",
    '{"nan": NaN, "inf": [Infinity, -Infinity]}',
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_loads_reads_what_json_reads(text):
    """Objects, arrays, strings with escapes, numbers and literals read as json.loads reads."""
    assert repr(wirejson.loads(text)) == repr(json.loads(text))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"mounts": [], "mounts": [1]}', "the key 'mounts' appears twice"),
        ('{"linux": {"devices": [{"major": 1, "major": 195}]}}', "the key 'major' appears twice"),
        ('{"a": 1} {"a": 2}', "Extra data: line 1 column 10 (char 9)"),
        ("", "Expecting value: line 1 column 1 (char 0)"),
        ("   ", "Expecting value: line 1 column 4 (char 3)"),
        ('{"a": }', "Expecting value: line 1 column 7 (char 6)"),
        ('{"a" 1}', "Expecting ':' delimiter"),
        ('"tab\tinside"', "Invalid control character"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_loads_refuses_naming_the_problem(text, fragment):
    """Duplicate keys, trailing data, malformed or too deeply nested text raise JSONError (a
    ValueError) saying what and where."""
    with pytest.raises(JSONError) as raised:
        wirejson.loads(text)
    assert fragment in str(raised.value)


@pytest.mark.parametrize(
    "value",
    [
        {"stage": "createRuntime", "pid": 12, "ok": True, "no": False, "none": None},
        {"env": {"A": 'é\n"\\\x00\u2028'}, "nested": [[], {}, (1, 2)], "big": 2**70},
        {"used_mib": 1.5, "tiny": 1e-300, "huge": 1e300, "odd": [float("nan"), float("-inf")]},
        {3: "int key", 2.5: "float key", True: "bool key", None: "null key"},
        [],
        "plain",
    ],
)
def test_dumps_writes_what_json_writes(value):
    """dumps is json.dumps with compact separators (ASCII, tuples as lists)."""
    assert wirejson.dumps(value) == json.dumps(value, separators=(",", ":"))
    assert repr(wirejson.loads(wirejson.dumps(value))) == repr(json.loads(json.dumps(value)))


@pytest.mark.parametrize("value", [{(1, 2): "a"}, [b"bytes"], {"a": {"b"}}])
def test_dumps_refuses_what_json_refuses(value):
    """Tuple keys, bytes and sets are a TypeError, as for json.dumps."""
    with pytest.raises(TypeError, match="not"):
        wirejson.dumps(value)
