"""Pins what ``nodemgr install`` renders: gpushare-node.service (notify, watchdog, restart
policy, the host mount namespace); systemd 252's ``systemd-analyze verify`` accepts
gpushare-node.service and an instance of gpushare-mps@.service, with paths that need
quoting, and ``systemd-tmpfiles`` creates run_dir (0755) and state_dir (0700) from the
entry; the default config is config.py's defaults, names every key, passes check-config,
and gets the daemon past config loading; the copies in systemd/ and hooks/ are exactly
what the templates render, and systemd-analyze accepts the shipped units as they are; the
quoting filters escape what systemd would expand.

Tests that need systemd-analyze, systemd-tmpfiles or unshare skip without them, except
where GPUSHARE_REQUIRE_RUNC=1 (CI): there they fail.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import json
import os
import stat
import subprocess

import pytest
import yaml

from nodemgr.cli.install import render
from nodemgr.config import schema
from nodemgr.config.loading import load_settings
from tests.unit.cli.install.support import (
    BIN,
    CONFIG,
    HOOK_CREATE,
    MPS_UNIT,
    NODE_UNIT,
    REPO,
    STAND_IN,
    TMPFILES,
    mps_instance,
    nodemgr,
    read,
    require_tool,
    unit_values,
    verify,
    write_config,
)

# --- the installed files ---------------------------------------------------------------


def test_node_unit_pins_notify_watchdog_restart_and_the_host_mount_namespace(tmp_path, capsys):
    """The node unit is Type=notify with watchdog, restart policy and KillMode=process, and keeps
    the host's mount namespace and devices."""
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    unit = read(tmp_path, NODE_UNIT)
    settings = {
        key: unit_values(unit, key)
        for key in (
            "Type",
            "ExecReload",
            "WatchdogSec",
            "Restart",
            "RestartPreventExitStatus",
            "KillMode",
            "TimeoutStartSec",
            "After",
            "WantedBy",
        )
    }
    assert settings == {
        "Type": ["notify"],  # notify-reload is systemd 253+
        "ExecReload": ["/bin/kill -HUP $MAINPID"],
        "WatchdogSec": ["60s"],
        "Restart": ["on-failure"],
        "RestartPreventExitStatus": ["2"],  # config error
        "KillMode": ["process"],  # MPS control daemons outlive a restart
        "TimeoutStartSec": ["300s"],
        "After": ["nvidia-persistenced.service", "network-online.target"],
        "WantedBy": ["multi-user.target"],
    }
    # Each of these gives the service its own mount namespace (the MPS tmpfs would be
    # invisible to container runtimes) or a device allow-list (/dev/nvidia*).
    for option in (
        "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ReadWritePaths",
        "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
        "ProtectHostname", "ProtectClock", "DeviceAllow", "DevicePolicy", "RuntimeDirectory",
        "PrivateMounts", "TemporaryFileSystem", "User", "DynamicUser",
    ):  # fmt: skip
        assert not unit_values(unit, option), option
    families = unit_values(unit, "RestrictAddressFamilies")
    assert families == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"]


def test_installed_units_and_tmpfiles_are_accepted_by_systemd(tmp_path, capsys):
    """Units rendered for paths with a space are accepted by systemd-analyze, and systemd-
    tmpfiles creates run_dir and state_dir with their modes."""
    root = tmp_path / "root"
    root.mkdir()
    run_dir, state_dir = "/srv/gpu share/run", "/srv/gpushare-state"  # a space: quoted
    write_config(
        root,
        {
            "run_dir": run_dir,
            "state_dir": state_dir,
            "mps": {"control_binary": STAND_IN},
            "enforcement": {"hook_socket": "/srv/hook.sock"},
        },
    )
    assert nodemgr(capsys, "install", "--root", str(root))[0] == 0
    verify(str(root / NODE_UNIT))
    mps = read(root, MPS_UNIT)
    # The card's daemon is started as gpushare-node starts it (its tmpfs and namespace):
    # by the nodemgr next to gpushare-node, with the config gpushare-node reads.
    nodemgr_script = os.path.join(BIN, "nodemgr")
    assert unit_values(mps, "ExecStart") == [
        f"{nodemgr_script} mps-start --config /etc/gpushare/config.yaml %i"
    ]
    assert unit_values(mps, "ExecStop") == [f"/bin/sh -c 'echo quit | \"$$0\"' {STAND_IN}"]
    assert unit_values(mps, "Environment") == [
        "CUDA_VISIBLE_DEVICES=%i",
        '"CUDA_MPS_PIPE_DIRECTORY=/srv/gpu share/run/mps/%i/pipe"',
        '"CUDA_MPS_LOG_DIRECTORY=/srv/gpu share/run/mps/%i/log"',
    ]
    verify(mps_instance(str(root / MPS_UNIT), tmp_path))
    hook = json.loads(read(root, HOOK_CREATE))["hook"]
    assert hook["args"][2] == "/srv/hook.sock"
    tmpfiles = require_tool("systemd-tmpfiles")
    done = subprocess.run(
        [tmpfiles, f"--root={root}", "--create", str(root / TMPFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for path, mode in ((run_dir, 0o755), (state_dir, 0o700)):
        info = os.stat(os.path.join(root, path.lstrip("/")))
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == mode, path


def test_installed_config_is_the_defaults_and_the_daemon_gets_past_loading_it(tmp_path, capsys):
    """The installed config passes check-config, equals the built-in defaults and the daemon gets
    past loading it."""
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    path = str(tmp_path / CONFIG)
    code, out, err = nodemgr(capsys, "check-config", "--config", path)
    assert code == 0, err
    environ = {"NODE_NAME": "node-a"}
    assert load_settings(path, environ) == load_settings(None, environ)
    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("NVML is here: the default config would run the daemon on this host's state")
    done = subprocess.run(
        [os.path.join(BIN, "gpushare-node"), "--config", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr  # 2 would be a config error
    assert "NVML" in done.stderr and "config error" not in done.stderr


def test_default_config_names_every_setting(tmp_path, capsys):
    """A key added to config.py must be added to the template too."""
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    document = yaml.safe_load(read(tmp_path, CONFIG))
    left_out = {"node_name", "gpus.simulated"}  # per node; only with backend: simulated

    def missing(cls, mapping: dict, prefix: str) -> list[str]:
        found = []
        for field in dataclasses.fields(cls):
            key = f"{prefix}{field.name}"
            if key in left_out:
                continue
            if field.name not in mapping:
                found.append(key)
            elif dataclasses.is_dataclass(field.default):
                found += missing(type(field.default), mapping[field.name], f"{key}.")
        return found

    assert missing(schema.Settings, document, "") == []


# --- the source tree's copies ---------------------------------------------------------


def test_shipped_files_are_what_the_templates_render():
    """The copies in systemd/ and hooks/ are exactly what the templates render by default."""
    for relative, content in render.shipped_files().items():
        with open(os.path.join(REPO, relative)) as f:
            assert f.read() == content, (
                f"{relative} differs from what nodemgr/cli/install/templates renders: edit the "
                "template and run scripts/render-shipped"
            )


def test_shipped_units_are_accepted_by_systemd_as_they_are(tmp_path):
    """The shipped units name /usr/local/bin/gpushare-node, /usr/local/bin/nodemgr and
    nvidia-cuda-mps-control, which verify checks: a private mount namespace shows this
    venv's scripts and the MPS stand-in at /usr/local/bin, and nothing else changes."""
    analyze = require_tool("systemd-analyze")
    unshare = require_tool("unshare")
    if os.geteuid() != 0:
        reason = "verifying the shipped units needs root (a private mount namespace)"
        if os.environ.get("GPUSHARE_REQUIRE_RUNC") == "1":
            pytest.fail(f"GPUSHARE_REQUIRE_RUNC=1 but {reason}")
        pytest.skip(reason)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, target in (
        ("gpushare-node", os.path.join(BIN, "gpushare-node")),
        ("gpushare-hook", os.path.join(BIN, "gpushare-hook")),
        ("nodemgr", os.path.join(BIN, "nodemgr")),
        ("nvidia-cuda-mps-control", STAND_IN),
    ):
        (fake_bin / name).symlink_to(target)
    units = [
        os.path.join(REPO, "systemd", "gpushare-node.service"),
        mps_instance(os.path.join(REPO, "systemd", "gpushare-mps@.service"), tmp_path),
    ]
    script = 'mount --bind "$1" /usr/local/bin && shift && exec "$@"'
    done = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(fake_bin), analyze, "verify", *units],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    output = done.stdout + done.stderr
    about_ours = [
        line
        for line in output.splitlines()
        if "gpushare-node.service" in line or "gpushare-mps@" in line
    ]
    assert done.returncode == 0 and not about_ours, output
    tmpfiles = require_tool("systemd-tmpfiles")
    root = tmp_path / "root"
    root.mkdir()
    done = subprocess.run(
        [tmpfiles, f"--root={root}", "--create",
         os.path.join(REPO, "systemd", "tmpfiles.d", "gpushare.conf")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(os.stat(root / "var/lib/gpushare").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "run/gpushare").st_mode) == 0o755


# --- quoting ------------------------------------------------------------------------------


def test_unit_quoting_escapes_what_systemd_would_expand():
    """The quoting filters leave plain paths alone and quote or escape spaces, quotes, % and $."""
    assert render.exec_arg("/usr/local/bin/gpushare-node") == "/usr/local/bin/gpushare-node"
    assert render.exec_arg("/opt/a b/100%$x") == '"/opt/a b/100%%$$x"'
    assert render.exec_arg('/opt/q"\\') == '"/opt/q\\"\\\\"'
    assert render.env_value("A=/x/50%") == "A=/x/50%%"
    assert render.tmpfiles_path("/run/a b") == '"/run/a b"'
