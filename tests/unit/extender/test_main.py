"""``gpushare-scheduler``, the console script, against the test API server.

Pins: bad flags (no signing key, no TLS) exit 2 and an unusable key, unusable TLS files
or no credentials exit 1, each saying why; it serves at once,
/healthz turns 200 once nodes and pods are listed (one LIST each, then watches);
SIGTERM stops it with exit 0; what it bound is rebuilt from the API after a restart
(the pod's annotations and nodeName), so the card stays taken; SIGHUP does not stop it;
TLS files rotated in its Secret volume are used by the same process from the next
connection.
"""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import time

import pytest

from nodemgr.kubernetes.publish import node_annotation
from standins import placementkeys
from standins.apiserver_sim import TestApiServer
from standins.extender_proc import ExtenderProc
from standins.extender_tls import TlsMaterial, https_request, secret_volume

MEMORY = "aliyun.com/gpu-mem"


def gpus(*allocated_gib):
    cards = [
        {
            "index": i,
            "uuid": f"GPU-{i}",
            "model": "Tesla T4",
            "mode": "shared" if gib else "idle",
            "healthy": True,
            "memory_total_mib": 15360,
            "memory_allocated_mib": gib * 1024,
            "core_allocated_percent": 0,
        }
        for i, gib in enumerate(allocated_gib)
    ]
    return node_annotation({"gpus": cards, "allocations": []})


@pytest.fixture
def api():
    server = TestApiServer()
    server.start()
    server.add_node("node-a", annotations={"gpushare.aliyun.com/gpus": gpus(0)})
    yield server
    server.stop()


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "nodemgr.extender.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_bad_flags_no_key_no_tls_and_no_credentials(tmp_path):
    """Exit 2 for bad flags (the signing key and TLS are required), 1 for an unusable key,
    unusable TLS files or no credentials, each saying why."""
    key, public = placementkeys.write_pair(str(tmp_path))
    tls = TlsMaterial(str(tmp_path / "tls"))
    both = ("--placement-key", key, "--tls-dir", tls.dir)
    done = run(*both, "--policy", "tightest")
    assert done.returncode == 2 and "unknown placement policy 'tightest'" in done.stderr
    done = run(*both, "--address", "nowhere")
    assert done.returncode == 2 and "'nowhere' is not HOST:PORT" in done.stderr
    done = run("--tls-dir", tls.dir)
    assert done.returncode == 2 and "the following arguments are required: --placement-key" in (
        done.stderr
    )
    done = run("--placement-key", key)
    assert done.returncode == 2 and "TLS is required: --tls-dir DIR, or --tls-cert-file" in (
        done.stderr
    )
    done = run("--placement-key", key, "--tls-dir", tls.dir, "--tls-key-file", "x")
    assert done.returncode == 2 and "not both" in done.stderr
    done = run("--placement-key", public, "--tls-dir", tls.dir)
    assert done.returncode == 1
    assert done.stderr == (
        f"gpushare-scheduler: --placement-key: {public} holds a PUBLIC KEY, not a PRIVATE KEY\n"
    )
    wrong = ("--tls-cert-file", f"{tls.dir}/tls.crt", "--tls-key-file", f"{tls.dir}/client.key")
    done = run("--placement-key", key, *wrong, "--tls-client-ca-file", f"{tls.dir}/ca.crt")
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"gpushare-scheduler: the certificate {tls.dir}/tls.crt and key {tls.dir}/client.key "
        "do not load: "
    )
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = run(*both, env=env)
    assert done.returncode == 1
    assert done.stderr.startswith("gpushare-scheduler: no Kubernetes credentials (tried ")


def test_serves_lists_once_and_rebuilds_after_a_restart(api, tmp_path):
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    pod = api.add_pod("default", "job", containers=[{"name": "main", "requests": {MEMORY: "8"}}])
    extender = ExtenderProc(kubeconfig)
    try:
        extender.wait_ready()
        lists = [p for m, p, q in api.requests if q.get("watch") != "true" and m == "GET"]
        assert sorted(lists) == ["/api/v1/nodes", "/api/v1/pods"]
        assert extender.post("filter", {"Pod": pod, "NodeNames": ["node-a"]})[0] == 200
        binding = {"PodName": "job", "PodNamespace": "default", "Node": "node-a"}
        binding["PodUID"] = pod["metadata"]["uid"]
        assert extender.post("bind", binding) == (200, {"Error": ""})
        assert api.pod("default", "job")["spec"]["nodeName"] == "node-a"
        extender.process.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert extender.process.poll() is None
        assert extender.stop() == 0
        assert "SIGTERM: stopping" in extender.log()
        restarted = ExtenderProc(kubeconfig, keys=extender.keys)
        try:
            restarted.wait_ready()
            assert "placement annotation" not in restarted.log()  # its own signature verifies
            other = api.add_pod(
                "default", "next", containers=[{"name": "main", "requests": {MEMORY: "8"}}]
            )
            status, result = restarted.post("filter", {"Pod": other, "NodeNames": ["node-a"]})
            assert status == 200
            assert result["NodeNames"] == []
            assert result["FailedNodes"]["node-a"] == (
                "no single GPU on node-a has 8 GiB free: GPU0 (Tesla T4) has 7 GiB/100 percent free"
            )
            status, metrics = restarted.get("/metrics")
            assert 'gpushare_extender_cache_synced{resource="pods"} 1' in metrics
            assert json.loads(json.dumps(result))  # plain JSON
        finally:
            assert restarted.stop() == 0
    finally:
        extender.stop()


def test_rotated_tls_files_are_used_without_a_restart(api, tmp_path):
    """The process's --tls-dir is a Secret volume; a new CA and certificates swapped in:
    the next connection uses them (the old client refused), the same process answers."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    old = TlsMaterial(str(tmp_path / "old"))
    new = TlsMaterial(str(tmp_path / "new"))
    volume = str(tmp_path / "volume")
    secret_volume(volume, old.dir)
    extender = ExtenderProc(kubeconfig, tls=TlsMaterial(volume))
    try:
        extender.wait_ready()
        url = extender.url + "/gpushare-scheduler"
        pid = extender.process.pid
        assert https_request(old.client(url), "GET", "/healthz")[0] == 200
        secret_volume(volume, new.dir)
        deadline = time.monotonic() + 10
        while True:  # the files are looked at once a second at most
            try:
                status = https_request(new.client(url), "GET", "/healthz")[0]
                break
            except (ssl.SSLError, OSError):
                assert time.monotonic() < deadline, extender.log()
                time.sleep(0.2)
        assert status == 200 and extender.process.pid == pid
        with pytest.raises((ssl.SSLError, OSError)):
            https_request(old.client(url), "GET", "/healthz")
        assert "TLS files changed: new connections use" in extender.log()
    finally:
        assert extender.stop() == 0
