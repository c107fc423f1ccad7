"""``nodemgr install`` / ``nodemgr uninstall``: put gpushare-node on a node, and take it off.

``install [--root DIR] [--config FILE] [--dry-run]`` renders the templates in
``nodemgr/cli/install/templates`` (jinja2) and writes, under DIR (default ``/``):

- ``/etc/systemd/system/gpushare-node.service`` and ``gpushare-mps@.service``,
  running the console scripts installed next to this Python;
- ``/etc/tmpfiles.d/gpushare.conf`` (run_dir 0755, state_dir 0700);
- ``/etc/gpushare/config.yaml``, the commented defaults, only when no config
  is there (an existing one is kept and read: the units and hooks then use its
  run_dir, state_dir, hook socket and control binary);
- the runtime hook configs: ``/etc/containers/oci/hooks.d/50-gpushare-*.json``
  (CRI-O, podman) and ``/etc/gpushare/containerd/`` (the containerd snippet and
  ``make-base-spec``), with the real gpushare-hook path and the hook socket;
- ``/etc/gpushare/installed-files.json``: what it wrote, with each file's
  SHA-256, so that ``uninstall`` removes exactly those files that are still as
  written (edits are kept; JSON files cannot carry a marker comment).

Files are written atomically (temporary file + rename). A file that exists and
was neither written by install nor left as written is kept, not replaced
(exit status 1, saying what to do). ``--dry-run`` prints the plan and writes
nothing.

What it must not do: run systemctl or change the running system (it prints the
commands to run), overwrite a config, remove the config, the state directory or
a file it did not write or that was edited, or write outside DIR.

``shipped_files()`` renders the copies kept in the source tree (``systemd/``,
``hooks/``) for the default install, so tests can check they never go stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import jinja2
import yaml

from mps.layout import MpsLayout
from nodemgr.config.loading import config_error_line, load_settings
from nodemgr.config.schema import (
    EnforcementSettings,
    GpuSettings,
    KubeletSettings,
    KubernetesSettings,
    MetricsSettings,
    MpsSettings,
    ResourceSettings,
    Settings,
    StatusSettings,
)
from nodemgr.errors import ConfigError, GpushareError

__all__ = [
    "CONFIG_PATH",
    "MANIFEST_PATH",
    "FileSpec",
    "InstallError",
    "Target",
    "add_parser",
    "render",
    "shipped_files",
]

CONFIG_PATH = "/etc/gpushare/config.yaml"
UNIT_DIR = "/etc/systemd/system"
NODE_UNIT = "gpushare-node.service"
MPS_UNIT = "gpushare-mps@.service"
TMPFILES_PATH = "/etc/tmpfiles.d/gpushare.conf"
OCI_HOOKS_DIR = "/etc/containers/oci/hooks.d"
CONTAINERD_DIR = "/etc/gpushare/containerd"
CONTAINERD_BASE_SPEC = "/etc/containerd/gpushare-base-spec.json"
MANIFEST_PATH = "/etc/gpushare/installed-files.json"
# Where `pip install` as root puts console scripts: the paths of the shipped copies.
SHIPPED_SCRIPTS_DIR = "/usr/local/bin"
# The stage of each CRI-O/podman hooks.d file.
OCI_HOOK_FILES = {
    "50-gpushare-create.json": "createRuntime",
    "50-gpushare-poststop.json": "poststop",
}
START_TIMEOUT_SECONDS = 300  # TimeoutStartSec= of gpushare-node.service, for the printed hint
_SAFE_UNIT_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:@+=,-"
)


class InstallError(GpushareError):
    """Install or uninstall cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class Target:
    """What the rendered files name: where things are on the node (absolute paths)."""

    node_command: str  # the gpushare-node console script
    hook_command: str  # the gpushare-hook console script
    config_path: str  # the config file the unit passes with --config
    run_dir: str
    state_dir: str
    hook_socket: str
    control_binary: str  # MPS control binary: a name in $PATH or an absolute path

    @classmethod
    def of(cls, settings: Settings, node_command: str, hook_command: str, config_path: str):
        return cls(
            node_command=node_command,
            hook_command=hook_command,
            config_path=config_path,
            run_dir=settings.run_dir,
            state_dir=settings.state_dir,
            hook_socket=settings.hook_socket,
            control_binary=settings.mps.control_binary,
        )


@dataclass(frozen=True)
class FileSpec:
    """One file install writes: its path on the node, content and mode."""

    path: str
    content: str
    mode: int
    is_config: bool = False  # written only when absent; never replaced or removed

    @property
    def digest(self) -> str:
        return _sha256(self.content.encode())


# --- rendering ------------------------------------------------------------------------


def render(target: Target, *, with_config: bool = True) -> list[FileSpec]:
    """Every file of an install for ``target``; the config only if ``with_config``."""
    for name, value in dataclasses.asdict(target).items():
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise InstallError(
                f"{name} {value!r} contains a control character, which unit files and "
                "hook configs cannot carry: use a path without it"
            )
    env = _environment()
    layout = MpsLayout(target.run_dir.replace("%", "%%"))  # %i below is a unit specifier
    values = {
        **dataclasses.asdict(target),
        "shm_dir": MpsLayout(target.run_dir).shm_dir,
        "pipe_dir": layout.pipe_dir("%i"),
        "log_dir": layout.log_dir("%i"),
    }

    def text(template: str, **extra) -> str:
        return env.get_template(template).render(**values, **extra)

    files = []
    if with_config:
        files.append(FileSpec(target.config_path, _default_config(env, target), 0o644, True))
    files += [
        FileSpec(f"{UNIT_DIR}/{NODE_UNIT}", text("gpushare-node.service.j2"), 0o644),
        FileSpec(f"{UNIT_DIR}/{MPS_UNIT}", text("gpushare-mps@.service.j2"), 0o644),
        FileSpec(TMPFILES_PATH, text("tmpfiles.conf.j2"), 0o644),
    ]
    for name, stage in OCI_HOOK_FILES.items():
        files.append(
            FileSpec(f"{OCI_HOOKS_DIR}/{name}", text("oci-hook.json.j2", stage=stage), 0o644)
        )
    files += [
        FileSpec(f"{CONTAINERD_DIR}/gpushare-hooks.json", text("containerd-hooks.json.j2"), 0o644),
        FileSpec(f"{CONTAINERD_DIR}/make-base-spec", text("make-base-spec.j2"), 0o755),
    ]
    return files


def _default_config(env: jinja2.Environment, target: Target) -> str:
    """The config file with the built-in defaults (config.py's dataclasses), commented."""
    return env.get_template("config.yaml.j2").render(
        config_path=target.config_path,
        kubelet=KubeletSettings(),
        state_dir=Settings.state_dir,
        run_dir=Settings.run_dir,
        gpus=GpuSettings(),
        resources=ResourceSettings(),
        mps=MpsSettings(),
        enforcement=EnforcementSettings(),
        status=StatusSettings(),
        metrics=MetricsSettings(),
        kubernetes=KubernetesSettings(),
    )


def shipped_files() -> dict[str, str]:
    """The source tree's copies (path relative to the repository -> content): the files of a
    default install, with the console scripts in /usr/local/bin."""
    target = Target.of(
        Settings(node_name="unused"),  # the node name is in no rendered file
        f"{SHIPPED_SCRIPTS_DIR}/gpushare-node",
        f"{SHIPPED_SCRIPTS_DIR}/gpushare-hook",
        CONFIG_PATH,
    )
    where = {
        f"{UNIT_DIR}/{NODE_UNIT}": f"systemd/{NODE_UNIT}",
        f"{UNIT_DIR}/{MPS_UNIT}": f"systemd/{MPS_UNIT}",
        TMPFILES_PATH: "systemd/tmpfiles.d/gpushare.conf",
        **{f"{OCI_HOOKS_DIR}/{name}": f"hooks/oci-hooks.d/{name}" for name in OCI_HOOK_FILES},
        f"{CONTAINERD_DIR}/gpushare-hooks.json": "hooks/containerd/gpushare-hooks.json",
        f"{CONTAINERD_DIR}/make-base-spec": "hooks/containerd/make-base-spec",
    }
    return {where[spec.path]: spec.content for spec in render(target, with_config=False)}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("nodemgr.cli.install", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # unit files, YAML and JSON, not HTML
    )
    env.filters["exec_arg"] = exec_arg
    env.filters["env_value"] = env_value
    env.filters["tmpfiles_path"] = tmpfiles_path
    env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)
    env.filters["yaml"] = _yaml_scalar
    return env


def exec_arg(value: str, keep_specifiers: bool = False) -> str:
    """One argument of a unit's Exec*= line: quoted when needed, ``%`` and ``$`` escaped
    (``keep_specifiers``: ``%`` is already escaped, or a specifier)."""
    escaped = value.replace("$", "$$")
    if not keep_specifiers:
        escaped = escaped.replace("%", "%%")
    return _quote_if_needed(escaped)


def env_value(assignment: str, keep_specifiers: bool = False) -> str:
    """A unit's ``Environment=`` assignment (``$`` is not special there)."""
    return _quote_if_needed(assignment if keep_specifiers else assignment.replace("%", "%%"))


def tmpfiles_path(value: str) -> str:
    """A path in a tmpfiles.d line: quoted when needed, ``%`` escaped."""
    return _quote_if_needed(value.replace("%", "%%"))


def _quote_if_needed(text: str) -> str:
    if text and set(text) <= _SAFE_UNIT_CHARS | {"%", "$"}:
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _yaml_scalar(value: object) -> str:
    """One YAML scalar on one line (``""`` for the empty string, as the comments say)."""
    if value == "":
        return '""'
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").removesuffix("\n")


# --- install --------------------------------------------------------------------------


@dataclass
class _Action:
    spec: FileSpec
    verb: str  # create, replace, unchanged, keep
    why: str = ""


def install(root: str, config_path: str | None, dry_run: bool, out=None) -> int:
    """Write (or with ``dry_run`` only list) every file under ``root``; the exit status:
    0, or 1 when a file that is not ours was kept. Raises InstallError, ConfigError."""
    out = sys.stdout if out is None else out  # looked up now: tests replace it
    node_command, hook_command = console_scripts()
    explicit_config = config_path is not None
    config_path = config_path or CONFIG_PATH
    _check_absolute(config_path, "--config")
    config_on_disk = _under(root, config_path)
    if os.path.exists(config_on_disk):
        settings = load_settings(config_on_disk)
        settings_from = f"the existing config {config_on_disk}"
    elif explicit_config:
        raise InstallError(
            f"--config {config_path}: no such file under {root} ({config_on_disk}); write the "
            f"config first, or leave out --config to install the defaults at {CONFIG_PATH}"
        )
    else:
        settings = load_settings(None, environ={"NODE_NAME": "unused"})  # node name not rendered
        written = "to be written" if dry_run else "written"
        settings_from = f"the defaults, {written} to a new {config_on_disk}"
    target = Target.of(settings, node_command, hook_command, config_path)
    manifest = _read_manifest(root)
    actions = [_plan(root, spec, manifest) for spec in render(target)]

    print(f"nodemgr install{' (dry run: nothing is written)' if dry_run else ''}", file=out)
    print(f"  root:            {root}", file=out)
    print(f"  gpushare-node:   {node_command}", file=out)
    print(f"  gpushare-hook:   {hook_command}", file=out)
    print(f"  settings from:   {settings_from}", file=out)
    print(f"  run_dir {target.run_dir}, state_dir {target.state_dir}", file=out)
    print(f"  hook socket {target.hook_socket}, MPS control {target.control_binary}", file=out)
    print("", file=out)
    for action in actions:
        verb = (
            f"would {action.verb}"
            if dry_run and action.verb in ("create", "replace")
            else action.verb
        )
        line = f"  {verb:<13} {_under(root, action.spec.path)}"
        print(line + (f"  ({action.why})" if action.why else ""), file=out)
    record = "would record" if dry_run else "record"
    print(
        f"  {record:<13} {_under(root, MANIFEST_PATH)}  (what was written, for uninstall)", file=out
    )
    conflicts = [a for a in actions if a.verb == "keep" and not a.spec.is_config]
    if not dry_run:
        created_dirs = []
        for action in actions:
            if action.verb in ("create", "replace"):
                created_dirs += _makedirs(root, os.path.dirname(action.spec.path))
                _write_atomic(_under(root, action.spec.path), action.spec.content, action.spec.mode)
        ours = {
            a.spec.path: a.spec.digest
            for a in actions
            if not a.spec.is_config and a.verb in ("create", "replace", "unchanged")
        }
        _write_manifest(root, manifest, ours, created_dirs, target)
    print("", file=out)
    if conflicts:
        print(
            f"nodemgr install: {len(conflicts)} file(s) kept because they were not written by "
            "nodemgr install or were edited since. Move them away (keep your changes elsewhere, "
            "e.g. in a systemd drop-in) and run nodemgr install again.",
            file=out,
        )
        return 1
    if dry_run:
        print("Dry run: nothing was written. Run it without --dry-run to write these.", file=out)
    else:
        _print_next_steps(root, target, out)
    return 0


def _print_notes(root: str, target: Target, out) -> None:
    """What this machine lacks for the installed units to run (checked only for --root /)."""
    if root != "/":
        return
    binary = target.control_binary
    if not (shutil.which(binary) if "/" not in binary else os.access(binary, os.X_OK)):
        print(
            f"Note: the MPS control binary {binary} is not found here. gpushare-node (with "
            "mps.enabled) and gpushare-mps@ units need it: install the NVIDIA driver's MPS "
            "tools, or set mps.control_binary in the config and run nodemgr install again.",
            file=out,
        )


def _plan(root: str, spec: FileSpec, manifest: dict) -> _Action:
    path = _under(root, spec.path)
    if not os.path.lexists(path):
        return _Action(spec, "create")
    if spec.is_config:
        return _Action(spec, "keep", "existing config, never overwritten")
    try:
        with open(path, "rb") as f:
            current = _sha256(f.read())
    except OSError as e:
        return _Action(spec, "keep", f"cannot read it: {e.strerror}")
    if current == spec.digest:
        return _Action(spec, "unchanged")
    if manifest.get("files", {}).get(spec.path) == current:
        return _Action(spec, "replace")
    return _Action(spec, "keep", "not written by nodemgr install, or edited since")


def _print_next_steps(root: str, target: Target, out) -> None:
    where = "on this node" if root == "/" else f"on the system that runs from {root}"
    print(
        f"""Installed. Next, as root {where}:
  systemctl daemon-reload
  systemd-tmpfiles --create {TMPFILES_PATH}
  systemctl enable --now gpushare-node
      # returns once gpushare-node has registered with kubelet: up to
      # {START_TIMEOUT_SECONDS} s while kubelet is not running (--no-block: at once)
  systemctl status gpushare-node; journalctl -u gpushare-node -f

CRI-O and podman read the hooks in {OCI_HOOKS_DIR} (CRI-O watches it).
containerd needs a base runtime spec with the hooks added:
  {CONTAINERD_DIR}/make-base-spec > {CONTAINERD_BASE_SPEC}
  then set, in /etc/containerd/config.toml:
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      base_runtime_spec = "{CONTAINERD_BASE_SPEC}"
  systemctl restart containerd    # containers created afterwards are checked

Optional, per card: its MPS control daemon in a unit of its own (gpushare-node adopts it):
  systemctl enable --now gpushare-mps@<card UUID>    # UUIDs: nvidia-smi -L

The units run {target.node_command}: after moving that
environment, run nodemgr install again. Settings: {target.config_path}
(check an edit with nodemgr check-config --config {target.config_path}).""",
        file=out,
    )
    _print_notes(root, target, out)


def console_scripts() -> tuple[str, str]:
    """gpushare-node and gpushare-hook as installed: next to this Python, else in $PATH."""
    found = []
    here = os.path.dirname(sys.executable)
    for name in ("gpushare-node", "gpushare-hook"):
        candidate = os.path.join(here, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            found.append(os.path.abspath(candidate))
            continue
        which = shutil.which(name)
        if which is None:
            raise InstallError(
                f"cannot find the {name} console script next to {sys.executable} or in $PATH: "
                "install the package into this Python (pip install .) and run its nodemgr"
            )
        found.append(os.path.abspath(which))
    return found[0], found[1]


# --- uninstall ------------------------------------------------------------------------


def uninstall(root: str, dry_run: bool, out=None) -> int:
    """Remove the recorded files that are still as install wrote them; the exit status:
    0, or 1 while systemd still has our units enabled (nothing is removed then)."""
    out = sys.stdout if out is None else out  # looked up now: tests replace it
    manifest = _read_manifest(root)
    manifest_path = _under(root, MANIFEST_PATH)
    print(f"nodemgr uninstall{' (dry run: nothing is removed)' if dry_run else ''}", file=out)
    if not manifest:
        print(
            f"Nothing to remove: {manifest_path} does not exist, so nodemgr install has not "
            "run here (or its record was removed; then remove its files by hand).",
            file=out,
        )
        return 0
    enabled = _enabled_links(root)
    if enabled:
        print("Still enabled in systemd (these links exist):", file=out)
        for link in enabled:
            print(f"  {link}", file=out)
        print(
            "First stop and disable them, then run nodemgr uninstall again:\n"
            "  systemctl disable --now gpushare-node\n"
            "  systemctl disable --now 'gpushare-mps@*'   # if you enabled any",
            file=out,
        )
        return 1
    print(
        "(gpushare-node is not enabled; if it still runs, `systemctl stop gpushare-node` first.)",
        file=out,
    )
    print("", file=out)
    for path, digest in sorted(manifest["files"].items()):
        on_disk = _under(root, path)
        verb, why = _removal(on_disk, digest)
        if verb == "remove" and dry_run:
            verb = "would remove"
        print(f"  {verb:<13} {on_disk}" + (f"  ({why})" if why else ""), file=out)
        if verb == "remove":
            os.unlink(on_disk)
    config_path = manifest.get("config_path", CONFIG_PATH)
    if os.path.exists(_under(root, config_path)):
        print(f"  {'keep':<13} {_under(root, config_path)}  (your configuration)", file=out)
    state_dir = manifest.get("state_dir")
    if state_dir and os.path.exists(_under(root, state_dir)):
        print(
            f"  {'keep':<13} {_under(root, state_dir)}  (the ledger of allocations; remove it "
            "by hand once no pod uses a GPU here)",
            file=out,
        )
    if not dry_run:
        os.unlink(manifest_path)
        for directory in sorted(manifest.get("directories", []), key=len, reverse=True):
            try:
                os.rmdir(_under(root, directory))  # only when empty
            except OSError:
                pass
    print("", file=out)
    if dry_run:
        print("Dry run: nothing was removed. Run it without --dry-run to remove these.", file=out)
        return 0
    where = "on this node" if root == "/" else f"on the system that runs from {root}"
    print(f"Removed. Next, as root {where}:\n  systemctl daemon-reload", file=out)
    print(
        "containerd, if you set it up: take base_runtime_spec out of "
        f"/etc/containerd/config.toml, remove {CONTAINERD_BASE_SPEC}, restart containerd.",
        file=out,
    )
    _print_mps_leftovers(root, manifest, out)
    return 0


def _removal(path: str, digest: str) -> tuple[str, str]:
    """What uninstall does with one recorded file: (verb, reason)."""
    if not os.path.lexists(path):
        return "gone", ""
    try:
        with open(path, "rb") as f:
            current = _sha256(f.read())
    except OSError as e:
        return "keep", f"cannot read it: {e.strerror}; remove it by hand"
    if current != digest:
        return "keep", "edited since install; remove it by hand"
    return "remove", ""


def _print_mps_leftovers(root: str, manifest: dict, out) -> None:
    """MPS control daemons outlive gpushare-node by design: say how to stop them."""
    run_dir = manifest.get("run_dir")
    binary = manifest.get("control_binary", MpsSettings().control_binary)
    if not run_dir:
        return
    layout = MpsLayout(run_dir)
    try:
        cards = sorted(
            name
            for name in os.listdir(_under(root, layout.root))
            if os.path.isdir(_under(root, layout.pipe_dir(name)))
        )
    except OSError:
        return
    if cards:
        print(
            "MPS control daemons that gpushare-node started outlive it (they serve running "
            "containers). Once no GPU pod runs here, quit each card's:",
            file=out,
        )
        for card in cards:
            print(
                f"  echo quit | CUDA_MPS_PIPE_DIRECTORY={layout.pipe_dir(card)} {binary}",
                file=out,
            )
        print(f"  umount {layout.shm_dir}    # the MPS clients' shared tmpfs, if mounted", file=out)


def _enabled_links(root: str) -> list[str]:
    """Symlinks `systemctl enable` made to our units (any .wants/.requires directory)."""
    links = []
    units_dir = _under(root, UNIT_DIR)
    if not os.path.isdir(units_dir):
        return links
    for entry in sorted(os.listdir(units_dir)):
        if not entry.endswith((".wants", ".requires")):
            continue
        directory = os.path.join(units_dir, entry)
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            if name == NODE_UNIT or (
                name.startswith("gpushare-mps@") and name.endswith(".service")
            ):
                links.append(os.path.join(directory, name))
    return links


# --- files ----------------------------------------------------------------------------


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _check_absolute(path: str, what: str) -> None:
    if not os.path.isabs(path):
        raise InstallError(
            f"{what} {path}: must be an absolute path (the path gpushare-node reads on the node)"
        )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _makedirs(root: str, directory: str) -> list[str]:
    """Create ``directory`` (a node path) under root, 0755; the node paths created."""
    missing = []
    while not os.path.isdir(_under(root, directory)):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for path in reversed(missing):
        os.mkdir(_under(root, path), 0o755)
    return missing


def _write_atomic(path: str, content: str, mode: int) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_manifest(root: str) -> dict:
    path = _under(root, MANIFEST_PATH)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise InstallError(
            f"{path}: cannot read nodemgr install's record of its files ({e}); move it away "
            "and run nodemgr install again"
        ) from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise InstallError(
            f"{path}: not a record written by nodemgr install; move it away and run "
            "nodemgr install again"
        )
    return manifest


def _write_manifest(
    root: str, old: dict, files: dict[str, str], created_dirs: list[str], target: Target
) -> None:
    manifest = {
        "written_by": "nodemgr install; nodemgr uninstall removes these files unless edited",
        "files": {**old.get("files", {}), **files},
        "directories": sorted(set(old.get("directories", [])) | set(created_dirs)),
        "config_path": target.config_path,
        "state_dir": target.state_dir,
        "run_dir": target.run_dir,
        "control_binary": target.control_binary,
    }
    _makedirs(root, os.path.dirname(MANIFEST_PATH))
    _write_atomic(_under(root, MANIFEST_PATH), json.dumps(manifest, indent=2) + "\n", 0o644)


# --- command line ---------------------------------------------------------------------


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "install",
        help="write the systemd units, tmpfiles.d entry, default config and runtime hook configs",
    )
    parser.add_argument(
        "--root", default="/", metavar="DIR", help="write under DIR instead of / (default /)"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"the config file gpushare-node.service passes to the daemon: its path on the "
        f"node, read under DIR; it must exist (default {CONFIG_PATH}, written with the defaults "
        "when absent)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    parser.set_defaults(run=_run_install)
    parser = sub.add_parser(
        "uninstall", help="remove the files nodemgr install wrote (keeps the config and state)"
    )
    parser.add_argument("--root", default="/", metavar="DIR", help="the root install used")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, remove nothing")
    parser.set_defaults(run=_run_uninstall)


def _run_install(args: argparse.Namespace) -> int:
    return _guarded(lambda: install(_root(args.root), args.config, args.dry_run), "install")


def _run_uninstall(args: argparse.Namespace) -> int:
    return _guarded(lambda: uninstall(_root(args.root), args.dry_run), "uninstall")


def _root(root: str) -> str:
    if not os.path.isdir(root):
        raise InstallError(f"--root {root}: no such directory; create it first")
    return os.path.abspath(root)


def _guarded(action, name: str) -> int:
    try:
        return action()
    except ConfigError as e:
        print(config_error_line(e), file=sys.stderr)
        print(
            f"nodemgr {name}: fix the config (nodemgr check-config --config FILE), then run "
            "this again",
            file=sys.stderr,
        )
        return 2
    except InstallError as e:
        print(f"nodemgr {name}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nodemgr {name}: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
