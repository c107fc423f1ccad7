"""Doctor's kubelet checks: the device-plugin registration socket and the pod-resources socket.

Each result says what it means for pods and the fix, with the config key to set when
kubelet runs with another ``--root-dir``.
"""

from __future__ import annotations

import os

from nodemgr.cli.doctor.host import Host, SocketProbe, probe_socket
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.config.schema import Settings


def check_kubelet_sockets(settings: Settings, host: Host) -> list[Result]:
    return [
        kubelet_socket_result(
            "kubelet socket",
            os.path.join(settings.kubelet.device_plugin_dir, "kubelet.sock"),
            probe_socket(
                os.path.join(settings.kubelet.device_plugin_dir, "kubelet.sock"),
                host.timeout_seconds,
            ),
        ),
        kubelet_socket_result(
            "pod-resources socket",
            settings.kubelet.pod_resources_socket,
            probe_socket(settings.kubelet.pod_resources_socket, host.timeout_seconds),
        ),
    ]


_KUBELET_SOCKETS = {
    # check name: (config key, where it is under kubelet's --root-dir, why it matters)
    "kubelet socket": (
        "kubelet.device_plugin_dir",
        "DIR/device-plugins",
        "gpushare-node cannot register its resources, so pods asking for them stay Pending",
    ),
    "pod-resources socket": (
        "kubelet.pod_resources_socket",
        "DIR/pod-resources/kubelet.sock",
        "the reconcile is skipped, so allocations of deleted pods are never released",
    ),
}


def kubelet_socket_result(check: str, path: str, probe: SocketProbe) -> Result:
    key, under_root_dir, consequence = _KUBELET_SOCKETS[check]
    start_fix = (
        f"is kubelet running? `systemctl status kubelet`; if kubelet runs with "
        f"--root-dir DIR, set {key}: {under_root_dir}"
    )
    state = probe.state
    if state == "ok":
        return Result(check, PASS, f"kubelet listens at {path}")
    if state == "denied":
        return Result(
            check, WARN, f"{path}: permission denied; not checked", "run `sudo nodemgr doctor`"
        )
    if state == "no_dir":
        found = f"no directory {os.path.dirname(path)}: kubelet is not installed or uses another "
        found += "--root-dir"
        fix = start_fix
    elif state == "missing":
        found, fix = f"no socket at {path}: kubelet is not running", start_fix
    elif state == "refused":
        found = f"{path} is a stale socket (nobody listens): kubelet is not running"
        fix = "start kubelet (`systemctl restart kubelet`); it recreates the socket"
    elif state == "not_socket":
        found = f"{path} exists but is not a socket"
        fix = f"correct {key}, or remove the file and restart kubelet (`systemctl restart kubelet`)"
    elif state == "timeout":
        found = f"{path} accepts no connection within the timeout: kubelet hung?"
        fix = "look at `journalctl -u kubelet` and restart kubelet"
    else:
        found, fix = f"{path}: {probe.error or state}", start_fix
    return Result(check, FAIL, f"{found}; {consequence}", fix)
