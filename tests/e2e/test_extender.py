"""End to end, the cluster side: the real gpushare-scheduler places, two real nodes admit.

Two nodes, each the real gpushare-node with its own test kubelet (real device plugin
and PodResources gRPC) against one test API server (real REST and watch); the real
``gpushare-scheduler`` process against the same API server; and a driver doing what
kube-scheduler does for each pending pod (filter with the full Nodes as with
``nodeCacheCapable: false``, prioritize, bind), after which the chosen node's kubelet
admits the pod.

Pins: a pod asking 6 GiB + 40 % skips the node whose totals fit but where no single
card fits both, with the issue's reason; every container the extender placed is
admitted by its node on exactly the card the extender chose (and signed), for memory and
for share (multi-container pods, share-only, whole cards); the node's own annotations then agree;
pods placed back to back, before any node has published, never share a card's space;
a pod that fits nowhere stays Pending with the reasons per node; ``kubectl inspect
gpushare`` through Debian's real kubectl shows the placement with the share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from standins import placementkeys
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, WHOLE, Node
from standins.extender_proc import ExtenderProc, Scheduler
from standins.kubelet_sim import ContainerSpec, TestKubelet

pytestmark = pytest.mark.e2e

PREFIX = "gpushare.aliyun.com/"
INDEX = {GPU0: 0, GPU1: 1}


class TwoNodeCluster:
    def __init__(self):
        self.api = TestApiServer()
        self.api.start()
        self.nodes: dict[str, Node] = {}
        self.kubelets: dict[str, TestKubelet] = {}
        # The extender's key pair: the private key for it, the public one for every node.
        self.keys = tempfile.mkdtemp(prefix="gpushare-keys-", dir="/tmp")
        _, public = placementkeys.write_pair(self.keys)
        try:
            for name in ("node-a", "node-b"):
                self.api.add_node(name)
                node = Node(node_name=name)
                kubeconfig = self.api.write_kubeconfig(os.path.join(node.root, "kubeconfig"))
                kubernetes = {"kubeconfig": kubeconfig, "placement_public_key": public}
                node.rewrite_config(lambda c, k=kubernetes: c.update(kubernetes=k))
                kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
                kubelet.start()
                node.start()
                self.nodes[name], self.kubelets[name] = node, kubelet
            for kubelet in self.kubelets.values():
                for resource in (MEMORY, CORE, WHOLE):
                    kubelet.wait_for_resource(resource, timeout=30)
            for name in self.nodes:
                self.wait_gpus(name, lambda gpus: len(gpus) == 2)
            self.kubeconfig = self.api.write_kubeconfig(
                os.path.join(self.nodes["node-a"].root, "admin.kubeconfig")
            )
            self.extender = ExtenderProc(self.kubeconfig, keys=self.keys)
            self.extender.wait_ready()
        except BaseException:
            self.close()
            raise
        self.scheduler = Scheduler(self.api, self.extender)

    def gpus(self, name):
        text = (self.api.node(name)["metadata"].get("annotations") or {}).get(PREFIX + "gpus")
        return json.loads(text)["gpus"] if text else []

    def wait_gpus(self, name, predicate, timeout=20.0):
        return self.nodes[name].wait_for(
            lambda: predicate(g := self.gpus(name)) and g, timeout, f"{name}'s GPU annotation"
        )

    def create(self, name, containers, node=None):
        self.api.add_pod(
            "default",
            name,
            node,
            containers=[
                {"name": n, "requests": {r: str(q) for r, q in requests.items()}}
                for n, requests in containers
            ],
        )

    def admit(self, node, name, containers):
        result = self.kubelets[node].admit_pod(
            "default", name, [ContainerSpec(n, r) for n, r in containers]
        )
        assert result.ok, f"{node} refused {name}: {result.error}\n{self.nodes[node].log()}"
        for container, _ in containers:
            self.kubelets[node].start_container("default", name, container)
        return result

    def annotations(self, name):
        return self.api.pod("default", name)["metadata"].get("annotations") or {}

    def close(self):
        if getattr(self, "extender", None) is not None:
            self.extender.stop()
        for node in self.nodes.values():
            node.cleanup()
        for kubelet in self.kubelets.values():
            kubelet.stop()
        self.api.stop()
        shutil.rmtree(self.keys, ignore_errors=True)


@pytest.fixture
def cluster():
    cluster = TwoNodeCluster()
    yield cluster
    cluster.close()


def chosen_cards(annotations):
    """Container index -> the card the extender chose, from the per-container annotation."""
    per_container = json.loads(annotations["scheduler.framework.gpushare.allocation"])
    return {int(i): int(next(iter(cards))) for i, cards in per_container.items()}


# What the scheduler sends, one after another, without waiting for any node to publish:
# the extender must count each bind on its card at once.
PODS = [
    ("job", [("main", {MEMORY: 6, CORE: 40})]),
    ("whole", [("main", {WHOLE: 1})]),  # the cluster's only idle card: node-b's other one
    ("two", [("small", {MEMORY: 2, CORE: 10}), ("big", {MEMORY: 3, CORE: 10})]),
    ("share-only", [("main", {CORE: 50})]),
    ("small", [("main", {MEMORY: 2, CORE: 20})]),
    ("fits-a", [("main", {MEMORY: 3, CORE: 15})]),
]
FILLERS = (("a-0", 7, 80), ("a-1", 11, 10))  # on node-a, bound without the extender


def check_admitted_on_the_chosen_cards(cluster, name, containers, result):
    """Each container's memory and share are on the card the extender chose."""
    annotations = cluster.annotations(name)
    cards = chosen_cards(annotations)
    for index, (container, requests) in enumerate(containers):
        admitted = next(c for c in result.containers if c.name == container)
        card = INDEX[admitted.envs["NVIDIA_VISIBLE_DEVICES"]]
        assert card == cards[index], (name, container, annotations, admitted.envs)
        for ids in admitted.device_ids.values():  # memory and share devices: that card's
            assert {INDEX[i.split("-_-")[0]] for i in ids} == {card}
        if CORE in requests:
            assert admitted.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(requests[CORE])


def expected_per_card(cluster, placed, node):
    """(MiB, %) per card of ``node``: the fillers and what the extender placed there."""
    memory, core = [0, 0], [0, 0]
    if node == "node-a":
        for (_, gib, percent), card in zip(FILLERS, (0, 1), strict=True):
            memory[card] += gib * 1024
            core[card] += percent
    for name, containers in PODS:
        if placed[name].node != node or name == "whole":
            continue
        cards = chosen_cards(cluster.annotations(name))
        for index, (_, requests) in enumerate(containers):
            memory[cards[index]] += requests.get(MEMORY, 0) * 1024
            core[cards[index]] += requests.get(CORE, 0)
    return memory, core


def test_the_extender_places_and_both_nodes_admit_on_exactly_the_chosen_cards(cluster):
    # node-a: GPU0 8 GiB/20 % free, GPU1 4 GiB/90 % free. Its totals (12 GiB, 110 %) fit a
    # 6 GiB + 40 % pod; no card does.
    for name, memory, core in FILLERS:
        containers = [("main", {MEMORY: memory, CORE: core})]
        cluster.create(name, containers, node="node-a")
        cluster.admit("node-a", name, containers)
    cluster.wait_gpus("node-a", lambda g: [c["memory_allocated_mib"] for c in g] == [7168, 11264])

    placed = {}
    for name, containers in PODS:
        cluster.create(name, containers)
        placed[name] = decision = cluster.scheduler.schedule("default", name)
        assert decision.node, (name, decision, cluster.extender.log())
        result = cluster.admit(decision.node, name, containers)
        if name == "whole":
            assert "ALIYUN_COM_GPU_MEM_IDX" not in cluster.annotations(name)  # the node picks
        else:
            check_admitted_on_the_chosen_cards(cluster, name, containers, result)

    # Every choice came with the extender's signature, and the nodes believed each one.
    for name, _ in PODS:
        if name != "whole":
            assert cluster.annotations(name)["gpushare.aliyun.com/placement"].startswith("v1;")
    ignored = [e for e in cluster.api.events() if e["reason"] == "GPUSharePlacementIgnored"]
    assert not ignored, [(e["involvedObject"]["name"], e["message"], e["source"]) for e in ignored]

    # The example: node-a skipped with the reason, node-b chosen.
    assert placed["job"].node == "node-b"
    assert placed["job"].failed["node-a"] == (
        "no single GPU on node-a has 6 GiB and 40 percent free: GPU0 (Tesla T4) has "
        "8 GiB/20 percent free, GPU1 (Tesla T4) has 4 GiB/90 percent free"
    )
    assert placed["whole"].node == "node-b"

    # The nodes publish what they admitted; per card it equals what the extender placed.
    memory_a, core_a = expected_per_card(cluster, placed, "node-a")
    # A node publishes at most once a second, and a container's memory and share come in
    # two Allocate calls: wait for the final state, not the first sign of the pods.
    gpus_a = cluster.wait_gpus(
        "node-a",
        lambda g: (
            [(c["memory_allocated_mib"], c["core_allocated_percent"]) for c in g]
            == list(zip(memory_a, core_a, strict=True))
        ),
    )
    assert [c["core_allocated_percent"] for c in gpus_a] == core_a
    memory_b, core_b = expected_per_card(cluster, placed, "node-b")

    def node_b_final(g) -> bool:
        shared = [c for c in g if c["mode"] != "whole"]
        return any(c["mode"] == "whole" for c in g) and all(
            (c["memory_allocated_mib"], c["core_allocated_percent"])
            == (memory_b[c["index"]], core_b[c["index"]])
            for c in shared
        )

    gpus_b = cluster.wait_gpus("node-b", node_b_final)
    for card in gpus_b:
        if card["mode"] == "whole":
            assert memory_b[card["index"]] == 0  # the extender left that card to it
        else:
            assert card["memory_allocated_mib"] == memory_b[card["index"]]
            assert card["core_allocated_percent"] == core_b[card["index"]]

    # Fits nowhere: stays Pending, with each node's reason.
    cluster.create("huge", [("main", {MEMORY: 16})])
    decision = cluster.scheduler.schedule("default", "huge")
    assert decision.node is None
    assert cluster.api.pod("default", "huge")["spec"].get("nodeName") is None
    assert set(decision.failed) == {"node-a", "node-b"}
    assert decision.failed["node-b"].startswith("no single GPU on node-b has 16 GiB free: GPU0")
    cluster.create("too-much-share", [("main", {MEMORY: 1, CORE: 95})])
    decision = cluster.scheduler.schedule("default", "too-much-share")
    assert decision.node is None
    assert "has 1 GiB and 95 percent free" in decision.failed["node-a"]

    check_kubectl_inspect(cluster, memory_a, core_a)


def check_kubectl_inspect(cluster, memory_a, core_a):
    """kubectl inspect gpushare, through the real kubectl: the placement, with the share."""
    # $GPUSHARE_KUBECTL: a kubectl that is not the first in $PATH (Debian's kubernetes-client
    # next to another one, e.g. unpacked with apt-get download + dpkg-deb -x).
    kubectl = os.environ.get("GPUSHARE_KUBECTL") or shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (apt-get install kubernetes-client)")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["KUBECONFIG"] = cluster.kubeconfig
    env["HOME"] = cluster.nodes["node-a"].root
    done = subprocess.run(
        [kubectl, "inspect", "gpushare"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line}
    assert rows["NAME"][-2:] == ["GPU0(Core)", "GPU1(Core)"]
    gib = [m // 1024 for m in memory_a]
    assert rows["node-a"][2:4] == [f"{gib[0]}/15", f"{gib[1]}/15"]
    assert rows["node-a"][-2:] == [f"{core_a[0]}%", f"{core_a[1]}%"]
    details = subprocess.run(
        [kubectl, "inspect", "gpushare", "-d"], capture_output=True, text=True, env=env, timeout=60
    )
    assert details.returncode == 0, details.stderr
    job_row = next(line.split() for line in details.stdout.splitlines() if line.startswith("job "))
    job_card = chosen_cards(cluster.annotations("job"))[0]
    assert job_row[2 + job_card] == "6" and job_row[4 + job_card] == "40%"
