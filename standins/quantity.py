"""Kubernetes resource quantities (apimachinery ``resource.Quantity``), as the API server
parses and prints them: the test API server's ``resource.k8s.io`` objects and the
allocation helper use them.

A quantity is a signed decimal number with an optional suffix: binary ``Ki Mi Gi Ti Pi
Ei`` (powers of 1024), decimal SI ``n u m k M G T P E``, or an exponent ``e<N>``/``E<N>``.
Parsing keeps the suffix family (the format); the value is exact, rounded up (away from
zero) to nano precision, as the real parser does. ``canonical`` prints it the way the
API server stores it: ``1024Mi`` -> ``1Gi``, ``1536Mi`` -> ``1536Mi``, ``0.5`` -> ``500m``,
``1500`` -> ``1500``, ``15000`` -> ``15k``, ``1e3`` -> ``1e3``; a binary quantity smaller
than 1024 or with a fraction prints as decimal SI.

Exact arithmetic uses ``fractions.Fraction``; ``int_value`` is Quantity.Value(): the
value rounded up (away from zero) to an integer, which the consumable-capacity rules
compute with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

BINARY_SI = "BinarySI"
DECIMAL_SI = "DecimalSI"
DECIMAL_EXPONENT = "DecimalExponent"

FORMAT_ERROR = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
SUFFIX_ERROR = "unable to parse quantity's suffix"

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
_BINARY_SUFFIX = {power: suffix for suffix, power in _BINARY.items()}
_SUFFIX_CHARS = set("eEinumkKMGTP")
_NANO = Fraction(1, 10**9)


class QuantityError(ValueError):
    """Not a quantity: the message is the API server's (``FORMAT_ERROR``, ``SUFFIX_ERROR``)."""


@dataclass(frozen=True)
class Quantity:
    value: Fraction
    format: str = DECIMAL_SI

    def __str__(self) -> str:
        return canonical(self)


def parse(text: str) -> Quantity:
    """A quantity from its string form, or QuantityError with the API server's message."""
    text = text.strip()
    if not text:
        raise QuantityError(FORMAT_ERROR)
    sign, number, suffix = _split(text)
    if suffix in _BINARY:
        scale, fmt = Fraction(1024) ** _BINARY[suffix], BINARY_SI
    elif suffix in _DECIMAL:
        scale, fmt = Fraction(10) ** _DECIMAL[suffix], DECIMAL_SI
    elif len(suffix) > 1 and suffix[0] in "eE" and _is_int(suffix[1:]):
        scale, fmt = Fraction(10) ** int(suffix[1:]), DECIMAL_EXPONENT
    else:
        raise QuantityError(SUFFIX_ERROR)
    whole, _, fraction = number.partition(".")
    value = Fraction(int(whole or "0")) + (
        Fraction(int(fraction), 10 ** len(fraction)) if fraction else 0
    )
    value *= scale * sign
    if value % _NANO:  # finer than nano: rounded up, away from zero
        steps = value / _NANO
        value = (math.ceil(steps) if steps > 0 else math.floor(steps)) * _NANO
    return Quantity(value, fmt)


def _split(text: str) -> tuple[int, str, str]:
    """(sign, digits with at most one '.', suffix) as apimachinery's parseQuantityString."""
    sign, pos = 1, 0
    if text[0] in "+-":
        sign, pos = (-1 if text[0] == "-" else 1), 1
    start = pos
    while pos < len(text) and text[pos].isdigit():
        pos += 1
    if pos < len(text) and text[pos] == ".":
        pos += 1
        while pos < len(text) and text[pos].isdigit():
            pos += 1
    number = text[start:pos]
    suffix_start = pos
    while pos < len(text) and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < len(text) and text[pos] in "+-":
        pos += 1
    while pos < len(text) and text[pos].isdigit():
        pos += 1
    if pos != len(text):
        raise QuantityError(FORMAT_ERROR)
    return sign, number, text[suffix_start:]


def _is_int(text: str) -> bool:
    body = text[1:] if text[:1] in "+-" else text
    return body.isdigit()


def canonical(q: Quantity) -> str:
    """The string the API server stores and returns for ``q``."""
    if q.value == 0:
        return "0"
    fmt = q.format
    if fmt == BINARY_SI and (abs(q.value) < 1024 or q.value.denominator != 1):
        fmt = DECIMAL_SI  # small or fractional binary quantities print as decimal
    if fmt == BINARY_SI:
        amount, power = int(q.value), 0
        while amount % 1024 == 0 and power < 6:
            amount //= 1024
            power += 1
        return f"{amount}{_BINARY_SUFFIX[power]}"
    mantissa, exponent = _decimal_parts(q.value)
    if fmt == DECIMAL_EXPONENT:
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    if exponent not in _DECIMAL_SUFFIX:  # beyond E or below n: apimachinery prints an exponent
        return f"{mantissa}e{exponent}"
    return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"


def _decimal_parts(value: Fraction) -> tuple[int, int]:
    """(integer mantissa, exponent, a multiple of 3) with value = mantissa * 10**exponent
    and as few trailing zeros as that allows (AsCanonicalBytes)."""
    exponent = 0
    while value.denominator != 1:  # at most nano: 9 steps
        value *= 10
        exponent -= 1
    mantissa = int(value)
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    while exponent % 3:
        mantissa *= 10
        exponent -= 1
    return mantissa, exponent


def int_value(q: Quantity) -> int:
    """Quantity.Value(): the value as an integer, rounded up away from zero."""
    return math.ceil(q.value) if q.value >= 0 else math.floor(q.value)


def from_int(value: int, fmt: str = BINARY_SI) -> Quantity:
    """resource.NewQuantity(value, fmt)."""
    return Quantity(Fraction(value), fmt)


def from_json(value) -> Quantity:
    """A quantity as it arrives in a JSON body: a string, or a bare JSON number (the
    API server reads the number's text)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise QuantityError(FORMAT_ERROR)
    return parse(value if isinstance(value, str) else repr(value))
