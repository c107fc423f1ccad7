"""The test API server in a process of its own, for the benchmarks.

On a node the API server is another machine, and kubelet and the scheduler are other
processes. In one Python process with the test kubelet they share one GIL: every
watch event the server streams to the daemon, every annotation PATCH it answers,
holds up kubelet's next Allocate. A benchmark of the daemon's admissions per second
then measures the stand-ins' contention as much as the daemon. Here the server runs
in a spawned process (a fresh interpreter: nothing of the bench's gRPC threads is
forked) and the bench drives it through a proxy with the few calls it needs.
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from multiprocessing.managers import BaseManager

from standins.apiserver_sim import TestApiServer

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ServedApiServer(TestApiServer):
    """TestApiServer with its properties as calls (a manager's proxy forwards only calls)."""

    __test__ = False

    def get_url(self) -> str:
        return self.url

    def request_count(self) -> int:
        return len(self.requests)


_SERVER: _ServedApiServer | None = None  # the child's one server


def _the_server() -> _ServedApiServer:
    global _SERVER
    if _SERVER is None:
        _SERVER = _ServedApiServer()
    return _SERVER


class _Manager(BaseManager):
    pass


_EXPOSED = (
    "start",
    "stop",
    "add_node",
    "add_pod",
    "delete_pod",
    "pod",
    "write_kubeconfig",
    "get_url",
    "request_count",
)
_Manager.register("ApiServer", _the_server, exposed=_EXPOSED)


class ApiServerProcess:
    """A started test API server in its own process. The calls the benchmarks use:
    ``add_node``, ``add_pod``, ``delete_pod``, ``pod``, ``write_kubeconfig``,
    ``request_count`` (also as ``len(requests)``), ``url``; ``stop`` ends the server and
    its process.

    The child is a plain ``python -m bench.apiserver_process`` (not multiprocessing's
    spawn, which re-runs the parent's main script) serving the server object on a unix
    socket in a private directory, with a random key."""

    def __init__(self, start_timeout_seconds: float = 30.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="apiserver-process-")
        address = os.path.join(self._dir, "manager.sock")
        authkey = secrets.token_bytes(16)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.apiserver_process", address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=_REPO_ROOT,
        )
        try:
            assert self._process.stdin is not None
            assert self._process.stdout is not None
            # stdin stays open: the child ends when it closes, so it never outlives
            # this process, however this one ends.
            self._process.stdin.write(authkey.hex().encode() + b"\n")
            self._process.stdin.flush()
            ready = _read_line(self._process.stdout, start_timeout_seconds)
            if ready != b"ready\n":
                raise RuntimeError(
                    f"the API server process did not start (exit {self._process.poll()}, "
                    f"said {ready!r})"
                )
            manager = _Manager(address=address, authkey=authkey)
            manager.connect()
            self._server = manager.ApiServer()  # type: ignore[attr-defined]
            self._server.start()
            self.url: str = self._server.get_url()
            self.requests = _RequestCount(self._server)
        except BaseException:
            self._end()
            raise

    def add_node(self, name: str, **kwargs) -> dict:
        return self._server.add_node(name, **kwargs)

    def add_pod(self, namespace: str, name: str, node: str | None = None, **kwargs) -> dict:
        return self._server.add_pod(namespace, name, node, **kwargs)

    def delete_pod(self, namespace: str, name: str) -> dict:
        return self._server.delete_pod(namespace, name)

    def pod(self, namespace: str, name: str) -> dict | None:
        return self._server.pod(namespace, name)

    def write_kubeconfig(self, path: str) -> str:
        return self._server.write_kubeconfig(path)

    def request_count(self) -> int:
        """How many requests the server has had (the bench's settle watches it)."""
        return self._server.request_count()

    def stop(self) -> None:
        try:
            self._server.stop()
        finally:
            self._end()

    def _end(self) -> None:
        self._process.kill()
        self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class _RequestCount:
    """``len()`` of the child's request log, as ``len(TestApiServer.requests)`` (the log
    itself stays in the child: copying it over at every look would cost more than the
    count)."""

    def __init__(self, server) -> None:
        self._server = server

    def __len__(self) -> int:
        return self._server.request_count()


def _read_line(stream, timeout_seconds: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout_seconds)
    return stream.readline() if ready else b""


def _serve(address: str) -> None:
    authkey = bytes.fromhex(sys.stdin.buffer.readline().strip().decode())
    server = _Manager(address=address, authkey=authkey).get_server()  # listening from here
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    print("ready", flush=True)
    server.serve_forever()


def _exit_with_parent() -> None:
    """End this process once the parent's end of stdin closes (it exited or stopped us)."""
    sys.stdin.buffer.read()
    os._exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1])
