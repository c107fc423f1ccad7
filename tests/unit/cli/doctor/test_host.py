"""Pins doctor's unix socket probe against real sockets: missing, no directory, listening,
stale (the file left, nobody listening) and not a socket."""

from __future__ import annotations

import os
import shutil

from nodemgr.cli.doctor import host
from nodemgr.cli.doctor.host import SocketProbe
from tests.unit.cli.doctor.support import listening, short_dir, write


def test_probe_socket_states(tmp_path):
    """Each state a unix socket can be in is told apart: missing, no_dir, ok, refused,
    not_socket."""
    directory = short_dir()
    try:
        path = os.path.join(directory, "k.sock")
        assert host.probe_socket(path, 1).state == "missing"
        assert host.probe_socket(os.path.join(directory, "no", "k.sock"), 1).state == "no_dir"
        server = listening(path)
        assert host.probe_socket(path, 1) == SocketProbe("ok")
        server.close()  # the file stays, nobody listens: what a dead kubelet leaves
        assert host.probe_socket(path, 1).state == "refused"
        plain = write(os.path.join(directory, "plain"), "")
        assert host.probe_socket(plain, 1).state == "not_socket"
    finally:
        shutil.rmtree(directory)


def test_host_paths_are_under_its_root():
    """Every system location is resolved under Host.root, so tests can use a fake node tree."""
    assert host.Host(root="/tmp/node").path("/etc/containerd/config.toml") == (
        "/tmp/node/etc/containerd/config.toml"
    )
    assert host.Host().path("/proc/self/status") == "/proc/self/status"
