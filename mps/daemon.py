"""One card's control daemon: start, adopt, probe, stop; what containers see of it.

Whoever answers at the card's pipe directory is its daemon, whether this process or an
earlier run of the node daemon started it (adoption). Which process that is comes from
facts a container cannot forge (mps.identity), never from a command line, an
environment or a PID file.

With a card namespace (mps.namespace) the daemon starts in it, so it and its MPS servers
have the card's tmpfs as /dev/shm, which no container gets; a daemon found in the
host's namespace is still the card's, and ``on_card_shm`` says it is not on that tmpfs.

Containers never see the pipe directory: it holds ``control_privileged``, through which
root may ``quit`` the daemon. They get the client directory, holding only ``control``: a
hard link to the daemon's socket, renewed at each daemon start since each start makes a
new socket (docs/mps.md says why a bind mount over ``control_privileged`` does not hold).
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
from dataclasses import dataclass

import psutil

from mps import connections, proc
from mps.control import (
    ControlClient,
    MpsError,
    MpsProtocolError,
    MpsTimeout,
    MpsUnavailable,
    MpsUnsupported,
    run_binary,
)
from mps.holders import Look
from mps.identity import DaemonIdentity
from mps.namespace import CardNamespace


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


# A unix socket's path (sun_path) holds 108 bytes with its terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


class CardDaemon:
    """The MPS control daemon of one card."""

    def __init__(
        self,
        card_uuid: str,
        binary: str,
        pipe_dir: str,
        log_dir: str,
        timeout_seconds: float,
        client_dir: str | None = None,
        namespace: CardNamespace | None = None,
    ):
        """``client_dir``: what containers mount as their pipe directory (None: none).
        ``namespace``: where the daemon is started (None: ours)."""
        self.card_uuid = card_uuid
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.client_dir = client_dir
        self.namespace = namespace
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
            return False  # driver 535 has no get_server_status: FAULT cannot be seen

    def start(self) -> None:
        """Start the daemon detached (it forks away) and wait until it answers."""
        longest = os.path.join(self.pipe_dir, "control_privileged")
        if len(os.fsencode(longest)) > MAX_SOCKET_PATH_BYTES:
            # The binary itself would only say it cannot access its pipe directory.
            raise MpsUnavailable(
                f"the MPS control socket {longest} would be {len(os.fsencode(longest))} "
                f"bytes, over the {MAX_SOCKET_PATH_BYTES} a unix socket path may have: give "
                "gpushare-node a shorter run_dir"
            )
        for directory in (self.pipe_dir, self.log_dir):
            os.makedirs(directory, mode=0o755, exist_ok=True)
        env = {
            "CUDA_VISIBLE_DEVICES": self.card_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
        }
        argv = [self.binary, "-d"]
        if self.namespace is not None:
            # A new namespace replaces the card's: never while a daemon answers in the old.
            if self.probe().state is not HealthState.DOWN:
                raise MpsUnavailable(
                    f"an MPS control daemon already answers at {self.pipe_dir}: not started again"
                )
            self.namespace.create()
            argv = self.namespace.command(argv)
        done = run_binary(argv, env, self.timeout_seconds)
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

    def identify(self, previous: DaemonIdentity | None = None) -> DaemonIdentity | None:
        """The verified control daemon of this pipe directory (mps.identity); None when
        no single process passes. ``previous`` stays while it still passes."""
        bound = None if self.namespace is None else self.namespace.bound()
        return proc.find_daemon(
            self.pipe_dir, self.binary, previous, () if bound is None else (bound,)
        )

    def on_card_shm(self, daemon: DaemonIdentity) -> bool | None:
        """Whether the daemon's /dev/shm is the card's tmpfs (the namespace's); None when
        there is no namespace or the daemon is no longer that process."""
        if self.namespace is None:
            return None
        try:
            seen = os.stat(f"/proc/{daemon.pid}/root/dev/shm").st_dev
            card = os.stat(self.namespace.shm_dir).st_dev
        except OSError:
            return None
        stat = proc.stat_of(daemon.pid)
        if stat is None or stat.start_ticks != daemon.start_ticks:
            return None
        return seen == card

    def pid(self) -> int | None:
        """PID of the verified control daemon of this pipe directory, if one runs."""
        identity = self.identify()
        return None if identity is None else identity.pid

    def servers(self, daemon: DaemonIdentity) -> frozenset[tuple[int, int]]:
        """(PID, start ticks) of ``daemon``'s MPS servers; empty once it is gone."""
        return proc.find_servers(daemon, self.binary)

    def look(self, daemon: DaemonIdentity, ours: int) -> Look:
        """The connections ``daemon`` accepted on its control socket now, and who holds
        them (mps.connections). ``ours``: the node daemon's PID."""
        return connections.look(daemon, self.pipe_dir, ours)

    def publish(self) -> None:
        """Make ``<client dir>/control`` a hard link to the daemon's current ``control``
        socket, replaced in one rename so a client never finds it missing."""
        if self.client_dir is None:
            return
        source = os.path.join(self.pipe_dir, "control")
        target = os.path.join(self.client_dir, "control")
        try:
            os.makedirs(self.client_dir, mode=0o755, exist_ok=True)
            wanted = os.stat(source)
            with contextlib.suppress(FileNotFoundError):
                have = os.lstat(target)
                if (have.st_dev, have.st_ino) == (wanted.st_dev, wanted.st_ino):
                    return
            for name in os.listdir(self.client_dir):  # left by a run stopped mid-publish
                if name.startswith(".control."):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.client_dir, name))
            temporary = os.path.join(self.client_dir, f".control.{os.getpid()}")
            os.link(source, temporary)
            os.replace(temporary, target)
        except OSError as e:
            raise MpsError(
                f"cannot give containers the MPS control socket of {self.card_uuid}: "
                f"linking {source} as {target} failed ({e.strerror or e}); both must be on one "
                "file system (under run_dir) writable by gpushare-node"
            ) from e


def _alive(pid: int | None) -> bool:
    """True while the process runs (a zombie counts as gone)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
