"""``nodemgr install`` / ``uninstall`` into a temporary root, and the shipped unit files.

Pins: install writes the units, tmpfiles.d entry, default config and hook
configs with their modes and the real console-script paths; systemd 252's
``systemd-analyze verify`` accepts gpushare-node.service and an instance of
gpushare-mps@.service, and ``systemd-tmpfiles`` creates run_dir (0755) and
state_dir (0700) from the entry; the default config is config.py's defaults,
names every key, passes check-config, and gets the daemon past config loading;
an existing config is kept and its settings used; --dry-run writes nothing;
a file install did not write is kept; uninstall removes what install wrote and
keeps the config and an edited unit, and refuses while the units are enabled;
the copies in systemd/ and hooks/ are exactly what the templates render, and
systemd-analyze accepts the shipped units as they are.

Tests that need systemd-analyze, systemd-tmpfiles or unshare skip without
them, except where GPUSHARE_REQUIRE_RUNC=1 (CI): there they fail.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from nodemgr.cli import main as cli
from nodemgr.cli.install import steps as install
from nodemgr.config import schema
from nodemgr.config.loading import load_settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.path.dirname(sys.executable)
STAND_IN = os.path.join(REPO, "tests", "harness", "fakes", "nvidia-cuda-mps-control")
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
    MANIFEST: 0o644,
}


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (apt-get install systemd; scripts/setup-runtime does it)"
    if os.environ.get("GPUSHARE_REQUIRE_RUNC") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_RUNC=1 but {reason}")
    pytest.skip(reason)


def nodemgr(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read(root, relative: str) -> str:
    with open(os.path.join(root, relative)) as f:
        return f.read()


def tree(root) -> dict[str, bytes]:
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
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(document, f)
    return path


# --- install --------------------------------------------------------------------------


def test_install_writes_every_file_with_its_mode_and_the_console_scripts(tmp_path, capsys):
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 0, err
    for relative, mode in WRITTEN.items():
        info = os.stat(tmp_path / relative)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == mode, relative
        assert f"create        {tmp_path / relative}" in out or relative == MANIFEST
    node_unit = read(tmp_path, NODE_UNIT)
    assert unit_values(node_unit, "ExecStart") == [
        f"{BIN}/gpushare-node --config /etc/gpushare/config.yaml"
    ]
    hook = os.path.join(BIN, "gpushare-hook")
    for relative, stage in ((HOOK_CREATE, "createRuntime"), (HOOK_POSTSTOP, "poststop")):
        entry = json.loads(read(tmp_path, relative))["hook"]
        assert entry["path"] == hook
        assert entry["args"] == ["gpushare-hook", "--socket", "/run/gpushare/hook.sock", stage]
    containerd = json.loads(read(tmp_path, CONTAINERD_HOOKS))["hooks"]
    assert {stage: entry["path"] for stage, [entry] in containerd.items()} == {
        "createRuntime": hook,
        "poststop": hook,
    }
    # The next commands, in the order they must run.
    steps = [
        "systemctl daemon-reload",
        "systemd-tmpfiles --create /etc/tmpfiles.d/gpushare.conf",
        "systemctl enable --now gpushare-node",
        "/etc/gpushare/containerd/make-base-spec > /etc/containerd/gpushare-base-spec.json",
        'base_runtime_spec = "/etc/containerd/gpushare-base-spec.json"',
        "systemctl restart containerd",
    ]
    positions = [out.index(step) for step in steps]
    assert positions == sorted(positions)


def test_node_unit_pins_notify_watchdog_restart_and_the_host_mount_namespace(tmp_path, capsys):
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
    assert unit_values(mps, "ExecStart") == [f"{STAND_IN} -d"]
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


def test_existing_config_is_kept_and_its_settings_used(tmp_path, capsys):
    path = write_config(tmp_path, {"run_dir": "/srv/run", "mps": {"control_binary": STAND_IN}})
    before = read(tmp_path, CONFIG)
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 0, err
    assert read(tmp_path, CONFIG) == before
    assert f"keep          {path}  (existing config, never overwritten)" in out
    assert "/srv/run/mps/%i/pipe" in read(tmp_path, MPS_UNIT)
    assert "d /srv/run 0755 root root -" in read(tmp_path, TMPFILES)
    assert json.loads(read(tmp_path, HOOK_CREATE))["hook"]["args"][2] == "/srv/run/hook.sock"


def test_config_option_names_the_file_the_unit_passes(tmp_path, capsys):
    write_config(tmp_path, {"run_dir": "/srv/run"}, "opt/gpu/node.yaml")
    code, out, err = nodemgr(
        capsys, "install", "--root", str(tmp_path), "--config", "/opt/gpu/node.yaml"
    )
    assert code == 0, err
    assert unit_values(read(tmp_path, NODE_UNIT), "ExecStart") == [
        f"{BIN}/gpushare-node --config /opt/gpu/node.yaml"
    ]
    assert not os.path.exists(tmp_path / CONFIG)
    code, out, err = nodemgr(
        capsys, "install", "--root", str(tmp_path), "--config", "/opt/gpu/missing.yaml"
    )
    assert code == 1 and "--config /opt/gpu/missing.yaml: no such file" in err


def test_bad_existing_config_stops_install_with_exit_2(tmp_path, capsys):
    write_config(tmp_path, {"kubernetes": {"enabled": "yes"}})
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 2
    assert "config error: kubernetes.enabled" in err and "check-config" in err
    assert set(tree(tmp_path)) == {CONFIG}


def test_dry_run_writes_nothing_and_says_what_it_would(tmp_path, capsys):
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path), "--dry-run")
    assert code == 0, err
    assert os.listdir(tmp_path) == []
    for relative in WRITTEN:
        verb = "would record" if relative == MANIFEST else "would create"
        assert f"{verb:<13} {tmp_path / relative}" in out
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    before = tree(tmp_path)
    assert nodemgr(capsys, "uninstall", "--root", str(tmp_path), "--dry-run")[0] == 0
    assert tree(tmp_path) == before


def test_install_keeps_a_file_it_did_not_write_and_replaces_its_own(tmp_path, capsys):
    foreign = tmp_path / HOOK_CREATE
    foreign.parent.mkdir(parents=True)
    foreign.write_text('{"someone": "else"}\n')
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 1
    assert f"keep          {foreign}  (not written by nodemgr install, or edited since)" in out
    assert "Move them away" in out
    assert foreign.read_text() == '{"someone": "else"}\n'
    foreign.unlink()
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    # A changed setting: install replaces the files it wrote, unedited.
    config_path = tmp_path / CONFIG
    config_path.write_text(
        config_path.read_text().replace("run_dir: /run/gpushare", "run_dir: /srv/x")
    )
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 0, out
    assert f"replace       {tmp_path / HOOK_CREATE}" in out
    assert json.loads(read(tmp_path, HOOK_CREATE))["hook"]["args"][2] == "/srv/x/hook.sock"


def test_missing_console_script_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, err = nodemgr(capsys, "install", "--root", str(tmp_path))
    assert code == 1
    assert "cannot find the gpushare-node console script" in err and "pip install" in err
    assert os.listdir(tmp_path) == []


# --- uninstall ------------------------------------------------------------------------


def test_uninstall_removes_what_install_wrote_and_keeps_config_and_edited_unit(tmp_path, capsys):
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    edited = tmp_path / MPS_UNIT
    edited.write_text(edited.read_text() + "# local change\n")
    code, out, err = nodemgr(capsys, "uninstall", "--root", str(tmp_path))
    assert code == 0, err
    assert set(tree(tmp_path)) == {CONFIG, MPS_UNIT}
    assert f"keep          {edited}  (edited since install; remove it by hand)" in out
    assert f"keep          {tmp_path / CONFIG}  (your configuration)" in out
    assert f"remove        {tmp_path / NODE_UNIT}" in out
    assert "systemctl daemon-reload" in out
    # The directories install created are gone where empty.
    assert not os.path.exists(tmp_path / "etc/containers")
    assert not os.path.exists(tmp_path / "etc/tmpfiles.d")


def test_uninstall_refuses_while_the_service_is_enabled(tmp_path, capsys):
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    wants = tmp_path / UNITS / "multi-user.target.wants"
    wants.mkdir()
    (wants / "gpushare-node.service").symlink_to("/etc/systemd/system/gpushare-node.service")
    before = tree(tmp_path)
    code, out, err = nodemgr(capsys, "uninstall", "--root", str(tmp_path))
    assert code == 1
    assert "systemctl disable --now gpushare-node" in out
    assert tree(tmp_path) == before


def test_uninstall_without_an_install_removes_nothing(tmp_path, capsys):
    write_config(tmp_path, {})
    code, out, err = nodemgr(capsys, "uninstall", "--root", str(tmp_path))
    assert code == 0 and "Nothing to remove" in out
    assert set(tree(tmp_path)) == {CONFIG}


# --- the source tree's copies ---------------------------------------------------------


def test_shipped_files_are_what_the_templates_render():
    for relative, content in install.shipped_files().items():
        with open(os.path.join(REPO, relative)) as f:
            assert f.read() == content, (
                f"{relative} differs from what nodemgr/cli/install/templates renders: edit the "
                "template and run scripts/render-shipped"
            )


def test_shipped_units_are_accepted_by_systemd_as_they_are(tmp_path):
    """The shipped units name /usr/local/bin/gpushare-node and nvidia-cuda-mps-control,
    which verify checks: a private mount namespace shows this venv's scripts and the
    MPS stand-in at /usr/local/bin, and nothing else changes."""
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


def test_unit_quoting_escapes_what_systemd_would_expand():
    assert install.exec_arg("/usr/local/bin/gpushare-node") == "/usr/local/bin/gpushare-node"
    assert install.exec_arg("/opt/a b/100%$x") == '"/opt/a b/100%%$$x"'
    assert install.exec_arg('/opt/q"\\') == '"/opt/q\\"\\\\"'
    assert install.env_value("A=/x/50%") == "A=/x/50%%"
    assert install.tmpfiles_path("/run/a b") == '"/run/a b"'
