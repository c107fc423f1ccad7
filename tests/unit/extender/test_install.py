"""``nodemgr install --scheduler``: the gpushare-scheduler unit on a control-plane node.

Pins: it writes only gpushare-scheduler.service, running the gpushare-scheduler next to
this Python on 127.0.0.1:32766 over mutual TLS (where the scheduler config points, its
probes plain on 127.0.0.1:9446) with the kubeconfig, the TLS files and the signing key
as systemd credentials, records it so ``nodemgr uninstall`` removes it, refuses while
it is enabled, keeps an edited unit (exit 1); a second run changes nothing; the unit is
one systemd-analyze verify accepts; --scheduler-kubeconfig alone is refused.
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.unit.cli.install.support import BIN, nodemgr, require_tool

UNIT = "etc/systemd/system/gpushare-scheduler.service"


def read(root, path):
    with open(os.path.join(root, path)) as f:
        return f.read()


def test_writes_records_and_uninstall_removes_the_unit(tmp_path, capsys):
    root = str(tmp_path)
    code, out, _ = nodemgr(capsys, "install", "--scheduler", "--root", root)
    assert code == 0, out
    unit = read(root, UNIT)
    script = os.path.join(BIN, "gpushare-scheduler")
    assert (
        f"ExecStart={script} --address 127.0.0.1:32766 --health-address 127.0.0.1:9446 "
        "--kubeconfig %d/kubeconfig --tls-cert-file %d/tls.crt --tls-key-file %d/tls.key "
        "--tls-client-ca-file %d/ca.crt --placement-key %d/placement.key\n"
    ) in unit
    assert "LoadCredential=kubeconfig:/etc/gpushare/scheduler-kubeconfig" in unit
    for name in ("tls.crt", "tls.key", "ca.crt"):
        assert f"LoadCredential={name}:/etc/gpushare/scheduler-tls/{name}" in unit
    assert "LoadCredential=placement.key:/etc/gpushare/placement.key" in unit
    assert not os.path.exists(os.path.join(root, "etc/systemd/system/gpushare-node.service"))
    manifest = json.loads(read(root, "etc/gpushare/installed-files.json"))
    assert list(manifest["files"]) == ["/etc/systemd/system/gpushare-scheduler.service"]
    assert "systemctl enable --now gpushare-scheduler" in out
    code, out, _ = nodemgr(capsys, "install", "--scheduler", "--root", root)
    assert code == 0 and "unchanged" in out

    wants = tmp_path / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir()
    (wants / "gpushare-scheduler.service").symlink_to(
        "/etc/systemd/system/gpushare-scheduler.service"
    )
    code, out, _ = nodemgr(capsys, "uninstall", "--root", root)
    assert code == 1 and "systemctl disable --now gpushare-scheduler" in out
    (wants / "gpushare-scheduler.service").unlink()
    code, out, _ = nodemgr(capsys, "uninstall", "--root", root)
    assert code == 0 and not os.path.exists(os.path.join(root, UNIT))


def test_an_edited_unit_is_kept_and_a_custom_kubeconfig_named(tmp_path, capsys):
    root = str(tmp_path)
    assert nodemgr(capsys, "install", "--scheduler", "--root", root)[0] == 0
    with open(os.path.join(root, UNIT), "a") as f:
        f.write("# mine\n")
    code, out, _ = nodemgr(
        capsys, "install", "--scheduler", "--root", root, "--scheduler-kubeconfig", "/etc/k"
    )
    assert code == 1 and "keep" in out and "# mine" in read(root, UNIT)
    code, _, err = nodemgr(capsys, "install", "--root", root, "--scheduler-kubeconfig", "/etc/k")
    assert code == 2 and "--scheduler-kubeconfig goes with --scheduler" in err
    code, out, err = nodemgr(
        capsys, "install", "--scheduler", "--root", root, "--scheduler-kubeconfig", "rel"
    )
    assert code == 1 and "must be an absolute path" in err


def test_systemd_accepts_the_unit(tmp_path, capsys):
    analyze = require_tool("systemd-analyze")
    root = str(tmp_path)
    assert nodemgr(capsys, "install", "--scheduler", "--root", root)[0] == 0
    done = subprocess.run(
        [analyze, "verify", os.path.join(root, UNIT)], capture_output=True, text=True, timeout=60
    )
    ours = [
        line for line in (done.stdout + done.stderr).splitlines() if "gpushare-scheduler" in line
    ]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr
