"""Pins standins.quantity, Kubernetes quantities as the API server parses and
stores them: the canonical forms, the two parse errors, nano rounding, Value()."""

from fractions import Fraction

import pytest

from standins import quantity as q


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("1024Mi", "1Gi"),
        ("1536Mi", "1536Mi"),
        ("1.5Gi", "1536Mi"),
        ("80Gi", "80Gi"),
        ("512", "512"),
        ("0.5Ki", "512"),  # binary below 1024 prints as decimal
        ("0.1Ki", "102400m"),  # a fractional binary quantity too
        ("0.5", "500m"),
        ("1500", "1500"),
        ("15000", "15k"),
        ("1e3", "1e3"),
        ("1e2", "100"),
        ("1.5m", "1500u"),
        ("0", "0"),
        ("0Gi", "0"),
        ("-1Gi", "-1Gi"),
        ("+5", "5"),
        ("2E", "2E"),
        ("1.G", "1G"),
        (" 4Gi ", "4Gi"),
        ("0.0000000001", "1n"),  # finer than nano: rounded up
    ],
)
def test_canonical_form(text, stored):
    """What the API server stores and returns for a quantity written as ``text``."""
    assert q.canonical(q.parse(text)) == stored


@pytest.mark.parametrize(("text", "message"), [
    ("", q.FORMAT_ERROR), ("1x", q.FORMAT_ERROR), ("1 Gi", q.FORMAT_ERROR),
    ("1.2.3", q.FORMAT_ERROR), ("abc", q.FORMAT_ERROR),
    ("1e", q.SUFFIX_ERROR), ("1KiB", q.FORMAT_ERROR), ("1Kb", q.FORMAT_ERROR),
    ("5ki", q.SUFFIX_ERROR),
])  # fmt: skip
def test_parse_errors_carry_the_api_servers_message(text, message):
    """A string that is no quantity: QuantityError with the API server's words."""
    with pytest.raises(q.QuantityError) as raised:
        q.parse(text)
    assert str(raised.value) == message


def test_values_and_int_value():
    """Exact values; int_value is Value(): rounded up, away from zero."""
    assert q.parse("4Gi").value == 4 * 2**30
    assert q.parse("250m").value == Fraction(1, 4)
    assert q.int_value(q.parse("250m")) == 1
    assert q.int_value(q.parse("-250m")) == -1
    assert q.int_value(q.parse("3")) == 3
    assert q.canonical(q.from_int(5 * 2**30)) == "5Gi"


def test_json_numbers_are_quantities_too():
    """A bare JSON number is read as its text; a bool or object is refused."""
    assert q.canonical(q.from_json(1024)) == "1024"
    assert q.canonical(q.from_json(0.5)) == "500m"
    for bad in (True, None, {}, []):
        with pytest.raises(q.QuantityError):
            q.from_json(bad)
