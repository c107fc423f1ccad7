"""Pins nodemgr.kubelet.rootsocket over real gRPC on unix sockets: the budget's channel
arguments are the ones gRPC reads; a socket is bound in a short private directory and
renamed into place, 0600, replacing a stale socket at its path; the staged path is never
longer than the final one for the names the daemon binds; a failed start leaves nothing
behind."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile

import grpc
import grpc.aio
import pytest

from nodemgr.kubelet import rootsocket
from nodemgr.kubelet.pluginloop import PLUGIN_LOOP
from nodemgr.kubelet.rootsocket import GrpcBudget, serve_root_only

BUDGET = GrpcBudget(
    max_connections=3,
    handshake_seconds=1.5,
    idle_seconds=7.0,
    max_streams=4,
    max_calls=5,
    max_receive_bytes=1024,
    max_metadata_bytes=2048,
)


@pytest.fixture
def directory():
    path = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_budget_is_given_to_grpc_as_its_channel_arguments():
    """Each number of the budget becomes the gRPC channel argument that holds it."""
    assert dict(BUDGET.options()) == {
        "grpc.max_allowed_incoming_connections": 3,
        "grpc.server_handshake_timeout_ms": 1500,
        "grpc.max_connection_idle_ms": 7000,
        "grpc.max_concurrent_streams": 4,
        "grpc.max_receive_message_length": 1024,
        "grpc.max_metadata_size": 2048,
    }


def _serve(path: str) -> grpc.aio.Server:
    async def start() -> grpc.aio.Server:
        server = BUDGET.server()
        await serve_root_only(server, path)
        return server

    return PLUGIN_LOOP.run(start(), 10)


def _stop(server: grpc.aio.Server) -> None:
    PLUGIN_LOOP.run(server.stop(None), 10)


def test_a_socket_is_renamed_into_place_0600_over_a_stale_one(directory):
    """A socket file left at the path (a crash) is replaced; the new one is 0600 and
    accepts connections; no staging directory is left."""
    path = os.path.join(directory, "dra.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    before = os.stat(path).st_ino
    server = _serve(path)
    try:
        assert os.stat(path).st_ino != before
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.listdir(directory) == ["dra.sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)
    finally:
        _stop(server)


def test_the_staged_path_is_no_longer_than_the_shortest_name_bound(directory, monkeypatch):
    """The staging directory is ``.`` and 4 hex digits, the socket in it ``s``: 8 bytes
    after the directory, under ``/dra.sock``'s 9, so every path the config accepts (107
    bytes at most) can be staged."""
    made = []
    real = rootsocket._private_directory

    def recording(parent):
        path = real(parent)
        made.append(path)
        return path

    monkeypatch.setattr(rootsocket, "_private_directory", recording)
    server = _serve(os.path.join(directory, "dra.sock"))
    _stop(server)
    [staging] = made
    staged = os.path.join(staging, "s")
    assert len(staged) - len(directory) == 8 < len("/dra.sock")
    assert os.path.basename(staging).startswith(".")


def test_a_failed_start_stops_the_server_and_leaves_nothing(directory):
    """A directory where the socket should go cannot be replaced: the error is raised, and
    neither a staging directory nor a socket is left."""
    path = os.path.join(directory, "dra.sock")
    os.mkdir(path)
    with pytest.raises(IsADirectoryError):
        _serve(path)
    assert os.listdir(directory) == ["dra.sock"]
    assert stat.S_ISDIR(os.lstat(path).st_mode)
