"""Runs the real ``gpushare-scheduler`` process, and a driver that does what kube-scheduler does.

``ExtenderProc`` starts the console script against a kubeconfig (the test API
server's), on a free loopback port, with the mutual TLS material ``deploy/render.py
tls`` makes, and waits for ``/healthz`` (its plain probe port). Its verbs are called
as kube-scheduler calls them: over TLS with the client built from exactly the
``tlsConfig`` of the KubeSchedulerConfiguration render.py writes
(``standins.extender_tls``). ``Scheduler``
is the part of kube-scheduler an extender sees: for a pending pod it POSTs
``filter`` (ExtenderArgs with the full Nodes, as with ``nodeCacheCapable:
false``, or NodeNames), then ``prioritize`` on the nodes that passed, picks
the highest score (kube-scheduler adds weight x score x 10 to its own scores;
here the extender's alone decide, ties to the first node) and POSTs ``bind``.
A pod no node passes stays Pending; its reasons are what kube-scheduler would
put in the FailedScheduling event.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from standins import placementkeys
from standins.extender_tls import TlsMaterial, client_from_config, https_request


def _script(name: str) -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "nodemgr.extender.main"]


class ExtenderProc:
    """gpushare-scheduler on 127.0.0.1:<free port>, its log in a file.

    ``keys``: a directory holding placement.key and placement.pub (one is made when not
    given): the nodes of a test read ``public_key`` as their placement_public_key."""

    def __init__(
        self,
        kubeconfig: str,
        *args: str,
        url_prefix: str = "/gpushare-scheduler",
        keys: str | None = None,
        tls: TlsMaterial | None = None,
        embed: bool = False,
    ):
        self.log_path = tempfile.mktemp(prefix="gpushare-scheduler-", suffix=".log", dir="/tmp")
        self.url_prefix = url_prefix
        if keys is None:
            keys = tempfile.mkdtemp(prefix="gpushare-keys-", dir="/tmp")
            placementkeys.write_pair(keys)
        self.keys = keys
        self.private_key = os.path.join(keys, "placement.key")
        self.public_key = os.path.join(keys, "placement.pub")
        self.tls = tls or TlsMaterial()
        self._log = open(self.log_path, "w+")
        self.process = subprocess.Popen(
            [
                *_script("gpushare-scheduler"),
                "--kubeconfig",
                kubeconfig,
                "--placement-key",
                self.private_key,
                "--tls-dir",
                self.tls.dir,
                "--address",
                "127.0.0.1:0",
                "--health-address",
                "127.0.0.1:0",
                "--url-prefix",
                url_prefix,
                *args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.port, self.health_port = self._wait_ports()
        self.url = f"https://127.0.0.1:{self.port}"
        self.health_url = f"http://127.0.0.1:{self.health_port}"
        # kube-scheduler's configuration for this extender, and its client from it.
        self.scheduler_config = self.tls.scheduler_config(self.url + url_prefix, embed)
        self.client = client_from_config(self.scheduler_config, self.tls.dir)

    def _wait_ports(self, timeout: float = 30.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(
                r"on https://127\.0\.0\.1:(\d+).*probes on http://127\.0\.0\.1:(\d+)/", self.log()
            )
            if match:
                return int(match.group(1)), int(match.group(2))
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"gpushare-scheduler did not start; log:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def get(self, path: str) -> tuple[int, str]:
        """GET on the plain probe port (/healthz, /metrics), as kubelet probes it."""
        try:
            with urllib.request.urlopen(self.health_url + path, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One request over mutual TLS, as kube-scheduler makes it."""
        return https_request(self.client, method, path, body)

    def post(self, verb: str, document) -> tuple[int, object]:
        data = document if isinstance(document, bytes) else json.dumps(document).encode()
        status, body = self.request("POST", f"{self.url_prefix}/{verb}", data)
        return status, json.loads(body or b"null")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/healthz")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"gpushare-scheduler not ready; log:\n{self.log()}")

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


@dataclass
class Decision:
    """What the driver did with one pod."""

    node: str | None  # bound to, or None (stays Pending)
    failed: dict[str, str] = field(default_factory=dict)  # node -> reason (both maps)
    scores: dict[str, int] = field(default_factory=dict)
    error: str = ""


class Scheduler:
    """kube-scheduler's calls to one extender (filter, prioritize, bind) for a pod."""

    def __init__(self, api, extender: ExtenderProc, node_cache_capable: bool = False):
        self.api = api
        self.extender = extender
        self.node_cache_capable = node_cache_capable

    def _args(self, pod: dict, nodes: list[dict]) -> dict:
        if self.node_cache_capable:
            return {"Pod": pod, "Nodes": None, "NodeNames": [n["metadata"]["name"] for n in nodes]}
        return {"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}

    def schedule(self, namespace: str, name: str) -> Decision:
        pod = self.api.pod(namespace, name)
        nodes = self.api.nodes()  # every node, as kube-scheduler's informer has them
        status, result = self.extender.post("filter", self._args(pod, nodes))
        assert status == 200, result
        failed = {**(result["FailedNodes"] or {}), **(result["FailedAndUnresolvableNodes"] or {})}
        if result["Error"]:
            return Decision(None, failed, error=result["Error"])
        if self.node_cache_capable:
            passed = result["NodeNames"] or []
            feasible = [n for n in nodes if n["metadata"]["name"] in passed]
        else:
            feasible = (result["Nodes"] or {}).get("items") or []
        if not feasible:
            return Decision(None, failed)
        status, priorities = self.extender.post("prioritize", self._args(pod, feasible))
        assert status == 200, priorities
        scores = {p["Host"]: p["Score"] for p in priorities}
        best = max(feasible, key=lambda n: scores.get(n["metadata"]["name"], 0))
        node = best["metadata"]["name"]
        status, bound = self.extender.post(
            "bind",
            {
                "PodName": name,
                "PodNamespace": namespace,
                "PodUID": pod["metadata"]["uid"],
                "Node": node,
            },
        )
        assert status == 200, bound
        if bound["Error"]:
            return Decision(None, failed, scores, bound["Error"])
        return Decision(node, failed, scores)
