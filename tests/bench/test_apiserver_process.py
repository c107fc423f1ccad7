"""bench.apiserver_process: the test API server in a process of its own, as the footprint
benchmark runs it. Pins that its proxy calls reach the server in the child, that the
request log is counted there, and that the child never outlives its parent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request

import psutil

from bench.apiserver_process import ApiServerProcess


def test_calls_reach_the_server_in_the_child_and_requests_are_counted(tmp_path):
    """Pods added through the proxy are served over HTTP by the child, which counts each
    request; stop ends the child process."""
    api = ApiServerProcess()
    try:
        api.add_node("node-a")
        api.add_pod("ns", "p", "node-a", containers=[{"name": "main", "requests": {}}])
        assert api.pod("ns", "p")["spec"]["nodeName"] == "node-a"
        with open(api.write_kubeconfig(str(tmp_path / "kubeconfig"))) as f:
            token = json.load(f)["users"][0]["user"]["token"]
        before = len(api.requests)
        request = urllib.request.Request(
            f"{api.url}/api/v1/namespaces/ns/pods/p", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.load(answer)["metadata"]["name"] == "p"
        assert len(api.requests) == before + 1
        child = psutil.Process(api._process.pid)
    finally:
        api.stop()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_the_child_ends_when_its_parent_does():
    """A bench that dies without stop() leaves no API server behind: the child ends when
    its parent's end of stdin closes."""
    script = textwrap.dedent(
        """
        from bench.apiserver_process import ApiServerProcess
        api = ApiServerProcess()
        print(api._process.pid, flush=True)
        raise SystemExit(3)  # no stop()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    child_pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child_pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        assert not psutil.pid_exists(child_pid), "the API server process outlived its parent"
