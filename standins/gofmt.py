"""Go's ``fmt.Sprintf(format)`` with no arguments, as kube-scheduler applies it to a message.

kube-scheduler posts a pod's FailedScheduling event with
``Eventf(pod, nil, Warning, "FailedScheduling", "Scheduling", msg)``: the
message (the extender's reasons and errors included) is the *format*, with no
arguments. So every ``%`` in it starts a verb. This is a model of Go's
``pp.doPrintf`` (src/fmt/print.go) for that case, written from its rules:

- ``%%`` prints ``%`` (it takes no argument and ignores width and precision);
- flags ``#0+- `` are skipped; ``[n]`` argument indexes, ``*`` widths and
  precisions and digit widths and precisions are parsed as Go parses them;
- a ``*`` with no argument left prints ``%!(BADWIDTH)`` (``%!(BADPREC)`` after
  a ``.``); an index never names an argument here: the verb prints
  ``%!<verb>(BADINDEX)``;
- a verb with no argument left prints ``%!<verb>(MISSING)``;
- a ``%`` that ends the string, flags and width included, prints ``%!(NOVERB)``.

Only the no-argument case is modelled: that is the only one the scheduler makes.
"""

from __future__ import annotations


def _parse_number(text: str, at: int, end: int) -> tuple[bool, int]:
    """Go's parsenum over text[at:end]: whether digits were there, and the index after."""
    if at >= end:
        return False, end
    number, found = 0, False
    while at < end and "0" <= text[at] <= "9":
        if number > 1_000_000:  # Go's tooLarge: a crazy long number is no number at all
            return False, end
        number, found = number * 10 + int(text[at]), True
        at += 1
    return found, at


def _argument_index(text: str, at: int) -> tuple[bool, bool, int]:
    """Go's argNumber with no arguments: (an index was written, it is good, index after)."""
    if at >= len(text) or text[at] != "[":
        return False, True, at
    if len(text) - at < 3:  # parseArgNumber: "[n]" needs three bytes; the "[" is skipped
        return False, False, at + 1
    close = text.find("]", at + 1)
    if close < 0:  # no closing bracket: the "[" alone is skipped
        return False, False, at + 1
    found, after = _parse_number(text, at + 1, close)
    if not found or after != close:
        return False, False, close + 1
    return True, False, close + 1  # a well-formed index, but no argument for it to name


def _width_and_precision(text: str, at: int, out: list[str]) -> tuple[bool, bool, int]:
    """After the flags: Go's index, width, precision and index again, as doPrintf reads
    them. (the argument indexes are good, an index came last, the index of the verb)."""
    end = len(text)
    after_index, good, at = _argument_index(text, at)
    if at < end and text[at] == "*":
        at += 1
        out.append("%!(BADWIDTH)")
        after_index = False
    else:
        width, at = _parse_number(text, at, end)
        if after_index and width:
            good = False
    if at + 1 < end and text[at] == ".":
        at += 1
        if after_index:
            good = False
        after_index, ok, at = _argument_index(text, at)
        good = good and ok
        if at < end and text[at] == "*":
            at += 1
            out.append("%!(BADPREC)")
            after_index = False
        else:
            _, at = _parse_number(text, at, end)
    if not after_index:
        after_index, ok, at = _argument_index(text, at)
        good = good and ok
    return good, after_index, at


def sprintf_no_args(format_string: str) -> str:
    """What Go's fmt.Sprintf(format_string) returns."""
    out: list[str] = []
    text, at, end = format_string, 0, len(format_string)
    while at < end:
        percent = text.find("%", at)
        if percent < 0:
            out.append(text[at:])
            break
        out.append(text[at:percent])
        at = percent + 1
        while at < end and text[at] in "#0+- ":
            at += 1
        good, _, at = _width_and_precision(text, at, out)
        if at >= end:
            out.append("%!(NOVERB)")
            break
        verb = text[at]
        at += 1
        if verb == "%":
            out.append("%")
        elif not good:
            out.append(f"%!{verb}(BADINDEX)")
        else:
            out.append(f"%!{verb}(MISSING)")
    return "".join(out)
