"""Pins nodemgr.kubernetes.sync, between the allocator and the adapter: CandidatePods gives
the allocator the adapter's candidate index and its index by what the candidates ask (also
through a real KubeAdapter on the test API server), and says the cache is live only when
synced and watching; candidate_filter keeps pending pods asking for a shared resource; the
Publisher hands the adapter only what differs from what it last sent (pod annotations per
pod, node labels, the node annotation and gpu-count together), forgets released pods,
publishes at start and after an allocation change, and survives a failing publish;
refusals and violations become pod Events (none for a process of no known pod)."""

import json
import threading
import time
from dataclasses import replace

from nodemgr.common.changes import ChangeCounter
from nodemgr.config.schema import KubernetesSettings
from nodemgr.domain.deviceids import ResourceKind, memory_device_id
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.podmatch import ContainerRequest, Demand, PodInfo, asked_sizes
from nodemgr.domain.violations import MEMORY, Violation
from nodemgr.errors import REFUSAL_IS_FINAL
from nodemgr.inventory import Card
from nodemgr.kubernetes.adapter import KubeAdapter
from nodemgr.kubernetes.publish import GPU_COUNT_RESOURCE
from nodemgr.kubernetes.sync import (
    REFUSAL_REASON,
    VIOLATION_REASON,
    CandidatePods,
    Publisher,
    candidate_filter,
    post_refusal,
    post_violation,
)
from standins.threadstats import wakeups_while_idle
from tests.unit.kubernetes.support import CORE, MEM, NODE, PREFIX, TIMEOUT_SECONDS, wait_until

CARDS = (Card(0, "GPU-a", "Tesla T4", 15360), Card(1, "GPU-b", "Tesla T4", 15360))


def pod(name, phase="Pending", requests=None):
    return PodInfo(
        namespace="ml",
        name=name,
        uid=f"uid-{name}",
        node_name="node-a",
        phase=phase,
        created_at=100.0,
        deleting=False,
        annotations={},
        containers=(ContainerRequest("main", requests if requests is not None else {MEM: 4}),),
    )


def allocation(id_, pod_name, units=4, card="GPU-a"):
    devices = {ResourceKind.MEMORY: tuple(memory_device_id(card, j) for j in range(units))}
    owner = ContainerRef("ml", pod_name, "main")
    return Allocation(id_, devices, units * 1024, 1000.0, owner=owner)


class FakeAllocator:
    def __init__(self, allocations=()):
        self.cards = CARDS
        self.resource_names = {ResourceKind.MEMORY: MEM, ResourceKind.CORE: CORE}
        self.changes = ChangeCounter()
        self.held = list(allocations)

    def allocations(self):
        return list(self.held)


class FakeAdapter:
    """Records what the publisher hands over; ``published`` is set at each node write."""

    def __init__(self, pods=(), fail_first=0):
        self.pod_list = list(pods)
        self.calls = []
        self.published = threading.Event()
        self.pod_written = threading.Event()
        self._fail = fail_first
        self.state_value = {"synced": True, "watching": True}
        self.generation = 7

    def pods(self):
        if self._fail:
            self._fail -= 1
            self.published.set()
            raise RuntimeError("adapter bug")
        return list(self.pod_list)

    def patch_pod_annotations(self, namespace, name, annotations):
        self.calls.append(("pod", namespace, name, annotations))
        self.pod_written.set()

    def set_node_labels(self, labels):
        self.calls.append(("labels", labels))

    def set_node_annotations(self, annotations):
        self.calls.append(("node-annotations", annotations))

    def set_node_extended_resources(self, quantities):
        self.calls.append(("resources", quantities))
        self.published.set()

    def record_event(self, namespace, pod, reason, message, type="Warning"):
        self.calls.append(("event", namespace, pod, reason, message))

    def state(self):
        return self.state_value

    def candidates(self):
        return tuple(p for p in self.pod_list if p.phase == "Pending")

    def candidates_asking(self, resource, size):
        return tuple(p for p in self.candidates() if (resource, size) in asked_sizes(p))

    def wait_for_change(self, seen_generation, timeout):
        return seen_generation + 1


STATUS = {"allocations": [], "gpus": []}


def publisher(adapter, allocator, status=None):
    document = status if status is not None else dict(STATUS)
    return Publisher(adapter, allocator, lambda: document, 1024, True, PREFIX)


def kinds(calls):
    return [call[0] for call in calls]


# --- CandidatePods and the filter ---------------------------------------------------------


def test_candidate_pods_are_the_adapters_index():
    """The allocator's PodSource reads the adapter's candidates, its index of them by
    what they ask, generation and waits."""
    adapter = FakeAdapter([pod("a"), pod("b", phase="Running"), pod("c", requests={MEM: 2})])
    source = CandidatePods(adapter)
    assert [p.name for p in source.candidates()] == ["a", "c"]
    assert [p.name for p in source.candidates_asking(MEM, 4)] == ["a"]
    assert [p.name for p in source.candidates_asking(MEM, 2)] == ["c"]
    assert source.generation == 7
    assert source.wait_for_change(7, 1.0) == 8


def test_candidates_asking_is_the_real_adapters_pod_watch_index(api, tmp_path):
    """Through a real KubeAdapter on the test API server (the daemon's wiring, with
    candidate_filter): the pending pods asking exactly (resource, size), following the
    watch; an adapter without a watch (kubernetes disabled) has none."""
    api.add_pod("ml", "a", NODE, containers=[{"name": "m", "requests": {MEM: "4", CORE: "30"}}])
    api.add_pod("ml", "b", NODE, containers=[{"name": "m", "requests": {MEM: "2"}}])
    api.add_pod(
        "ml", "done", NODE, phase="Running", containers=[{"name": "m", "requests": {MEM: "4"}}]
    )
    settings = KubernetesSettings(
        kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig"),
        request_timeout_seconds=TIMEOUT_SECONDS,
    )
    adapter = KubeAdapter(settings, NODE, candidate_filter=candidate_filter((MEM, CORE)))
    adapter.start()
    try:
        wait_until(lambda: adapter.synced, what="initial LIST")
        source = CandidatePods(adapter)

        def asking(resource, size):
            return sorted(p.name for p in source.candidates_asking(resource, size))

        assert (asking(MEM, 4), asking(CORE, 30), asking(MEM, 2)) == (["a"], ["a"], ["b"])
        api.add_pod("ml", "c", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}])
        wait_until(lambda: asking(MEM, 4) == ["a", "c"], what="ADDED pod in its bucket")
    finally:
        adapter.stop()
        adapter.join(2.0)
    disabled = KubeAdapter(KubernetesSettings(enabled=False), NODE, home=str(tmp_path))
    disabled.start()
    assert CandidatePods(disabled).candidates_asking(MEM, 4) == ()


def test_the_cache_is_live_only_when_synced_and_watching():
    """Worth waiting for only with a complete LIST and an open watch."""
    adapter = FakeAdapter()
    source = CandidatePods(adapter)
    assert source.live is True
    for state in ({"synced": True, "watching": False}, {"synced": False, "watching": True}, {}):
        adapter.state_value = state
        assert source.live is False


def test_candidate_filter_keeps_pending_pods_asking_for_a_shared_resource():
    """Pending and asking for memory or share: a candidate; running, or asking for
    something else only: not."""
    keep = candidate_filter((MEM, CORE))
    assert keep(pod("a", requests={MEM: 4}))
    assert keep(pod("b", requests={CORE: 20}))
    assert not keep(pod("c", phase="Running"))
    assert not keep(pod("d", requests={"nvidia.com/gpu": 1}))


# --- Publisher.publish --------------------------------------------------------------------


def test_first_publish_sends_pods_and_the_node():
    """Each pod holding shared GPUs gets its gpushare annotations; the node gets its
    labels, its per-card annotation under the prefix, and gpu-count."""
    adapter = FakeAdapter([pod("train-0")])
    publisher(adapter, FakeAllocator([allocation("ga-1", "train-0")])).publish()
    assert kinds(adapter.calls) == ["pod", "labels", "node-annotations", "resources"]
    _, namespace, name, annotations = adapter.calls[0]
    assert (namespace, name) == ("ml", "train-0")
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert annotations["ALIYUN_COM_GPU_MEM_POD"] == "4"
    assert adapter.calls[1][1]["gpu-count"] == "2"
    assert set(adapter.calls[2][1]) == {PREFIX + "gpus"}
    assert adapter.calls[3] == ("resources", {GPU_COUNT_RESOURCE: 2})


def test_nothing_changed_nothing_sent():
    """A second publish with the same state hands the adapter nothing."""
    adapter = FakeAdapter([pod("train-0")])
    sync = publisher(adapter, FakeAllocator([allocation("ga-1", "train-0")]))
    sync.publish()
    adapter.calls.clear()
    sync.publish()
    assert adapter.calls == []


def test_only_the_pod_that_changed_is_sent():
    """A new allocation for another pod: that pod's annotations, and nothing else (the
    node's labels and annotation did not change)."""
    allocator = FakeAllocator([allocation("ga-1", "train-0")])
    adapter = FakeAdapter([pod("train-0"), pod("train-1")])
    sync = publisher(adapter, allocator)
    sync.publish()
    adapter.calls.clear()
    allocator.held.append(allocation("ga-2", "train-1", card="GPU-b"))
    sync.publish()
    assert [(c[0], c[2]) for c in adapter.calls] == [("pod", "train-1")]
    assert adapter.calls[0][3]["ALIYUN_COM_GPU_MEM_IDX"] == "1"


def test_a_released_pod_is_forgotten_and_sent_again_if_it_comes_back():
    """A pod whose allocation was released is forgotten: the same annotations later are
    sent again (the pod may have been recreated under the same name)."""
    first = allocation("ga-1", "train-0")
    allocator = FakeAllocator([first])
    adapter = FakeAdapter([pod("train-0")])
    sync = publisher(adapter, allocator)
    sync.publish()
    allocator.held.clear()
    sync.publish()
    adapter.calls.clear()
    allocator.held.append(first)
    sync.publish()
    assert kinds(adapter.calls) == ["pod"]


def test_a_pod_recreated_under_its_name_gets_annotations_equal_to_the_old_ones():
    """web-0 deleted and created again, its new allocation on the same card with the same
    demand, and no publish saw the name without an allocation: the new pod (another UID)
    has none of the annotations the old one got, so they are sent again, equal or not."""
    old_pod = pod("web-0")
    allocator = FakeAllocator([replace(allocation("ga-1", "web-0"), owner_uid=old_pod.uid)])
    adapter = FakeAdapter([old_pod])
    sync = publisher(adapter, allocator)
    sync.publish()
    adapter.calls.clear()
    new_pod = replace(old_pod, uid="uid-web-0-again")
    adapter.pod_list = [new_pod]
    allocator.held = [replace(allocation("ga-2", "web-0"), owner_uid=new_pod.uid)]
    sync.publish()
    assert [(c[0], c[2]) for c in adapter.calls] == [("pod", "web-0")]


def test_a_node_change_resends_labels_annotation_and_gpu_count_together():
    """The status document changed (a card's totals): the node's three writes go again."""
    status = {"allocations": [], "gpus": []}
    adapter = FakeAdapter()
    sync = publisher(adapter, FakeAllocator(), status)
    sync.publish()
    adapter.calls.clear()
    status["gpus"] = [
        {
            "index": 0,
            "uuid": "GPU-a",
            "model": "Tesla T4",
            "mode": "idle",
            "healthy": False,
            "memory_total_mib": 15360,
            "memory_allocated_mib": 0,
            "core_allocated_percent": 0,
        }
    ]
    sync.publish()
    assert kinds(adapter.calls) == ["labels", "node-annotations", "resources"]


# --- Publisher, the thread ----------------------------------------------------------------


def test_the_publisher_publishes_at_start_and_after_a_change():
    """Started: it publishes at once; an allocation change (the allocator's counter
    moving) publishes the new pod soon after; stop ends it."""
    allocator = FakeAllocator()
    adapter = FakeAdapter([pod("train-0")])
    sync = publisher(adapter, allocator)
    sync.start()
    try:
        assert adapter.published.wait(5), "no publish at start"
        assert not adapter.pod_written.is_set()  # nobody held a GPU at the first publish
        allocator.held.append(allocation("ga-1", "train-0"))
        allocator.changes.bump()
        assert adapter.pod_written.wait(5), "the change was not published"
        assert adapter.calls[-1][:3] == ("pod", "ml", "train-0")
    finally:
        sync.stop()
    assert sync.join(5)


def test_an_idle_publisher_sleeps_until_its_next_periodic_publish():
    """With nothing changing it does not wake on a short timer (it polled twice a second
    before): its waits last until the next periodic publish, and stop still ends it at
    once."""
    adapter = FakeAdapter([pod("train-0")])
    sync = publisher(adapter, FakeAllocator())  # nothing will change
    sync.start()
    try:
        assert adapter.published.wait(5), "no publish at start"
        time.sleep(1.1)  # past the one-per-second limit: now it waits for a change
        assert wakeups_while_idle(sync._thread, 1.5) <= 1
    finally:
        stopped = time.monotonic()
        sync.stop()
    assert sync.join(5) and time.monotonic() - stopped < 2


def test_a_failing_publish_does_not_end_the_publisher(caplog):
    """An error while publishing is logged; the thread lives on and the next change is
    published."""
    allocator = FakeAllocator()
    adapter = FakeAdapter([pod("train-0")], fail_first=1)
    sync = publisher(adapter, allocator)
    sync.start()
    try:
        assert adapter.published.wait(5), "the first publish was never tried"
        adapter.published.clear()
        allocator.changes.bump()
        assert adapter.published.wait(5), "no publish after the failure"
        assert sync.alive
    finally:
        sync.stop()
        sync.join(5)
    assert any("publishing to the Kubernetes API failed" in r.getMessage() for r in caplog.records)


# --- events -------------------------------------------------------------------------------


def test_a_refusal_is_an_event_on_the_pod():
    """post_refusal records a GPUShareRefused Event on the demand's pod with the message and
    what it means for the pod: rejected for good by kubelet, and what to do."""
    adapter = FakeAdapter()
    demand = Demand("ml", "train-0", "main", 0, 16, 0, None)
    post_refusal(adapter, demand, "no single GPU on node-a has 16 GiB free")
    message = f"no single GPU on node-a has 16 GiB free. {REFUSAL_IS_FINAL}"
    assert adapter.calls == [("event", "ml", "train-0", REFUSAL_REASON, message)]


def test_a_violation_is_an_event_naming_container_card_and_action():
    """post_violation records a GPUQuotaViolation naming the container, the card, what
    happened and the action; a process of no known pod gets no Event."""
    adapter = FakeAdapter()
    owner = ContainerRef("ml", "train-0", "main")
    violation = Violation(MEMORY, "GPU-a", (123,), "uses 6 GiB of its 4 GiB", owner=owner)
    post_violation(adapter, violation, "GPU0 (GPU-a)", "kill")
    assert adapter.calls == [
        (
            "event",
            "ml",
            "train-0",
            VIOLATION_REASON,
            "container main on GPU0 (GPU-a): uses 6 GiB of its 4 GiB (action: kill)",
        )
    ]
    adapter.calls.clear()
    post_violation(adapter, Violation(MEMORY, "GPU-a", (9,), "stray"), "GPU0", "log")
    assert adapter.calls == []


def test_pods_get_their_isolation_from_the_status_document():
    """Each pod's annotations include ``<prefix>isolation`` with its containers' levels,
    taken from the status document the node annotation is made of; an allocation the
    document does not know (made since) is left out until the next publish."""
    isolation = {"memory": "enforced", "memory_detail": "watchdog", "compute": "unlimited",
                 "compute_detail": "no share asked"}  # fmt: skip
    row = {"id": "ga-1", "gpus": ["GPU-a"], "namespace": "ml", "pod": "train-0",
           "container": "main", "memory_mib": 4096, "core_percent": 0,
           "isolation": isolation}  # fmt: skip
    status = {"allocations": [row], "gpus": []}
    allocator = FakeAllocator([allocation("ga-1", "train-0"), allocation("ga-2", "train-1")])
    adapter = FakeAdapter([pod("train-0"), pod("train-1")])
    publisher(adapter, allocator, status).publish()
    sent = {call[2]: call[3] for call in adapter.calls if call[0] == "pod"}
    assert json.loads(sent["train-0"][PREFIX + "isolation"]) == {
        "main": {"memory": "enforced", "compute": "unlimited"}
    }
    assert PREFIX + "isolation" not in sent["train-1"]
