"""``nodemgr install --scheduler``: the gpushare-scheduler unit for a control-plane node.

The unit serves on 127.0.0.1:32766 over mutual TLS (where kube-scheduler on the same
host expects it, ``deploy/render.py gpushare-scheduler-config``'s default) and passes
the kubeconfig, TLS files and signing key as systemd credentials. It is recorded in
install's manifest and planned as ``apply.install`` plans; nothing of the node daemon
is written: a control-plane node without GPUs needs only this.

What it must not do: run systemctl, write the kubeconfig (it holds a
credential the admin makes), or touch the node daemon's files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from nodemgr.cli.install.apply import SCHEDULER_UNIT, _plan
from nodemgr.cli.install.files import (
    MANIFEST_PATH,
    check_absolute,
    makedirs,
    read_manifest,
    under,
    write_atomic,
)
from nodemgr.cli.install.render import UNIT_DIR, FileSpec, InstallError, _environment

SCHEDULER_KUBECONFIG = "/etc/gpushare/scheduler-kubeconfig"
SCHEDULER_ADDRESS = "127.0.0.1:32766"
SCHEDULER_HEALTH_ADDRESS = "127.0.0.1:9446"
SCHEDULER_TLS_DIR = "/etc/gpushare/scheduler-tls"  # tls.crt, tls.key, ca.crt (render.py tls)
SCHEDULER_PLACEMENT_KEY = "/etc/gpushare/placement.key"  # render.py placement-keys


def scheduler_command() -> str:
    """Next to this Python, else in $PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), "gpushare-scheduler")
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return os.path.abspath(candidate)
    found = shutil.which("gpushare-scheduler")
    if found is None:
        raise InstallError(
            f"cannot find the gpushare-scheduler console script next to {sys.executable} or in "
            "$PATH: install the package into this Python (pip install .) and run its nodemgr"
        )
    return os.path.abspath(found)


def render_unit(command: str, kubeconfig: str, address: str = SCHEDULER_ADDRESS) -> FileSpec:
    for name, value in (("gpushare-scheduler", command), ("--scheduler-kubeconfig", kubeconfig)):
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise InstallError(f"{name} {value!r} contains a control character")
    text = (
        _environment()
        .get_template("gpushare-scheduler.service.j2")
        .render(
            scheduler_command=command,
            kubeconfig=kubeconfig,
            address=address,
            health_address=SCHEDULER_HEALTH_ADDRESS,
            tls_dir=SCHEDULER_TLS_DIR,
            placement_key=SCHEDULER_PLACEMENT_KEY,
        )
    )
    return FileSpec(f"{UNIT_DIR}/{SCHEDULER_UNIT}", text, 0o644)


def install_scheduler(root: str, kubeconfig: str | None, dry_run: bool, out=None) -> int:
    """1 when a file not ours was kept."""
    out = sys.stdout if out is None else out
    kubeconfig = kubeconfig or SCHEDULER_KUBECONFIG
    check_absolute(kubeconfig, "--scheduler-kubeconfig")
    command = scheduler_command()
    spec = render_unit(command, kubeconfig)
    manifest = read_manifest(root)
    action = _plan(root, spec, manifest)
    print(
        f"nodemgr install --scheduler{' (dry run: nothing is written)' if dry_run else ''}",
        file=out,
    )
    print(f"  root:                {root}", file=out)
    print(f"  gpushare-scheduler:  {command}", file=out)
    print(f"  listens on:          {SCHEDULER_ADDRESS} (mutual TLS)", file=out)
    print(f"  probes on:           {SCHEDULER_HEALTH_ADDRESS} (GET /healthz)", file=out)
    print(f"  kubeconfig:          {kubeconfig}", file=out)
    print(f"  TLS files:           {SCHEDULER_TLS_DIR}/{{tls.crt,tls.key,ca.crt}}", file=out)
    print(f"  signing key:         {SCHEDULER_PLACEMENT_KEY}", file=out)
    print("", file=out)
    verb = (
        f"would {action.verb}" if dry_run and action.verb in ("create", "replace") else action.verb
    )
    line = f"  {verb:<13} {under(root, spec.path)}"
    print(line + (f"  ({action.why})" if action.why else ""), file=out)
    print(
        f"  {'would record' if dry_run else 'record':<13} {under(root, MANIFEST_PATH)}  "
        "(what was written, for uninstall)",
        file=out,
    )
    print("", file=out)
    if action.verb == "keep":
        print(
            "nodemgr install --scheduler: the unit was kept because it was not written by "
            "nodemgr install or was edited since. Move it away (keep your changes in a drop-in) "
            "and run this again.",
            file=out,
        )
        return 1
    if dry_run:
        print("Dry run: nothing was written. Run it without --dry-run to write it.", file=out)
        return 0
    created: list[str] = []
    if action.verb in ("create", "replace"):
        created = makedirs(root, os.path.dirname(spec.path))
        write_atomic(under(root, spec.path), spec.content, spec.mode)
    _record(root, manifest, spec, created)
    _print_next_steps(root, kubeconfig, out)
    return 0


def _record(root: str, manifest: dict, spec: FileSpec, created: list[str]) -> None:
    updated = dict(manifest)
    updated.setdefault(
        "written_by", "nodemgr install; nodemgr uninstall removes these files unless edited"
    )
    updated["files"] = {**manifest.get("files", {}), spec.path: spec.digest}
    updated["directories"] = sorted(set(manifest.get("directories", [])) | set(created))
    makedirs(root, os.path.dirname(MANIFEST_PATH))
    write_atomic(under(root, MANIFEST_PATH), json.dumps(updated, indent=2) + "\n", 0o644)


def _print_next_steps(root: str, kubeconfig: str, out) -> None:
    where = "on this node" if root == "/" else f"on the system that runs from {root}"
    print(
        f"""Installed. Next, once per cluster (deploy/README.md):
  python deploy/render.py scheduler-rbac | kubectl apply -f -
  python deploy/render.py kubeconfig --service-account gpushare-scheduler \\
      --server https://<API server>:6443 --ca-file ca.crt --token-file token -o scheduler-kubeconfig
  python deploy/render.py tls --dir tls && python deploy/render.py placement-keys --dir keys
then, as root {where}:
  install -m 0600 scheduler-kubeconfig {kubeconfig}
  install -d -m 0700 {SCHEDULER_TLS_DIR}
  install -m 0600 tls/tls.crt tls/tls.key tls/ca.crt {SCHEDULER_TLS_DIR}/
  install -m 0600 keys/placement.key {SCHEDULER_PLACEMENT_KEY}
  systemctl daemon-reload
  systemctl enable --now gpushare-scheduler
  curl -s http://{SCHEDULER_HEALTH_ADDRESS}/healthz    # ok once nodes and pods are listed
and point kube-scheduler at it (its client files: tls/client.crt, client.key, ca.crt):
  python deploy/render.py gpushare-scheduler-config > /etc/kubernetes/gpushare-scheduler-config.yaml
  (kube-scheduler --config=/etc/kubernetes/gpushare-scheduler-config.yaml; see deploy/README.md)""",
        file=out,
    )
