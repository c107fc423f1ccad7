"""The daemon's end of the runtime hook socket (``<run_dir>/hook.sock``).

Translates the protocol of :mod:`hooks.protocol` into calls on the
:class:`~nodemgr.enforcement.registry.ContainerRegistry` and back; it decides nothing.
A malformed request gets a refusal naming what is wrong. The socket is
root-only (0600): only the container runtime talks to it.

No client holds it: the request must arrive whole within ``READ_TIMEOUT_SECONDS``
(in all, not per read), each connection is cut ``DEADLINE_SECONDS`` after it was
accepted, and at most ``MAX_CONNECTIONS`` are served at once (the excess is closed
unread; the hook tries again within its own timeout), see
:mod:`nodemgr.common.unixserver`.
"""

from __future__ import annotations

import logging
import socket
import time

from hooks import protocol
from hooks.gpuenv import GPU_ENV_NAMES
from nodemgr.common.unixserver import UnixServer
from nodemgr.domain.model import ContainerRef
from nodemgr.enforcement.registry import ContainerRegistry

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0  # the whole request, in all: a trickling client is dropped
# Reading, kubelet's answer (its client's timeout is shorter) and one ledger write.
DEADLINE_SECONDS = 5.0
# Container creations at once; a burst over it waits in the hook's retries, not here.
MAX_CONNECTIONS = 64
ANSWER_TIMEOUT_SECONDS = 1.0  # the answer is one short line; the hook is waiting for it


class BadRequest(Exception):
    pass


class HookServer(UnixServer):
    def __init__(
        self,
        registry: ContainerRegistry,
        socket_path: str,
        max_connections: int | None = None,
        deadline_seconds: float | None = None,
    ):
        super().__init__(
            socket_path,
            self._handle,
            "hook-server",
            max_connections=MAX_CONNECTIONS if max_connections is None else max_connections,
            deadline_seconds=DEADLINE_SECONDS if deadline_seconds is None else deadline_seconds,
        )
        self._registry = registry

    def start(self) -> None:
        super().start()
        log.info("runtime hook socket ready at %s", self.socket_path)

    def _handle(self, sock: socket.socket) -> None:
        try:
            request = protocol.read_message(sock, deadline=time.monotonic() + READ_TIMEOUT_SECONDS)
            answer = _answer(self._registry, request)
        except (protocol.ProtocolError, OSError) as e:
            answer = _refusal(f"unreadable hook request ({e})")
        except Exception as e:  # a bug must still answer (and refuse), not hang the hook
            log.exception("runtime hook request failed")
            answer = _refusal(f"internal error in gpushare-node ({e}); see its log")
        try:
            sock.settimeout(ANSWER_TIMEOUT_SECONDS)
            sock.sendall(protocol.encode(answer))
        except OSError:
            pass  # the hook gave up waiting; it refuses on its own


def _answer(registry: ContainerRegistry, request: dict) -> dict:
    try:
        stage = request.get("stage")
        container_id = _string(request, "container_id")
        if stage == protocol.POSTSTOP:
            registry.release(container_id)
            return {"allowed": True, "message": "unregistered"}
        if stage != protocol.CREATE:
            raise BadRequest(f"unknown stage {stage!r}")
        pid = request.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise BadRequest(f"pid must be a positive integer (got {pid!r})")
        allowed, message = registry.admit(
            container_id,
            pid,
            _env(request.get("env")),
            _identity(request.get("identity")),
            _string(request, "cgroup"),
        )
    except BadRequest as e:
        return _refusal(f"bad hook request: {e}")
    return {"allowed": allowed, "message": message}


def _refusal(problem: str) -> dict:
    log.warning("runtime hook: %s", problem)
    return {"allowed": False, "message": f"gpushare-node refused the container: {problem}"}


def _string(request: dict, name: str) -> str:
    value = request.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    return value


def _env(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise BadRequest("env must map names to strings")
    return {k: v for k, v in value.items() if k in GPU_ENV_NAMES}


def _identity(value: object) -> ContainerRef | None:
    if not value:
        return None
    if not isinstance(value, dict):
        raise BadRequest("identity must be an object")
    values = [value.get(k) for k in ("namespace", "pod", "container")]
    fields = [f for f in values if isinstance(f, str) and f]
    if len(fields) != len(values):
        return None  # partial identity: the runtime did not say; nothing to compare
    return ContainerRef(*fields)
