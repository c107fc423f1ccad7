"""End to end with the Kubernetes API: the real gpushare-node, the test kubelet (real
device plugin and PodResources gRPC) and the test API server (real REST and watch, the
official client inside the daemon).

Pins: each container of a multi-container pod lands on a card that fits it, and the pod's
annotations say so the way `kubectl inspect gpushare` reads them; the scheduler
extender's card is honoured when it signed it (its key's public half in
kubernetes.placement_public_key), and the old extender's unsigned annotations only under
``placement_trust: annotations``; a container asking 4 GiB + 40 % while one card has only
30 % share left lands wholly on the other card, whichever resource kubelet allocates
first; a pod gets no annotation while its container holds only the first of its two
resources (either order); a pod admitted right after another was deleted gets the room
it left, before any reconcile, whichever resource comes first; node labels (foreign ones
untouched), gpu-count and the per-card annotation follow allocations and releases; a
refusal becomes a pod Event; with the API server stopped for a minute admissions keep
working and the annotations catch up when it returns; the pods are listed once, never on
the Allocate path.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from nodemgr.common.placementkey import read_private_key
from nodemgr.domain.extenderchoice import signed_message, signed_text, with_signature
from standins import placementkeys
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, WHOLE, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet

pytestmark = pytest.mark.e2e

PREFIX = "gpushare.aliyun.com/"
PLACEMENT = PREFIX + "placement"


class Cluster:
    def __init__(self, trust="signed"):
        self.api = TestApiServer()
        self.api.start()
        self.api.add_node("node-a", labels={"team": "ml", PREFIX + "stale-label": "x"})
        self.node = Node()
        kubeconfig = self.api.write_kubeconfig(os.path.join(self.node.root, "kubeconfig"))
        private, public = placementkeys.write_pair(self.node.root)
        self.signing_key = read_private_key(private)  # the extender's
        kubernetes = {
            "kubeconfig": kubeconfig,
            "placement_public_key": public,
            "placement_trust": trust,
        }
        self.node.rewrite_config(lambda c: c.update(kubernetes=kubernetes))
        self.kubelet = TestKubelet(self.node.device_plugin_dir, self.node.pod_resources_socket)
        self.kubelet.start()
        self.node.start()
        for resource in (MEMORY, CORE, WHOLE):
            self.kubelet.wait_for_resource(resource, timeout=20)

    def create(self, name, containers, annotations=None, node="node-a"):
        """The scheduler binds a pod to node-a (it is in the API before kubelet admits it)."""
        self.api.add_pod(
            "default",
            name,
            node,
            containers=[
                {"name": n, "requests": {r: str(q) for r, q in requests.items()}}
                for n, requests in containers
            ],
            annotations=annotations,
        )

    def admit(
        self, name, containers, order=None, annotations=None, create=True, after_allocate=None
    ):
        if create:
            self.create(name, containers, annotations)
        result = self.kubelet.admit_pod(
            "default",
            name,
            [ContainerSpec(n, r) for n, r in containers],
            order=order,
            after_allocate=after_allocate,
        )
        if result.ok:
            for container, _ in containers:
                self.kubelet.start_container("default", name, container)
        return result

    def bind_signed(self, name, node, cards, t):
        """What the extender does at bind: its signed placement on the pod, then the
        Binding (the node's watch sees the pod bound with its annotations)."""
        uid = self.api.pod("default", name)["metadata"]["uid"]
        text = signed_text(uid, node, t, cards)
        value = with_signature(text, self.signing_key.sign(signed_message(text)))

        def bind(pod):
            pod["metadata"].setdefault("annotations", {}).update({PLACEMENT: value})
            pod["spec"]["nodeName"] = node

        self.api.update_pod("default", name, bind)

    def annotations(self, pod):
        return self.api.pod("default", pod)["metadata"].get("annotations", {})

    def wait_annotations(self, pod, timeout=15.0):
        return self.node.wait_for(
            lambda: (
                self.annotations(pod).get("ALIYUN_COM_GPU_MEM_ASSIGNED") == "true"
                and self.annotations(pod)
            ),
            timeout=timeout,
            what=f"the gpushare annotations of {pod}",
        )

    def close(self):
        self.node.cleanup()
        self.kubelet.stop()
        self.api.stop()


@pytest.fixture
def cluster():
    cluster = Cluster()
    yield cluster
    cluster.close()


def inspect_gpushare(api, node_name="node-a"):
    """GiB allocated per GPU index, read like `kubectl inspect gpushare` does: a pod's
    ALIYUN_COM_GPU_MEM_IDX (no index: PENDING, not counted), the per-container allocation
    annotation when present, else the pod's whole gpu-mem on IDX."""
    used = {}
    for pod in api.pods():
        if pod["spec"].get("nodeName") != node_name:
            continue
        annotations = pod["metadata"].get("annotations", {})
        if "ALIYUN_COM_GPU_MEM_IDX" not in annotations:
            continue
        per_container = annotations.get("scheduler.framework.gpushare.allocation")
        if per_container:
            for gpus in json.loads(per_container).values():
                for index, units in gpus.items():
                    used[int(index)] = used.get(int(index), 0) + units
        else:
            total = sum(
                int(c["resources"]["limits"].get(MEMORY, 0)) for c in pod["spec"]["containers"]
            )
            index = int(annotations["ALIYUN_COM_GPU_MEM_IDX"])
            used[index] = used.get(index, 0) + total
    return used


def card_of(result, container):
    return next(c for c in result.containers if c.name == container).envs["NVIDIA_VISIBLE_DEVICES"]


def test_two_container_pod_each_container_on_a_fitting_card_with_inspect_annotations(cluster):
    assert cluster.admit("filler", [("main", {MEMORY: 10})]).ok  # GPU0: 5 GiB left
    result = cluster.admit("two", [("small", {MEMORY: 4}), ("big", {MEMORY: 8, CORE: 20})])
    assert result.ok, result.error
    assert card_of(result, "small") == GPU0  # binpack: the fuller card that fits
    assert card_of(result, "big") == GPU1  # 8 GiB does not fit GPU0 any more
    big_env = next(c for c in result.containers if c.name == "big").envs
    assert big_env["ALIYUN_COM_GPU_MEM_POD"] == "12"
    annotations = cluster.wait_annotations("two")
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert annotations["ALIYUN_COM_GPU_MEM_POD"] == "12"
    assert json.loads(annotations["scheduler.framework.gpushare.allocation"]) == {
        "0": {"0": 4},
        "1": {"1": 8},
    }
    cluster.wait_annotations("filler")
    assert inspect_gpushare(cluster.api) == {0: 14, 1: 8}
    pod_lists = [r for r in cluster.api.requests if r[0] == "GET" and r[1].endswith("/pods")
                 and r[2].get("watch") not in ("true", "1")]  # fmt: skip
    assert len(pod_lists) == 1, pod_lists  # one LIST at start; admissions read the cache


def test_extender_choice_is_honoured_when_signed_and_marked_assigned(cluster):
    """The gpushare annotations as the extender writes them at bind, and its signed
    placement of the same card: the node honours GPU1 where binpack alone takes GPU0."""
    now = time.time_ns()
    chosen = {
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(now),
    }
    cluster.create("pinned", [("main", {MEMORY: 2})], annotations=chosen, node=None)
    cluster.bind_signed("pinned", "node-a", {0: 1}, now)
    result = cluster.admit("pinned", [("main", {MEMORY: 2})], create=False)
    assert result.ok, result.error
    assert card_of(result, "main") == GPU1  # binpack alone would take GPU0
    annotations = cluster.wait_annotations("pinned")
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    assert not [e for e in cluster.api.events() if e["reason"] == "GPUSharePlacementIgnored"]


def test_annotations_trust_honours_the_old_extenders_unsigned_choice():
    """``kubernetes.placement_trust: annotations``: the old gpushare extender's unsigned
    ALIYUN_COM_GPU_MEM_IDX is honoured (and so is a pod owner's: the documented risk)."""
    cluster = Cluster(trust="annotations")
    try:
        chosen = {
            "ALIYUN_COM_GPU_MEM_IDX": "1",
            "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
            "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(time.time_ns()),
        }
        result = cluster.admit("old", [("main", {MEMORY: 2})], annotations=chosen)
        assert result.ok, result.error
        assert card_of(result, "main") == GPU1
    finally:
        cluster.close()


@pytest.mark.parametrize("order", [[MEMORY, CORE], [CORE, MEMORY]])
def test_memory_and_share_land_wholly_on_the_card_that_fits_both(cluster, order):
    assert cluster.admit("busy", [("main", {MEMORY: 2, CORE: 70})]).ok  # GPU0: 30 % left
    result = cluster.admit("job", [("main", {MEMORY: 4, CORE: 40})], order=order)
    assert result.ok, result.error
    [container] = result.containers
    assert {ids[0].split("-_-")[0] for ids in container.device_ids.values()} == {GPU1}
    assert container.envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert container.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert cluster.wait_annotations("job")["ALIYUN_COM_GPU_MEM_IDX"] == "1"


def node_gpus(api):
    """The cards of the node annotation gpushare-node publishes (None before the first)."""
    text = api.node("node-a")["metadata"].get("annotations", {}).get(PREFIX + "gpus")
    return json.loads(text)["gpus"] if text else None


@pytest.mark.parametrize("order", [[CORE, MEMORY], [MEMORY, CORE]])
def test_no_pod_annotation_from_half_a_containers_demand(cluster, order):
    """kubelet allocates a container's memory and share one after the other, in either
    order. Held between the two until a publish has shown the first in the node annotation,
    the pod still has no gpushare annotation (no isolation "unlimited" for the half not yet
    allocated, no pod total of 0); after the second, its isolation says what the whole
    demand gets."""
    published_half = []

    def pause(container, resource):
        if resource != order[0]:
            return
        cluster.node.wait_for(
            lambda: any(card["allocations"] for card in node_gpus(cluster.api) or []),
            what="a publish of the first resource's allocation",
        )
        published_half.append(dict(cluster.annotations("job")))

    result = cluster.admit("job", [("main", {MEMORY: 4, CORE: 30})], order=order,
                           after_allocate=pause)  # fmt: skip
    assert result.ok, result.error
    assert [{k: v for k, v in a.items() if "GPU_MEM" in k or "isolation" in k}
            for a in published_half] == [{}]  # fmt: skip
    annotations = cluster.node.wait_for(
        lambda: cluster.annotations("job").get(PREFIX + "isolation") and cluster.annotations("job"),
        what="the isolation annotation",
    )
    isolation = json.loads(annotations[PREFIX + "isolation"])["main"]
    assert isolation["memory"] != "unlimited" and isolation["compute"] != "unlimited", isolation
    assert annotations["ALIYUN_COM_GPU_MEM_POD"] == "4"


@pytest.mark.parametrize("order", [[CORE, MEMORY], [MEMORY, CORE]])
def test_a_pod_admitted_right_after_another_left_gets_its_room(cluster, order):
    """Both cards hold 12 GiB + 50 %. One pod is deleted and kubelet hands its devices to
    the next pod at once, before gpushare-node reconciles: that pod, asking the same,
    lands on the card it left, whichever resource kubelet allocates first (a refusal would
    be final: kubelet never retries the pod)."""
    for name in ("old-0", "old-1"):
        assert cluster.admit(name, [("main", {MEMORY: 12, CORE: 50})]).ok
    cluster.api.delete_pod("default", "old-0")
    cluster.kubelet.remove_pod("default", "old-0")
    result = cluster.admit("new", [("main", {MEMORY: 12, CORE: 50})], order=order)
    assert result.ok, result.error
    assert card_of(result, "main") == GPU0  # where old-0 was (binpack: the first card)


def test_a_pod_recreated_under_its_name_before_a_reconcile_is_matched_to_its_spec(cluster):
    """A StatefulSet's web-0: deleted, created again under its name (a new UID) with the
    extender's placement on GPU1 signed over that UID, and admitted before gpushare-node
    reconciled the old one away (kubelet's PodResources is down meanwhile, so no reconcile
    can). The old allocation still holds under default/web-0/main, yet the new pod is
    matched to its own spec: the extender's card is honoured, the pod-total env is there,
    and its annotations count its own allocation only. Once kubelet answers again, the old
    allocation goes and the new one stays."""
    spec = [("main", {MEMORY: 2, CORE: 10})]
    assert cluster.admit("web-0", spec).ok  # binpack: GPU0
    [old_id] = [a["id"] for a in cluster.node.allocations()]
    cluster.kubelet.set_pod_resources_available(False)
    cluster.api.delete_pod("default", "web-0")
    cluster.kubelet.remove_pod("default", "web-0")  # its devices free for the next pod
    now = time.time_ns()
    chosen = {"ALIYUN_COM_GPU_MEM_ASSIGNED": "false", "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(now)}
    cluster.create("web-0", spec, annotations=chosen, node=None)
    cluster.bind_signed("web-0", "node-a", {0: 1}, now)
    result = cluster.admit("web-0", spec, create=False)
    assert result.ok, result.error
    assert card_of(result, "main") == GPU1  # binpack alone (no pod known) takes GPU0
    assert result.containers[0].envs["ALIYUN_COM_GPU_MEM_POD"] == "2"
    annotations = cluster.wait_annotations("web-0")
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    assert annotations["ALIYUN_COM_GPU_MEM_POD"] == "2"  # not 4: the old one's is not its
    uid = cluster.api.pod("default", "web-0")["metadata"]["uid"]
    held = {a["id"]: (a["cards"], a["pod_uid"]) for a in cluster.node.allocations()}
    assert len(held) == 2 and held[old_id][0] == [GPU0]  # no reconcile yet
    assert held[old_id][1] != uid
    assert sorted(held.values()) == sorted([held[old_id], ([GPU1], uid)])
    cluster.kubelet.set_pod_resources_available(True)
    cluster.node.wait_for(
        lambda: [(a["cards"], a["pod_uid"]) for a in cluster.node.allocations()] == [([GPU1], uid)],
        timeout=20,
        what="the old web-0's allocation released, the new one's kept",
    )


def test_node_labels_count_and_card_annotation_follow_allocations_and_releases(cluster):
    api = cluster.api

    def node():
        return api.node("node-a")

    def gpus():
        text = node()["metadata"].get("annotations", {}).get(PREFIX + "gpus")
        return json.loads(text)["gpus"] if text else None

    labels = cluster.node.wait_for(
        lambda: (
            PREFIX + "gpu-count" in node()["metadata"]["labels"] and node()["metadata"]["labels"]
        ),
        what="the node labels",
    )
    assert labels["team"] == "ml"  # not ours: untouched
    assert PREFIX + "stale-label" not in labels  # ours, no longer meant: removed
    assert labels[PREFIX + "gpu-count"] == "2"
    assert labels[PREFIX + "gpu-model"] == "Tesla-T4"
    assert labels[PREFIX + "gpu-memory-mib"] == "15360"
    status = node()["status"]
    assert status["capacity"]["aliyun.com/gpu-count"] == "2"
    assert status["allocatable"]["aliyun.com/gpu-count"] == "2"

    assert cluster.admit("job", [("main", {MEMORY: 4, CORE: 30})]).ok
    cluster.node.wait_for(
        lambda: (g := gpus()) and g[0]["allocations"] == [["default", "job", "main", 4096, 30]],
        what="the allocation in the node annotation",
    )
    assert gpus()[0]["memory_allocated_mib"] == 4096 and gpus()[0]["mode"] == "shared"

    cluster.kubelet.remove_pod("default", "job")
    api.delete_pod("default", "job")
    cluster.node.wait_for(
        lambda: (g := gpus()) and all(not card["allocations"] for card in g),
        what="the release in the node annotation",
    )
    assert [card["mode"] for card in gpus()] == ["idle", "idle"]


def test_a_refusal_becomes_a_pod_event(cluster):
    assert cluster.admit("small", [("main", {MEMORY: 2, CORE: 10})]).ok  # GPU0: 13 GiB/90 %
    assert cluster.admit("large", [("main", {MEMORY: 14})]).ok  # GPU1: 1 GiB/100 %
    refused = cluster.admit("toobig", [("main", {MEMORY: 8, CORE: 95})])
    assert not refused.ok
    assert "no single GPU on node-a has 8 GiB and 95% free" in refused.error
    event = cluster.node.wait_for(
        lambda: next(
            (e for e in cluster.api.events() if e.get("reason") == "GPUShareRefused"), None
        ),
        what="the refusal event",
    )
    assert event["involvedObject"]["name"] == "toobig"
    assert "8 GiB and 95%" in event["message"] and "default/toobig/main" in event["message"]
    assert "never retries it" in event["message"] and "Deployment" in event["message"]


def test_admissions_work_with_the_api_server_down_and_annotations_catch_up(cluster):
    cluster.create("during-1", [("main", {MEMORY: 3, CORE: 20})])
    cluster.create("during-2", [("a", {MEMORY: 2}), ("b", {MEMORY: 13})])
    time.sleep(1.0)  # the daemon's watch has both pods bound here
    cluster.api.stop()
    outage_started = time.monotonic()
    started = time.monotonic()
    first = cluster.admit("during-1", [("main", {MEMORY: 3, CORE: 20})], create=False)
    second = cluster.admit("during-2", [("a", {MEMORY: 2}), ("b", {MEMORY: 13})], create=False)
    assert first.ok and second.ok, (first.error, second.error)
    assert time.monotonic() - started < 10  # the API server being down blocks nothing
    # The pod identity came from the cache: the pod total is known although the API is down.
    assert first.containers[0].envs["ALIYUN_COM_GPU_MEM_POD"] == "3"
    assert card_of(second, "a") != card_of(second, "b")  # 13 GiB needs a card of its own
    time.sleep(max(0.0, 60.0 - (time.monotonic() - outage_started)))  # a minute down
    assert cluster.node.process.poll() is None
    cluster.api.restart()
    annotations = cluster.wait_annotations("during-2", timeout=60)
    assert json.loads(annotations["scheduler.framework.gpushare.allocation"]) == {
        "0": {str(int(card_of(second, "a") == GPU1)): 2},
        "1": {str(int(card_of(second, "b") == GPU1)): 13},
    }
    assert cluster.wait_annotations("during-1", timeout=30)["ALIYUN_COM_GPU_MEM_POD"] == "3"
