"""Pins nodemgr.kubelet.servicer over real gRPC on a unix socket, against a fake
ResourceManager: the options kubelet reads; ListAndWatch sends the device list (health,
NUMA) at once and again only when it changed; GetPreferredAllocation, Allocate and
PreStartContainer pass kubelet's IDs through and answer per container (envs, mounts);
our errors reach kubelet as gRPC codes with the allocator's message (NoFitError ->
RESOURCE_EXHAUSTED, ...), a bug as INTERNAL; each Allocate is observed, refused or not;
stop ends the watch streams and removes the socket, unless kubelet replaced it. The
socket is root-only and never wider while it is made; the server keeps to its budget
(connection cap, handshake deadline, message limit)."""

import os
import queue
import shutil
import socket
import stat
import tempfile
import threading
import time

import grpc
import pytest

from nodemgr.allocation.resources import AllocateResult, DeviceInfo
from nodemgr.common.changes import ChangeCounter
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Mount
from nodemgr.errors import (
    REFUSAL_IS_FINAL,
    AllocationError,
    ConflictError,
    LedgerError,
    NoFitError,
    UnknownDeviceError,
)
from nodemgr.kubelet import servicer
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.pluginloop import PLUGIN_LOOP
from nodemgr.kubelet.servicer import PluginServer
from tests.harness.threadstats import wakeups_while_idle

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
MEM_NAME = "aliyun.com/gpu-mem"


class FakeResources:
    """A ResourceManager: canned devices and answers, every call recorded."""

    def __init__(self):
        self.resource_names = {MEM: MEM_NAME, CORE: "aliyun.com/gpu-core.percentage"}
        self.device_changes = ChangeCounter()
        self.device_list = [
            DeviceInfo("GPU-a-_-0", True, 0),
            DeviceInfo("GPU-a-_-1", False, None),
        ]
        self.device_reads = queue.Queue()  # one item per devices() call
        self.calls = []
        self.error: BaseException | None = None

    def devices(self, kind):
        self.device_reads.put(kind)
        return list(self.device_list)

    def _maybe_fail(self):
        if self.error is not None:
            raise self.error

    def preferred(self, kind, available, must_include, size):
        self.calls.append(("preferred", kind, available, must_include, size))
        self._maybe_fail()
        return (
            list(must_include)
            + [i for i in available if i not in must_include][: size - len(must_include)]
        )

    def allocate(self, kind, device_ids):
        self.calls.append(("allocate", kind, list(device_ids)))
        self._maybe_fail()
        return AllocateResult(
            allocation_id="ga-1",
            envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a", "GPUSHARE_ALLOCATION_ID": "ga-1"},
            mounts=(Mount("/tmp/nvidia-mps", "/run/gpushare/mps/GPU-a", read_only=True),),
        )

    def check_known(self, kind, device_ids):
        self.calls.append(("check_known", kind, list(device_ids)))
        self._maybe_fail()


@pytest.fixture
def socket_dir():
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path may not.
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-dp-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def resources():
    return FakeResources()


@pytest.fixture
def observed():
    return []


@pytest.fixture
def server(resources, socket_dir, observed):
    server = PluginServer(
        resources,
        MEM,
        os.path.join(socket_dir, "gpushare-memory.sock"),
        observe_allocate=lambda *args: observed.append(args),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(f"unix://{server.socket_path}")
    yield dp_grpc.DevicePluginStub(channel)
    channel.close()


def refusal(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=5)
    return caught.value


def test_options_ask_for_prestart_and_preferred_allocation(stub):
    """kubelet is told to call PreStartContainer and GetPreferredAllocation."""
    options = stub.GetDevicePluginOptions(dp.Empty(), timeout=5)
    assert options.pre_start_required is True
    assert options.get_preferred_allocation_available is True


def test_server_names_its_resource_and_endpoint(server):
    """What registration tells kubelet: the resource name and the socket's file name."""
    assert server.resource_name == MEM_NAME
    assert server.endpoint == "gpushare-memory.sock"
    assert server.alive


def test_list_and_watch_sends_the_list_at_once(stub):
    """The first message is the whole list: IDs, health, NUMA node when known."""
    stream = stub.ListAndWatch(dp.Empty(), timeout=10)
    first = next(stream)
    stream.cancel()
    assert [(d.ID, d.health) for d in first.devices] == [
        ("GPU-a-_-0", "Healthy"),
        ("GPU-a-_-1", "Unhealthy"),
    ]
    assert [n.ID for n in first.devices[0].topology.nodes] == [0]
    assert not first.devices[1].HasField("topology")


def test_list_and_watch_sends_again_only_when_the_list_changed(stub, resources):
    """A change signal with the same list sends nothing; a changed list is sent. (The
    next message after an unchanged re-read is the changed list, not a repeat.)"""
    stream = stub.ListAndWatch(dp.Empty(), timeout=10)
    next(stream)
    assert resources.device_reads.get(timeout=5) is MEM  # the read behind the first message
    resources.device_changes.bump()  # something changed, but not this list
    assert resources.device_reads.get(timeout=5) is MEM  # re-read after the bump
    resources.device_list = [DeviceInfo("GPU-a-_-0", False, 0)]
    resources.device_changes.bump()
    second = next(stream)
    stream.cancel()
    assert [(d.ID, d.health) for d in second.devices] == [("GPU-a-_-0", "Unhealthy")]


def test_preferred_allocation_answers_per_container(stub, resources):
    """Each container request is passed through (available, must-include, size) and
    answered with the IDs the allocation state prefers."""
    request = dp.PreferredAllocationRequest(
        container_requests=[
            dp.ContainerPreferredAllocationRequest(
                available_deviceIDs=["a-_-0", "a-_-1", "a-_-2"],
                must_include_deviceIDs=["a-_-2"],
                allocation_size=2,
            ),
            dp.ContainerPreferredAllocationRequest(
                available_deviceIDs=["b-_-0", "b-_-1"], allocation_size=1
            ),
        ]
    )
    response = stub.GetPreferredAllocation(request, timeout=5)
    assert [list(r.deviceIDs) for r in response.container_responses] == [
        ["a-_-2", "a-_-0"],
        ["b-_-0"],
    ]
    assert resources.calls[0] == ("preferred", MEM, ["a-_-0", "a-_-1", "a-_-2"], ["a-_-2"], 2)


def test_allocate_returns_envs_and_mounts(stub, resources, observed):
    """Allocate answers each container with the allocation's envs and mounts, and is
    observed once as a success."""
    request = dp.AllocateRequest(
        container_requests=[dp.ContainerAllocateRequest(devices_ids=["GPU-a-_-0", "GPU-a-_-1"])]
    )
    response = stub.Allocate(request, timeout=5)
    [container] = response.container_responses
    assert dict(container.envs) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a",
        "GPUSHARE_ALLOCATION_ID": "ga-1",
    }
    [mount] = container.mounts
    assert (mount.container_path, mount.host_path, mount.read_only) == (
        "/tmp/nvidia-mps",
        "/run/gpushare/mps/GPU-a",
        True,
    )
    assert resources.calls == [("allocate", MEM, ["GPU-a-_-0", "GPU-a-_-1"])]
    [(name, seconds, ok)] = observed
    assert (name, ok) == (MEM_NAME, True) and seconds >= 0


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NoFitError("no single GPU on node-a has 16 GiB free"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (
            UnknownDeviceError("GPU-x-_-0 is not a device of this node"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (ConflictError("two cards for one container"), grpc.StatusCode.FAILED_PRECONDITION),
        (AllocationError("refused"), grpc.StatusCode.FAILED_PRECONDITION),
        (LedgerError("cannot write the ledger"), grpc.StatusCode.INTERNAL),
    ],
)
def test_our_errors_reach_kubelet_as_grpc_codes(stub, resources, observed, error, code):
    """A refusal becomes its gRPC code with the allocator's message as the details
    (kubelet shows them in the pod's events), followed by what a refused Allocate means for
    the pod: kubelet fails it for good (UnexpectedAdmissionError) and never retries it, and
    what to do; the Allocate is observed as failed."""
    resources.error = error
    request = dp.AllocateRequest(
        container_requests=[dp.ContainerAllocateRequest(devices_ids=["x"])]
    )
    refused = refusal(stub.Allocate, request)
    assert refused.code() == code
    assert refused.details() == f"{error}. {REFUSAL_IS_FINAL}"
    assert "UnexpectedAdmissionError" in refused.details()
    assert "Deployment" in refused.details() and "scheduler extender" in refused.details()
    assert [ok for _, _, ok in observed] == [False]


def test_a_bug_is_internal_and_the_server_lives_on(stub, resources):
    """An unexpected exception is INTERNAL naming it; the next call is served."""
    resources.error = KeyError("oops")
    request = dp.AllocateRequest(
        container_requests=[dp.ContainerAllocateRequest(devices_ids=["x"])]
    )
    refused = refusal(stub.Allocate, request)
    assert refused.code() == grpc.StatusCode.INTERNAL
    assert (
        refused.details() == f"gpushare-node internal error: KeyError('oops'). {REFUSAL_IS_FINAL}"
    )
    resources.error = None
    assert stub.Allocate(request, timeout=5).container_responses


def test_preferred_allocation_refusals_map_too(stub, resources):
    """GetPreferredAllocation's refusals use the same mapping, and say the rejection is
    final too (kubelet fails the pod on it just as on a refused Allocate)."""
    resources.error = NoFitError("nothing fits")
    request = dp.PreferredAllocationRequest(
        container_requests=[dp.ContainerPreferredAllocationRequest(allocation_size=1)]
    )
    refused = refusal(stub.GetPreferredAllocation, request)
    assert (refused.code(), refused.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"nothing fits. {REFUSAL_IS_FINAL}",
    )


def test_prestart_checks_the_ids_and_refuses_unknown_ones(stub, resources):
    """PreStartContainer passes the IDs to check_known; an unknown ID is INVALID_ARGUMENT."""
    assert stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=["a"]), timeout=5) == (
        dp.PreStartContainerResponse()
    )
    assert resources.calls == [("check_known", MEM, ["a"])]
    resources.error = UnknownDeviceError("GPU-z-_-0 was never advertised")
    refused = refusal(stub.PreStartContainer, dp.PreStartContainerRequest(devices_ids=["z"]))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A failed start is retried by kubelet (back-off): no word of a final rejection.
    assert refused.details() == "GPU-z-_-0 was never advertised"


def test_a_failing_observer_does_not_fail_allocate(resources, socket_dir):
    """A metrics bug in observe_allocate never turns an answer into an error."""

    def broken(*args):
        raise RuntimeError("metrics bug")

    server = PluginServer(resources, MEM, os.path.join(socket_dir, "m.sock"), broken)
    server.start()
    channel = grpc.insecure_channel(f"unix://{server.socket_path}")
    try:
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=["x"])]
        )
        response = dp_grpc.DevicePluginStub(channel).Allocate(request, timeout=5)
        assert response.container_responses[0].envs["GPUSHARE_ALLOCATION_ID"] == "ga-1"
    finally:
        channel.close()
        server.stop()


def test_stop_ends_the_watch_and_removes_the_socket(server, stub):
    """stop ends an open ListAndWatch stream, removes the socket, and the server is no
    longer alive."""
    stream = stub.ListAndWatch(dp.Empty(), timeout=30)
    next(stream)
    ended = threading.Event()

    def drain():
        try:
            for _ in stream:
                pass
        except grpc.RpcError:
            pass
        ended.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    server.stop(grace_seconds=0.5)
    assert ended.wait(10), "the watch stream outlived the server"
    assert not os.path.exists(server.socket_path)
    assert not server.alive and server.join(0.0)


def test_socket_present_notices_kubelet_removing_or_replacing_it(server):
    """socket_present turns False when kubelet deletes or recreates our socket; stop
    then leaves a file that is no longer ours alone."""
    assert server.socket_present()
    os.unlink(server.socket_path)
    assert not server.socket_present()
    with open(server.socket_path, "w") as replaced:
        replaced.write("someone else's")
    assert not server.socket_present()
    server.stop()
    assert os.path.exists(server.socket_path)


def test_a_stale_socket_is_replaced_at_start(resources, socket_dir):
    """A file left at the socket path by a crash does not stop the server from serving."""
    path = os.path.join(socket_dir, "stale.sock")
    with open(path, "w") as stale:
        stale.write("left by a crash")
    server = PluginServer(resources, MEM, path)
    server.start()
    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        options = dp_grpc.DevicePluginStub(channel).GetDevicePluginOptions(dp.Empty(), timeout=5)
        assert options.pre_start_required
    finally:
        channel.close()
        server.stop()


def test_list_and_watch_reads_the_devices_only_when_the_card_state_moved(stub, resources):
    """Between changes the stream only wakes to notice a stop (every second): it does not
    rebuild the device list then (thousands of devices on a big node, per stream)."""
    stream = stub.ListAndWatch(dp.Empty(), timeout=10)
    next(stream)
    assert resources.device_reads.get(timeout=5) is MEM
    with pytest.raises(queue.Empty):
        resources.device_reads.get(timeout=2.5)  # two idle wake-ups pass: no read
    resources.device_changes.bump()
    assert resources.device_reads.get(timeout=5) is MEM
    stream.cancel()


def test_an_open_watch_stream_wakes_nothing_while_nothing_changes(stub, resources):
    """Idle, the plugin loop's thread sleeps: an open ListAndWatch stream is woken by a
    change, not by a timer (a synchronous server polled five times a second and each
    stream once a second); a change still reaches the stream at once."""
    stream = stub.ListAndWatch(dp.Empty(), timeout=30)
    next(stream)
    assert wakeups_while_idle(PLUGIN_LOOP.thread, 1.5) <= 1
    resources.device_list = [DeviceInfo("GPU-a-_-0", False, 0)]
    resources.device_changes.bump()
    assert [d.health for d in next(stream).devices] == ["Unhealthy"]
    stream.cancel()


# --- the socket's permissions and the server's budget ----------------------------------------


def _umask_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    pytest.skip("this kernel does not show Umask in /proc/self/status")


def test_the_socket_is_root_only_whatever_the_umask_and_never_wider(resources, socket_dir):
    """With umask 0 the socket is 0600, and while the server starts no socket of wider mode
    is ever at its path or in its directory (it is bound in a private directory and renamed
    into place): only root (kubelet) can connect; no staging directory is left behind."""
    path = os.path.join(socket_dir, "gpushare-memory.sock")
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for name in os.listdir(socket_dir):
                try:
                    mode = os.lstat(os.path.join(socket_dir, name)).st_mode
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(mode):
                    seen.add(stat.S_IMODE(mode))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    old = os.umask(0)
    try:
        server = PluginServer(resources, MEM, path)
        server.start()
    finally:
        os.umask(old)
        done.set()
        watcher.join()
    try:
        assert _umask_now() == old
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert seen <= {0o600}, {oct(m) for m in seen}
        assert os.listdir(socket_dir) == ["gpushare-memory.sock"]
        with grpc.insecure_channel(f"unix://{path}") as channel:
            options = dp_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                dp.Empty(), timeout=5
            )
        assert options.pre_start_required
    finally:
        server.stop()


def test_connections_over_the_cap_are_closed_and_idle_ones_cut_at_the_handshake(server):
    """40 connections that never speak HTTP/2: at most MAX_CONNECTIONS are kept, the rest
    closed at once; those kept are closed once HANDSHAKE_SECONDS passed; kubelet's own
    channel, opened before, still answers meanwhile."""
    with grpc.insecure_channel(f"unix://{server.socket_path}") as channel:
        stub = dp_grpc.DevicePluginStub(channel)
        stub.GetDevicePluginOptions(dp.Empty(), timeout=5)  # kubelet's connection, open
        raw = []
        for _ in range(40):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(server.socket_path)
            raw.append(sock)
        try:
            time.sleep(1.0)
            assert stub.GetDevicePluginOptions(dp.Empty(), timeout=5).pre_start_required
            open_now = [s for s in raw if not _closed(s)]
            assert len(open_now) <= servicer.MAX_CONNECTIONS, len(open_now)
            time.sleep(servicer.HANDSHAKE_SECONDS + 1.0)
            assert [s for s in raw if not _closed(s)] == []
        finally:
            for sock in raw:
                sock.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed it (what it sent first, its HTTP/2 settings, is read away)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def test_a_request_over_the_message_limit_is_refused_unread(stub, resources):
    """An Allocate of 8 MiB is refused by gRPC (RESOURCE_EXHAUSTED) before the servicer
    sees it; the server answers the next call."""
    ids = [f"GPU-a-_-{i}-" + "x" * 100 for i in range(80_000)]
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    assert request.ByteSize() > servicer.MAX_RECEIVE_BYTES
    error = refusal(stub.Allocate, request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert resources.calls == []
    assert stub.GetDevicePluginOptions(dp.Empty(), timeout=5).pre_start_required
