"""Pins nodemgr.domain.quantity: Kubernetes quantities read exactly, written canonically."""

from fractions import Fraction

import pytest

from nodemgr.domain import quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 << 30),
        ("1536Mi", 1536 << 20),
        ("30", 30),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("2.5G", 2_500_000_000),
        ("0.5Ki", 512),
        (42, 42),
    ],
)
def test_quantities_are_read_exactly(text, value):
    """Binary and decimal suffixes, exponents and fractions, no float rounding."""
    assert quantity.parse(text) == value


@pytest.mark.parametrize("text", ["", "4 Gi", "4GiB", "lots", "1e99", None, True, "1" * 80])
def test_what_is_no_quantity_is_refused_by_name(text):
    """Anything else is a QuantityError (never a silent zero)."""
    with pytest.raises(quantity.QuantityError):
        quantity.parse(text)


def test_whole_counts_are_written_as_the_api_stores_them():
    """The largest binary suffix that divides the count exactly."""
    assert quantity.format_binary(4 << 30) == "4Gi"
    assert quantity.format_binary(1536 << 20) == "1536Mi"
    assert quantity.format_binary(100) == "100"
    assert quantity.format_binary(0) == "0"
