"""The daemon's end of the runtime hook socket (``<run_dir>/hook.sock``).

Translates :mod:`hooks.protocol` to calls on the
:class:`~nodemgr.enforcement.registry.ContainerRegistry` and back; it decides nothing. A
malformed request gets a refusal naming what is wrong. The pod identity is read again
here from the request's ``identity_annotations`` and ``runtime``, never taken from the
hook's ``identity``; a createRuntime request without them or without ``spec`` is
refused (fail closed: the hook and the daemon ship together).

The request must arrive whole within ``READ_TIMEOUT_SECONDS`` (in all, not per read), on
the budget of :mod:`nodemgr.common.unixserver`.
"""

from __future__ import annotations

import logging
import socket
import time

from hooks import podidentity, protocol
from hooks.gpuenv import GPU_ENV_NAMES
from hooks.specfacts import MAX_ENTRIES
from nodemgr.common.unixserver import UnixServer, refusal_reason
from nodemgr.domain.model import ContainerRef
from nodemgr.domain.podtie import runtime_identity, runtime_pod_uid
from nodemgr.domain.speccheck import DeviceFact, MountFact, RuleFact, SpecFacts
from nodemgr.enforcement.registry import ContainerRegistry

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 2.0
# Reading, kubelet's answer (its client's timeout is shorter) and one ledger write.
DEADLINE_SECONDS = 5.0
# A burst over it waits in the hook's retries, not here.
MAX_CONNECTIONS = 64
ANSWER_TIMEOUT_SECONDS = 1.0  # one short line to a waiting hook


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
            reason = refusal_reason(e)
            if reason is not None and not self.budget.was_cut(sock):  # a cut counts already
                self.budget.refuse(reason)
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
        identity, pod_uid, identity_problem = _identity(request)
        allowed, message = registry.admit(
            container_id,
            pid,
            _env(request.get("env")),
            identity,
            _string(request, "cgroup"),
            _spec(request.get("spec")),
            identity_problem=identity_problem,
            pod_uid=pod_uid,
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


def _identity(request: dict) -> tuple[ContainerRef | None, str | None, str | None]:
    """(pod identity, pod UID where the runtime gives it, why it is refused)."""
    claimed = request.get("identity") or {}
    if not isinstance(claimed, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in claimed.items()
    ):
        raise BadRequest("identity must map names to strings")
    found = request.get("identity_annotations")
    if found is None:
        raise BadRequest(_stale_hook("identity_annotations"))
    if not isinstance(found, dict) or not all(
        k in podidentity.KEYS and isinstance(v, str) for k, v in found.items()
    ):
        raise BadRequest(
            "identity_annotations must map the pod identity keys "
            f"({', '.join(podidentity.KEYS)}) to strings"
        )
    runtime = request.get("runtime")
    if runtime is not None and runtime not in podidentity.RUNTIMES:
        raise BadRequest(f"runtime must be null or one of {', '.join(podidentity.RUNTIMES)}")
    identity, problem = runtime_identity(found, runtime, claimed)
    pod_uid = runtime_pod_uid(found, runtime) if identity is not None else None
    return identity, pod_uid, problem


def _stale_hook(missing: str) -> str:
    return (
        f"{missing} missing: this gpushare-hook is older than the daemon; run `nodemgr "
        "install` again so the runtime runs the hook installed with gpushare-node"
    )


def _spec(value: object) -> SpecFacts:
    if value is None:
        raise BadRequest(_stale_hook("spec"))
    if not isinstance(value, dict):
        raise BadRequest("spec must be an object")
    lists = {}
    for name in ("mounts", "devices", "rules"):
        entries = value.get(name)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise BadRequest(f"spec.{name} must be a list of objects")
        if len(entries) > MAX_ENTRIES:
            raise BadRequest(f"spec.{name} has {len(entries)} entries, over {MAX_ENTRIES}")
        lists[name] = entries
    return SpecFacts(
        mounts=tuple(_mount(m) for m in lists["mounts"]),
        devices=tuple(_device(d) for d in lists["devices"]),
        rules=tuple(_rule(r) for r in lists["rules"]),
    )


def _mount(entry: dict) -> MountFact:
    sources, nodes = entry.get("sources"), entry.get("nodes")
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise BadRequest("spec.mounts[].sources must be a list of strings")
    if not isinstance(nodes, list) or not all(
        isinstance(n, list) and len(n) == 2 and all(_is_int(x) for x in n) for n in nodes
    ):
        raise BadRequest("spec.mounts[].nodes must be a list of [major, minor]")
    return MountFact(
        _string(entry, "destination"),
        tuple(sources),
        tuple((major, minor) for major, minor in nodes),
    )


def _device(entry: dict) -> DeviceFact:
    major, minor = entry.get("major"), entry.get("minor")
    if type(major) is not int or type(minor) is not int:  # not bool either
        raise BadRequest("spec.devices[].major and minor must be integers")
    return DeviceFact(_string(entry, "path"), _text(entry, "type"), major, minor)


def _rule(entry: dict) -> RuleFact:
    allow, major, minor = entry.get("allow"), entry.get("major"), entry.get("minor")
    if not isinstance(allow, bool):
        raise BadRequest("spec.rules[].allow must be true or false")
    if not all(n is None or _is_int(n) for n in (major, minor)):
        raise BadRequest("spec.rules[].major and minor must be integers or null")
    return RuleFact(allow, _text(entry, "type"), major, minor, _text(entry, "access"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(entry: dict, name: str) -> str:
    value = entry.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    return value
