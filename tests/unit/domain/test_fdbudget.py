"""Pins nodemgr.domain.fdbudget: what the daemon may hold at once is what was open at start,
every listener at its cap and the reserve; a limit that holds it has no shortfall; one
that does not is named with every number and the fix (LimitNOFILE= of the unit)."""

from nodemgr.domain.fdbudget import RESERVE, needed, shortfall

CAPS = {"hook": 64, "status": 16, "metrics": 16, "device-plugin:aliyun.com/gpu-mem": 8}


def test_needed_adds_what_was_open_every_cap_and_the_reserve():
    assert needed(40, CAPS) == 40 + 104 + RESERVE
    assert needed(40, {}, reserve=10) == 50


def test_a_limit_that_holds_it_all_has_no_shortfall():
    assert shortfall(needed(40, CAPS), 40, CAPS) is None
    assert shortfall(65536, 40, CAPS) is None


def test_a_limit_too_small_is_named_with_the_numbers_and_the_fix():
    need = needed(40, CAPS)
    problem = shortfall(need - 1, 40, CAPS)
    assert problem is not None
    assert f"RLIMIT_NOFILE) is {need - 1}, under the {need}" in problem
    assert "40 open at start" in problem and f"{RESERVE} kept for enforcement" in problem
    assert "hook 64" in problem and "device-plugin:aliyun.com/gpu-mem 8" in problem
    assert f"LimitNOFILE= of the unit (`systemctl edit gpushare-node`) to {need}" in problem
