"""Talking to a control daemon: ``nvidia-cuda-mps-control`` in client mode.

The client reads commands on stdin, prints answers on stdout and finds its daemon
through ``CUDA_MPS_PIPE_DIRECTORY``. Each call runs in its own process group, killed
when its time is up.

The dialect is NVIDIA's (driver 535, pinned by tests/contract): a non-zero exit means
no daemon answered, but a refused command still exits 0 and says why on stdout
(``Unknown command "x"``, ``Server 42 not found``, the kept value for an invalid
percentage, "Not enough privilege ..." for ``quit``). So setters check their answer,
and the pinned memory limit is read back: it shows in whole GiB from 1 GiB up (4096M
reads ``4G``, 1536M reads ``1G``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

SERVER_STATES = ("ACTIVE", "INITIALIZING", "FAULT")
UNKNOWN_COMMAND = re.compile(r'Unknown command ".*"')
SERVER_NOT_FOUND = re.compile(r"(?:Error: )?[Ss]erver \d+ not found!?")
PINNED_LIMIT = re.compile(r"([0-9]+)([MG])")


class MpsError(Exception):
    """Base of the errors of this library; messages name the pipe directory."""


class MpsUnavailable(MpsError):
    """No control daemon answers (not running, socket gone, binary missing)."""


class MpsTimeout(MpsError):
    """The control binary did not finish in time: a hung control daemon."""


class MpsProtocolError(MpsError):
    """An answer that is an error or cannot be parsed."""


class MpsUnsupported(MpsProtocolError):
    """The control daemon does not know the command (``Unknown command "<name>"``)."""


def run_binary(
    argv: list[str], env: dict[str, str], timeout_seconds: float, stdin: str = ""
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError as e:
        raise MpsUnavailable(
            f"MPS control binary {argv[0]!r} not found: install the NVIDIA driver's MPS "
            "tools (nvidia-cuda-mps-control) or set mps.control_binary"
        ) from e
    except PermissionError as e:
        raise MpsUnavailable(f"MPS control binary {argv[0]!r} is not executable") from e
    try:
        out, err = proc.communicate(stdin, timeout=timeout_seconds)
    except subprocess.TimeoutExpired as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise MpsTimeout(f"{' '.join(argv)} did not finish within {timeout_seconds:g} s") from e
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


class ControlClient:
    """Commands to the control daemon serving one pipe directory."""

    def __init__(self, binary: str, pipe_dir: str, timeout_seconds: float):
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.timeout_seconds = timeout_seconds

    def command(self, line: str) -> list[str]:
        """Send one command; its answer's non-empty lines. Errors become MpsError."""
        done = self._send(line)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise MpsUnavailable(f"no MPS control daemon answers at {self.pipe_dir}: {said}")
        return self._answer(line, done.stdout)

    def _send(self, line: str) -> subprocess.CompletedProcess:
        try:
            return run_binary(
                [self.binary],
                {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir},
                self.timeout_seconds,
                stdin=line + "\n",
            )
        except MpsTimeout as e:
            raise MpsTimeout(
                f"MPS control daemon at {self.pipe_dir} did not answer {line!r} within "
                f"{self.timeout_seconds:g} s (hung?)"
            ) from e

    def _answer(self, line: str, stdout: str) -> list[str]:
        lines = [text.strip() for text in stdout.splitlines() if text.strip()]
        if lines and UNKNOWN_COMMAND.fullmatch(lines[0]):
            raise MpsUnsupported(
                f"MPS control daemon at {self.pipe_dir} does not know {line!r} (an older "
                f"driver?): {lines[0]}"
            )
        if lines and lines[0].lower().startswith("error"):
            raise MpsProtocolError(f"MPS control daemon at {self.pipe_dir}: {line!r}: {lines[0]}")
        return lines

    def server_pids(self) -> list[int]:
        return [self._pid(text, "get_server_list") for text in self.command("get_server_list")]

    def server_status(self, server_pid: int) -> str | None:
        """ACTIVE, INITIALIZING or FAULT; None when the server exited since it was listed.
        Raises MpsUnsupported where the driver has no such command (535 has none)."""
        answer = self.command(f"get_server_status {server_pid}")
        if len(answer) == 1 and SERVER_NOT_FOUND.fullmatch(answer[0]):
            return None
        if len(answer) != 1 or answer[0] not in SERVER_STATES:
            raise self._unexpected(f"get_server_status {server_pid}", answer)
        return answer[0]

    def client_pids(self, server_pid: int) -> list[int]:
        """Client PIDs of a server; none when the server exited since it was listed."""
        command = f"get_client_list {server_pid}"
        answer = self.command(command)
        if len(answer) == 1 and SERVER_NOT_FOUND.fullmatch(answer[0]):
            return []
        return [self._pid(text, command) for text in answer]

    def set_default_pinned_mem_limit(self, device: str, memory_mib: int) -> None:
        """Set it and read it back: the daemon answers nothing either way, and keeps no
        limit for a device it cannot resolve."""
        command = f"set_default_device_pinned_mem_limit {device} {memory_mib}M"
        answer = self.command(command)
        if answer:
            raise self._unexpected(command, answer)
        shown = self.default_pinned_mem_limit_mib(device)
        if shown != shown_pinned_limit_mib(memory_mib):
            shown_text = "none" if shown is None else f"{shown}M"
            raise MpsProtocolError(
                f"MPS control daemon at {self.pipe_dir} did not keep the pinned memory limit "
                f"{memory_mib}M for device {device}: it reads back {shown_text}"
            )

    def default_pinned_mem_limit_mib(self, device: str) -> int | None:
        """As the daemon shows it, in MiB (``4G`` is 4096); None when none is set."""
        command = f"get_default_device_pinned_mem_limit {device}"
        answer = self.command(command)
        if not answer:
            return None
        match = PINNED_LIMIT.fullmatch(answer[0]) if len(answer) == 1 else None
        if match is None:
            raise self._unexpected(command, answer)
        return int(match.group(1)) * (1024 if match.group(2) == "G" else 1)

    def set_default_active_thread_percentage(self, percent: float) -> None:
        """Set it; the daemon answers the value it now has (the old one when it refused)."""
        command = f"set_default_active_thread_percentage {percent:g}"
        answer = self.command(command)
        if answer != [f"{percent:.1f}"]:
            kept = " | ".join(answer)[:200] or "(nothing)"
            raise MpsProtocolError(
                f"MPS control daemon at {self.pipe_dir} refused {command!r} (kept {kept})"
            )

    def default_active_thread_percentage(self) -> float:
        command = "get_default_active_thread_percentage"
        answer = self.command(command)
        try:
            [value] = answer
            return float(value)
        except ValueError:
            raise self._unexpected(command, answer) from None

    def quit(self) -> None:
        """Ask the daemon to exit. The client then exits with the daemon's status
        (non-zero when its servers did not exit gracefully), so that is no error: the
        caller checks the daemon is gone. A refusal ("Not enough privilege ...") is."""
        answer = self._answer("quit", self._send("quit").stdout)
        if answer:
            raise self._unexpected("quit", answer)

    def _pid(self, text: str, command: str) -> int:
        if not text.isdigit():
            raise self._unexpected(command, [text])
        return int(text)

    def _unexpected(self, command: str, answer: list[str]) -> MpsProtocolError:
        shown = " | ".join(answer)[:200] or "(nothing)"
        return MpsProtocolError(
            f"MPS control daemon at {self.pipe_dir} gave an unexpected answer to "
            f"{command!r}: {shown!r}"
        )


def shown_pinned_limit_mib(memory_mib: int) -> int | None:
    """What the daemon reads back for a limit set in MiB (0: no limit)."""
    if memory_mib <= 0:
        return None
    return memory_mib if memory_mib < 1024 else memory_mib // 1024 * 1024
