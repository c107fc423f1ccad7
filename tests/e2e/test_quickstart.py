"""A new engineer's first ten minutes: the README's quick start, exactly as written, in a
fresh clone.

The checkout is cloned into a temporary directory (``git clone``; changes not committed
yet are copied over, so that what is tested is what the checkout holds), and the
commands of the README's quick start are run there as the README writes them, terminal
by terminal (standins.transcript says how a transcript is read): the first start
installs gpushare-node into the clone's own ``.venv`` (pip's wheel cache makes that
quick), the daemon runs on its simulated cards, the test kubelet admits a pod, ``nodemgr
status``, ``doctor`` and ``allocations`` answer, Ctrl-C stops the kubelet and then the
daemon, and ``scripts/quickstart-clean`` removes what the quick start left. What each
command prints must be what the README shows, ids, times and what the README leaves out
(``…``) aside; a command that only reads the daemon's state may be run again for a few
seconds until it does (``QUERIES``), as a reader runs it seconds after the pod was admitted.

The README's transcript is a root shell's (as root the daemon also mounts each card's
/dev/shm tmpfs, and doctor's privileges line passes): as another user the test skips,
except where CI requires the root-only tests to run (``GPUSHARE_REQUIRE_RUNC=1``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from standins import transcript
from standins.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FIRST_START_SECONDS = 240  # the first start installs the clone's .venv
OUTPUT_SECONDS = 60  # until a running command has printed what the README shows
EXIT_SECONDS = 60  # a command after its output, or after Ctrl-C
# Commands that only read the daemon's state. A reader of the README runs them a few
# seconds after the kubelet terminal printed its pod, by which time the daemon has
# registered its last resource and its next reconcile has named the pod; run at once,
# they may show the moment before. Such a command is run again until it prints what the
# README shows, for up to SETTLE_SECONDS.
QUERIES = (".venv/bin/nodemgr status ", ".venv/bin/nodemgr allocations ")
SETTLE_SECONDS = 15


class Terminal:
    """One command running as a terminal's foreground job: its own process group (so
    that Ctrl-C reaches the group, as a terminal sends it), stdout and stderr together."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]):
        self.command = command
        self.process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        for chunk in iter(lambda: stdout.read1(65536), b""):
            self._chunks.append(chunk)

    def lines(self) -> list[str]:
        """The whole lines printed so far."""
        text = b"".join(self._chunks).decode(errors="replace")
        return text.split("\n")[:-1]

    def wait_for(self, expected: list[str], seconds: float) -> None:
        """Until what it printed so far is what the README shows, or fail showing both."""
        deadline = time.monotonic() + seconds
        while not transcript.matches(expected, self.lines()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self._reader.join(timeout=5)
                if transcript.matches(expected, self.lines()):
                    return
                code = self.process.poll()
                state = "still running" if code is None else f"exited {code}"
                shown = transcript.difference(expected, self.lines())
                pytest.fail(f"`{self.command}` ({state}): {shown}")
            time.sleep(0.1)

    def interrupt(self) -> None:
        os.killpg(self.process.pid, signal.SIGINT)

    def finish(self, expected: list[str], seconds: float = EXIT_SECONDS) -> None:
        """Its exit, then its whole output against the README's."""
        assert self.finished_as(expected, seconds), (
            f"`{self.command}`: {transcript.difference(expected, self.lines())}"
        )

    def finished_as(self, expected: list[str], seconds: float = EXIT_SECONDS) -> bool:
        """Its exit, then whether its whole output is the README's."""
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{self.command}` did not exit within {seconds} s")
        self._reader.join(timeout=5)
        return transcript.matches(expected, self.lines())

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def fresh_clone(into: Path) -> Path:
    """``git clone`` of this checkout, with its uncommitted changes (modified, new and
    deleted files that git does not ignore) carried over."""
    clone = into / "gpushare-node"
    subprocess.run(["git", "clone", "--quiet", REPO, str(clone)], check=True)

    def listed(*flags: str) -> list[str]:
        out = subprocess.run(
            ["git", "-C", REPO, "ls-files", "-z", *flags], check=True, capture_output=True
        ).stdout.decode()
        return [name for name in out.split("\0") if name]

    for name in listed("--deleted"):
        (clone / name).unlink(missing_ok=True)
    for name in listed("--modified", "--others", "--exclude-standard"):
        source = Path(REPO) / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    return clone


def run_terminals(blocks: list[list[transcript.Command]], cwd: Path, env, started: list) -> None:
    """The first terminal's commands in order; at its first command shown with ``^C``,
    once that command printed what precedes the ``^C``, every later terminal runs (the
    same way) before Ctrl-C is pressed here."""
    if not blocks:
        return
    first, later = blocks[0], blocks[1:]
    later_done = False
    for command in first:
        terminal = Terminal(command.text, cwd, env)
        started.append(terminal)
        first_start = not (cwd / ".venv").exists()
        if not command.interrupted and command.text.startswith(QUERIES):
            settle = time.monotonic() + SETTLE_SECONDS
            while not terminal.finished_as(command.output) and time.monotonic() < settle:
                time.sleep(0.5)
                terminal = Terminal(command.text, cwd, env)
                started.append(terminal)
            terminal.finish(command.output)
            continue
        if not command.interrupted:
            terminal.finish(command.output, FIRST_START_SECONDS if first_start else EXIT_SECONDS)
            continue
        terminal.wait_for(command.output, FIRST_START_SECONDS if first_start else OUTPUT_SECONDS)
        if not later_done:
            run_terminals(later, cwd, env, started)
            later_done = True
        terminal.interrupt()
        terminal.finish(command.whole_output)
    if not later_done:
        run_terminals(later, cwd, env, started)


def clean_up(clone: Path, started: list[Terminal]) -> None:
    """What a failed run may have left: its commands, the quick start's MPS stand-ins and
    mounts (``scripts/quickstart-clean``), then any process still using the clone (its
    path is in the command line or environment of none but ours) and any mount below it."""
    for terminal in started:
        terminal.kill()
    if (clone / ".quickstart").exists():
        subprocess.run(["scripts/quickstart-clean"], cwd=clone, capture_output=True, timeout=60)
    for process in psutil.process_iter():
        try:
            if str(clone) in " ".join(process.cmdline()) or any(
                str(clone) in value for value in process.environ().values()
            ):
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(str(clone))), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


def test_the_readme_quick_start_runs_as_written_in_a_fresh_clone():
    """The README's quick start, run command by command in a fresh clone as its transcript
    shows (three terminals: the daemon, the test kubelet, nodemgr), prints what the README
    shows, and quickstart-clean leaves no .quickstart behind."""
    if os.geteuid() != 0:
        if os.environ.get("GPUSHARE_REQUIRE_RUNC") == "1":
            pytest.fail("GPUSHARE_REQUIRE_RUNC=1 but not root: the quick start is a root shell's")
        pytest.skip("the README's quick start transcript is a root shell's")
    if not (Path(REPO) / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: nothing to clone")
    readme = (Path(REPO) / "README.md").read_text()
    blocks = transcript.terminals(transcript.section(readme, "Quick start"))
    commands = [command.text for block in blocks for command in block]
    assert commands[:2] == ["scripts/quickstart", "scripts/quickstart-clean"], commands
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONUNBUFFERED"] = "1"  # a terminal is line-buffered; a pipe would hold prints back
    with tempfile.TemporaryDirectory(prefix="gpushare-quickstart-") as tmp:
        clone = fresh_clone(Path(tmp))
        started: list[Terminal] = []
        began = time.monotonic()
        try:
            run_terminals(blocks, clone, env, started)
        except BaseException:
            for terminal in started:  # shown by pytest with the failure
                print(f"--- $ {terminal.command}", *terminal.lines(), sep="\n")
            raise
        finally:
            clean_up(clone, started)
        print(f"quick start in a fresh clone: {time.monotonic() - began:.1f} s")
        assert not (clone / ".quickstart").exists(), "quickstart-clean left .quickstart"
