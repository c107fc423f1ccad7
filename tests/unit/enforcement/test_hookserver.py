"""Pins the daemon's end of the hook socket with a real ContainerRegistry, Allocator and Ledger:
a malformed request is refused with a message naming what is wrong and registers nothing; a
container whose env matches a live allocation is registered durably (a new Ledger loads it) and
poststop forgets it; a mismatching env, a vanished init process, a second pod on one allocation
or a GPU container without a whole pod identity is refused (any container of the pod may use
it); the socket is root-only (0600). Trickling clients hold the socket neither forever (a total
deadline per connection) nor in numbers (a connection cap: the excess is closed at once,
counted and logged once), and a real call still answers; a host cgroup is refused. A
createRuntime request must carry well-formed spec facts (a stale hook's request without them is
refused); a spec showing another card's MPS pipe directory or node is refused naming the mount
and the card, one showing any GPU thing without an allocation too, and one showing only its own
card's passes."""

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from hooks import podidentity, protocol
from mps.layout import MpsLayout
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import CgroupKey, ContainerRef
from nodemgr.enforcement import hookserver, hostdevices
from nodemgr.enforcement.hookserver import HookServer
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, GPU1, MPS_PIPE, env_of, simulated_settings

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
PIPE = MPS_PIPE
POD_A = {"namespace": "default", "pod": "a", "container": "main"}
POD_B = {"namespace": "default", "pod": "b", "container": "main"}
CRI_POD = "io.kubernetes.cri.sandbox-name"


class Node:
    def __init__(self, tmp_path):
        self.settings = simulated_settings(str(tmp_path))
        self.ledger = Ledger(self.settings.state_dir)
        cards = open_inventory(self.settings.gpus).cards()
        self.allocator = Allocator(self.settings, cards, self.ledger)
        self.layout = MpsLayout(self.settings.run_dir)
        self.registry = ContainerRegistry(self.ledger, self.allocator, PIPE, mps_layout=self.layout)
        # Unix socket paths must stay under 108 bytes; pytest's tmp_path may not.
        self.socket_dir = tempfile.mkdtemp(dir="/tmp", prefix="gsn-")
        self.socket_path = os.path.join(self.socket_dir, "hook.sock")
        self.server = HookServer(self.registry, self.socket_path)
        self.server.start()

    def close(self):
        self.server.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def allocate(self, memory_units=4, core_percent=30):
        """What kubelet does for one container: both resources, on one card."""
        allocation_id = None
        for kind, size in ((MEM, memory_units), (CORE, core_percent)):
            held = {key for a in self.allocator.allocations() for key in a.device_pairs()}
            available = [d.id for d in self.allocator.devices(kind) if (kind, d.id) not in held]
            ids = self.allocator.preferred(kind, available, [], size)
            allocation_id = self.allocator.allocate(kind, ids).allocation_id
        return self.allocator.allocation(allocation_id)

    def call(self, message):
        return protocol.call(self.socket_path, message, timeout_seconds=5)

    def registered(self):
        return {r.container_id: r for r in self.registry.registrations()}


@pytest.fixture
def node(tmp_path):
    node = Node(tmp_path)
    yield node
    node.close()


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def create(container_id, pid, env, identity=None, cgroup=None, runtime="containerd"):
    """A createRuntime request as the hook installed for ``runtime`` sends it: ``identity``
    written under that runtime's annotation keys; the cgroup is the container's own (runc's
    default path)."""
    if cgroup is None:
        cgroup = f"0::/{container_id}\n"
    keys = podidentity.FAMILIES[runtime]
    found = {keys[field]: value for field, value in (identity or {}).items()}
    return {
        "stage": "createRuntime",
        "container_id": container_id,
        "pid": pid,
        "env": env,
        "identity": podidentity.resolve(found, runtime),
        "identity_annotations": found,
        "runtime": runtime,
        "cgroup": cgroup,
        "spec": {"mounts": [], "devices": [], "rules": []},
    }


def assert_refused(answer, fragment):
    assert answer["allowed"] is False
    assert answer["message"].startswith("gpushare-node refused")
    assert fragment in answer["message"]


# --- malformed requests ----------------------------------------------------------------------


def valid_fields(allocation, pid):
    return create("c1", pid, env_of(allocation), POD_A)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"container_id": None}, "container_id must be a non-empty string"),
        ({"container_id": ""}, "container_id must be a non-empty string"),
        ({"container_id": 7}, "container_id must be a non-empty string"),
        ({"pid": "1234"}, "pid must be a positive integer (got '1234')"),
        ({"pid": True}, "pid must be a positive integer (got True)"),
        ({"pid": 0}, "pid must be a positive integer"),
        ({"pid": None}, "pid must be a positive integer"),
        ({"env": ["NVIDIA_VISIBLE_DEVICES=all"]}, "env must map names to strings"),
        ({"env": {"NVIDIA_VISIBLE_DEVICES": 0}}, "env must map names to strings"),
        ({"identity": "default/a/main"}, "identity must map names to strings"),
        ({"identity_annotations": None}, "identity_annotations missing: this gpushare-hook is"),
        ({"identity_annotations": {CRI_POD: 1}}, "identity_annotations must map"),
        ({"identity_annotations": {"app": "x"}}, "identity_annotations must map the pod identity"),
        ({"runtime": "docker"}, "runtime must be null or one of containerd, cri-o"),
        ({"cgroup": None}, "cgroup must be a non-empty string"),
        ({"stage": "prestart"}, "unknown stage 'prestart'"),
        ({"stage": None}, "unknown stage None"),
        ({"spec": None}, "spec missing: this gpushare-hook is older than the daemon"),
        ({"spec": []}, "spec must be an object"),
        ({"spec": {"mounts": [], "devices": []}}, "spec.rules must be a list of objects"),
        ({"spec": {"mounts": ["/x"], "devices": [], "rules": []}}, "spec.mounts must be a list"),
        (
            {"spec": {"mounts": [{"destination": "/x", "sources": "/y", "nodes": []}],
                      "devices": [], "rules": []}},
            "spec.mounts[].sources must be a list of strings",
        ),
        (
            {"spec": {"mounts": [{"destination": "/x", "sources": [], "nodes": [[195]]}],
                      "devices": [], "rules": []}},
            "spec.mounts[].nodes must be a list of [major, minor]",
        ),
        (
            {"spec": {"mounts": [], "rules": [],
                      "devices": [{"path": "/dev/x", "type": "c", "major": "195", "minor": 1}]}},
            "spec.devices[].major and minor must be integers",
        ),
        (
            {"spec": {"mounts": [], "devices": [],
                      "rules": [{"allow": 1, "type": "c", "major": 195, "minor": 1,
                                 "access": "rw"}]}},
            "spec.rules[].allow must be true or false",
        ),
        (
            {"spec": {"mounts": [{"destination": "/x", "sources": [], "nodes": []}] * 1025,
                      "devices": [], "rules": []}},
            "spec.mounts has 1025 entries, over 1024",
        ),
    ],
)  # fmt: skip
def test_bad_request_is_refused_naming_the_problem(node, child, change, fragment):
    allocation = node.allocate()
    request = valid_fields(allocation, child.pid)
    for name, value in change.items():
        if value is None:
            del request[name]
        else:
            request[name] = value
    answer = node.call(request)
    assert_refused(answer, "bad hook request: " + fragment)
    assert node.registered() == {}
    assert Ledger(node.settings.state_dir).load_registrations() == []


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [(b"hello daemon\n", "not JSON"), (b"[1, 2]\n", "not a JSON object")],
)
def test_raw_garbage_is_refused_as_unreadable(node, raw, fragment):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(node.socket_path)
        sock.sendall(raw)
        answer = protocol.read_message(sock)
    assert_refused(answer, "unreadable hook request")
    assert fragment in answer["message"]
    assert node.registered() == {}


def test_poststop_without_container_id_is_refused(node):
    assert_refused(node.call({"stage": "poststop"}), "container_id must be a non-empty string")


# --- admission -------------------------------------------------------------------------------


def test_matching_container_is_registered_durably(node, child):
    allocation = node.allocate()
    answer = node.call(create("c1", child.pid, env_of(allocation), POD_A))
    assert answer == {
        "allowed": True,
        "message": f"container c1 (default/a/main) registered on allocation {allocation.id}",
    }
    [registration] = node.registry.registrations()
    assert registration.container_id == "c1"
    assert registration.allocation_id == allocation.id
    assert registration.cgroup == CgroupKey("", "/c1")
    assert registration.init_pid == child.pid
    assert registration.init_start_ticks > 0
    assert registration.identity == ContainerRef("default", "a", "main")
    assert Ledger(node.settings.state_dir).load_registrations() == [registration]
    # A registry started on that ledger (a daemon restart) knows it too.
    again = ContainerRegistry(Ledger(node.settings.state_dir), node.allocator, PIPE)
    assert again.registrations() == [registration]


def test_poststop_forgets_the_container(node, child):
    allocation = node.allocate()
    assert node.call(create("c1", child.pid, env_of(allocation), POD_A))["allowed"]
    answer = node.call({"stage": "poststop", "container_id": "c1"})
    assert answer["allowed"] is True
    assert node.registered() == {}
    assert Ledger(node.settings.state_dir).load_registrations() == []


def test_poststop_of_an_unknown_container_is_answered(node):
    assert node.call({"stage": "poststop", "container_id": "never-seen"})["allowed"] is True


def test_non_gpu_container_is_allowed_and_not_registered(node, child):
    answer = node.call(create("c1", child.pid, {"NVIDIA_VISIBLE_DEVICES": "void"}))
    assert answer["allowed"] is True and "asks for no GPU" in answer["message"]
    assert node.registered() == {}


def test_gpus_without_allocation_are_refused(node, child):
    answer = node.call(create("c1", child.pid, {"NVIDIA_VISIBLE_DEVICES": "all"}))
    assert_refused(answer, "without a gpushare allocation")
    assert node.registered() == {}


def test_mismatching_env_is_refused_and_not_registered(node, child):
    allocation = node.allocate()
    env = env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=15G")
    answer = node.call(create("c1", child.pid, env, POD_A))
    assert_refused(answer, "raises the quota of 4096 MiB")
    assert "container c1 (default/a/main)" in answer["message"]
    assert node.registered() == {}


def test_other_pipe_directory_is_refused(node, child):
    allocation = node.allocate()
    env = env_of(allocation, CUDA_MPS_PIPE_DIRECTORY="/var/run/other-mps")
    assert_refused(node.call(create("c1", child.pid, env)), "differs from /tmp/nvidia-mps")


def test_index_form_of_the_card_is_accepted(node, child):
    allocation = node.allocate()
    assert allocation.cards == (GPU0,)
    env = env_of(allocation, NVIDIA_VISIBLE_DEVICES="0")
    answer = node.call(create("c1", child.pid, env, POD_A))
    assert answer["allowed"] is True


def test_container_without_a_cgroup_of_its_own_is_refused(node, child):
    allocation = node.allocate()
    answer = node.call(create("c1", child.pid, env_of(allocation), POD_A, cgroup="0::/\n"))
    assert_refused(answer, "no cgroup of its own")
    assert node.registered() == {}


def test_vanished_init_process_is_refused(node):
    allocation = node.allocate()
    with open("/proc/sys/kernel/pid_max") as f:
        gone = int(f.read()) + 1
    answer = node.call(create("c1", gone, env_of(allocation), POD_A))
    assert_refused(answer, f"its init process {gone} is gone")
    assert node.registered() == {}


def test_second_identity_on_one_allocation_is_refused(node, child):
    allocation = node.allocate()
    assert node.call(create("c1", child.pid, env_of(allocation), POD_A))["allowed"]
    answer = node.call(create("c2", child.pid, env_of(allocation), POD_B))
    assert_refused(answer, f"allocation {allocation.id} belongs to pod default/a")
    assert "not to pod default/b" in answer["message"]
    assert set(node.registered()) == {"c1"}
    # The same identity (a restarted container) may use it, so may another of its containers.
    assert node.call(create("c3", child.pid, env_of(allocation), POD_A))["allowed"]
    sidecar = {**POD_A, "container": "sidecar"}
    assert node.call(create("c4", child.pid, env_of(allocation), sidecar))["allowed"]
    assert set(node.registered()) == {"c1", "c3", "c4"}


@pytest.mark.parametrize(
    "identity",
    [None, {"namespace": "default", "pod": "a"}, {"namespace": "default", "container": "main"}],
)
def test_a_gpu_container_without_a_whole_pod_identity_is_refused(node, child, identity):
    """No pod identity from the runtime, or only part of it (issue 14, item 4): the
    container cannot be tied to the pod its allocation was given to, so it gets no GPU."""
    allocation = node.allocate()
    answer = node.call(create("c1", child.pid, env_of(allocation), identity))
    assert_refused(answer, "the runtime gave no pod identity")
    assert node.registered() == {}


def crio_request(container_id, pid, env, own, forged, runtime="cri-o"):
    """A request from a container whose CRI-O keys name ``own`` and whose containerd keys
    (its pod's own annotations, as CRI-O copies them) name ``forged``, as the hook sends it."""
    found = {podidentity.FAMILIES["cri-o"][f]: v for f, v in own.items()}
    found.update({podidentity.FAMILIES["containerd"][f]: v for f, v in forged.items()})
    request = create(container_id, pid, env, runtime="containerd")
    request.update(identity_annotations=found, runtime=runtime, identity={})
    return request


@pytest.mark.parametrize("runtime", ["cri-o", None], ids=["cri-o", "older-hook-config"])
def test_annotations_naming_two_pods_are_refused_naming_both(node, child, runtime):
    """A CRI-O pod whose own annotations carry containerd's keys naming the allocation's pod,
    with its env (what CRI-O copies into the container): refused, naming both pods, whether
    the hook was installed for CRI-O or by an older install without --runtime (then both
    families must agree); never registered, and the daemon's log names both."""
    allocation = node.allocate()
    request = crio_request("c9", child.pid, env_of(allocation), POD_B, POD_A, runtime)
    answer = node.call(request)
    assert_refused(answer, "its annotations name two pods")
    assert "default/b/main" in answer["message"] and "default/a/main" in answer["message"]
    assert node.registered() == {}


def test_the_hooks_identity_is_read_again_from_the_annotations(node, child):
    """The hook says pod a, but the annotations it sent say pod b: refused, the daemon does
    not take the hook's word for it."""
    allocation = node.allocate()
    request = create("c1", child.pid, env_of(allocation), POD_B)
    request["identity"] = POD_A
    answer = node.call(request)
    assert_refused(answer, "the hook read the pod identity default/a/main from annotations")
    assert node.registered() == {}


@pytest.mark.parametrize("runtime", ["containerd", "cri-o"])
def test_the_pods_uid_from_the_runtimes_keys_reaches_the_registry(node, child, runtime):
    """The pod UID the runtime wrote (containerd's sandbox-uid, CRI-O's pod.uid) is handed
    to the registry, which tells a pod recreated under its name from the old one by it;
    none written, none handed."""
    seen = []
    admit = node.registry.admit

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pod_uid"))
        return admit(*args, **kwargs)

    node.registry.admit = spy
    allocation = node.allocate()
    answer = node.call(create("c1", child.pid, env_of(allocation), {**POD_A, "uid": "u-1"},
                              runtime=runtime))  # fmt: skip
    assert answer["allowed"], answer["message"]
    node.call(create("c2", child.pid, env_of(allocation), POD_A, runtime=runtime))
    assert seen == ["u-1", None]


def test_a_crio_pod_repeating_its_own_identity_is_admitted(node, child):
    """containerd's keys naming the container's own pod (and container): admitted as it."""
    allocation = node.allocate()
    request = crio_request("c1", child.pid, env_of(allocation), POD_A, POD_A)
    request["identity"] = POD_A
    assert node.call(request)["allowed"]
    [registration] = node.registry.registrations()
    assert registration.identity == ContainerRef("default", "a", "main")


# --- the spec (issue 14, item 7) -------------------------------------------------------------


def with_spec(request, mounts=(), devices=(), rules=()):
    request["spec"] = {"mounts": list(mounts), "devices": list(devices), "rules": list(rules)}
    return request


def mount(destination, *sources, nodes=()):
    return {"destination": destination, "sources": list(sources),
            "nodes": [list(n) for n in nodes]}  # fmt: skip


def test_a_spec_showing_its_own_card_passes(node, child):
    """What Allocate and the NVIDIA runtime give a shared container on card 0: registered."""
    allocation = node.allocate()
    request = with_spec(
        create("c1", child.pid, env_of(allocation), POD_A),
        mounts=[
            mount(PIPE, node.layout.client_dir(GPU0)),
            mount("/dev/nvidia0", "/dev/nvidia0", nodes=[(195, 0)]),
        ],
        devices=[{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}],
        rules=[{"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"}],
    )
    assert node.call(request)["allowed"] is True
    assert set(node.registered()) == {"c1"}


def test_another_cards_client_directory_is_refused_naming_it(node, child):
    """Card 1's client directory mounted at /tmp/nvidia-mps by card 0's container: refused,
    naming the mount, card 1 and the allocation; nothing registered."""
    allocation = node.allocate()
    other = node.layout.client_dir(GPU1)
    request = with_spec(
        create("c1", child.pid, env_of(allocation), POD_A),
        mounts=[mount(PIPE, other)],
    )
    answer = node.call(request)
    assert_refused(answer, f"the mount of {other} at {PIPE} shows GPU 1 ({GPU1})'s MPS")
    assert f"beyond allocation {allocation.id}" in answer["message"]
    assert node.registered() == {}


def test_another_cards_rule_is_refused(node, child):
    """A rule allowing c 195:1 for card 0's container: refused naming the rule and card 1."""
    allocation = node.allocate()
    rule = {"allow": True, "type": "c", "major": 195, "minor": 1, "access": "rw"}
    request = with_spec(create("c1", child.pid, env_of(allocation), POD_A), rules=[rule])
    answer = node.call(request)
    assert_refused(answer, f"its device rule allowing c 195:1 rw shows /dev/nvidia1 (c 195:1, "
                           f"GPU 1 ({GPU1}))")  # fmt: skip
    assert node.registered() == {}


def test_a_container_without_gpu_env_touching_a_gpu_is_refused(node, child):
    """No GPU env but /dev/nvidia1 in linux.devices: refused without an allocation."""
    device = {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}
    request = with_spec(create("c1", child.pid, {}), devices=[device])
    answer = node.call(request)
    assert_refused(answer, "its linux.devices node /dev/nvidia1 (c 195:1)")
    assert "without a gpushare allocation" in answer["message"]
    assert node.registered() == {}


def test_device_nodes_are_refused_while_nvidias_numbers_cannot_be_read(node, child, monkeypatch):
    """/proc/devices unreadable: a spec with device nodes cannot be judged, so it is refused
    (fail closed), naming why."""

    def unreadable(path=hostdevices.PROC_DEVICES):
        raise hostdevices.HostDevicesError(f"{path}: Permission denied")

    monkeypatch.setattr(hostdevices, "nvidia_majors", unreadable)
    allocation = node.allocate()
    device = {"path": "/dev/nvidia-uvm", "type": "c", "major": 510, "minor": 0}
    request = with_spec(create("c1", child.pid, env_of(allocation), POD_A), devices=[device])
    answer = node.call(request)
    assert_refused(answer, "NVIDIA's device numbers on this host cannot be read (/proc/devices")
    assert node.registered() == {}


def test_a_container_without_gpu_env_or_gpu_things_is_allowed(node, child):
    """The spec facts of an ordinary container (a hosts file): allowed, not registered."""
    request = with_spec(create("c1", child.pid, {}), mounts=[mount("/etc/hosts", "/etc/hosts")])
    answer = node.call(request)
    assert answer["allowed"] is True and "asks for no GPU" in answer["message"]
    assert node.registered() == {}


# --- the socket ------------------------------------------------------------------------------


def test_socket_is_root_only(node):
    mode = os.stat(node.socket_path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_stale_socket_file_is_replaced_and_stop_removes_it(tmp_path):
    node = Node(tmp_path)
    node.server.stop()
    with open(node.socket_path, "w") as f:
        f.write("left by a killed daemon")
    server = HookServer(node.registry, node.socket_path)
    server.start()
    try:
        answer = protocol.call(node.socket_path, {"stage": "poststop", "container_id": "x"}, 5)
        assert answer["allowed"] is True
    finally:
        server.stop()
    assert not os.path.exists(node.socket_path)
    node.close()


def test_env_that_cannot_be_parsed_still_gets_an_answer(node, child):
    allocation = node.allocate()
    env = env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=²M")
    answer = node.call(create("c1", child.pid, env))
    assert_refused(answer, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    assert node.registered() == {}


def test_a_host_cgroup_is_refused(node, child):
    allocation = node.allocate()
    cgroup = "0::/system.slice/containerd.service\n"
    answer = node.call(create("c1", child.pid, env_of(allocation), POD_A, cgroup))
    assert_refused(answer, "not a container cgroup")
    assert "/system.slice/containerd.service" in answer["message"]
    assert node.registered() == {}


# --- trickling clients (issue 14, item 9) ----------------------------------------------------

TRICKLERS = 50
CAP = 16
DEADLINE = 1.0


def _closed_by_peer(sock):
    """Whether the server closed this connection (EOF or reset), without blocking."""
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT) == b"" or True  # an answer: done too
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_trickling_clients_are_cut_capped_and_a_real_call_still_answers(
    tmp_path, child, monkeypatch, caplog
):
    """50 clients that each send a byte every 0.2 s and never a whole request: at most the
    cap is served (threads stay bounded), the excess is closed at once, counted and logged
    once; each served one is cut at its total deadline; a real call then answers promptly."""
    monkeypatch.setattr(hookserver, "MAX_CONNECTIONS", CAP, raising=False)
    monkeypatch.setattr(hookserver, "DEADLINE_SECONDS", DEADLINE, raising=False)
    monkeypatch.setattr(hookserver, "READ_TIMEOUT_SECONDS", DEADLINE)
    caplog.set_level("INFO")
    baseline = threading.active_count()
    node = Node(tmp_path)
    try:
        allocation = node.allocate()
        clients = []
        for _ in range(TRICKLERS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(node.socket_path)
            clients.append(sock)
        open_ = set(range(TRICKLERS))
        most_threads, started = 0, time.monotonic()
        cut_at = {}
        while open_ and time.monotonic() - started < DEADLINE + 3:
            for i in list(open_):
                try:
                    clients[i].send(b"{")
                except OSError:
                    open_.discard(i)
                    cut_at[i] = time.monotonic() - started
                    continue
                if _closed_by_peer(clients[i]):
                    open_.discard(i)
                    cut_at[i] = time.monotonic() - started
            most_threads = max(most_threads, threading.active_count() - baseline)
            time.sleep(0.2)
        for sock in clients:
            sock.close()
        assert most_threads <= CAP + 3, most_threads  # + the server's own threads
        assert not open_, f"{len(open_)} trickling connections are still held"
        at_once = [t for t in cut_at.values() if t < DEADLINE / 2]
        assert len(at_once) >= TRICKLERS - CAP
        assert max(cut_at.values()) < DEADLINE + 1.0
        assert node.server.refused_connections >= TRICKLERS - CAP
        over_cap = [r for r in caplog.records if "connection cap" in r.getMessage()]
        assert len([r for r in over_cap if r.levelname == "WARNING"]) == 1
        started = time.monotonic()
        answer = node.call(create("c1", child.pid, env_of(allocation), POD_A))
        assert answer["allowed"] is True, answer
        assert time.monotonic() - started < 0.5
    finally:
        for sock in clients:
            sock.close()
        node.close()
