"""Pins doctor's report: the aligned PASS/WARN/FAIL lines with the fix appended, the summary
line, and which status wins when a check combines several findings."""

from __future__ import annotations

from nodemgr.cli.doctor import report
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result


def test_render_aligns_checks_and_appends_fix_and_summary():
    """The report aligns the check names, appends the fix to a FAIL and ends with the counts and
    what they mean."""
    text = report.render(
        [Result("config", PASS, "ok"), Result("kubelet socket", FAIL, "gone", "start it")]
    )
    assert text.splitlines() == [
        "PASS  config          ok",
        "FAIL  kubelet socket  gone — fix: start it",
        "",
        "1 FAIL, 0 WARN, 1 PASS: gpushare-node cannot work on this node until every FAIL is fixed",
    ]


def test_render_without_a_fail_says_nothing_blocks():
    """With no FAIL the summary says nothing blocks gpushare-node."""
    text = report.render([Result("config", PASS, "ok"), Result("ledger", WARN, "none", "start")])
    assert text.splitlines()[-1] == "0 FAIL, 1 WARN, 1 PASS: nothing blocks gpushare-node here"


def test_worst_prefers_fail_over_warn_over_pass():
    """A check that found several problems reports the most severe one."""
    assert report.worst([PASS, WARN]) == WARN
    assert report.worst([WARN, FAIL, PASS]) == FAIL
    assert report.worst([PASS]) == PASS
