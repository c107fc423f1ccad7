"""Pins nodemgr.runtime.fdlimit in processes of their own (prlimit sets their limits): the
soft open-file limit is raised to the hard one and both are logged; a limit that cannot
hold the listeners' caps, the reserve and what is open refuses with FdLimitError naming
the numbers; a soft limit already at the hard one is left as it is."""

import subprocess
import sys
import textwrap

from standins.paths import REPO

SCRIPT = textwrap.dedent(
    """\
    import logging, resource, sys
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from nodemgr.runtime import fdlimit
    caps = {"hook": 64, "status": 16}
    try:
        limit = fdlimit.prepare(caps)
    except fdlimit.FdLimitError as e:
        print("REFUSED", e)
        sys.exit(2)
    print("LIMIT", limit.soft, limit.hard, limit.raised_from, limit.needed)
    print("NOW", *resource.getrlimit(resource.RLIMIT_NOFILE))
    """
)


def run(nofile: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["prlimit", f"--nofile={nofile}", "--", sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def line(done: subprocess.CompletedProcess, head: str) -> list[str]:
    [found] = [x for x in done.stdout.splitlines() if x.startswith(head + " ")]
    return found.split()[1:]


def test_the_soft_limit_is_raised_to_the_hard_one_and_logged():
    done = run("1024:4096")
    assert done.returncode == 0, done.stderr
    soft, hard, raised_from, _ = line(done, "LIMIT")
    assert (soft, hard, raised_from) == ("4096", "4096", "1024")
    assert line(done, "NOW") == ["4096", "4096"]
    assert "open-file limit 4096, raised from 1024 (hard 4096)" in done.stderr


def test_a_limit_at_its_hard_value_is_kept():
    done = run("2048:2048")
    assert done.returncode == 0, done.stderr
    assert line(done, "LIMIT")[:3] == ["2048", "2048", "None"]


def test_a_limit_too_small_for_the_listeners_and_the_reserve_is_refused():
    done = run("200:200")
    assert done.returncode == 2, done.stdout + done.stderr
    refused = " ".join(line(done, "REFUSED"))
    assert "the open-file limit (RLIMIT_NOFILE) is 200, under the" in refused
    assert "hook 64, status 16" in refused and "LimitNOFILE=" in refused
