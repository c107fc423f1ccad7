"""The daemon's end of the runtime hook socket (``<run_dir>/hook.sock``).

Translates the protocol of :mod:`hooks.protocol` into calls on the
:class:`~nodemgr.containers.ContainerRegistry` and back; it decides nothing.
A malformed request gets a refusal naming what is wrong. The socket is
root-only (0600): only the container runtime talks to it.
"""

from __future__ import annotations

import logging
import os
import socketserver
import threading

from hooks import protocol
from hooks.gpuenv import GPU_ENV_NAMES
from nodemgr.containers import ContainerRegistry
from nodemgr.model import ContainerRef

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0  # a client that sends nothing is dropped


class BadRequest(Exception):
    pass


class HookServer:
    def __init__(self, registry: ContainerRegistry, socket_path: str):
        self.socket_path = socket_path
        self._registry = registry
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path), mode=0o755, exist_ok=True)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by a killed daemon; nobody serves it
        registry = self._registry

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(READ_TIMEOUT_SECONDS)
                try:
                    answer = _answer(registry, protocol.read_message(self.request))
                except (protocol.ProtocolError, OSError) as e:
                    answer = _refusal(f"unreadable hook request ({e})")
                except Exception as e:  # a bug must still answer (and refuse), not hang the hook
                    log.exception("runtime hook request failed")
                    answer = _refusal(f"internal error in gpushare-node ({e}); see its log")
                try:
                    self.request.sendall(protocol.encode(answer))
                except OSError:
                    pass  # the hook gave up waiting; it refuses on its own

        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            self._server = socketserver.ThreadingUnixStreamServer(self.socket_path, Handler)
        finally:
            os.umask(old_umask)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.2,), name="hook-server", daemon=True
        )
        self._thread.start()
        log.info("runtime hook socket ready at %s", self.socket_path)

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


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
    fields = [value.get(k) for k in ("namespace", "pod", "container")]
    if not all(isinstance(f, str) and f for f in fields):
        return None  # partial identity: the runtime did not say; nothing to compare
    return ContainerRef(*fields)
