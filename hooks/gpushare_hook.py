"""``gpushare-hook [--socket PATH] [--run-dir DIR] [--runtime NAME] [--guard PATH] STAGE``.

The OCI runtime hook.

The runtime passes the container's state JSON on stdin (``id``, ``pid``, ``bundle``,
``annotations``); the hook reads ``<bundle>/config.json``. A state over
``MAX_STATE_BYTES``, or a config.json over ``MAX_CONFIG_BYTES`` or not a regular file, is
refused unread (exit 2), GPU container or not: what it asks for is unknown until read.

- ``createRuntime``: a container that asks for no GPU, claims no allocation and whose
  spec touches no GPU nor a path of the daemon's own
  (:func:`hooks.specfacts.touches_gpu`) exits 0 at once. Any other is sent to the
  daemon with its spec facts (mount paths with their real paths, the numbers of a
  bind-mounted device node; NVIDIA's dynamic majors from /proc/devices, which must be
  readable); exit 0 if allowed, else 1 with one line on stderr. A daemon that does not
  answer refuses the container (fail closed).
- ``poststop``: tells the daemon the container is gone; always exits 0 (the daemon
  also drops registrations of containers that stopped unseen).

``--run-dir`` is gpushare-node's run_dir (MPS directories in ``<run_dir>/mps``; default:
the socket's directory). ``--runtime`` (``containerd`` or ``cri-o``; podman counts as
CRI-O) names the runtime whose keys give the pod identity (:mod:`hooks.podidentity`);
without it either family is read and both must agree. ``--guard PATH`` (repeated) names a
path of the daemon's own besides its run_dir and socket: a container whose mounts show
one is sent to the daemon, which refuses it unless it is node-wide.

Exit codes: 0 allowed; 1 refused; 2 bad invocation or unreadable input (also a
refusal: the runtime stops the container either way).

It runs at every container creation, so start-up is kept short: the launcher
``nodemgr install`` writes starts Python with ``-I -S``; it imports no ``argparse`` or
``__future__``, and the socket code only to call the daemon. Run as a file it finds its
package next to this file.
"""

import os
import stat
import sys

if not __package__:  # run as a file (python3 -I -S .../hooks/gpushare_hook.py): no sys.path
    sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from hooks import gpuenv, specfacts, wirejson  # noqa: E402 (after the path above)

CREATE = "createRuntime"
POSTSTOP = "poststop"
MAX_STATE_BYTES = 256 * 1024
# A pod's spec is at most ~1.5 MiB in etcd; env from ConfigMaps adds up to 1 MiB each.
# Parsing this much takes ~0.1 s; a 300 MB config.json is refused unread.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
# A line per cgroup hierarchy, each path at most PATH_MAX (also the cap on /proc/devices).
MAX_CGROUP_BYTES = 128 * 1024
PROC_DEVICES = "/proc/devices"  # char and block majors by driver name
# hooks.podidentity.RUNTIMES, not imported for non-GPU containers (a test keeps them equal).
RUNTIMES = ("containerd", "cri-o")
USAGE = (
    "usage: gpushare-hook [--socket PATH] [--run-dir DIR] [--runtime {containerd,cri-o}] "
    "[--guard PATH ...] {createRuntime,poststop}"
)

DEFAULT_SOCKET = "/run/gpushare/hook.sock"
# mps/layout.py's MpsLayout.root under run_dir (a test keeps the two equal).
MPS_SUBDIR = "mps"
# The daemon answers from memory, one question to kubelet and one SQLite write.
TIMEOUT_SECONDS = 2.0


class Refusal(Exception):
    """Why the container must not start; exit status in ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    try:
        options = _parse_args(sys.argv[1:] if argv is None else argv)
        if options is None:
            print(USAGE)
            return 0
        state = _read_state(sys.stdin.buffer.read(MAX_STATE_BYTES + 1))
        if options["stage"] == POSTSTOP:
            _poststop(options["socket"], state)
            return 0
        return _create(options, state)
    except Refusal as e:
        # One line: the runtime passes it on into the pod's events (values in it escaped).
        from hooks.textsafe import one_line

        print(f"gpushare-hook: {one_line(str(e))}", file=sys.stderr)
        return e.code


def _parse_args(args: list[str]) -> dict | None:
    """{socket, run_dir, runtime (None: not given), guarded, stage}; None for --help."""
    parsed = _split_args(args)
    if parsed is None:
        return None
    values, guarded, stages = parsed
    if len(stages) != 1 or stages[0] not in (CREATE, POSTSTOP):
        raise Refusal(f"expected one stage, createRuntime or poststop (got {stages}); {USAGE}", 2)
    socket_path = values["--socket"]
    if not socket_path:
        raise Refusal(f"--socket needs a path; {USAGE}", code=2)
    run_dir = values["--run-dir"] or os.path.dirname(socket_path)
    if not os.path.isabs(run_dir):
        raise Refusal(f"--run-dir must be an absolute path (got {run_dir!r}); {USAGE}", code=2)
    runtime = values["--runtime"] or None
    if runtime is not None and runtime not in RUNTIMES:
        raise Refusal(f"--runtime must be containerd or cri-o (got {runtime!r}); {USAGE}", 2)
    if not all(os.path.isabs(path) for path in guarded):
        raise Refusal(f"--guard takes absolute paths (got {guarded!r}); {USAGE}", code=2)
    own = tuple(specfacts.normpath(p) for p in (run_dir, socket_path, *guarded))
    return {"socket": socket_path, "run_dir": run_dir, "runtime": runtime, "guarded": own,
            "stage": stages[0]}  # fmt: skip


def _split_args(args: list[str]) -> tuple[dict, list[str], list[str]] | None:
    """(the single-valued options, the --guard paths, the other arguments); None for
    --help. Options take ``--name VALUE`` or ``--name=VALUE``."""
    values = {"--socket": DEFAULT_SOCKET, "--run-dir": "", "--runtime": ""}
    guarded: list[str] = []
    stages = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            return None
        name, equals, value = arg.partition("=")
        known = name in values or name == "--guard"
        if known and not equals:
            if i + 1 == len(args):
                raise Refusal(f"{name} needs a value; {USAGE}", code=2)
            value, i = args[i + 1], i + 1
        if name == "--guard":
            guarded.append(value)
        elif known:
            values[name] = value
        elif arg.startswith("-"):
            raise Refusal(f"unknown option {arg!r}; {USAGE}", code=2)
        else:
            stages.append(arg)
        i += 1
    return values, guarded, stages


def _create(options: dict, state: dict) -> int:
    socket_path = options["socket"]
    mps_root = os.path.join(options["run_dir"], MPS_SUBDIR)
    config = _read_config(state["bundle"])
    try:
        env = gpuenv.env_from_list(specfacts.process_env(config))
        majors = _ProcMajors()
        facts = specfacts.read_facts(config, state["bundle"], majors)
    except (gpuenv.EnvError, specfacts.SpecError) as e:
        from hooks.textsafe import quote

        raise Refusal(f"container {quote(state['id'])}: {e}") from None
    _resolve_host_paths(facts)
    touches = specfacts.touches_gpu(facts, mps_root, options["guarded"], majors)
    if not gpuenv.needs_daemon(env) and touches is None:
        return 0
    annotations = {**_mapping(config.get("annotations")), **_mapping(state.get("annotations"))}
    from hooks import (
        podidentity,
        protocol,  # only containers touching GPUs talk to the daemon
    )

    found = podidentity.identity_keys(annotations)
    request = {
        "stage": CREATE,
        "container_id": state["id"],
        "pid": state.get("pid"),
        "env": env,
        "identity": _identity(found, options["runtime"]),
        "identity_annotations": found,
        "runtime": options["runtime"],
        "cgroup": _read_cgroup(state),
        "spec": facts,
    }
    data = protocol.encode(request)
    if len(data) > protocol.MAX_MESSAGE_BYTES:
        raise Refusal(
            f"refused container {state['id']}: the GPU facts of its spec (mounts, devices, "
            f"device rules) take {len(data)} bytes, over the {protocol.MAX_MESSAGE_BYTES} "
            "the daemon reads: give it fewer or shorter mounts"
        )
    try:
        answer = protocol.call(socket_path, data, TIMEOUT_SECONDS)
    except (OSError, protocol.ProtocolError) as e:
        raise Refusal(
            f"refused container {state['id']}: it asks for GPUs (or its spec touches them) "
            f"and the gpushare-node daemon did not answer at {socket_path} ({e}); GPU "
            "containers cannot start until it runs (check: systemctl status gpushare-node)"
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
        state = wirejson.loads(data.decode("utf-8"))
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
        config = wirejson.loads(data.decode("utf-8"))
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


class _ProcMajors(specfacts.HostMajors):
    def read(self) -> frozenset[int]:
        return _nvidia_majors()


def _nvidia_majors() -> frozenset[int]:
    """NVIDIA's char majors besides 195 from /proc/devices. Without them an nvidia-uvm
    node or rule cannot be told from any other, so an unreadable file refuses (exit 2)."""
    try:
        with open(PROC_DEVICES, "rb") as f:
            text = f.read(MAX_CGROUP_BYTES).decode("ascii", "replace")
    except OSError as e:
        raise Refusal(
            f"cannot read {PROC_DEVICES} ({e.strerror}): NVIDIA's device numbers on this "
            "host are unknown; the hook must see the host's /proc",
            code=2,
        ) from None
    return specfacts.nvidia_majors(text)


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


def _resolve_host_paths(facts: dict) -> None:
    """Add to each mount's host paths their real paths and the numbers of the char device
    nodes they name (a node's name says nothing). runc runs createRuntime hooks after the
    mounts, from the same paths in this mount namespace."""
    for mount in facts["mounts"]:
        for path in list(mount["sources"]):
            real = os.path.realpath(path)
            if real not in mount["sources"]:
                mount["sources"].append(real)
            try:
                info = os.stat(real)
            except OSError:
                continue  # gone or unreadable: its path is still checked
            if stat.S_ISCHR(info.st_mode):
                node = [os.major(info.st_rdev), os.minor(info.st_rdev)]
                if node not in mount["nodes"]:
                    mount["nodes"].append(node)


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _identity(found: dict[str, str], runtime: str | None) -> dict[str, str]:
    """The pod identity the runtime's keys give; {} for none, or when the annotations name
    two pods (the daemon judges the keys again and refuses, naming both)."""
    from hooks import podidentity

    try:
        return podidentity.resolve(found, runtime)
    except podidentity.IdentityConflict:
        return {}


if __name__ == "__main__":
    sys.exit(main())
