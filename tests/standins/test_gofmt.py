"""standins/gofmt.py: Go's fmt.Sprintf(format) with no arguments.

Pins the model on the outputs Go's fmt documents for each format error (a verb with
no argument, a lone ``%``, ``%%``, ``*`` widths and precisions, argument indexes) and
on the one kube-scheduler was seen to make of an extender reason ("3 GiB/10% free"
posted as "3 GiB/10%!f(MISSING)ree").
"""

from __future__ import annotations

import pytest

from standins.gofmt import sprintf_no_args


@pytest.mark.parametrize(
    ("format_string", "printed"),
    [
        ("plain text, no verb", "plain text, no verb"),
        ("GPU0 (Tesla T4) has 3 GiB/10% free", "GPU0 (Tesla T4) has 3 GiB/10%!f(MISSING)ree"),
        ("hi%d", "hi%!d(MISSING)"),
        ("100%", "100%!(NOVERB)"),
        ("100% ", "100%!(NOVERB)"),  # a flag, then the end
        ("100%%", "100%"),
        ("50%% and 40%%", "50% and 40%"),
        ("%-5s|", "%!s(MISSING)|"),
        ("%*d", "%!(BADWIDTH)%!d(MISSING)"),
        ("%.*d", "%!(BADPREC)%!d(MISSING)"),
        ("%.2f", "%!f(MISSING)"),
        ("%[1]d", "%!d(BADINDEX)"),
        ("%[x]d", "%!d(BADINDEX)"),
        ("%[1d", "%!d(BADINDEX)"),  # no closing bracket: "[" skipped, 1 read as a width
        ("40%)", "40%!)(MISSING)"),
        ("é%é", "é%!é(MISSING)"),
    ],
)
def test_go_fmt_without_arguments(format_string, printed):
    """Each format error prints as Go's fmt prints it when Sprintf gets no arguments."""
    assert sprintf_no_args(format_string) == printed
