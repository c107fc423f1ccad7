"""One card's control daemon: start, adopt, probe, stop.

A control daemon is identified by its pipe directory: whoever answers there
is the card's daemon, whether this process started it or an earlier run of
the node daemon did (adoption). Its PID is found in /proc (the process whose
command line runs the control binary in daemon mode and whose environment
names that pipe directory), so nothing depends on a PID file.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass

import psutil

from mps.control import (
    ControlClient,
    MpsError,
    MpsProtocolError,
    MpsTimeout,
    MpsUnavailable,
    MpsUnsupported,
    run_binary,
)

DAEMON_FLAGS = ("-d", "-f")


class HealthState(enum.StrEnum):
    HEALTHY = "healthy"
    DOWN = "down"  # no control daemon answers
    HUNG = "hung"  # the control binary did not answer in time
    BROKEN = "broken"  # answers that are errors or cannot be parsed
    FAULT = "fault"  # an MPS server reports FAULT: no new clients until its clients exit


@dataclass(frozen=True)
class Health:
    state: HealthState
    reason: str = ""  # for the log and the operator; empty when healthy
    servers: int = 0
    clients: int = 0

    @property
    def ok(self) -> bool:
        return self.state is HealthState.HEALTHY


class CardDaemon:
    """The MPS control daemon of one card."""

    def __init__(
        self, card_uuid: str, binary: str, pipe_dir: str, log_dir: str, timeout_seconds: float
    ):
        self.card_uuid = card_uuid
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.timeout_seconds = timeout_seconds
        self.client = ControlClient(binary, pipe_dir, timeout_seconds)

    def probe(self) -> Health:
        """Ask the daemon for its servers and their state. Reads only; never kills."""
        try:
            servers = self.client.server_pids()
            clients = 0
            for server_pid in servers:
                if self._in_fault(server_pid):
                    return Health(
                        HealthState.FAULT,
                        f"MPS server {server_pid} on {self.card_uuid} is in FAULT: it takes no "
                        "new clients until its current clients exit",
                        len(servers),
                    )
                clients += len(self.client.client_pids(server_pid))
        except MpsTimeout as e:
            return Health(HealthState.HUNG, str(e))
        except MpsUnavailable as e:
            return Health(HealthState.DOWN, str(e))
        except MpsProtocolError as e:
            return Health(HealthState.BROKEN, str(e))
        return Health(HealthState.HEALTHY, "", len(servers), clients)

    def _in_fault(self, server_pid: int) -> bool:
        try:
            return self.client.server_status(server_pid) == "FAULT"
        except MpsUnsupported:
            return False  # driver 535 has no get_server_status: a FAULT cannot be seen

    def start(self) -> None:
        """Start the daemon detached (it forks away) and wait until it answers."""
        for directory in (self.pipe_dir, self.log_dir):
            os.makedirs(directory, mode=0o755, exist_ok=True)
        env = {
            "CUDA_VISIBLE_DEVICES": self.card_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
        }
        done = run_binary([self.binary, "-d"], env, self.timeout_seconds)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise MpsUnavailable(f"{self.binary} -d for {self.card_uuid} failed: {said}")
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            health = self.probe()
            if health.state is not HealthState.DOWN or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if health.state is HealthState.DOWN:
            raise MpsUnavailable(
                f"{self.binary} -d for {self.card_uuid} returned but nothing answers at "
                f"{self.pipe_dir} within {self.timeout_seconds:g} s; see {self.log_dir}/control.log"
            )

    def stop(self) -> None:
        """``quit`` the daemon and wait until it no longer answers and its process has exited."""
        pid = self.pid()
        self.client.quit()
        deadline = time.monotonic() + self.timeout_seconds
        while self.probe().state is not HealthState.DOWN or _alive(pid):
            if time.monotonic() > deadline:
                raise MpsError(f"MPS control daemon at {self.pipe_dir} did not quit in time")
            time.sleep(0.05)

    def pid(self) -> int | None:
        """PID of the control daemon serving this pipe directory, if one runs."""
        name = os.path.basename(self.binary)
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if not any(os.path.basename(arg) == name for arg in cmdline[:2]):
                continue
            if not any(flag in cmdline for flag in DAEMON_FLAGS):
                continue
            try:
                if proc.environ().get("CUDA_MPS_PIPE_DIRECTORY") == self.pipe_dir:
                    return proc.pid
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        return None


def _alive(pid: int | None) -> bool:
    """True while the process runs (a zombie, exited but not reaped, counts as gone)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
