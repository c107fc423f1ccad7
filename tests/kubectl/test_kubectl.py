"""The real kubectl reads back what gpushare-node wrote, through the test API server.

A second client, not the Python one the daemon and the other tests use, holds the test
API server's dialect to what a real client expects, and shows that what the daemon
writes is what kubectl shows. The real gpushare-node (simulated cards, the test kubelet,
``kubernetes`` on) runs against the test API server; pods are admitted, one is refused.
Then ``kubectl`` (``scripts/setup-kubectl``: $GPUSHARE_KUBECTL, else Debian's
kubernetes-client 1.20 unpacked into the real-parts cache, else the one on PATH) reads:

* ``get node -o json``: the Node exactly as stored (labels: ours, the foreign one kept;
  the ``<label_prefix>gpus`` annotation byte for byte, via jsonpath too; the
  ``aliyun.com/gpu-count`` capacity and allocatable);
* ``get pod -o json``: each pod exactly as stored, with the gpushare annotations;
* ``get pods -o json`` (paged with --chunk-size=1, field selector) and the tables of
  ``get nodes``, ``get nodes -L``, ``get pods -o wide`` and ``get events``.

kubectl sends no credentials over plain HTTP (the test server has no TLS), so its
kubeconfig has none and the server serves anonymous requests (``anonymous = True``);
the daemon keeps its token. Skipped with scripts/setup-kubectl's reason where kubectl
cannot be had (missing, and not root or no apt), failed instead where
GPUSHARE_REQUIRE_REAL_PARTS=1.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time

import pytest

from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet
from standins.paths import REPO
from standins.setup_script import run_setup

pytestmark = pytest.mark.e2e

SETUP = os.path.join(REPO, "scripts", "setup-kubectl")
PREFIX = "gpushare.aliyun.com/"  # the default kubernetes.label_prefix
GPUS_ANNOTATION = PREFIX + "gpus"
GPU_COUNT = "aliyun.com/gpu-count"


@functools.cache
def find() -> dict[str, str] | str:
    """GPUSHARE_KUBECTL and GPUSHARE_KUBECTL_VERSION, or why there is no kubectl."""
    return run_setup(SETUP, 600)


class Kubectl:
    def __init__(self, binary: str, server: TestApiServer, home: str):
        self.binary, self.home = binary, home
        self.kubeconfig = os.path.join(home, "kubeconfig")
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "sim",
            "clusters": [{"name": "sim", "cluster": {"server": server.url}}],
            "users": [{"name": "anonymous", "user": {}}],
            "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "anonymous"}}],
        }
        with open(self.kubeconfig, "w") as f:
            json.dump(config, f)

    def __call__(self, *args: str) -> str:
        done = subprocess.run(
            [self.binary, "--kubeconfig", self.kubeconfig, "--cache-dir",
             os.path.join(self.home, "cache"), *args],
            capture_output=True, text=True, timeout=30,
            env=dict(os.environ, HOME=self.home, KUBECONFIG=self.kubeconfig),
        )  # fmt: skip
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "-o", "json"))

    def table(self, *args: str) -> list[list[str]]:
        """The printed table, split on runs of spaces (header first)."""
        return [line.split() for line in self(*args).splitlines()]


def read_back(kubectl: Kubectl, args: tuple[str, ...], stored) -> dict:
    """What ``kubectl get ARGS -o json`` shows, asserted equal to the stored object once
    both are at the same resourceVersion (the daemon may still be writing)."""
    deadline = time.monotonic() + 10
    while True:
        shown, now = kubectl.json("get", *args), stored()
        if shown["metadata"]["resourceVersion"] == now["metadata"]["resourceVersion"]:
            assert shown == now
            return shown
        assert time.monotonic() < deadline, "kubectl never saw the stored version"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def kubectl_binary():
    found = find()
    if isinstance(found, str):
        if os.environ.get("GPUSHARE_REQUIRE_REAL_PARTS") == "1":
            pytest.fail(f"kubectl is required here: {found}")
        pytest.skip(found)
    return found["GPUSHARE_KUBECTL"]


@pytest.fixture(scope="module")
def cluster(kubectl_binary, tmp_path_factory):
    """node-a with the daemon and the test kubelet; pods admitted; one refused."""
    api = TestApiServer()
    api.start()
    api.anonymous = True  # kubectl: no token over plain HTTP
    api.add_node("node-a", labels={"team": "ml", PREFIX + "stale-label": "x"})
    node = Node()
    kubeconfig = api.write_kubeconfig(os.path.join(node.root, "kubeconfig"))
    node.rewrite_config(lambda c: c.update(kubernetes={"kubeconfig": kubeconfig}))
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.start()
    try:
        for resource in (MEMORY, CORE, WHOLE):
            kubelet.wait_for_resource(resource, timeout=20)
        results = {}
        for name, containers in [
            ("filler", [("main", {MEMORY: 10})]),
            ("two", [("small", {MEMORY: 4}), ("big", {MEMORY: 8, CORE: 20})]),
            ("toobig", [("main", {MEMORY: 8})]),  # 8 GiB free: 1 on GPU0, 7 on GPU1
        ]:
            api.add_pod("default", name, "node-a", containers=[
                {"name": n, "requests": {r: str(q) for r, q in requests.items()}}
                for n, requests in containers
            ])  # fmt: skip
            specs = [ContainerSpec(n, r) for n, r in containers]
            results[name] = kubelet.admit_pod("default", name, specs)
            if results[name].ok:
                for container, _ in containers:
                    kubelet.start_container("default", name, container)
        assert results["filler"].ok and results["two"].ok and not results["toobig"].ok

        def settled():
            pods = [(api.pod("default", p)["metadata"].get("annotations") or {})
                    for p in ("filler", "two")]  # fmt: skip
            meta = api.node("node-a")["metadata"]
            gpus = json.loads(meta.get("annotations", {}).get(GPUS_ANNOTATION) or "null")
            return (
                all(a.get("ALIYUN_COM_GPU_MEM_ASSIGNED") == "true" for a in pods)
                and gpus and sum(len(g["allocations"]) for g in gpus["gpus"]) == 3
                and PREFIX + "gpu-count" in meta["labels"]
                and GPU_COUNT in api.node("node-a")["status"]["capacity"]
                and any(e.get("reason") == "GPUShareRefused" for e in api.events())
            )  # fmt: skip

        node.wait_for(settled, timeout=20, what="the pod and node writes and the event")
        home = str(tmp_path_factory.mktemp("kubectl"))
        yield api, Kubectl(kubectl_binary, api, home)
    finally:
        node.cleanup()
        kubelet.stop()
        api.stop()


def test_node_reads_back_exactly_as_the_daemon_wrote_it(cluster):
    api, kubectl = cluster
    shown = read_back(kubectl, ("node", "node-a"), lambda: api.node("node-a"))
    assert (shown["kind"], shown["apiVersion"]) == ("Node", "v1")
    labels = shown["metadata"]["labels"]
    assert labels["team"] == "ml" and PREFIX + "stale-label" not in labels
    assert {k: v for k, v in labels.items() if k.startswith(PREFIX)} == {
        PREFIX + "gpu-count": "2",
        PREFIX + "gpu-model": "Tesla-T4",
        PREFIX + "gpu-memory-mib": "15360",
    }
    for part in ("capacity", "allocatable"):
        assert shown["status"][part][GPU_COUNT] == "2"
        assert shown["status"][part]["cpu"] == "16"  # kubelet's, untouched

    text = shown["metadata"]["annotations"][GPUS_ANNOTATION]
    assert text == api.node("node-a")["metadata"]["annotations"][GPUS_ANNOTATION]
    escaped = GPUS_ANNOTATION.replace(".", r"\.")
    raw = kubectl("get", "node", "node-a", "-o", f"jsonpath={{.metadata.annotations.{escaped}}}")
    assert raw == text  # the string itself, byte for byte
    gpus = json.loads(text)
    assert gpus["v"] == 1
    assert [(g["index"], g["uuid"], g["memory_allocated_mib"]) for g in gpus["gpus"]] == [
        (0, GPU0, 14 * 1024),
        (1, GPU1, 8 * 1024),
    ]
    assert gpus["gpus"][1]["allocations"] == [["default", "two", "big", 8192, 20]]
    count = kubectl(
        "get", "node", "node-a", "-o", r"jsonpath={.status.capacity.aliyun\.com/gpu-count}"
    )
    assert count == "2"


def test_pods_read_back_exactly_as_the_daemon_wrote_them(cluster):
    api, kubectl = cluster
    expected = {
        "filler": {"ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_POD": "10"},
        "two": {
            "ALIYUN_COM_GPU_MEM_IDX": "0",
            "ALIYUN_COM_GPU_MEM_POD": "12",
            "scheduler.framework.gpushare.allocation": '{"0":{"0":4},"1":{"1":8}}',
        },
    }
    for name, wanted in expected.items():
        shown = read_back(
            kubectl, ("pod", "-n", "default", name), lambda n=name: api.pod("default", n)
        )
        annotations = shown["metadata"]["annotations"]
        assert {k: annotations[k] for k in wanted} == wanted
        assert annotations["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "true"
        assert annotations["ALIYUN_COM_GPU_MEM_DEV"] == "15"
        assert int(annotations["ALIYUN_COM_GPU_MEM_ASSUME_TIME"]) > 0
    refused = kubectl.json("get", "pod", "-n", "default", "toobig")
    assert "ALIYUN_COM_GPU_MEM_IDX" not in (refused["metadata"].get("annotations") or {})

    # A list, one pod a page (limit/continue), selected on the server by node name.
    listed = kubectl.json(
        "get", "pods", "-A", "--chunk-size=1", "--field-selector", "spec.nodeName=node-a"
    )
    stored = {p["metadata"]["name"]: p for p in api.pods()}
    assert [p["metadata"]["name"] for p in listed["items"]] == ["filler", "toobig", "two"]
    for item in listed["items"]:  # kubectl puts kind and apiVersion into each item
        assert item == stored[item["metadata"]["name"]] | {"kind": "Pod", "apiVersion": "v1"}
    pages = [q for m, p, q in api.requests if p == "/api/v1/pods" and q.get("limit") == "1"]
    assert len(pages) == 3 and pages[1].get("continue")


def test_tables_as_kubectl_get_prints_them(cluster):
    api, kubectl = cluster
    nodes = kubectl.table("get", "nodes")
    assert nodes[0] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert [nodes[1][i] for i in (0, 1, 2, 4)] == ["node-a", "Ready", "<none>", "v1.30.2"]
    labelled = kubectl.table("get", "nodes", "-L", PREFIX + "gpu-count,team")
    assert labelled[0][-2:] == ["GPU-COUNT", "TEAM"]  # read from each row's metadata
    assert labelled[1][-2:] == ["2", "ml"]
    pods = kubectl.table("get", "pods", "-n", "default", "-o", "wide")
    assert pods[0][:5] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert {row[0]: row[6] for row in pods[1:]} == {
        "filler": "node-a",
        "toobig": "node-a",
        "two": "node-a",
    }
    events = kubectl("get", "events", "-n", "default")
    assert "GPUShareRefused" in events and "pod/toobig" in events
