"""Kubernetes resource quantities (``4Gi``, ``30``, ``1500m``, ``1e3``) as exact numbers (pure).

DRA capacities are compared with cards in bytes and percent, so they are read exactly
(a ``Fraction``), never as floats, in the API's grammar: a signed decimal, then a binary
suffix (``Ki`` .. ``Ei``), a decimal one (``n`` .. ``E``) or an exponent (``e3``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from nodemgr.errors import GpushareError

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[numkMGTPE]?)"
)
_MAX_TEXT = 64  # the API's quantities are short; a longer text is not one


class QuantityError(GpushareError):
    """A text that is not a Kubernetes quantity."""


def parse(text: object) -> Fraction:
    """The exact value of a quantity; QuantityError naming the text otherwise."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise QuantityError(f"{text!r} is not a quantity (a string such as '4Gi' or '30')")
    value = str(text).strip()
    match = _QUANTITY.fullmatch(value) if len(value) <= _MAX_TEXT else None
    if match is None:
        raise QuantityError(f"{value[:_MAX_TEXT]!r} is not a quantity (e.g. '4Gi', '30', '500m')")
    number = Fraction(match["number"])
    suffix = match["suffix"]
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        exponent = int(suffix[1:])
        if abs(exponent) > 30:
            raise QuantityError(f"{value!r}: exponent out of range")
        return number * Fraction(10) ** exponent
    return number * _DECIMAL[suffix]


def format_binary(count: int) -> str:
    """A whole count as the API writes it canonically: ``4Gi``, ``1536Mi``."""
    if count < 0:
        raise QuantityError(f"{count} is negative")
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if count and count % _BINARY[suffix] == 0:
            return f"{count // _BINARY[suffix]}{suffix}"
    return str(count)
