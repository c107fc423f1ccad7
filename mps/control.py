"""Talking to a control daemon: ``nvidia-cuda-mps-control`` in client mode.

The client reads commands on stdin and prints answers on stdout; it finds its
daemon through ``CUDA_MPS_PIPE_DIRECTORY``. Each call runs the binary in its
own process group with a timeout, and kills the group when the time is up.
"""

from __future__ import annotations

import os
import signal
import subprocess

SERVER_STATES = ("ACTIVE", "INITIALIZING", "FAULT")


class MpsError(Exception):
    """Base of the errors of this library; messages name the pipe directory."""


class MpsUnavailable(MpsError):
    """No control daemon answers (not running, socket gone, binary missing)."""


class MpsTimeout(MpsError):
    """The control binary did not finish in time: a hung control daemon."""


class MpsProtocolError(MpsError):
    """An answer that is an error or cannot be parsed."""


def run_binary(
    argv: list[str], env: dict[str, str], timeout_seconds: float, stdin: str = ""
) -> subprocess.CompletedProcess:
    """Run the control binary; on timeout kill its whole process group."""
    try:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group, so a timeout kills all of it
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
        try:
            done = run_binary(
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
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise MpsUnavailable(f"no MPS control daemon answers at {self.pipe_dir}: {said}")
        lines = [text.strip() for text in done.stdout.splitlines() if text.strip()]
        if lines and lines[0].lower().startswith("error"):
            raise MpsProtocolError(f"MPS control daemon at {self.pipe_dir}: {line!r}: {lines[0]}")
        return lines

    def server_pids(self) -> list[int]:
        return [self._pid(text, "get_server_list") for text in self.command("get_server_list")]

    def server_status(self, server_pid: int) -> str:
        answer = self.command(f"get_server_status {server_pid}")
        if len(answer) != 1 or answer[0] not in SERVER_STATES:
            raise self._unexpected(f"get_server_status {server_pid}", answer)
        return answer[0]

    def client_pids(self, server_pid: int) -> list[int]:
        command = f"get_client_list {server_pid}"
        return [self._pid(text, command) for text in self.command(command)]

    def set_default_pinned_mem_limit(self, device: str, memory_mib: int) -> None:
        self.command(f"set_default_device_pinned_mem_limit {device} {memory_mib}M")

    def set_default_active_thread_percentage(self, percent: int) -> None:
        self.command(f"set_default_active_thread_percentage {percent}")

    def quit(self) -> None:
        self.command("quit")

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
