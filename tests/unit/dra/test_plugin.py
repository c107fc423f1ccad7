"""Pins nodemgr.dra.plugin over real gRPC on unix sockets: GetInfo (type, name, endpoint,
v1 before v1beta1), kubelet's verdict kept, the servicers' translation of both API
versions (share ID only in v1; an empty entry present), kubelet's deadline handed to the
driver, the claim budget, sockets bound again after removal, and removed on stop; the
changes a driver call makes wake other threads once its answer is handed over. Both
sockets are root-only and never wider while they are made, whatever the umask; both
servers keep to a budget (connection cap, handshake deadline, calls at once, a message
limit that still takes the largest request kubelet sends)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import grpc
import pytest

from nodemgr.common.changes import ChangeCounter
from nodemgr.config.schema import DraSettings
from nodemgr.dra import plugin as plugin_module
from nodemgr.dra.driver import Prepared, PreparedDevice
from nodemgr.dra.plugin import HANDSHAKE_SECONDS, MAX_CALLS, MAX_CONNECTIONS, DraPlugin
from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc

DEVICE = PreparedDevice(("gpu",), "node-a", "gpu-a", ("gpushare.aliyun.com/gpu=u1-gpu-a-s",), "s")


class FakeDriver:
    def __init__(self):
        self.calls = []

    def prepare(self, claims, deadline=None):
        self.calls.append(("prepare", [c.uid for c in claims], deadline))
        return {"u1": Prepared((DEVICE,)), "u2": Prepared(error="no room"), "u3": Prepared()}

    def unprepare(self, claims):
        self.calls.append(("unprepare", [c.uid for c in claims], None))
        return {c.uid: None for c in claims}


def settings_in(root):
    return DraSettings(enabled=True, plugins_registry_dir=f"{root}/registry",
                       plugins_dir=f"{root}/plugins", cdi_dir=f"{root}/cdi")  # fmt: skip


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(plugin_module, "CHECK_PERIOD_SECONDS", 0.05)
    root = tempfile.mkdtemp(prefix="dp", dir="/tmp")
    settings = settings_in(root)
    driver = FakeDriver()
    plugin = DraPlugin(settings, driver)
    plugin.start()
    yield plugin, driver
    plugin.stop()
    plugin.join(5)
    shutil.rmtree(root, ignore_errors=True)


def channel(path):
    return grpc.insecure_channel(f"unix://{path}")


def claims(*uids):
    return [dra_v1_pb2.Claim(namespace="ns", uid=u, name=f"c-{u}") for u in uids]


def test_get_info_names_the_driver_its_socket_and_v1_first(served):
    plugin, _ = served
    stub = reg_grpc.RegistrationStub(channel(plugin.settings.registration_socket))
    info = stub.GetInfo(reg.InfoRequest(), timeout=5)
    assert (info.type, info.name, info.endpoint) == (
        "DRAPlugin", "gpushare.aliyun.com", plugin.settings.service_socket)  # fmt: skip
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error="x"))
    assert plugin.state()["registered"] is False and plugin.state()["registration_error"] == "x"
    for path in (plugin.settings.registration_socket, plugin.settings.service_socket):
        assert os.stat(path).st_mode & 0o777 == 0o600


def test_v1_answers_devices_share_ids_errors_and_empty_entries(served):
    """Every claim the driver answered has an entry (an empty one too); kubelet's
    deadline less the margin reaches the driver."""
    plugin, driver = served
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    started = time.monotonic()
    answer = stub.NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(claims=claims("u1", "u2", "u3")), timeout=45
    )
    assert set(answer.claims) == {"u1", "u2", "u3"}
    [device] = answer.claims["u1"].devices
    assert (device.device_name, device.share_id, list(device.cdi_device_ids)) == (
        "gpu-a", "s", ["gpushare.aliyun.com/gpu=u1-gpu-a-s"])  # fmt: skip
    assert answer.claims["u2"].error == "no room" and not answer.claims["u3"].devices
    _, uids, deadline = driver.calls[0]
    assert uids == ["u1", "u2", "u3"] and started + 40 < deadline < started + 44


def test_v1beta1_answers_without_share_ids_and_unprepares(served):
    plugin, driver = served
    stub = dra_v1beta1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1beta1_pb2.Claim(namespace="ns", uid="u1", name="c")]
    )
    [device] = stub.NodePrepareResources(request, timeout=5).claims["u1"].devices
    assert device.device_name == "gpu-a" and "share_id" not in device.DESCRIPTOR.fields_by_name
    gone = stub.NodeUnprepareResources(
        dra_v1beta1_pb2.NodeUnprepareResourcesRequest(claims=request.claims), timeout=5
    )
    assert list(gone.claims) == ["u1"] and gone.claims["u1"].error == ""


def test_too_many_claims_in_one_call_is_refused(served):
    plugin, driver = served
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    many = claims(*(f"u{i}" for i in range(plugin_module.MAX_CLAIMS + 1)))
    with pytest.raises(grpc.RpcError) as refused:
        stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=many), timeout=5)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert driver.calls == []


def test_a_removed_socket_is_bound_again_and_stop_removes_both(served):
    plugin, _ = served
    registration = plugin.settings.registration_socket
    os.unlink(registration)
    deadline = time.monotonic() + 5
    while not (os.path.exists(registration) and plugin.sockets_present()):
        assert time.monotonic() < deadline, "the registration socket was not bound again"
        time.sleep(0.05)
    stub = reg_grpc.RegistrationStub(channel(registration))
    assert stub.GetInfo(reg.InfoRequest(), timeout=5).name == "gpushare.aliyun.com"
    plugin.stop()
    assert plugin.join(5)
    assert not os.path.exists(registration)
    assert not os.path.exists(plugin.settings.service_socket)


# --- who may connect, and the budget --------------------------------------------------------


def _umask_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    pytest.skip("this kernel does not show Umask in /proc/self/status")


def test_both_sockets_are_root_only_whatever_the_umask_and_never_wider():
    """With umask 0 both sockets are 0600, and while the plugin starts no socket of wider
    mode is ever in either directory (each is bound in a private directory and renamed
    into place): only root (kubelet) can connect; no staging directory is left behind."""
    root = tempfile.mkdtemp(prefix="dp", dir="/tmp")
    settings = settings_in(root)
    directories = (settings.plugins_registry_dir, os.path.dirname(settings.service_socket))
    for directory in directories:
        os.makedirs(directory)
    seen: set[int] = set()  # modes of sockets anyone can reach in the directories
    staging: set[int] = set()  # modes of the directories sockets are bound in first
    done = threading.Event()

    def watch() -> None:
        # Only what another user could reach: entries of the directories themselves. A
        # socket inside a staging directory is reachable only if that directory is.
        while not done.is_set():
            for directory in directories:
                for name in os.listdir(directory):
                    try:
                        mode = os.lstat(os.path.join(directory, name)).st_mode
                    except FileNotFoundError:
                        continue
                    if stat.S_ISSOCK(mode):
                        seen.add(stat.S_IMODE(mode))
                    elif stat.S_ISDIR(mode):
                        staging.add(stat.S_IMODE(mode))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    old = os.umask(0)
    plugin = DraPlugin(settings, FakeDriver())
    try:
        plugin.start()
    finally:
        os.umask(old)
        done.set()
        watcher.join()
    try:
        assert _umask_now() == old
        sockets = (settings.registration_socket, settings.service_socket)
        assert {stat.S_IMODE(os.stat(p).st_mode) for p in sockets} == {0o600}
        assert seen <= {0o600}, {oct(m) for m in seen}
        assert staging <= {0o700}, {oct(m) for m in staging}
        assert os.listdir(directories[0]) == [os.path.basename(settings.registration_socket)]
        assert os.listdir(directories[1]) == ["dra.sock"]
        info = reg_grpc.RegistrationStub(channel(settings.registration_socket)).GetInfo(
            reg.InfoRequest(), timeout=5
        )
        assert info.endpoint == settings.service_socket
    finally:
        plugin.stop()
        plugin.join(5)
        shutil.rmtree(root, ignore_errors=True)


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


def _kubelet_call(plugin, which):
    """A call on ``which`` socket as kubelet makes it, on a channel of its own."""
    if which == "registration":
        stub = reg_grpc.RegistrationStub(channel(plugin.settings.registration_socket))
        return lambda: stub.GetInfo(reg.InfoRequest(), timeout=5).name
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    request = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=claims("u1"))
    return lambda: list(stub.NodeUnprepareResources(request, timeout=5).claims)


@pytest.mark.parametrize("which", ["registration", "service"])
def test_connections_over_the_cap_are_closed_and_idle_ones_cut_at_the_handshake(served, which):
    """40 connections that never speak HTTP/2 to either socket: at most MAX_CONNECTIONS
    are kept, the rest closed at once; those kept are closed once HANDSHAKE_SECONDS
    passed; kubelet's own channel, opened before, answers meanwhile."""
    plugin, _ = served
    path = getattr(plugin.settings, f"{which}_socket")
    call = _kubelet_call(plugin, which)
    assert call()  # kubelet's connection, open
    raw = []
    try:
        for _ in range(40):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            raw.append(sock)
        time.sleep(1.0)
        assert call()
        open_now = [s for s in raw if not _closed(s)]
        assert len(open_now) <= MAX_CONNECTIONS, len(open_now)
        time.sleep(HANDSHAKE_SECONDS + 1.0)
        assert [s for s in raw if not _closed(s)] == []
    finally:
        for sock in raw:
            sock.close()


def _longest_claims(count):
    """``count`` claims named as long as the API allows: namespace 63 characters (a DNS
    label), UID 36 (a UUID), name 253 (a DNS subdomain)."""
    return [
        dra_v1_pb2.Claim(namespace="n" * 63, uid=f"{i:036d}", name="c" * 253) for i in range(count)
    ]


def test_the_largest_request_kubelet_sends_is_served(served):
    """MAX_CLAIMS claims, each named as long as the API allows, reach the driver: the
    message limit is above the largest NodePrepareResources kubelet can send."""
    plugin, driver = served
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    request = dra_v1_pb2.NodePrepareResourcesRequest(
        claims=_longest_claims(plugin_module.MAX_CLAIMS)
    )
    stub.NodePrepareResources(request, timeout=5)
    assert len(driver.calls[0][1]) == plugin_module.MAX_CLAIMS


def test_the_largest_answer_stays_under_what_a_grpc_client_reads():
    """MAX_CLAIMS claims of MAX_RESULTS devices each, every name as long as the API allows
    (node 253, request 63, device 63, driver 63), make a NodePrepareResources answer under
    4 MiB, the most a gRPC client reads unless told otherwise; and the request naming them
    is under MAX_RECEIVE_BYTES."""
    uid = "u" * 36
    cdi_id = f"{'d' * 63}/gpu={uid}-{'g' * 63}-{'s' * 36}"
    device = PreparedDevice(("r" * 63,), "n" * 253, "g" * 63, (cdi_id,), "s" * 36)
    response = dra_v1_pb2.NodePrepareResourcesResponse()
    service = plugin_module._DraService(dra_v1_pb2, None, None, share_ids=True)
    for i in range(plugin_module.MAX_CLAIMS):
        key = f"{i:036d}"
        service._fill(response.claims[key], Prepared((device,) * plugin_module.MAX_RESULTS))
    assert response.ByteSize() < 4 * 1024 * 1024, response.ByteSize()
    request = dra_v1_pb2.NodePrepareResourcesRequest(
        claims=_longest_claims(plugin_module.MAX_CLAIMS)
    )
    assert request.ByteSize() < plugin_module.MAX_RECEIVE_BYTES, request.ByteSize()


def test_a_request_over_the_message_limit_is_refused_unread(served):
    """A NodePrepareResources of 1 MiB (200 claims whose names no API object can have) is
    refused RESOURCE_EXHAUSTED by gRPC before the servicer sees it; the same holds on the
    registration socket; both answer the next call."""
    plugin, driver = served
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    big = [dra_v1_pb2.Claim(namespace="ns", uid=f"u{i}", name="c" * 5000) for i in range(200)]
    request = dra_v1_pb2.NodePrepareResourcesRequest(claims=big)
    assert request.ByteSize() > 1_000_000
    with pytest.raises(grpc.RpcError) as refused:
        stub.NodePrepareResources(request, timeout=5)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert driver.calls == []
    registration = reg_grpc.RegistrationStub(channel(plugin.settings.registration_socket))
    status = reg.RegistrationStatus(plugin_registered=False, error="x" * 1_000_000)
    with pytest.raises(grpc.RpcError) as refused:
        registration.NotifyRegistrationStatus(status, timeout=5)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert plugin.state()["registered"] is None
    assert _kubelet_call(plugin, "service")() == ["u1"]
    assert _kubelet_call(plugin, "registration")() == "gpushare.aliyun.com"


class BlockedDriver(FakeDriver):
    """Unprepare waits until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def unprepare(self, claims):
        self.release.wait(30)
        return super().unprepare(claims)


def test_calls_over_the_server_cap_are_refused_at_once():
    """With the driver busy, MAX_CALLS + 8 calls at once over several connections: those
    over MAX_CALLS are refused RESOURCE_EXHAUSTED at once, not queued; the others are
    answered once the driver goes on."""
    root = tempfile.mkdtemp(prefix="dp", dir="/tmp")
    driver = BlockedDriver()
    plugin = DraPlugin(settings_in(root), driver)
    plugin.start()
    # A connection each (channels to one target share one unless told not to): more
    # calls at once than MAX_STREAMS lets one connection carry.
    channels = [
        grpc.insecure_channel(
            f"unix://{plugin.settings.service_socket}",
            options=[("grpc.use_local_subchannel_pool", 1)],
        )
        for _ in range(4)
    ]
    request = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=claims("u1"))
    outcomes: list[object] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        stub = dra_v1_pb2_grpc.DRAPluginStub(channels[i % len(channels)])
        try:
            stub.NodeUnprepareResources(request, timeout=20)
            outcome: object = "answered"
        except grpc.RpcError as e:
            outcome = e.code()
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(MAX_CALLS + 8)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(outcomes) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        with lock:
            early = list(outcomes)
        driver.release.set()
        for thread in threads:
            thread.join(30)
        assert early == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 8, early
        assert outcomes.count("answered") == MAX_CALLS, outcomes
    finally:
        driver.release.set()
        for c in channels:
            c.close()
        plugin.stop()
        plugin.join(5)
        shutil.rmtree(root, ignore_errors=True)


def test_what_a_driver_call_changed_wakes_others_once_its_answer_is_handed_over():
    """The driver's thread delivers the change notifications a call made (ListAndWatch
    streams, the MPS supervisor, the publishers) after its answer is handed to the loop,
    so the threads they wake do not run against the rest of the call and its answer;
    a call that fails hands its error over first as well."""
    counter = ChangeCounter()
    worker = plugin_module._DriverThread("test-dra-driver")
    seen: list[bool] = []
    calls: list = []
    counter.add_listener(lambda: seen.append(calls[-1].done()))

    def change(fail: bool) -> str:
        counter.bump()
        if fail:
            raise RuntimeError("refused")
        return "answer"

    try:
        for fail in (False, True):
            calls.append(worker.submit(change, fail))
            try:
                calls[-1].result(timeout=5)
            except RuntimeError:
                pass
    finally:
        worker.shutdown()
    assert seen == [True, True]


def test_a_listener_that_raises_does_not_end_the_driver_thread():
    """A change listener breaking its contract (it must not raise) is logged: the call's
    answer was handed over, other counters were woken, and the next call is served."""
    broken, counted = ChangeCounter(), ChangeCounter()
    heard: list[int] = []

    def raising() -> None:
        raise RuntimeError("a listener bug")

    broken.add_listener(raising)
    counted.add_listener(lambda: heard.append(counted.generation))
    worker = plugin_module._DriverThread("test-dra-driver")
    try:
        first = worker.submit(lambda: (broken.bump(), counted.bump())[1])
        assert first.result(timeout=5) == 1
        assert worker.submit(counted.bump).result(timeout=5) == 2
    finally:
        worker.shutdown()
    deadline = time.monotonic() + 5
    while len(heard) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heard == [1, 2]
