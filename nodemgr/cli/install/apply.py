"""``nodemgr install`` / ``nodemgr uninstall`` applied to a root: plan, write, record, remove.

``install`` writes the rendered files under root, and a manifest of them with each
file's SHA-256 (``files.MANIFEST_PATH``), so ``uninstall`` removes exactly those still
as written. An existing config is kept and read (the units and hooks then use its
paths). Each file is planned first: create, replace (as install last wrote it),
unchanged, or keep (the config, or a file install did not write or that was edited:
exit 1, saying what to do); then written atomically and the next commands printed.

``uninstall`` refuses (exit 1) while systemd still has our units enabled, and says how
to quit the MPS control daemons that outlive gpushare-node.

What it must not do: run systemctl or change the running system (it prints the
commands to run), overwrite a config, remove the config, the state directory or
a file it did not write or that was edited, or write outside the root.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from mps.layout import MpsLayout
from nodemgr.cli.install.files import (
    MANIFEST_PATH,
    check_absolute,
    makedirs,
    read_manifest,
    under,
    write_atomic,
    write_manifest,
)
from nodemgr.cli.install.render import (
    CONFIG_PATH,
    CONTAINERD_BASE_SPEC,
    CONTAINERD_DIR,
    NODE_UNIT,
    OCI_HOOKS_DIR,
    TMPFILES_PATH,
    UNIT_DIR,
    FileSpec,
    InstallError,
    Target,
    console_scripts,
    hook_package_dir,
    render,
    sha256,
)
from nodemgr.config.loading import load_settings
from nodemgr.config.schema import MpsSettings

SCHEDULER_UNIT = "gpushare-scheduler.service"  # nodemgr install --scheduler (scheduler.py)
START_TIMEOUT_SECONDS = 300  # TimeoutStartSec= of gpushare-node.service, for the printed hint


# --- install --------------------------------------------------------------------------


@dataclass
class _Action:
    spec: FileSpec
    verb: str  # create, replace, unchanged, keep
    why: str = ""


def install(root: str, config_path: str | None, dry_run: bool, out=None) -> int:
    """The exit status: 1 when a file that is not ours was kept."""
    out = sys.stdout if out is None else out  # looked up now: tests replace it
    node_command, hook_command = console_scripts()
    explicit_config = config_path is not None
    config_path = config_path or CONFIG_PATH
    check_absolute(config_path, "--config")
    config_on_disk = under(root, config_path)
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
    target = Target.of(
        settings, node_command, hook_command, config_path, sys.executable, hook_package_dir()
    )
    manifest = read_manifest(root)
    actions = [_plan(root, spec, manifest) for spec in render(target)]

    print(f"nodemgr install{' (dry run: nothing is written)' if dry_run else ''}", file=out)
    print(f"  root:            {root}", file=out)
    print(f"  gpushare-node:   {node_command}", file=out)
    print(f"  gpushare-hook:   {hook_command}", file=out)
    print(f"  hook runs as:    {sys.executable} -I -S, hooks from {hook_package_dir()}", file=out)
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
        line = f"  {verb:<13} {under(root, action.spec.path)}"
        print(line + (f"  ({action.why})" if action.why else ""), file=out)
    record = "would record" if dry_run else "record"
    print(
        f"  {record:<13} {under(root, MANIFEST_PATH)}  (what was written, for uninstall)", file=out
    )
    conflicts = [a for a in actions if a.verb == "keep" and not a.spec.is_config]
    if not dry_run:
        created_dirs = []
        for action in actions:
            if action.verb in ("create", "replace"):
                created_dirs += makedirs(root, os.path.dirname(action.spec.path))
                write_atomic(under(root, action.spec.path), action.spec.content, action.spec.mode)
        ours = {
            a.spec.path: a.spec.digest
            for a in actions
            if not a.spec.is_config and a.verb in ("create", "replace", "unchanged")
        }
        write_manifest(root, manifest, ours, created_dirs, target)
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
    """Checked only for --root /."""
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
    path = under(root, spec.path)
    if not os.path.lexists(path):
        return _Action(spec, "create")
    if spec.is_config:
        return _Action(spec, "keep", "existing config, never overwritten")
    try:
        with open(path, "rb") as f:
            current = sha256(f.read())
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


# --- uninstall ------------------------------------------------------------------------


def uninstall(root: str, dry_run: bool, out=None) -> int:
    """The exit status: 1 while systemd still has our units enabled (nothing removed)."""
    out = sys.stdout if out is None else out  # looked up now: tests replace it
    manifest = read_manifest(root)
    manifest_path = under(root, MANIFEST_PATH)
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
            "  systemctl disable --now 'gpushare-mps@*'   # if you enabled any\n"
            "  systemctl disable --now gpushare-scheduler  # if installed with --scheduler",
            file=out,
        )
        return 1
    print(
        "(gpushare-node is not enabled; if it still runs, `systemctl stop gpushare-node` first.)",
        file=out,
    )
    print("", file=out)
    _remove_recorded_files(root, manifest, dry_run, out)
    _print_kept(root, manifest, out)
    if not dry_run:
        os.unlink(manifest_path)
        for directory in sorted(manifest.get("directories", []), key=len, reverse=True):
            try:
                os.rmdir(under(root, directory))  # only when empty
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


def _remove_recorded_files(root: str, manifest: dict, dry_run: bool, out) -> None:
    for path, digest in sorted(manifest["files"].items()):
        on_disk = under(root, path)
        verb, why = _removal(on_disk, digest)
        if verb == "remove" and dry_run:
            verb = "would remove"
        print(f"  {verb:<13} {on_disk}" + (f"  ({why})" if why else ""), file=out)
        if verb == "remove":
            os.unlink(on_disk)


def _print_kept(root: str, manifest: dict, out) -> None:
    config_path = manifest.get("config_path", CONFIG_PATH)
    if os.path.exists(under(root, config_path)):
        print(f"  {'keep':<13} {under(root, config_path)}  (your configuration)", file=out)
    state_dir = manifest.get("state_dir")
    if state_dir and os.path.exists(under(root, state_dir)):
        print(
            f"  {'keep':<13} {under(root, state_dir)}  (the ledger of allocations; remove it "
            "by hand once no pod uses a GPU here)",
            file=out,
        )


def _removal(path: str, digest: str) -> tuple[str, str]:
    if not os.path.lexists(path):
        return "gone", ""
    try:
        with open(path, "rb") as f:
            current = sha256(f.read())
    except OSError as e:
        return "keep", f"cannot read it: {e.strerror}; remove it by hand"
    if current != digest:
        return "keep", "edited since install; remove it by hand"
    return "remove", ""


def _print_mps_leftovers(root: str, manifest: dict, out) -> None:
    run_dir = manifest.get("run_dir")
    binary = manifest.get("control_binary", MpsSettings().control_binary)
    if not run_dir:
        return
    layout = MpsLayout(run_dir)
    try:
        cards = sorted(
            name
            for name in os.listdir(under(root, layout.root))
            if os.path.isdir(under(root, layout.pipe_dir(name)))
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
        print("then unmount what gpushare-node mounted for them:", file=out)
        for card in cards:
            print(f"  umount {layout.shm_dir(card)}    # its MPS daemon's /dev/shm tmpfs", file=out)
            print(
                f"  umount {layout.namespace_file(card)}    # the mount namespace of its "
                "control daemon",
                file=out,
            )
        print(f"  umount {layout.namespace_dir}", file=out)


def _enabled_links(root: str) -> list[str]:
    links: list[str] = []
    units_dir = under(root, UNIT_DIR)
    if not os.path.isdir(units_dir):
        return links
    for entry in sorted(os.listdir(units_dir)):
        if not entry.endswith((".wants", ".requires")):
            continue
        directory = os.path.join(units_dir, entry)
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            if name in (NODE_UNIT, SCHEDULER_UNIT) or (
                name.startswith("gpushare-mps@") and name.endswith(".service")
            ):
                links.append(os.path.join(directory, name))
    return links
