"""Pins doctor's kubelet socket verdicts: what each probe state means for pods, and the fix
naming the config key to set when kubelet runs with another --root-dir."""

from __future__ import annotations

import pytest

from nodemgr.cli.doctor import kubelet
from nodemgr.cli.doctor.host import SocketProbe
from nodemgr.cli.doctor.report import FAIL, PASS, WARN


@pytest.mark.parametrize(
    ("state", "status", "found"),
    [
        ("ok", PASS, "kubelet listens at /k/device-plugins/kubelet.sock"),
        ("no_dir", FAIL, "no directory /k/device-plugins"),
        ("missing", FAIL, "no socket at /k/device-plugins/kubelet.sock: kubelet is not running"),
        ("refused", FAIL, "stale socket (nobody listens)"),
        ("not_socket", FAIL, "exists but is not a socket"),
        ("timeout", FAIL, "accepts no connection"),
        ("denied", WARN, "permission denied"),
    ],
)
def test_kubelet_socket_verdicts(state, status, found):
    """Each probe state of the registration socket gives its verdict, consequence for pods and
    fix."""
    result = kubelet.kubelet_socket_result(
        "kubelet socket", "/k/device-plugins/kubelet.sock", SocketProbe(state)
    )
    assert result.status == status and found in result.detail
    if status == FAIL:
        assert "stay Pending" in result.detail  # what it means for pods
        assert "kubelet" in result.fix
    if state in ("missing", "no_dir"):
        assert "--root-dir DIR, set kubelet.device_plugin_dir: DIR/device-plugins" in result.fix


def test_pod_resources_socket_verdict_names_its_key_and_consequence():
    """A missing pod-resources socket FAILs saying allocations are never released, naming its
    key."""
    result = kubelet.kubelet_socket_result(
        "pod-resources socket", "/k/pod-resources/kubelet.sock", SocketProbe("missing")
    )
    assert result.status == FAIL and "never released" in result.detail
    assert "kubelet.pod_resources_socket: DIR/pod-resources/kubelet.sock" in result.fix
