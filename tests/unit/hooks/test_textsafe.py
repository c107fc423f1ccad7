"""Pins how values from containers are shown: a plain one-line value as it is, any other as a
string literal whose escapes cannot end a line, move the cursor or reorder text; cut at the
limit, saying how much was left out."""

import pytest

from hooks.textsafe import one_line, quote


@pytest.mark.parametrize(
    "value", ["default/victim/main", "GPU-6a7c0000-0000", "/run/gpushare/hook.sock", "ü-ñ", "a b"]
)
def test_a_plain_value_is_shown_as_it_is(value):
    assert quote(value) == value


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("GPU-1,1\n2026-11-27 CRITICAL x", "'GPU-1,1\\n2026-11-27 CRITICAL x'"),
        ("a\rb", "'a\\rb'"),
        ("\x1b[31mred", "'\\x1b[31mred'"),
        ("line\u2028sep", "'line\\u2028sep'"),
        ("abc\u202edef", "'abc\\u202edef'"),
        ("x\x85y", "'x\\x85y'"),
        (" padded", "' padded'"),
        ("", "''"),
    ],
    ids=["newline", "cr", "escape", "u2028", "bidi", "nel", "space", "empty"],
)
def test_any_other_value_is_an_escaped_literal(value, shown):
    """What splitlines() would break at, terminal escapes, bidi overrides, edge spaces and
    the empty string: a Python string literal, one printable line."""
    assert quote(value) == shown
    assert quote(value).isprintable()


def test_a_long_value_is_cut_saying_how_much_is_left_out():
    assert quote("x" * 300, limit=10) == "xxxxxxxxxx…(+290 characters)"
    assert quote("\n" * 300, limit=3) == "'\\n\\n\\n'…(+297 characters)"


def test_non_strings_are_shown_through_str():
    assert quote(42) == "42"


def test_one_line_escapes_in_place_without_quotes():
    """A whole message: what does not print is written as its escape, the rest as it is."""
    assert one_line("refused: a=b") == "refused: a=b"
    assert one_line("x=GPU-1\n2026 CRITICAL\r\x1b[2K") == "x=GPU-1\\n2026 CRITICAL\\r\\x1b[2K"
    assert one_line("tab\there").isprintable()
