"""Helpers the install tests share: the installed paths and modes, running ``nodemgr`` in
process, reading a root's files, and systemd's own tools (skipped without them, except where
GPUSHARE_REQUIRE_RUNC=1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from nodemgr.cli import main as cli
from standins.paths import MPS_STANDIN

REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
BIN = os.path.dirname(sys.executable)
STAND_IN = MPS_STANDIN
CARD = "GPU-6a7c0d1e-2f30-4152-6374-8596a7b8c9d0"

UNITS = "etc/systemd/system"
NODE_UNIT = f"{UNITS}/gpushare-node.service"
MPS_UNIT = f"{UNITS}/gpushare-mps@.service"
TMPFILES = "etc/tmpfiles.d/gpushare.conf"
CONFIG = "etc/gpushare/config.yaml"
HOOK_CREATE = "etc/containers/oci/hooks.d/50-gpushare-create.json"
HOOK_POSTSTOP = "etc/containers/oci/hooks.d/50-gpushare-poststop.json"
CONTAINERD_HOOKS = "etc/gpushare/containerd/gpushare-hooks.json"
MAKE_BASE_SPEC = "etc/gpushare/containerd/make-base-spec"
HOOK_LAUNCHER = "etc/gpushare/gpushare-hook"
MANIFEST = "etc/gpushare/installed-files.json"
WRITTEN = {
    NODE_UNIT: 0o644,
    MPS_UNIT: 0o644,
    TMPFILES: 0o644,
    CONFIG: 0o644,
    HOOK_CREATE: 0o644,
    HOOK_POSTSTOP: 0o644,
    CONTAINERD_HOOKS: 0o644,
    MAKE_BASE_SPEC: 0o755,
    HOOK_LAUNCHER: 0o755,
    MANIFEST: 0o644,
}


def require_tool(name: str) -> str:
    """The path of ``name``; skips the test without it (fails it where GPUSHARE_REQUIRE_RUNC=1)."""
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (apt-get install systemd; scripts/setup-runtime does it)"
    if os.environ.get("GPUSHARE_REQUIRE_RUNC") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_RUNC=1 but {reason}")
    pytest.skip(reason)


def nodemgr(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``nodemgr ARGS`` in this process: (exit status, stdout, stderr)."""
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read(root, relative: str) -> str:
    """The text of ``relative`` under ``root``."""
    with open(os.path.join(root, relative)) as f:
        return f.read()


def tree(root) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> content; a symlink -> its target)."""
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                files[os.path.relpath(path, root)] = os.readlink(path).encode()
                continue
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def unit_values(text: str, key: str) -> list[str]:
    """The values of every ``key=`` line of a unit file, in order."""
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{key}=")]


def verify(unit_path: str) -> None:
    """systemd-analyze verify: exit 0 and not a word about our unit (it may chat about
    unrelated units of this machine)."""
    analyze = require_tool("systemd-analyze")
    done = subprocess.run(
        [analyze, "verify", unit_path], capture_output=True, text=True, timeout=60
    )
    name = os.path.basename(unit_path)
    about_ours = [line for line in (done.stdout + done.stderr).splitlines() if name in line]
    assert done.returncode == 0 and not about_ours, done.stdout + done.stderr


def mps_instance(template_path: str, directory) -> str:
    """A copy of the template named as the instance for CARD, as systemd would load it."""
    path = os.path.join(directory, f"gpushare-mps@{CARD}.service")
    shutil.copyfile(template_path, path)
    return path


def write_config(root, document: dict, relative: str = CONFIG) -> str:
    """Write ``document`` as YAML to ``relative`` (default: the installed config) under root."""
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(document, f)
    return path
