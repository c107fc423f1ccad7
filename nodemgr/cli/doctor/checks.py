"""``nodemgr doctor``: what this node lacks for gpushare-node, and the fix for each.

One line per check, ``PASS|WARN|FAIL  <check>  <what was found>`` and, for WARN
and FAIL, ``— fix: <exact action>``; ``--json`` gives the same as a list of
``{check, status, detail, fix}``. Exit status: 0 when nothing FAILs, 1 when
something does, 2 when the config file itself is unusable (as every nodemgr
command and the daemon do; nothing else is checked then, since every other
check reads its paths from the config).

Each check is a thin probe (stat, connect, read a file) followed by a pure
verdict function (``*_result``) that turns what was found into a ``Result``;
the verdicts are what the unit tests pin. Every system location (/etc,
/usr/share, /sys, /proc and the paths named in the runtime's hook files) is
resolved under ``Host.root``, so tests build a fake node in a temporary
directory. Paths named in gpushare-node's config are used as they are: the
config is the admin's statement of where things are.

What it must not do: change anything. It reads files, connects to sockets,
initialises NVML to list the cards, opens the ledger read-only, asks the
daemon's status socket for its status document (as ``nodemgr status`` does),
sends its hook socket one ``poststop`` for a container ID no runtime can
produce (the daemon answers it from memory without writing or logging), and,
with ``kubernetes.enabled``, asks the API server with the daemon's credentials
(found as the daemon finds them) for this node and, per verb of
``nodemgr.kubernetes.adapter.API_PERMISSIONS``, a SelfSubjectAccessReview (what ``kubectl
auth can-i`` sends: the server answers it and stores nothing). It never
starts, stops, writes, creates or removes anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace

from hooks import protocol
from hooks.gpushare_hook import DEFAULT_SOCKET as HOOK_DEFAULT_SOCKET
from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.config.loading import config_error_line, load_settings
from nodemgr.config.schema import Settings
from nodemgr.errors import (
    ConfigError,
    InventoryError,
    KubeApiError,
    KubeCredentialsError,
    KubeNotFound,
    KubeUnavailable,
    LedgerError,
)
from nodemgr.inventory import Card, open_inventory
from nodemgr.status.server import query as query_status

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
_RANK = {PASS: 0, WARN: 1, FAIL: 2}

# MPS's per-client address-space isolation and active-thread percentage, which
# the quotas rest on, need Volta (7.0) or newer (shared/reference/mps.md,
# "Faults and limits"); before Volta a client's fault also kills the server.
MPS_MIN_COMPUTE_CAPABILITY = (7, 0)
CAP_NET_ADMIN = 12  # bit in /proc/PID/status CapEff (linux/capability.h)
HOOK_NAME = "gpushare-hook"
CREATE, POSTSTOP = protocol.CREATE, protocol.POSTSTOP
# The poststop probe: no runtime makes IDs like this (they are 64 hex digits),
# so the daemon finds nothing to unregister and writes nothing.
PROBE_CONTAINER_ID = "gpushare-doctor-probe"
# CRI-O and podman read both; a file in /etc replaces the same name in /usr/share.
OCI_HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
# Where `nodemgr install` puts the daemon's config (nodemgr.cli.install.steps.CONFIG_PATH; a
# sibling command module, so not imported: a test keeps the two equal).
INSTALLED_CONFIG = "/etc/gpushare/config.yaml"
NVIDIA_DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
KUBERNETES_CHECK = "Kubernetes API"
KUBERNETES_DISABLED = (
    "disabled: no pod annotations, node labels or events; the gpushare scheduler extender and "
    "kubectl inspect gpushare won't see this node's allocations"
)
_INSTALL_HOOK_FIX = (
    "`nodemgr install` writes the CRI-O/podman hooks into /etc/containers/oci/hooks.d; for "
    "containerd run `/etc/gpushare/containerd/make-base-spec > "
    "/etc/containerd/gpushare-base-spec.json`, set it as base_runtime_spec of the runc runtime "
    'in /etc/containerd/config.toml and restart containerd (README "Enforcement")'
)


@dataclass(frozen=True)
class Result:
    """One line of the report."""

    check: str
    status: str  # PASS, WARN or FAIL
    detail: str  # what was found
    fix: str | None = None  # the exact action; None for PASS


@dataclass(frozen=True)
class Host:
    """Where the node's system files are (tests: a fake tree) and how long to wait."""

    root: str = "/"
    search_path: str | None = None  # $PATH for mps.control_binary; None = this process's
    timeout_seconds: float = 1.0  # per socket probe

    def path(self, absolute: str) -> str:
        return os.path.join(self.root, absolute.lstrip("/"))


@dataclass(frozen=True)
class SocketProbe:
    """What connecting to a unix socket found.

    ``state``: ok, no_dir (its directory is missing), missing, not_socket,
    refused (a stale socket: nobody listens), denied, timeout, bad_answer
    (connected, but the answer was not the protocol's), error.
    """

    state: str
    error: str = ""


# --- the CLI -----------------------------------------------------------------------------


def add_parser(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check what this node needs for gpushare-node (changes nothing)",
        description="One line per check: PASS, WARN or FAIL with the fix. "
        "Exit 1 if any check FAILs, 2 if the config file is unusable.",
    )
    doctor.add_argument("--config", metavar="FILE", help="the daemon's config file")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(run=run)


def run(args, host: Host | None = None) -> int:
    host = host or Host()
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        results = [config_error_result(args.config, e)]
        code = 2
    else:
        results = run_checks(settings, args.config, host)
        code = 1 if any(r.status == FAIL for r in results) else 0
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(render(results))
    return code


def run_checks(settings: Settings, config_path: str | None, host: Host) -> list[Result]:
    installed = config_path is None and os.path.isfile(host.path(INSTALLED_CONFIG))
    results = [config_result(config_path, settings, installed), check_privileges(host)]
    results += check_gpus(settings, host)
    results.append(check_mps_binary(settings, host))
    results.append(
        kubelet_socket_result(
            "kubelet socket",
            os.path.join(settings.kubelet.device_plugin_dir, "kubelet.sock"),
            probe_socket(
                os.path.join(settings.kubelet.device_plugin_dir, "kubelet.sock"),
                host.timeout_seconds,
            ),
        )
    )
    results.append(
        kubelet_socket_result(
            "pod-resources socket",
            settings.kubelet.pod_resources_socket,
            probe_socket(settings.kubelet.pod_resources_socket, host.timeout_seconds),
        )
    )
    results.append(check_cgroups(host))
    results.append(check_runtime_hook(settings, host))
    results.append(check_daemon(settings, host))
    results.append(check_ledger(settings))
    results.append(check_kubernetes(settings, host))
    return results


def render(results: list[Result]) -> str:
    width = max(len(r.check) for r in results)
    lines = []
    for r in results:
        line = f"{r.status}  {r.check:<{width}}  {r.detail}"
        if r.fix:
            line += f" — fix: {r.fix}"
        lines.append(line)
    counts = {s: sum(r.status == s for r in results) for s in (FAIL, WARN, PASS)}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    if counts[FAIL]:
        summary += ": gpushare-node cannot work on this node until every FAIL is fixed"
    else:
        summary += ": nothing blocks gpushare-node here"
    return "\n".join(lines) + f"\n\n{summary}"


# --- config and privileges ---------------------------------------------------------------


def config_result(path: str | None, settings: Settings, installed_config: bool) -> Result:
    """``installed_config``: no --config was given, yet INSTALLED_CONFIG exists on this node."""
    valid = f"valid (node {settings.node_name}, GPU backend {settings.gpus.backend})"
    if path:
        return Result("config", PASS, f"{path}: {valid}")
    if installed_config:
        # The installed unit runs the daemon with that file: checking the defaults
        # instead would look at other paths than the daemon uses.
        return Result(
            "config",
            WARN,
            f"no --config: checking the built-in defaults, but {INSTALLED_CONFIG} exists "
            "(the config the installed gpushare-node.service uses)",
            f"nodemgr doctor --config {INSTALLED_CONFIG}",
        )
    return Result(
        "config",
        PASS,
        f"no --config: the built-in defaults are {valid}; give the daemon's --config FILE "
        "to check its settings",
    )


def config_error_result(path: str | None, err: ConfigError) -> Result:
    return Result(
        "config",
        FAIL,
        config_error_line(err).removeprefix("gpushare-node: "),
        f"correct {err.key} in {path} (`nodemgr check-config --config {path}` rechecks it); "
        "nothing else was checked",
    )


def check_privileges(host: Host) -> Result:
    try:
        with open(host.path("/proc/self/status"), encoding="utf-8") as f:
            euid, cap_eff = parse_proc_status(f.read())
    except OSError:
        euid, cap_eff = os.geteuid(), None
    return privileges_result(euid, cap_eff)


def parse_proc_status(text: str) -> tuple[int, int | None]:
    """(effective UID, effective capability mask or None) from /proc/PID/status."""
    euid, cap_eff = -1, None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if name == "Uid" and len(fields) >= 2:
            euid = int(fields[1])
        elif name == "CapEff" and fields:
            cap_eff = int(fields[0], 16)
    return euid, cap_eff


def privileges_result(euid: int, cap_eff: int | None) -> Result:
    net_admin = cap_eff is not None and bool(cap_eff >> CAP_NET_ADMIN & 1)
    if euid == 0 and net_admin:
        return Result("privileges", PASS, "root, with CAP_NET_ADMIN (as gpushare-node must run)")
    if euid == 0:
        return Result(
            "privileges",
            WARN,
            "root without CAP_NET_ADMIN: gpushare-node run like this gets no netlink process "
            "events; its watchdog then relies on the periodic scan alone",
            "run gpushare-node with CAP_NET_ADMIN (not in a capability-restricted container)",
        )
    return Result(
        "privileges",
        WARN,
        f"not root (uid {euid}): doctor cannot probe root-only sockets; gpushare-node must run "
        "as root (NVML compute modes, MPS mounts, CAP_NET_ADMIN for netlink process events)",
        "run `sudo nodemgr doctor`; run gpushare-node as root",
    )


# --- GPUs --------------------------------------------------------------------------------


def check_gpus(settings: Settings, host: Host) -> list[Result]:
    driver = read_driver_version(host)
    try:
        inventory = open_inventory(settings.gpus)
        try:
            cards = inventory.cards()
        finally:
            inventory.close()
    except InventoryError as e:
        return [gpus_result(settings.gpus.backend, None, str(e), driver)]
    results = [gpus_result(settings.gpus.backend, cards, None, driver)]
    if settings.gpus.backend == "nvml":  # simulated cards have no real facts to check
        results += [card_result(card, settings.mps.enabled) for card in cards]
    return results


def read_driver_version(host: Host) -> str | None:
    """The loaded kernel module's version from /proc/driver/nvidia/version, or None."""
    try:
        with open(host.path(NVIDIA_DRIVER_VERSION_FILE), encoding="utf-8") as f:
            return parse_driver_version(f.read())
    except OSError:
        return None


def parse_driver_version(text: str) -> str | None:
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024"
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            for word in line.split():
                if word[:1].isdigit() and "." in word:
                    return word
    return None


def gpus_result(
    backend: str, cards: tuple[Card, ...] | None, error: str | None, driver: str | None
) -> Result:
    if backend == "simulated":
        if cards is None:
            return Result("GPUs", FAIL, f"simulated backend: {error}", "correct gpus.simulated")
        return Result(
            "GPUs",
            WARN,
            f"simulated: not a real GPU node ({_card_list(cards)} from gpus.simulated.devices; "
            "compute capability and MIG not checked)",
            "on a GPU node set gpus.backend: nvml (the default)",
        )
    if cards is None:
        problem = _without_nvml_hint(error or "NVML failed")
        if driver is None:
            return Result(
                "GPUs",
                FAIL,
                f"{problem}; no NVIDIA kernel module loaded ({NVIDIA_DRIVER_VERSION_FILE} absent)",
                "install the NVIDIA driver and load it (`modprobe nvidia`; `nvidia-smi` must "
                "list the cards); on a machine without GPUs set gpus.backend: simulated",
            )
        return Result(
            "GPUs",
            FAIL,
            f"{problem}; the kernel module {driver} is loaded",
            f"install the driver's user-space libraries of the same version {driver} "
            "(libnvidia-ml.so.1; `nvidia-smi` must list the cards), or run as root if "
            "permission was denied",
        )
    driver_text = f"driver {driver}, " if driver else ""
    if not cards:
        return Result(
            "GPUs",
            FAIL,
            f"NVML works ({driver_text}no cards): nothing to share",
            "check `nvidia-smi -L` lists the cards (not passed through to a VM, not disabled)",
        )
    return Result("GPUs", PASS, f"NVML: {driver_text}{_card_list(cards)}")


def _card_list(cards: Iterable[Card]) -> str:
    cards = list(cards)
    listed = ", ".join(f"GPU{c.index} {c.name} {c.memory_mib} MiB" for c in cards)
    return f"{len(cards)} card{'s' if len(cards) != 1 else ''}: {listed}"


def _without_nvml_hint(message: str) -> str:
    """The NVML backend's problem without its generic driver hint (the fix says it better)."""
    cut = message.find(": is the NVIDIA driver installed")
    return message[:cut] if cut > 0 else message


def card_result(card: Card, mps_enabled: bool) -> Result:
    """Compute capability (MPS needs >= 7.0) and MIG mode of one real card."""
    name = f"GPU{card.index}"
    found = [card.name]
    problems: list[tuple[str, str, str]] = []  # (status, text, fix)
    capability = _capability(card.compute_capability)
    if mps_enabled:
        if capability is None:
            problems.append(
                (
                    WARN,
                    f"compute capability unknown (NVML reported {card.compute_capability!r}); "
                    "MPS limits need >= 7.0",
                    f"check `nvidia-smi -i {card.index} --query-gpu=compute_cap --format=csv`; "
                    "below 7.0 set mps.enabled: false",
                )
            )
        elif capability < MPS_MIN_COMPUTE_CAPABILITY:
            problems.append(
                (
                    FAIL,
                    f"compute capability {card.compute_capability} < 7.0: MPS before Volta has "
                    "no per-client address-space isolation or active-thread percentage, which "
                    "the quotas rely on (shared/reference/mps.md)",
                    "set mps.enabled: false (shared containers then get env quotas only) or "
                    "use cards of compute capability 7.0 or newer",
                )
            )
        else:
            found.append(f"compute capability {card.compute_capability} (MPS needs >= 7.0)")
    elif card.compute_capability:
        found.append(f"compute capability {card.compute_capability} (MPS off)")
    if card.mig_enabled:
        problems.append(
            (
                WARN,
                "MIG mode is on: gpushare-node does not share MIG cards (CUDA needs a MIG "
                "instance, not the whole card's UUID, and MIG and MPS are not combined here)",
                f"disable MIG: `nvidia-smi -i {card.index} -mig 0`, then reset the card",
            )
        )
    elif card.mig_enabled is False:
        found.append("MIG off")
    if not problems:
        return Result(name, PASS, ", ".join(found))
    status = max((p[0] for p in problems), key=_RANK.__getitem__)
    return Result(
        name,
        status,
        f"{card.name}: " + "; ".join(p[1] for p in problems),
        "; ".join(p[2] for p in problems),
    )


def _capability(text: str | None) -> tuple[int, int] | None:
    major, dot, minor = (text or "").partition(".")
    if dot and major.isdigit() and minor.isdigit():
        return int(major), int(minor)
    return None


# --- MPS ---------------------------------------------------------------------------------


def check_mps_binary(settings: Settings, host: Host) -> Result:
    binary = settings.mps.control_binary
    if not settings.mps.enabled:
        return mps_binary_result(False, binary, None, None, False, settings.gpus.backend)
    if os.path.isabs(binary):
        if not os.path.exists(binary):
            problem = "does not exist"
        elif not os.path.isfile(binary):
            problem = "is not a file"
        elif not os.access(binary, os.X_OK):
            problem = "is not executable"
        else:
            problem = None
        found = None if problem else binary
    else:
        found = shutil.which(binary, path=host.search_path)
        problem = None if found else "is not in $PATH"
    return mps_binary_result(
        True, binary, found, problem, bool(found) and _is_script(found), settings.gpus.backend
    )


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def mps_binary_result(
    enabled: bool,
    binary: str,
    found: str | None,
    problem: str | None,
    is_script: bool,
    backend: str,
) -> Result:
    name = "MPS control binary"
    if not enabled:
        return Result(name, PASS, "mps.enabled: false: MPS not used (env quotas only)")
    if found is None:
        return Result(
            name,
            FAIL,
            f"{binary} {problem}: no card can be shared with MPS limits",
            "install the NVIDIA driver utilities that ship nvidia-cuda-mps-control and set "
            "mps.control_binary to its absolute path (the daemon's $PATH under systemd is not "
            "your shell's), or set mps.enabled: false (env quotas only)",
        )
    shown = found if found == binary else f"{binary} → {found}"
    if is_script and backend == "nvml":
        # NVIDIA ships an ELF binary; a script here is most likely the test stand-in
        # copied with a simulated config, which would make real cards look healthy.
        return Result(
            name,
            WARN,
            f"{shown} is a script, not NVIDIA's binary (the test stand-in?) on a real GPU node",
            "set mps.control_binary to NVIDIA's nvidia-cuda-mps-control",
        )
    if is_script:
        return Result(name, PASS, f"{shown} (a script: the stand-in, fine with simulated GPUs)")
    return Result(name, PASS, shown)


# --- sockets -----------------------------------------------------------------------------


def probe_socket(path: str, timeout: float) -> SocketProbe:
    """Connect to a unix stream socket and close at once."""
    found = _stat_socket(path)
    if found is not None:
        return found
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            return _connect_error(e)
    return SocketProbe("ok")


def probe_hook_socket(path: str, timeout: float) -> SocketProbe:
    """Ask the daemon on its hook socket for a no-op ``poststop``: proves it answers."""
    found = _stat_socket(path)
    if found is not None:
        return found
    try:
        answer = protocol.call(
            path, {"stage": POSTSTOP, "container_id": PROBE_CONTAINER_ID}, timeout
        )
    except protocol.ProtocolError as e:
        return SocketProbe("bad_answer", str(e))
    except OSError as e:
        return _connect_error(e)
    if not answer["allowed"]:
        return SocketProbe("bad_answer", answer["message"])
    return SocketProbe("ok")


def _stat_socket(path: str) -> SocketProbe | None:
    """The probe's answer when there is no socket to connect to, else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return SocketProbe("missing" if os.path.isdir(os.path.dirname(path)) else "no_dir")
    except PermissionError as e:
        return SocketProbe("denied", e.strerror or str(e))
    except OSError as e:
        return SocketProbe("error", e.strerror or str(e))
    return None if stat.S_ISSOCK(mode) else SocketProbe("not_socket")


def _connect_error(e: OSError) -> SocketProbe:
    if isinstance(e, ConnectionRefusedError):
        return SocketProbe("refused")
    if isinstance(e, PermissionError):
        return SocketProbe("denied", e.strerror or str(e))
    if isinstance(e, TimeoutError):
        return SocketProbe("timeout")
    return SocketProbe("error", e.strerror or str(e))


_KUBELET_SOCKETS = {
    # check name: (config key, where it is under kubelet's --root-dir, why it matters)
    "kubelet socket": (
        "kubelet.device_plugin_dir",
        "DIR/device-plugins",
        "gpushare-node cannot register its resources, so pods asking for them stay Pending",
    ),
    "pod-resources socket": (
        "kubelet.pod_resources_socket",
        "DIR/pod-resources/kubelet.sock",
        "the reconcile is skipped, so allocations of deleted pods are never released",
    ),
}


def kubelet_socket_result(check: str, path: str, probe: SocketProbe) -> Result:
    key, under_root_dir, consequence = _KUBELET_SOCKETS[check]
    start_fix = (
        f"is kubelet running? `systemctl status kubelet`; if kubelet runs with "
        f"--root-dir DIR, set {key}: {under_root_dir}"
    )
    state = probe.state
    if state == "ok":
        return Result(check, PASS, f"kubelet listens at {path}")
    if state == "denied":
        return Result(
            check, WARN, f"{path}: permission denied; not checked", "run `sudo nodemgr doctor`"
        )
    if state == "no_dir":
        found = f"no directory {os.path.dirname(path)}: kubelet is not installed or uses another "
        found += "--root-dir"
        fix = start_fix
    elif state == "missing":
        found, fix = f"no socket at {path}: kubelet is not running", start_fix
    elif state == "refused":
        found = f"{path} is a stale socket (nobody listens): kubelet is not running"
        fix = "start kubelet (`systemctl restart kubelet`); it recreates the socket"
    elif state == "not_socket":
        found = f"{path} exists but is not a socket"
        fix = f"correct {key}, or remove the file and restart kubelet (`systemctl restart kubelet`)"
    elif state == "timeout":
        found = f"{path} accepts no connection within the timeout: kubelet hung?"
        fix = "look at `journalctl -u kubelet` and restart kubelet"
    else:
        found, fix = f"{path}: {probe.error or state}", start_fix
    return Result(check, FAIL, f"{found}; {consequence}", fix)


# --- cgroups -----------------------------------------------------------------------------


def check_cgroups(host: Host) -> Result:
    base = host.path("/sys/fs/cgroup")
    if os.path.isfile(os.path.join(base, "cgroup.controllers")):
        layout = "v2"
    elif os.path.isfile(os.path.join(base, "unified", "cgroup.controllers")):
        layout = "hybrid"
    else:
        layout = "v1" if _v1_hierarchies(base) else "none"
    return cgroup_result(layout, _v1_hierarchies(base))


def _v1_hierarchies(base: str) -> list[str]:
    # The controllers the watchdog can key a container by (containercheck.container_cgroup).
    return [h for h in ("memory", "pids") if os.path.isfile(os.path.join(base, h, "cgroup.procs"))]


def cgroup_result(layout: str, v1: list[str]) -> Result:
    if layout == "v2":
        return Result("cgroups", PASS, "cgroup v2 (unified) at /sys/fs/cgroup")
    if layout == "hybrid":
        return Result(
            "cgroups",
            PASS,
            "hybrid: v1 controllers and v2 at /sys/fs/cgroup/unified; containers are keyed by "
            f"their unified cgroup, else their v1 {' or '.join(v1) or 'memory'} cgroup "
            "(the hook and watchdog support v1 and v2)",
        )
    if layout == "v1":
        return Result(
            "cgroups",
            PASS,
            f"cgroup v1 ({', '.join(v1)} hierarchies); the hook and watchdog support v1 and v2",
        )
    return Result(
        "cgroups",
        FAIL,
        "no cgroup hierarchy mounted at /sys/fs/cgroup: the hook cannot tell one container's "
        "processes from another's and refuses GPU containers",
        "mount cgroup v2: `mount -t cgroup2 none /sys/fs/cgroup` (systemd does it at boot)",
    )


# --- the runtime hook --------------------------------------------------------------------


@dataclass(frozen=True)
class HookEntry:
    """One gpushare-hook entry a container runtime will run."""

    source: str  # the file it is configured in
    stage: str  # OCI stage: createRuntime, poststop, ...
    path: str  # the executable the runtime runs
    args: tuple[str, ...]
    executable: bool  # path is an executable file on this node
    always: bool = True  # CRI-O's when.always; containerd's base spec applies to every container

    @property
    def socket(self) -> str:
        """The daemon socket the hook will call (its --socket, else its default)."""
        args = list(self.args)
        if "--socket" in args[:-1]:
            return args[args.index("--socket") + 1]
        return HOOK_DEFAULT_SOCKET


@dataclass
class RuntimeHooks:
    """What one container runtime's configuration says about gpushare-hook."""

    runtime: str  # "CRI-O/podman" or "containerd"
    configured: bool  # the runtime's config location exists on this node
    entries: list[HookEntry] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (status, text)


def is_gpushare_hook(hook: dict) -> bool:
    args = hook.get("args") or []
    names = [hook.get("path"), args[0] if isinstance(args, list) and args else None]
    return any(isinstance(n, str) and os.path.basename(n) == HOOK_NAME for n in names)


def oci_hook_entries(source: str, document: object, executable) -> list[HookEntry]:
    """The gpushare-hook entries of one CRI-O/podman hooks.d file (schema 1.0.0).

    ``executable(path) -> bool`` says whether the hook's path can run here.
    Raises ValueError when a file that names gpushare-hook is not a valid hook file.
    """
    if not isinstance(document, dict) or not isinstance(document.get("hook"), dict):
        raise ValueError("not an OCI hook file: no hook object")
    hook = document["hook"]
    if not is_gpushare_hook(hook):
        return []
    stages = document.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ValueError("no stages list")
    if not isinstance(hook.get("path"), str):
        raise ValueError("hook.path is not a string")
    when = document.get("when")
    always = isinstance(when, dict) and when.get("always") is True
    args = tuple(str(a) for a in hook.get("args") or [])
    return [
        HookEntry(source, str(stage), hook["path"], args, executable(hook["path"]), always)
        for stage in stages
    ]


def spec_hook_entries(source: str, spec: object, executable) -> list[HookEntry]:
    """The gpushare-hook entries of an OCI runtime spec (containerd's base_runtime_spec)."""
    if not isinstance(spec, dict):
        raise ValueError("not a JSON object")
    hooks = spec.get("hooks") or {}
    if not isinstance(hooks, dict):
        raise ValueError("hooks is not an object")
    entries = []
    for stage, stage_hooks in hooks.items():
        for hook in stage_hooks if isinstance(stage_hooks, list) else []:
            if isinstance(hook, dict) and is_gpushare_hook(hook) and "path" in hook:
                args = tuple(str(a) for a in hook.get("args") or [])
                entries.append(
                    HookEntry(source, stage, hook["path"], args, executable(hook["path"]))
                )
    return entries


def containerd_base_specs(config: dict) -> list[tuple[str, str | None, bool]]:
    """(runtime name, base_runtime_spec or None, is the default runtime) of every CRI runtime.

    Walks the whole document, so config version 2 (``io.containerd.grpc.v1.cri``)
    and 3 (``io.containerd.cri.v1.runtime``) are both read.
    """
    found = []

    def walk(table: dict) -> None:
        runtimes = table.get("runtimes")
        if isinstance(runtimes, dict):
            default = table.get("default_runtime_name", "runc")
            for name, runtime in runtimes.items():
                if isinstance(runtime, dict):
                    found.append((name, runtime.get("base_runtime_spec") or None, name == default))
        for key, value in table.items():
            if isinstance(value, dict) and key != "runtimes":
                walk(value)

    walk(config)
    return found


def check_runtime_hook(settings: Settings, host: Host) -> Result:
    return runtime_hook_result([_crio_hooks(host), _containerd_hooks(host)], settings.hook_socket)


def _executable_under(host: Host):
    def executable(path: str) -> bool:
        real = host.path(path)
        return os.path.isabs(path) and os.path.isfile(real) and os.access(real, os.X_OK)

    return executable


def _crio_hooks(host: Host) -> RuntimeHooks:
    found = RuntimeHooks("CRI-O/podman", configured=False)
    files: dict[str, str] = {}  # name -> path; /etc (listed last) replaces /usr/share
    for directory in OCI_HOOKS_DIRS:
        real = host.path(directory)
        if not os.path.isdir(real):
            continue
        found.configured = True
        for name in sorted(os.listdir(real)):
            if name.endswith(".json"):
                files[name] = os.path.join(directory, name)
    for _name, path in sorted(files.items()):
        try:
            with open(host.path(path), encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            found.problems.append((WARN, f"{path}: cannot read ({e.strerror})"))
            continue
        if HOOK_NAME not in text:
            continue  # another product's hook: none of our business
        try:
            found.entries += oci_hook_entries(path, json.loads(text), _executable_under(host))
        except ValueError as e:
            found.problems.append((FAIL, f"{path} names {HOOK_NAME} but is invalid ({e})"))
    return found


def _containerd_hooks(host: Host) -> RuntimeHooks:
    found = RuntimeHooks("containerd", configured=os.path.isfile(host.path(CONTAINERD_CONFIG)))
    if not found.configured:
        return found
    try:
        with open(host.path(CONTAINERD_CONFIG), "rb") as f:
            config = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        found.problems.append((WARN, f"{CONTAINERD_CONFIG}: cannot read ({e})"))
        return found
    for runtime, spec_path, default in containerd_base_specs(config):
        if spec_path is None:
            continue
        source = f"{spec_path} (base_runtime_spec of runtime {runtime})"
        try:
            with open(host.path(spec_path), encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            status = FAIL if default else WARN
            found.problems.append(
                (status, f"{source}: cannot read ({getattr(e, 'strerror', None) or e})")
            )
            continue
        try:
            entries = spec_hook_entries(source, spec, _executable_under(host))
        except ValueError as e:
            found.problems.append((FAIL if default else WARN, f"{source}: {e}"))
            continue
        if default:
            found.entries += entries
        elif entries:
            found.problems.append(
                (WARN, f"{source} has the hooks, but pods use the default runtime")
            )
    return found


def hook_entry_problems(entry: HookEntry, hook_socket: str) -> list[tuple[str, str]]:
    problems = []
    if not entry.executable:
        problems.append(
            (
                FAIL,
                f"{entry.source}: {entry.path} is not an executable file (the runtime cannot "
                "run the hook: container creation fails or the hook is ignored)",
            )
        )
    if entry.socket != hook_socket:
        problems.append(
            (
                FAIL,
                f"{entry.source}: the hook calls {entry.socket}, but this config's daemon "
                f"serves {hook_socket} (GPU containers would be refused)",
            )
        )
    if not entry.always:
        problems.append(
            (
                WARN,
                f"{entry.source}: when.always is not true: containers its conditions miss "
                "are not checked",
            )
        )
    return problems


def runtime_hook_result(runtimes: list[RuntimeHooks], hook_socket: str) -> Result:
    name = "runtime hook"
    installed, problems, notes = [], [], []
    for rt in runtimes:
        problems += [(s, f"{rt.runtime}: {t}") for s, t in rt.problems]
        creates = [e for e in rt.entries if e.stage == CREATE]
        if not creates:
            if rt.configured:
                notes.append(rt.runtime)
            continue
        for entry in rt.entries:
            problems += [
                (s, f"{rt.runtime}: {t}") for s, t in hook_entry_problems(entry, hook_socket)
            ]
        stages = sorted({e.stage for e in rt.entries})
        if POSTSTOP not in stages:
            problems.append(
                (
                    WARN,
                    f"{rt.runtime}: no poststop hook (stopped containers stay registered until "
                    "the daemon sees their init process gone)",
                )
            )
        installed.append(
            f"{rt.runtime}: {creates[0].path} ({', '.join(stages)}; socket {creates[0].socket})"
        )
    if not installed:
        places = ", ".join(OCI_HOOKS_DIRS) + f", or a base_runtime_spec in {CONTAINERD_CONFIG}"
        detail = f"containers are not checked at creation: no {HOOK_NAME} in {places}"
        if problems:
            detail += "; " + "; ".join(t for _, t in problems)
        return Result(name, FAIL, detail, _INSTALL_HOOK_FIX)
    for runtime in notes:
        problems.append(
            (
                WARN,
                f"{runtime} is configured here without {HOOK_NAME}: if kubelet uses it, its "
                "containers are not checked",
            )
        )
    detail = "; ".join(installed)
    if not problems:
        return Result(name, PASS, detail)
    status = max((s for s, _ in problems), key=_RANK.__getitem__)
    fix = (
        f"make every hook entry run an executable {HOOK_NAME} with --socket {hook_socket} "
        "(or set enforcement.hook_socket to the hook's socket); " + _INSTALL_HOOK_FIX
    )
    return Result(name, status, detail + "; " + "; ".join(t for _, t in problems), fix)


# --- the daemon and its ledger -----------------------------------------------------------


def check_daemon(settings: Settings, host: Host) -> Result:
    hook = probe_hook_socket(settings.hook_socket, host.timeout_seconds)
    status, document = probe_status_socket(settings.status_socket, host.timeout_seconds)
    return daemon_result(settings.hook_socket, hook, settings.status_socket, status, document)


def probe_status_socket(path: str, timeout: float) -> tuple[SocketProbe, dict | None]:
    """Ask the daemon for its status document (what ``nodemgr status`` shows)."""
    found = _stat_socket(path)
    if found is not None:
        return found, None
    try:
        return SocketProbe("ok"), query_status(path, timeout)
    except protocol.ProtocolError as e:
        return SocketProbe("bad_answer", str(e)), None
    except OSError as e:
        return _connect_error(e), None


def daemon_result(
    hook_path: str,
    hook: SocketProbe,
    status_path: str,
    status: SocketProbe,
    document: dict | None,
) -> Result:
    name = "gpushare-node"
    start = (
        "start it: `systemctl enable --now gpushare-node` (after `nodemgr install`) or "
        "`gpushare-node --config FILE`; if it runs, give doctor the same --config"
    )
    down = "while it is down the hook refuses GPU containers (fail closed)"
    if hook.state == "denied":
        return Result(
            name, WARN, f"{hook_path}: permission denied; not checked", "run `sudo nodemgr doctor`"
        )
    if hook.state in ("missing", "no_dir"):
        return Result(name, FAIL, f"not running: no hook socket at {hook_path}; {down}", start)
    if hook.state == "refused":
        return Result(
            name,
            FAIL,
            f"not running: {hook_path} is a stale socket (nobody listens); {down}",
            start,
        )
    if hook.state == "timeout":
        return Result(
            name,
            FAIL,
            f"{hook_path} does not answer within the timeout: gpushare-node hung?; {down}",
            "look at `journalctl -u gpushare-node` and restart it",
        )
    if hook.state != "ok":
        return Result(
            name,
            FAIL,
            f"{hook_path}: {hook.error or hook.state} (is this gpushare-node's hook socket?)",
            "check enforcement.hook_socket and run_dir match the daemon's config; restart it",
        )
    answering = f"answers on {hook_path}"
    if status.state == "denied":
        return Result(name, PASS, f"{answering}; status socket {status_path} not readable by you")
    if status.state != "ok" or document is None:
        found = "absent" if status.state in ("missing", "no_dir") else status.error or status.state
        return Result(
            name,
            WARN,
            f"{answering}, but its status socket {status_path} is {found}: "
            "`nodemgr status` cannot reach it",
            "give doctor the daemon's --config (status.socket); restart gpushare-node if it "
            "predates the status socket",
        )
    daemon = document.get("daemon") or {}
    who = f"running (pid {daemon.get('pid', '?')}, version {daemon.get('version', '?')})"
    if daemon.get("ready"):
        return Result(
            name, PASS, f"{who}, ready: registered with kubelet, MPS healthy; {answering}"
        )
    why = []
    if not daemon.get("registered"):
        why.append("not registered with kubelet")
    why += [
        f"GPU{gpu.get('index')}: {gpu.get('problem')}"
        for gpu in document.get("gpus") or []
        if gpu.get("healthy") is False
    ]
    return Result(
        name,
        WARN,
        f"{who} but not ready: {'; '.join(why) or 'MPS not healthy yet'}; {answering}",
        "see `nodemgr status` and `journalctl -u gpushare-node`; fix the kubelet and MPS "
        "lines above",
    )


def check_ledger(settings: Settings) -> Result:
    state_dir = settings.state_dir
    if not os.path.exists(os.path.join(state_dir, LEDGER_FILE)):
        return ledger_result(state_dir, os.path.isdir(state_dir), None, None)
    try:
        ledger = Ledger(state_dir, read_only=True)
        try:
            counts = (len(ledger.load()), len(ledger.load_registrations()))
        finally:
            ledger.close()
    except LedgerError as e:
        return ledger_result(state_dir, True, None, str(e))
    return ledger_result(state_dir, True, counts, None)


def ledger_result(
    state_dir: str, dir_exists: bool, counts: tuple[int, int] | None, error: str | None
) -> Result:
    path = os.path.join(state_dir, LEDGER_FILE)
    if error is not None:
        problem, _, recovery = error.partition("; to recover, ")
        return Result(
            "ledger", FAIL, problem, recovery or "see the message; gpushare-node will not start"
        )
    if counts is None:
        where = "" if dir_exists else f" (state_dir {state_dir} does not exist)"
        return Result(
            "ledger",
            WARN,
            f"no ledger yet at {path}{where}: gpushare-node has not run with this state_dir",
            "start gpushare-node; if it already runs, give doctor its --config (state_dir)",
        )
    allocations, containers = counts
    return Result(
        "ledger",
        PASS,
        f"{path} opens read-only: {allocations} allocation(s), {containers} registered "
        "container(s)",
    )


# --- Kubernetes --------------------------------------------------------------------------


@dataclass(frozen=True)
class KubeProbe:
    """What doctor's requests to the API server found (the input of ``kubernetes_result``)."""

    credentials: str  # where they came from: Credentials.describe()
    server: str
    node_name: str
    node: str | None = None  # found, missing; None: not known (the GET failed)
    node_error: str | None = None  # why the GET of the node was refused (HTTP 403)
    error: str | None = None  # the request that failed and why, when one did
    error_status: int | None = None  # its HTTP status; None when there was no answer
    unavailable: bool = False  # no answer (refused, timeout, TLS), 5xx or 429
    checked: tuple[tuple[str, str, str], ...] = ()  # (group, resource, verb) reviewed
    denied: tuple[tuple[str, str, str], ...] = ()  # those RBAC does not allow


def check_kubernetes(settings: Settings, host: Host) -> Result:
    """Credentials (as the daemon finds them), the API server, this node, the adapter's RBAC."""
    kubernetes = settings.kubernetes
    if not kubernetes.enabled:
        return kubernetes_disabled_result()
    # Imported here: the kubernetes client takes half a second to load, which
    # every other nodemgr command would pay.
    from nodemgr.kubernetes import adapter as kube
    from nodemgr.kubernetes import client as kube_client

    try:
        credentials = kube_client.find_credentials(
            kubernetes.kubeconfig,
            service_account_dir=host.path(kube_client.SERVICE_ACCOUNT_DIR),
        )
        client = kube_client.CommandClient(credentials, kubernetes.request_timeout_seconds)
    except KubeCredentialsError as e:
        return kubernetes_credentials_result(
            kube_client.credentials_problem(str(e)), kube_client.CREDENTIALS_FIX
        )
    with client:
        return kubernetes_result(probe_kubernetes(client, settings.node_name, kube.API_PERMISSIONS))


def probe_kubernetes(client, node_name: str, permissions) -> KubeProbe:
    """GET this node, then one SelfSubjectAccessReview per verb of ``permissions``.

    ``client``: a ``kube_client.CommandClient``; ``permissions``: (group,
    resource, verbs) as ``nodemgr.kubernetes.adapter.API_PERMISSIONS``. Stops at the first
    request that gets no usable answer.
    """
    found = KubeProbe(client.credentials.describe(), client.server, node_name)
    try:
        client.read_node(node_name)
        node = "found"
    except KubeNotFound:
        node = "missing"
    except KubeApiError as e:
        if e.status != 403:  # 403: RBAC, which the reviews below name exactly
            return _failed(found, e)
        node, found = None, replace(found, node_error=str(e))
    checked, denied = [], []
    for group, resource, verbs in permissions:
        # The adapter reads and patches only its own Node: ask about that one.
        name = node_name if resource.partition("/")[0] == "nodes" else ""
        for verb in verbs:
            try:
                allowed, _ = client.can_i(verb, group, resource, name)
            except KubeApiError as e:
                return _failed(found, e, "cannot review RBAC: ")
            checked.append((group, resource, verb))
            if not allowed:
                denied.append((group, resource, verb))
    return replace(found, node=node, checked=tuple(checked), denied=tuple(denied))


def _failed(probe: KubeProbe, error: KubeApiError, prefix: str = "") -> KubeProbe:
    return replace(
        probe,
        error=prefix + str(error),
        error_status=error.status,
        unavailable=isinstance(error, KubeUnavailable),
    )


def kubernetes_disabled_result() -> Result:
    return Result(
        KUBERNETES_CHECK,
        WARN,
        KUBERNETES_DISABLED,
        "set kubernetes.enabled: true and give gpushare-node credentials: kubernetes.kubeconfig "
        "naming its service account's kubeconfig, made as deploy/README.md says",
    )


def kubernetes_credentials_result(problem: str, fix: str) -> Result:
    """``problem``: why there are no usable credentials (find_credentials, the loader)."""
    return Result(
        KUBERNETES_CHECK,
        FAIL,
        f"kubernetes.enabled, but {problem}: gpushare-node would run as a plain device plugin "
        "(no pod annotations, node labels or events)",
        fix,
    )


def kubernetes_result(probe: KubeProbe) -> Result:
    where = f"{probe.server} (credentials from {probe.credentials})"
    if probe.error is not None:
        if probe.unavailable:
            return Result(
                KUBERNETES_CHECK,
                FAIL,
                f"API server {where} unreachable: {probe.error}",
                "check the server address in the kubeconfig, that the API server runs and that "
                "this node reaches it (firewall, proxy); meanwhile gpushare-node runs as a plain "
                "device plugin and retries",
            )
        if probe.error_status == 401:
            return Result(
                KUBERNETES_CHECK,
                FAIL,
                f"API server {probe.server}: credentials rejected (from {probe.credentials}): "
                f"{probe.error}",
                "make the kubeconfig again from the gpushare-node-token Secret (`python "
                "deploy/render.py kubeconfig`, deploy/README.md) and copy it to this node",
            )
        return Result(
            KUBERNETES_CHECK,
            FAIL,
            f"API server {where}: {probe.error}",
            "see the API server's answer; `kubectl auth can-i --list` with the same kubeconfig "
            "shows what it may do",
        )
    missing_node = (
        f"node {probe.node_name} does not exist there (node_name wrong? kubelet not registered "
        "yet?)"
    )
    if probe.denied:
        detail = (
            f"API server {where}: RBAC denies {len(probe.denied)} of the {len(probe.checked)} "
            f"requests gpushare-node makes: {_verbs_on(probe.denied)} missing"
        )
        if probe.node == "missing":
            detail += f"; {missing_node}"
        return Result(
            KUBERNETES_CHECK,
            FAIL,
            detail,
            "apply the ClusterRole and binding of deploy/: `python deploy/render.py rbac | "
            "kubectl apply -f -` (deploy/README.md); if they are applied, the kubeconfig is not "
            "that of their service account",
        )
    allowed = f"RBAC allows every request gpushare-node makes ({_verbs_on(probe.checked)})"
    if probe.node is None:  # refused although the reviews allow it: another authorizer
        return Result(
            KUBERNETES_CHECK,
            FAIL,
            f"API server {where}: the reviews say {allowed}, yet {probe.node_error}",
            "look at the cluster's other authorizers (webhook, ABAC) for this identity; "
            "`kubectl auth can-i get nodes/NAME` with the same kubeconfig",
        )
    if probe.node == "missing":
        return Result(
            KUBERNETES_CHECK,
            WARN,
            f"API server {where}: {allowed}, but {missing_node}",
            "set node_name to this node's name in `kubectl get nodes` (default: $NODE_NAME, else "
            "the lowercased hostname); a node kubelet has not registered yet appears by itself",
        )
    return Result(
        KUBERNETES_CHECK, PASS, f"API server {where}: node {probe.node_name} found; {allowed}"
    )


def _verbs_on(permissions: Iterable[tuple[str, str, str]]) -> str:
    """E.g. ``get, list on pods; patch on nodes/status``, in the order given."""
    verbs: dict[str, list[str]] = {}
    for group, resource, verb in permissions:
        verbs.setdefault(f"{resource}.{group}" if group else resource, []).append(verb)
    return "; ".join(f"{', '.join(v)} on {resource}" for resource, v in verbs.items())
