"""Pins ``nodemgr install`` / ``uninstall`` applied to a temporary root: install writes the
units, tmpfiles.d entry, default config and hook configs with their modes and the real
console-script paths, and prints the next commands in order; an existing config is kept and
its settings used; --config names the file the unit passes; --dry-run writes nothing; a file
install did not write is kept; uninstall removes what install wrote and keeps the config and
an edited unit, refuses while the units are enabled, removes nothing without an install, and
says how to quit each card's MPS daemon and unmount its /dev/shm tmpfs and namespace.
"""

from __future__ import annotations

import json
import os
import stat
import sys

from nodemgr.config.schema import Settings
from tests.unit.cli.install.support import (
    BIN,
    CONFIG,
    CONTAINERD_HOOKS,
    HOOK_CREATE,
    HOOK_LAUNCHER,
    HOOK_POSTSTOP,
    MANIFEST,
    MPS_UNIT,
    NODE_UNIT,
    STAND_IN,
    TMPFILES,
    UNITS,
    WRITTEN,
    nodemgr,
    read,
    tree,
    unit_values,
    write_config,
)

# --- install --------------------------------------------------------------------------


def test_install_writes_every_file_with_its_mode_and_the_console_scripts(tmp_path, capsys):
    """Install writes every file with its mode, naming this environment's console scripts, and
    prints the next commands in the order they must run."""
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
    hook = "/etc/gpushare/gpushare-hook"  # the launcher: this Python, isolated, without site
    assert read(tmp_path, HOOK_LAUNCHER).startswith(f"#!{sys.executable} -IS\n")
    for relative, stage in ((HOOK_CREATE, "createRuntime"), (HOOK_POSTSTOP, "poststop")):
        entry = json.loads(read(tmp_path, relative))["hook"]
        assert entry["path"] == hook
        socket = ["--socket", "/run/gpushare/hook.sock"]
        guards = [a for p in Settings(node_name="n").hook_guards() for a in ("--guard", p)]
        assert entry["args"] == ["gpushare-hook", *socket, *guards, "--runtime", "cri-o", stage]
    containerd = json.loads(read(tmp_path, CONTAINERD_HOOKS))["hooks"]
    assert {stage: entry["path"] for stage, [entry] in containerd.items()} == {
        "createRuntime": hook,
        "poststop": hook,
    }
    assert {stage: entry["args"][-3:-1] for stage, [entry] in containerd.items()} == {
        "createRuntime": ["--runtime", "containerd"],
        "poststop": ["--runtime", "containerd"],
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


def test_existing_config_is_kept_and_its_settings_used(tmp_path, capsys):
    """An existing config is kept as it is and its run_dir and control binary are rendered."""
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
    """--config names the file the node unit passes; a --config that does not exist is refused."""
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


def test_dry_run_writes_nothing_and_says_what_it_would(tmp_path, capsys):
    """--dry-run of install and uninstall changes no file and lists what it would do."""
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
    """A foreign file is kept (exit 1); files install wrote are replaced when a setting changes."""
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


# --- uninstall ------------------------------------------------------------------------


def test_uninstall_removes_what_install_wrote_and_keeps_config_and_edited_unit(tmp_path, capsys):
    """Uninstall removes what install wrote and the directories it made, keeping the config and
    an edited unit."""
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
    """While systemd has the unit enabled, uninstall removes nothing and says how to disable it."""
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
    """Without install's manifest uninstall removes nothing, not even the config."""
    write_config(tmp_path, {})
    code, out, err = nodemgr(capsys, "uninstall", "--root", str(tmp_path))
    assert code == 0 and "Nothing to remove" in out
    assert set(tree(tmp_path)) == {CONFIG}


def test_uninstall_says_how_to_quit_each_cards_daemon_and_unmount_its_shm(tmp_path, capsys):
    """With cards' MPS directories in the run directory, uninstall prints, per card, how to
    quit its control daemon, then how to unmount its /dev/shm tmpfs and its namespace,
    then the namespace directory; never the node-wide tmpfs of earlier versions."""
    assert nodemgr(capsys, "install", "--root", str(tmp_path))[0] == 0
    card = "GPU-6a7c0d1e-2f30-4152-6374-8596a7b8c9d0"
    mps_root = tmp_path / "run/gpushare/mps"
    (mps_root / card / "pipe").mkdir(parents=True)
    (mps_root / "ns").mkdir()
    code, out, err = nodemgr(capsys, "uninstall", "--root", str(tmp_path))
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    quit_line = next(i for i, line in enumerate(lines) if line.startswith("echo quit |"))
    assert f"CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/{card}/pipe" in lines[quit_line]
    umounts = [line.split("#")[0].strip() for line in lines if line.startswith("umount ")]
    assert umounts == [
        f"umount /run/gpushare/mps/{card}/shm",
        f"umount /run/gpushare/mps/ns/{card}",
        "umount /run/gpushare/mps/ns",
    ]
    assert all(i > quit_line for i, line in enumerate(lines) if line.startswith("umount "))
