"""Doctor's ``runtime hook`` check: will a container runtime run gpushare-hook at creation?

Reads CRI-O's and podman's OCI hooks directories and the ``base_runtime_spec`` of each
CRI runtime in containerd's config (versions 2 and 3). It fails when no runtime runs the
hook at ``createRuntime``, or an entry is not executable, calls another socket, or names
another runtime's ``--runtime`` (it would read identity keys a pod can write); it warns
about a missing ``poststop``, conditional hooks, an entry without ``--runtime`` or
``--guard`` (rerun install), and a configured runtime without the hook. Paths are
resolved under ``Host.root``.

The containerd config read is the one each running containerd owned by root was started
with (``--config``/``-c`` from its cmdline, relative to its cwd; else the default path):
anyone can start a binary named containerd pointing at a config of their own.

Longer than 400 lines: two runtimes' configuration formats, each found, read and judged.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field, replace

from hooks import podidentity, protocol
from hooks.gpushare_hook import DEFAULT_SOCKET as HOOK_DEFAULT_SOCKET
from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result, worst
from nodemgr.config.schema import Settings

HOOK_NAME = "gpushare-hook"
CREATE, POSTSTOP = protocol.CREATE, protocol.POSTSTOP
# CRI-O and podman read both; a file in /etc replaces the same name in /usr/share.
OCI_HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")
CONTAINERD_CONFIG = "/etc/containerd/config.toml"


def _install_hook_fix(containerd_config: str = CONTAINERD_CONFIG) -> str:
    return (
        "`nodemgr install` writes the CRI-O/podman hooks into /etc/containers/oci/hooks.d; for "
        "containerd run `/etc/gpushare/containerd/make-base-spec > "
        "/etc/containerd/gpushare-base-spec.json`, set it as base_runtime_spec of the runc "
        f"runtime in {containerd_config} and restart containerd (docs/enforcement.md)"
    )


@dataclass(frozen=True)
class HookEntry:
    source: str  # the file it is configured in
    stage: str  # OCI stage: createRuntime, poststop, ...
    path: str  # the executable the runtime runs
    args: tuple[str, ...]
    executable: bool  # path is an executable file on this node
    always: bool = True  # CRI-O's when.always; a base spec applies to every container

    @property
    def socket(self) -> str:
        return self.option("--socket") or HOOK_DEFAULT_SOCKET

    @property
    def runtime(self) -> str | None:
        return self.option("--runtime")

    @property
    def guards(self) -> tuple[str, ...]:
        return tuple(v for n, v in self._options() if n == "--guard")

    def option(self, name: str) -> str | None:
        """The last one given; None without it."""
        values = [v for n, v in self._options() if n == name]
        return values[-1] if values else None

    def _options(self) -> list[tuple[str, str]]:
        options = []
        args = list(self.args)[1:-1]  # argv[0] and the stage
        i = 0
        while i < len(args):
            name, equals, value = args[i].partition("=")
            if name.startswith("--") and equals:
                options.append((name, value))
            elif name.startswith("--") and i + 1 < len(args):
                options.append((name, args[i + 1]))
                i += 1
            i += 1
        return options


# The hook's --runtime for each runtime's configuration (hooks.podidentity.RUNTIMES).
HOOK_RUNTIME = {"CRI-O/podman": podidentity.CRIO, "containerd": podidentity.CONTAINERD}


@dataclass
class RuntimeHooks:
    runtime: str  # "CRI-O/podman" or "containerd (<its config>, <how it was found>)"
    configured: bool  # the runtime's config location exists on this node
    entries: list[HookEntry] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (status, text)
    place: str = ""  # where the hook would be configured
    config: str = ""  # containerd's, for the fix


@dataclass(frozen=True)
class ContainerdConfig:
    path: str  # absolute, on the node
    found: str  # "--config of pid 123", "default path of pid 123", ...


def is_gpushare_hook(hook: dict) -> bool:
    args = hook.get("args") or []
    names = [hook.get("path"), args[0] if isinstance(args, list) and args else None]
    return any(isinstance(n, str) and os.path.basename(n) == HOOK_NAME for n in names)


def oci_hook_entries(source: str, document: object, executable) -> list[HookEntry]:
    """Schema 1.0.0; ValueError when a file naming gpushare-hook is not a valid hook file."""
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
    """(runtime name, base_runtime_spec or None, is default) of every CRI runtime; walks
    the whole document, so versions 2 and 3 are both read."""
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
    runtimes = [_crio_hooks(host)]
    runtimes += [_containerd_hooks(host, config) for config in containerd_configs(host)]
    result = runtime_hook_result(runtimes, settings.hook_socket, settings.hook_guards())
    if result.status == FAIL and settings.gpus.backend == "simulated":
        # Still a FAIL (nothing is checked at creation), but not a surprise to follow up.
        result = replace(result, detail=result.detail + SIMULATED_NOTE)
    return result


SIMULATED_NOTE = (
    "; expected on a node with simulated GPUs and no container runtime (the quick start)"
)


def containerd_configs(host: Host) -> list[ContainerdConfig]:
    """In PID order, each once; the default path when none runs."""
    proc = host.path("/proc")
    try:
        pids = sorted(int(name) for name in os.listdir(proc) if name.isdigit())
    except OSError:
        pids = []
    by_path: dict[str, list[tuple[int, str]]] = {}
    for pid in pids:
        found = _containerd_config_of(host, pid)
        if found is not None:
            by_path.setdefault(found[0], []).append((pid, found[1]))
    if not by_path:
        return [ContainerdConfig(CONTAINERD_CONFIG, "default path, no containerd process found")]
    configs = []
    for path, owners in by_path.items():
        pids_text = ", ".join(str(pid) for pid, _ in owners)
        how = owners[0][1]
        configs.append(ContainerdConfig(path, f"{how} of pid {pids_text}"))
    return configs


def _containerd_config_of(host: Host, pid: int) -> tuple[str, str] | None:
    base = host.path(f"/proc/{pid}")
    try:
        exe = os.readlink(os.path.join(base, "exe"))
        if os.path.basename(exe.removesuffix(" (deleted)")) != "containerd":
            return None
        if not _owned_by_root(os.path.join(base, "status")):
            return None
        with open(os.path.join(base, "cmdline"), "rb") as f:
            argv = f.read().decode("utf-8", "surrogateescape").split("\0")
        cwd = os.readlink(os.path.join(base, "cwd"))
    except OSError:
        return None
    config = config_flag(argv[1:])
    if config is None:
        return CONTAINERD_CONFIG, "default path"
    return os.path.normpath(os.path.join(cwd, config)), "--config"


def config_flag(args: list[str]) -> str | None:
    """As Go's flag package reads it: one or two dashes, ``=`` or the next argument, the
    last one wins."""
    value = None
    for i, arg in enumerate(args):
        dashes = len(arg) - len(arg.lstrip("-"))
        name, equals, rest = arg[dashes:].partition("=")
        if dashes not in (1, 2) or name not in ("c", "config"):
            continue
        if equals:
            value = rest
        elif i + 1 < len(args):
            value = args[i + 1]
    return value or None


def _owned_by_root(status_path: str) -> bool:
    with open(status_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("Uid:"):
                uids = line.split()[1:3]
                return uids == ["0", "0"]
    return False


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


def _containerd_hooks(host: Host, where: ContainerdConfig) -> RuntimeHooks:
    found = RuntimeHooks(
        f"containerd ({where.path}, {where.found})",
        configured=os.path.isfile(host.path(where.path)),
        place=f"a base_runtime_spec in {where.path} ({where.found})",
        config=where.path,
    )
    if not found.configured:
        return found
    try:
        with open(host.path(where.path), "rb") as f:
            config = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        found.problems.append((WARN, f"{where.path}: cannot read ({e})"))
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


def hook_entry_problems(
    entry: HookEntry,
    hook_socket: str,
    runtime: str | None = None,
    guards: tuple[str, ...] = (),
) -> list[tuple[str, str]]:
    """``runtime`` None: any."""
    problems = []
    unguarded = [path for path in guards if path not in entry.guards]
    if unguarded:
        problems.append(
            (
                WARN,
                f"{entry.source}: the hook is not told of the daemon's own "
                f"{', '.join(unguarded)} (--guard): a container without GPUs mounting one "
                "starts unchecked; rerun `nodemgr install`",
            )
        )
    if runtime is not None and entry.runtime is None:
        problems.append(
            (
                WARN,
                f"{entry.source}: the hook has no --runtime (a configuration written by an "
                "older nodemgr install): it reads either runtime's pod identity keys and only "
                f"refuses where both are present and differ; rerun `nodemgr install` so it "
                f"reads only {runtime}'s",
            )
        )
    elif runtime is not None and entry.runtime != runtime:
        problems.append(
            (
                FAIL,
                f"{entry.source}: the hook runs with --runtime {entry.runtime}, but this is "
                f"{runtime}'s configuration: it would read the pod identity from keys a pod's "
                "own annotations can write (or find none and refuse every GPU container); "
                f"make it --runtime {runtime}",
            )
        )
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


def runtime_hook_result(
    runtimes: list[RuntimeHooks], hook_socket: str, guards: tuple[str, ...] = ()
) -> Result:
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
            runtime = HOOK_RUNTIME.get(rt.runtime)
            found = hook_entry_problems(entry, hook_socket, runtime, guards)
            problems += [(s, f"{rt.runtime}: {t}") for s, t in found]
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
    containerd_config = next((rt.config for rt in runtimes if rt.config), CONTAINERD_CONFIG)
    if not installed:
        places = [*OCI_HOOKS_DIRS, *(rt.place for rt in runtimes if rt.place)]
        if not any(rt.place for rt in runtimes):
            places.append(f"a base_runtime_spec in {CONTAINERD_CONFIG}")
        where = ", ".join(places[:-1]) + ", or " + places[-1]
        detail = f"containers are not checked at creation: no {HOOK_NAME} in {where}"
        if problems:
            detail += "; " + "; ".join(t for _, t in problems)
        return Result(name, FAIL, detail, _install_hook_fix(containerd_config))
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
    status = worst(s for s, _ in problems)
    fix = (
        f"make every hook entry run an executable {HOOK_NAME} with --socket {hook_socket} "
        "(or set enforcement.hook_socket to the hook's socket) and the --runtime of its "
        "runtime (rerun `nodemgr install` to write them so); "
        + _install_hook_fix(containerd_config)
    )
    return Result(name, status, detail + "; " + "; ".join(t for _, t in problems), fix)
