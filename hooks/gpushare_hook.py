"""``gpushare-hook --socket PATH STAGE``: the OCI runtime hook.

The runtime passes the container's state JSON on stdin (``id``, ``pid``,
``bundle``, ``annotations``); the hook reads ``<bundle>/config.json``. Both are
read with a size cap: a state over ``MAX_STATE_BYTES``, or a config.json over
``MAX_CONFIG_BYTES`` or that is not a regular file, is refused without being read
whole (exit 2), whether or not the container asks for GPUs: what it asks for
cannot be known without reading it.

- ``createRuntime``: a container that asks for no GPU (and claims no
  gpushare allocation) exits 0 at once. Any other is sent to the daemon, which
  checks its GPU env against a live allocation and registers its cgroup;
  exit 0 if allowed, else exit 1 with one line on stderr. If the daemon cannot
  be reached the GPU container is refused (fail closed).
- ``poststop``: tells the daemon the container is gone; always exits 0 (the
  daemon also drops registrations of containers that stopped unseen).

Exit codes: 0 allowed; 1 refused; 2 bad invocation or unreadable input
(also a refusal: the runtime stops the container either way).

It runs at every container creation on the node, so start-up is kept short:
no argparse, and the socket code is imported only for GPU containers.
"""

from __future__ import annotations

import json
import os
import stat
import sys

from hooks import gpuenv

CREATE = "createRuntime"
POSTSTOP = "poststop"
MAX_STATE_BYTES = 256 * 1024
# A pod's spec is at most ~1.5 MiB in etcd; env from ConfigMaps adds up to 1 MiB each.
# Parsing this much takes ~0.1 s; a 300 MB config.json is refused unread.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
# A line per cgroup hierarchy, each path at most PATH_MAX.
MAX_CGROUP_BYTES = 128 * 1024
USAGE = "usage: gpushare-hook [--socket PATH] {createRuntime,poststop}"

DEFAULT_SOCKET = "/run/gpushare/hook.sock"
# The daemon answers from memory, one question to kubelet and one SQLite write; this
# bounds the whole call (a hung daemon, or one at its connection cap for that long).
TIMEOUT_SECONDS = 2.0

# Pod identity as the CRI runtimes write it into the OCI annotations.
_IDENTITY_KEYS = {
    "namespace": ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
    "pod": ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
    "container": ("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
}


class Refusal(Exception):
    """Why the container must not start; exit status in ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    try:
        socket_path, stage = _parse_args(sys.argv[1:] if argv is None else argv)
        if stage is None:
            print(USAGE)
            return 0
        state = _read_state(sys.stdin.buffer.read(MAX_STATE_BYTES + 1))
        if stage == POSTSTOP:
            _poststop(socket_path, state)
            return 0
        return _create(socket_path, state)
    except Refusal as e:
        print(f"gpushare-hook: {e}", file=sys.stderr)
        return e.code


def _parse_args(args: list[str]) -> tuple[str, str | None]:
    """(socket path, stage); stage None for --help."""
    socket_path, stages = DEFAULT_SOCKET, []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            return socket_path, None
        if arg == "--socket" and i + 1 < len(args):
            socket_path, i = args[i + 1], i + 2
            continue
        if arg.startswith("--socket="):
            socket_path = arg.partition("=")[2]
        elif arg.startswith("-"):
            raise Refusal(f"unknown option {arg!r}; {USAGE}", code=2)
        else:
            stages.append(arg)
        i += 1
    if len(stages) != 1 or stages[0] not in (CREATE, POSTSTOP):
        raise Refusal(f"expected one stage, createRuntime or poststop (got {stages}); {USAGE}", 2)
    if not socket_path:
        raise Refusal(f"--socket needs a path; {USAGE}", code=2)
    return socket_path, stages[0]


def _create(socket_path: str, state: dict) -> int:
    config = _read_config(state["bundle"])
    process = config.get("process") or {}
    try:
        env = gpuenv.env_from_list(process.get("env") or [])
    except gpuenv.EnvError as e:
        raise Refusal(f"container {state['id']}: {e}") from None
    if not gpuenv.needs_daemon(env):
        return 0
    annotations = {**(config.get("annotations") or {}), **(state.get("annotations") or {})}
    from hooks import protocol  # only GPU containers talk to the daemon

    request = {
        "stage": CREATE,
        "container_id": state["id"],
        "pid": state.get("pid"),
        "env": env,
        "identity": _identity(annotations),
        "cgroup": _read_cgroup(state),
    }
    try:
        answer = protocol.call(socket_path, request, TIMEOUT_SECONDS)
    except (OSError, protocol.ProtocolError) as e:
        raise Refusal(
            f"refused container {state['id']}: it asks for GPUs and the gpushare-node daemon "
            f"did not answer at {socket_path} ({e}); GPU containers cannot start until it "
            "runs (check: systemctl status gpushare-node)"
        ) from None
    if not answer["allowed"]:
        raise Refusal(answer["message"])
    return 0


def _poststop(socket_path: str, state: dict) -> None:
    from hooks import protocol

    try:
        protocol.call(
            socket_path,
            {"stage": POSTSTOP, "container_id": state["id"]},
            TIMEOUT_SECONDS,
        )
    except (OSError, protocol.ProtocolError):
        pass  # nothing to refuse; the daemon drops registrations of stopped containers


def _read_state(data: bytes) -> dict:
    if len(data) > MAX_STATE_BYTES:
        raise Refusal(f"the OCI state on stdin is over {MAX_STATE_BYTES} bytes", code=2)
    try:
        state = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(f"the OCI state on stdin is not JSON ({e})", code=2) from None
    if not isinstance(state, dict):
        raise Refusal("the OCI state on stdin is not a JSON object", code=2)
    if not isinstance(state.get("id"), str) or not state["id"]:
        raise Refusal("the OCI state on stdin has no container id", code=2)
    if not isinstance(state.get("bundle"), str):
        raise Refusal(f"the OCI state of container {state['id']} has no bundle", code=2)
    return state


def _read_config(bundle: str) -> dict:
    path = os.path.join(bundle, "config.json")
    try:
        # O_NONBLOCK: a FIFO put there must not hang the container's creation.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise Refusal(f"cannot read the container's {path}: {e}", code=2) from None
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Refusal(f"the container's {path} is not a regular file", code=2)
        if info.st_size > MAX_CONFIG_BYTES:
            raise Refusal(_too_big(path, info.st_size), code=2)
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise Refusal(f"cannot read the container's {path}: {e}", code=2) from None
    if len(data) > MAX_CONFIG_BYTES:  # it grew after fstat
        raise Refusal(_too_big(path, len(data)), code=2)
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(f"cannot read the container's {path}: {e}", code=2) from None
    if not isinstance(config, dict):
        raise Refusal(f"{path} is not a JSON object", code=2)
    return config


def _too_big(path: str, size: int) -> str:
    return (
        f"the container's {path} is over {MAX_CONFIG_BYTES} bytes ({size} or more): "
        "refused unread (gpushare-hook reads at most that much)"
    )


def _read_cgroup(state: dict) -> str:
    pid = state.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise Refusal(
            f"container {state['id']}: the OCI state has no pid (the hook must run at the "
            "createRuntime stage)",
            code=2,
        )
    path = f"/proc/{pid}/cgroup"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CGROUP_BYTES + 1)
    except OSError as e:
        raise Refusal(
            f"container {state['id']}: cannot read {path} ({e.strerror}); the "
            "hook must run in the runtime's PID namespace",
            code=2,
        ) from None
    if len(data) > MAX_CGROUP_BYTES:
        raise Refusal(f"container {state['id']}: {path} is over {MAX_CGROUP_BYTES} bytes", 2)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refusal(
            f"container {state['id']}: {path} is not UTF-8 (byte {data[e.start]:#04x} at "
            f"offset {e.start}: a cgroup named with it); it cannot be a container's cgroup",
            code=2,
        ) from None


def _identity(annotations: dict) -> dict[str, str]:
    identity = {}
    for field, keys in _IDENTITY_KEYS.items():
        for key in keys:
            value = annotations.get(key)
            if isinstance(value, str) and value:
                identity[field] = value
                break
    return identity


if __name__ == "__main__":
    sys.exit(main())
