"""A test kubelet: kubelet's device manager and PodResources server, over real unix sockets.

End-to-end tests run the real gpushare-node daemon against this stand-in. It
speaks the real protocols (device plugin API v1beta1 and PodResources v1, the
generated code in ``nodemgr.kubelet.api``) and copies the parts of kubelet's
behaviour a device plugin can observe, as described in
``docs/kubelet-api.md``:

* ``Registration.Register`` is served on ``<device_plugin_dir>/kubelet.sock``.
  Before Register returns, the plugin's own socket is dialled and
  ``GetDevicePluginOptions`` is called; then a background thread runs
  ``ListAndWatch``. Every message replaces the resource's device list. When the
  stream ends, every device of the resource turns unhealthy and ListAndWatch is
  never called again: the plugin has to register again.
* Pods are admitted one at a time. For each container and each requested
  resource: check there are enough healthy free devices, ask the plugin for its
  preferred allocation (if it offers one), call ``Allocate`` with exactly one
  container request, and record the devices as kubelet does. A container's
  resources come in a random order, drawn per container (kubelet ranges over
  the container's resource map, and Go randomises map order); ``seed`` (or
  ``GPUSHARE_KUBELET_SEED``) makes it repeatable, and every admission logs it.
  The responses of a container's resources are merged in another random order,
  the first value of an env name (and the first mount of a container path)
  winning, as kubelet's "Skip existing env".
* An error of GetPreferredAllocation or Allocate (or too few devices) fails
  the pod for good: ``UnexpectedAdmissionError``, the message kubelet writes
  ("Allocate failed due to ..., which is unexpected"); the pod is never admitted
  again, and its devices, those allocated before the error included, are free
  for the next pod at once (kubelet frees the devices of pods no longer active
  before every allocation and every PodResources List). The pod stays listed,
  without devices, until ``remove_pod``. Likewise a removed pod's devices go to
  the next admission at once, whatever the plugin's own state.
* ``start_container`` calls PreStartContainer once per resource of the
  container (random order), at every start; ``restart_container`` is a restart:
  PreStartContainer again, no Allocate (kubelet reuses its checkpointed answer).
* ``device_list_in_flight(resource)``: while inside, the resource's ListAndWatch
  updates are received but not applied (applied, the latest one, on leaving): an
  admission meanwhile sees the older list, as a real kubelet does while a plugin's
  update is on its way (kubelet applies each update asynchronously, between
  admissions).
* ``restart()`` deletes every file in the device plugin directory except
  kubelet's checkpoint, forgets the plugins and recreates ``kubelet.sock``;
  allocations survive, as kubelet restores them from its checkpoint.
* The node's capacity and allocatable (``node_status``) are what the last node
  status update published: one at start and then every ``status_update_seconds``
  (kubelet's nodeStatusUpdateFrequency, 10 s). After a restart every resource
  has capacity 0 until its plugin registered again AND the next update ran.
* The PodResources server answers from this kubelet's own record of who holds
  which device, with one ``ContainerDevices`` entry per device (and NUMA node),
  like kubelet: clients have to merge entries of the same resource.

* Optional DRA side (``attach_dra``, standins.kubelet_dra): plugin registration
  through plugins_registry and the DRA node API; its pods and each container's
  ``dynamic_resources`` join the PodResources answers, and ``restart()`` restarts it.

* Optional CRI mode (``use_cri``): ``run_pod`` admits a pod, then creates it
  through a container runtime's CRI v1 API (``standins.cri``) as kubelet's
  SyncPod does: RunPodSandbox, then per container PreStartContainer,
  CreateContainer with the envs, mounts, devices and annotations of the
  device plugins' Allocate answers, StartContainer; ``stop_pod`` stops and
  removes the sandbox, removes the pod's cgroups (runc leaves them, kubelet
  removes them), then frees the devices. Without it nothing changes.

Everything is guarded by one lock; waits use a Condition on it. gRPC calls to
plugins are never made while holding that lock (a plugin that hangs must not
freeze ListAndWatch updates or the PodResources server), which is why pod
admission is serialised by a second lock of its own.

Why this module is longer than 400 lines: it stands in for kubelet's whole device plugin
side (Registration server, one ListAndWatch reader per plugin,
GetPreferredAllocation/Allocate/PreStartContainer as kubelet orders them, the
PodResources server, restarts) plus an optional CRI mode; splitting it would split one
protocol's state.
"""

import contextlib
import dataclasses
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.api import podresources_v1_pb2 as pr
from nodemgr.kubelet.api import podresources_v1_pb2_grpc as pr_grpc
from standins.cri import configs as cri_configs
from standins.cri.api import runtime_v1_pb2 as cri
from standins.cri.api import runtime_v1_pb2_grpc as cri_grpc

log = logging.getLogger(__name__)

# Constants of the device plugin API (k8s.io/kubelet .../deviceplugin/v1beta1/constants.go).
VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"

# kubelet dials a registering plugin with a 10 s timeout.
DIAL_TIMEOUT_S = 10.0
# kubelet's deadline for PreStartContainer.
PRE_START_TIMEOUT_S = 30.0
# The deadline of each CRI call in CRI mode (kubelet's --runtime-request-timeout: 2 min).
CRI_TIMEOUT_S = 120.0
# How long stop() waits for one ListAndWatch thread after closing its channel.
THREAD_JOIN_TIMEOUT_S = 5.0
# kubelet's default nodeStatusUpdateFrequency: how often it publishes capacity.
NODE_STATUS_UPDATE_S = 10.0
# Sets the random seed of every TestKubelet built without one (to repeat a run).
SEED_ENV = "GPUSHARE_KUBELET_SEED"
# The reason kubelet gives a pod whose device allocation failed at admission.
UNEXPECTED_ADMISSION_ERROR = "UnexpectedAdmissionError"
# grpc-go's names of the status codes (its "rpc error: code = <name> desc = ..." text).
_GO_CODE_NAMES = {
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
# Every thread this module starts (ListAndWatch readers, gRPC handler pools)
# has a name with this prefix, so that tests can check none of them leaks.
THREAD_PREFIX = "kubelet-sim"

# sun_path of struct sockaddr_un is 108 bytes, including the terminating NUL.
_MAX_UNIX_PATH = 107

# Resource name validation, as kubelet's v1helper.IsExtendedResourceName: the
# name must contain "/", must not be a native resource (anything containing
# "kubernetes.io/") and "requests." + name must be a qualified name: a DNS-1123
# subdomain prefix (at most 253 characters), "/", and a name part of at most 63
# characters.
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_QUOTA_PREFIX = "requests."


def is_extended_resource_name(name: str) -> bool:
    """Whether kubelet accepts ``name`` as a device plugin's resource name."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith(_QUOTA_PREFIX):
        return False
    parts = (_QUOTA_PREFIX + name).split("/")
    if len(parts) != 2:
        return False
    prefix, short = parts
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return False
    return 0 < len(short) <= 63 and _QUALIFIED_NAME_PART.fullmatch(short) is not None


@dataclass
class Device:
    """One device as the plugin last reported it through ListAndWatch.

    ``health`` is the plugin's string as sent (or "Unhealthy" once the plugin's
    stream ended); only exactly "Healthy" counts as healthy.
    """

    id: str
    health: str
    numa_nodes: list[int]

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass
class ContainerSpec:
    """A container of a pod to admit: its name and its extended resource requests."""

    name: str
    requests: dict[str, int]  # resource name -> count


@dataclass
class ContainerAdmission:
    """What admission did for one container.

    ``responses``, ``device_ids`` and ``preferred`` are per resource, in the
    order kubelet called the plugins; ``preferred`` holds the plugin's raw answer
    to GetPreferredAllocation (only for resources whose plugin offers it).
    ``envs`` merges the envs of all the responses like kubelet, in the random
    order ``merge_order`` says (the first value seen for a name wins), and
    ``mounts`` their mounts (``dp.Mount`` messages; the first one of a container
    path wins).
    """

    name: str
    responses: dict[str, dp.ContainerAllocateResponse] = field(default_factory=dict)
    device_ids: dict[str, list[str]] = field(default_factory=dict)
    preferred: dict[str, list[str]] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list = field(default_factory=list)
    merge_order: list[str] = field(default_factory=list)


@dataclass
class AdmitResult:
    """The outcome of ``admit_pod``.

    On failure ``containers`` holds the containers handled so far; the last one
    is the container that failed, with the resources that did succeed; ``error``
    is kubelet's message and ``reason`` its reason (``UnexpectedAdmissionError``).
    """

    ok: bool
    error: str | None
    containers: list[ContainerAdmission]
    reason: str | None = None


@dataclass
class CriPod:
    """What ``run_pod`` did for one pod in CRI mode.

    ``error`` is None when every container started; else the first failure
    (admission, or the CRI call that failed, with the runtime's message).
    ``container_ids`` holds the containers created (a refused one included).
    """

    namespace: str
    name: str
    uid: str
    admission: AdmitResult
    sandbox_id: str | None = None
    container_ids: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class RegisterRecord:
    """One Register call as received.

    ``time`` is ``time.monotonic()`` at receipt. ``error`` is None for an
    accepted registration, else why it was refused (an addition to the
    fields the brief lists; it defaults to None).
    """

    resource_name: str
    endpoint: str
    version: str
    options: dp.DevicePluginOptions
    time: float
    error: str | None = None


class PluginError(Exception):
    """A device plugin call failed (gRPC error, or no usable endpoint)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _AdmissionFailed(Exception):
    """Internal: stops admission of a pod with the device manager's error (kubelet wraps
    it into the pod's UnexpectedAdmissionError message)."""


def go_rpc_error(error: PluginError) -> str:
    """A failed plugin call as grpc-go prints it in kubelet's messages."""
    name = _GO_CODE_NAMES.get(error.code, error.code.name)
    return f"rpc error: code = {name} desc = {error.details}"


@dataclass
class _Plugin:
    """kubelet's endpoint for one registered resource."""

    resource: str
    endpoint: str
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub
    options: dp.DevicePluginOptions
    listed: bool = False  # the first ListAndWatch message arrived
    stopped: bool = False  # the stream ended or the endpoint was replaced/closed
    thread: threading.Thread | None = None


@dataclass
class _Allocation:
    """Devices of one resource held by one container, with their NUMA nodes at allocation."""

    ids: list[str]
    numa: dict[str, list[int]]


# kubelet's record: (namespace, pod) -> container -> resource -> allocation.
# Containers are listed at admission even when they hold no device, like the
# pod spec kubelet answers PodResources List from.
_PodRecord = dict[str, dict[str, _Allocation]]


def _device_from_proto(device: dp.Device) -> Device:
    return Device(
        id=device.ID, health=device.health, numa_nodes=[n.ID for n in device.topology.nodes]
    )


def _copy_devices(devices: list[Device]) -> list[Device]:
    # Callers get their own copies: the stored lists are shared between threads.
    return [dataclasses.replace(d, numa_nodes=list(d.numa_nodes)) for d in devices]


def _call(method, request, timeout: float | None = None):
    """Call a plugin RPC, turning every failure into a PluginError.

    A channel closed under our feet (re-registration, stop) raises ValueError in
    grpcio rather than RpcError; treat it like a cancelled call.
    """
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise PluginError(exc.code(), exc.details() or "") from exc
    except ValueError as exc:
        raise PluginError(grpc.StatusCode.CANCELLED, f"channel closed: {exc}") from exc


def _unix_address(path: str) -> str:
    path = os.path.abspath(path)
    if len(path.encode()) > _MAX_UNIX_PATH:
        raise ValueError(f"unix socket path too long ({len(path)} > {_MAX_UNIX_PATH}): {path}")
    return "unix://" + path


def _remove_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _RegistrationServicer(dp_grpc.RegistrationServicer):
    """v1beta1.Registration: translates the call and delegates to the TestKubelet."""

    def __init__(self, kubelet: "TestKubelet", generation: int):
        self._kubelet = kubelet
        self._generation = generation

    def Register(self, request, context):  # noqa: N802 (gRPC method name)
        self._kubelet._register(request, context, self._generation)
        return dp.Empty()


class _PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    """v1.PodResourcesLister: answers from the TestKubelet's record."""

    def __init__(self, kubelet: "TestKubelet"):
        self._kubelet = kubelet

    def List(self, request, context):  # noqa: N802
        self._kubelet._check_pod_resources_up(context)
        return pr.ListPodResourcesResponse(pod_resources=self._kubelet._pod_resources())

    def GetAllocatableResources(self, request, context):  # noqa: N802
        self._kubelet._check_pod_resources_up(context)
        return pr.AllocatableResourcesResponse(devices=self._kubelet._allocatable())

    def Get(self, request, context):  # noqa: N802
        self._kubelet._check_pod_resources_up(context)
        pods = self._kubelet._pod_resources((request.pod_namespace, request.pod_name))
        if not pods:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        return pr.GetPodResourcesResponse(pod_resources=pods[0])


class TestKubelet:
    """A kubelet stand-in: device plugin registration, pod admission, PodResources.

    ``start()`` serves Registration on ``<device_plugin_dir>/kubelet.sock`` and
    PodResourcesLister on ``pod_resources_socket`` and starts the node status
    updates; ``stop()`` tears all down and joins every thread it started.
    ``seed`` draws the random orders (default: ``GPUSHARE_KUBELET_SEED``, else a
    fresh one, in ``self.seed``); ``status_update_seconds`` None: node status
    updates only at start and by ``update_node_status()``.
    """

    __test__ = False  # not a pytest test class, despite its name

    def __init__(
        self,
        device_plugin_dir: str,
        pod_resources_socket: str,
        *,
        seed: int | None = None,
        status_update_seconds: float | None = NODE_STATUS_UPDATE_S,
    ):
        self.device_plugin_dir = os.path.abspath(device_plugin_dir)
        self.pod_resources_socket = os.path.abspath(pod_resources_socket)
        self.kubelet_socket = os.path.join(self.device_plugin_dir, KUBELET_SOCKET)
        if seed is None:
            seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().getrandbits(32))
        self.seed = seed
        self._rng = random.Random(seed)
        self._status_update_seconds = status_update_seconds

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Pods are admitted one at a time, like kubelet; a separate lock so that
        # plugin calls during admission never hold the state lock.
        self._admit_lock = threading.Lock()
        # Serialises start/stop/restart.
        self._lifecycle_lock = threading.Lock()

        # --- state guarded by self._lock ---
        self._running = False
        # Bumped on every stop: a Register call that began under an older
        # generation must not install a plugin into a stopped or restarted kubelet.
        self._generation = 0
        self._plugins: dict[str, _Plugin] = {}
        self._devices: dict[str, list[Device]] = {}
        # resource -> the latest list received while its updates are in flight (None: none
        # yet); see device_list_in_flight.
        self._in_flight: dict[str, list[Device] | None] = {}
        self._registrations: list[RegisterRecord] = []
        self._pods: dict[tuple[str, str], _PodRecord] = {}
        # Pods whose admission failed: (namespace, pod) -> kubelet's message. Never
        # admitted again; listed without devices until removed.
        self._rejected: dict[tuple[str, str], str] = {}
        # Every resource a plugin ever registered (kubelet's checkpoint keeps their names):
        # after a restart they have capacity 0 until registered and the next status update.
        self._known_resources: set[str] = set()
        # What the last node status update published: resource -> (capacity, allocatable).
        self._node_status: dict[str, tuple[int, int]] = {}
        self._status_stop = threading.Event()
        self._status_thread: threading.Thread | None = None
        # Containers started at least once: (namespace, pod, container).
        self._started: set[tuple[str, str, str]] = set()
        self._pod_resources_up = True
        self._dialing: set[grpc.Channel] = set()  # channels of Register calls in progress
        self._threads: list[threading.Thread] = []  # ListAndWatch readers

        self._servers: list[tuple[grpc.Server, futures.ThreadPoolExecutor]] = []

        # CRI mode (use_cri): the runtime endpoint, where pod logs go, the pods run.
        self._cri_endpoint: str | None = None
        self._cri_log_root: str | None = None
        self._cri_pods: dict[tuple[str, str], CriPod] = {}
        self._dra = None  # the DRA side (kubelet_dra.DraKubelet), see attach_dra

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Serve Registration on kubelet.sock and PodResourcesLister on its socket."""
        with self._lifecycle_lock:
            with self._lock:
                if self._running:
                    raise RuntimeError("test kubelet already running")
                generation = self._generation
            os.makedirs(self.device_plugin_dir, exist_ok=True)
            os.makedirs(os.path.dirname(self.pod_resources_socket), exist_ok=True)

            registration = self._new_server("registration")
            dp_grpc.add_RegistrationServicer_to_server(
                _RegistrationServicer(self, generation), registration[0]
            )
            pod_resources = self._new_server("podresources")
            pr_grpc.add_PodResourcesListerServicer_to_server(
                _PodResourcesServicer(self), pod_resources[0]
            )
            self._servers = [registration, pod_resources]
            try:
                for (server, _), path in (
                    (registration, self.kubelet_socket),
                    (pod_resources, self.pod_resources_socket),
                ):
                    _remove_socket(path)  # a stale socket from a crashed run
                    server.add_insecure_port(_unix_address(path))
                    server.start()
            except BaseException:
                self._stop_servers()
                raise
            with self._lock:
                self._running = True
            self.update_node_status()  # kubelet's first status update at start
            if self._status_update_seconds is not None:
                self._status_stop = threading.Event()
                self._status_thread = threading.Thread(
                    target=self._update_node_status_every,
                    args=(self._status_stop, self._status_update_seconds),
                    name=f"{THREAD_PREFIX}-node-status",
                    daemon=True,
                )
                self._status_thread.start()

    def stop(self) -> None:
        """Stop both servers, close plugin channels and streams, remove the sockets.

        Plugins' devices turn unhealthy (their streams end); their records stay
        until ``restart()`` forgets them. Safe to call when not running.
        """
        with self._lifecycle_lock:
            with self._cond:
                if not self._running:
                    return
                self._running = False
                self._generation += 1
                plugins = list(self._plugins.values())
                dialing = list(self._dialing)
                for plugin in plugins:
                    if not plugin.stopped:
                        plugin.stopped = True
                        self._mark_unhealthy_locked(plugin.resource)
                threads = list(self._threads)
                self._cond.notify_all()

            self._status_stop.set()
            if self._status_thread is not None:
                self._status_thread.join(THREAD_JOIN_TIMEOUT_S)
                self._status_thread = None
            # Abort dials of Register calls in progress, so their handlers return now.
            for channel in dialing:
                channel.close()
            self._stop_servers()
            # Closing a channel cancels its ListAndWatch stream: the reader thread exits.
            for plugin in plugins:
                plugin.channel.close()
            for thread in threads:
                thread.join(THREAD_JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.warning("ListAndWatch thread %s did not exit", thread.name)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
            _remove_socket(self.kubelet_socket)
            _remove_socket(self.pod_resources_socket)

    def restart(self) -> None:
        """Restart like kubelet: plugins must notice and register again.

        Stops, deletes every file of the device plugin directory except the
        checkpoint (kubelet's removeContents: directories are left alone),
        forgets plugins and device lists, keeps the allocations (kubelet restores
        them from its checkpoint) and starts again.
        """
        self.stop()
        with self._lifecycle_lock:
            for name in os.listdir(self.device_plugin_dir):
                if name == CHECKPOINT_FILE:
                    continue
                path = os.path.join(self.device_plugin_dir, name)
                if os.path.isdir(path):
                    continue
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            with self._cond:
                self._plugins.clear()
                self._devices.clear()
                self._cond.notify_all()
        self.start()
        if self._dra is not None:
            self._dra.restart()

    def attach_dra(self, dra) -> None:
        """Give this kubelet a DRA side (a started ``kubelet_dra.DraKubelet``): PodResources
        lists its pods and claims, and ``restart()`` restarts it too."""
        self._dra = dra

    def _new_server(self, name: str) -> tuple[grpc.Server, futures.ThreadPoolExecutor]:
        executor = futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix=f"{THREAD_PREFIX}-{name}"
        )
        return grpc.server(executor), executor

    def _stop_servers(self) -> None:
        for server, executor in self._servers:
            server.stop(grace=None).wait()
            # Handlers still running (a Register mid-dial) finish before we go on.
            executor.shutdown(wait=True)
        self._servers = []

    # ------------------------------------------------------------------ registration

    def _register(self, request: dp.RegisterRequest, context, generation: int) -> None:
        """Register handler: validate, dial the plugin, get options, start ListAndWatch."""
        options = dp.DevicePluginOptions()
        options.CopyFrom(request.options)
        record = RegisterRecord(
            resource_name=request.resource_name,
            endpoint=request.endpoint,
            version=request.version,
            options=options,
            time=time.monotonic(),
        )
        with self._cond:
            self._registrations.append(record)
            self._cond.notify_all()

        error = None
        if request.version != VERSION:
            error = (
                f"requested device plugin version {request.version!r} is not supported, "
                f"supported versions are [{VERSION}]"
            )
        elif not is_extended_resource_name(request.resource_name):
            error = f"the ResourceName {request.resource_name!r} is invalid"
        if error:
            self._refuse(record, context, grpc.StatusCode.INVALID_ARGUMENT, error)

        resource = request.resource_name
        path = os.path.join(self.device_plugin_dir, request.endpoint)
        try:
            channel = grpc.insecure_channel(_unix_address(path))
        except ValueError as exc:
            self._refuse(record, context, grpc.StatusCode.UNKNOWN, str(exc))
        with self._lock:
            current = generation == self._generation
            if current:
                # Registered so that stop() can close it and end a dial in progress.
                self._dialing.add(channel)
        if not current:
            channel.close()
            self._refuse(record, context, grpc.StatusCode.UNAVAILABLE, "kubelet stopping")
        stub = dp_grpc.DevicePluginStub(channel)
        try:
            # kubelet dials with WithBlock and a 10 s timeout, then asks for options
            # before Register returns: the plugin must already be serving.
            plugin_options = stub.GetDevicePluginOptions(
                dp.Empty(), timeout=DIAL_TIMEOUT_S, wait_for_ready=True
            )
        except (grpc.RpcError, ValueError) as exc:
            channel.close()
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            self._refuse(
                record,
                context,
                grpc.StatusCode.UNKNOWN,
                f"failed to dial device plugin {path}: {details}",
            )
        finally:
            with self._lock:
                self._dialing.discard(channel)

        plugin = _Plugin(
            resource=resource,
            endpoint=request.endpoint,
            channel=channel,
            stub=stub,
            options=plugin_options,
        )
        old = None
        with self._cond:
            stale = generation != self._generation
            if not stale:
                old = self._plugins.get(resource)
                if old is not None:
                    # Re-registration replaces the endpoint; the old stream's end
                    # must not mark the new plugin's devices unhealthy.
                    old.stopped = True
                self._plugins[resource] = plugin
                self._known_resources.add(resource)
                plugin.thread = threading.Thread(
                    target=self._watch,
                    args=(plugin,),
                    name=f"{THREAD_PREFIX}-listandwatch-{resource}",
                    daemon=True,
                )
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(plugin.thread)
                plugin.thread.start()
                self._cond.notify_all()
        if stale:
            channel.close()
            self._refuse(record, context, grpc.StatusCode.UNAVAILABLE, "kubelet stopping")
        if old is not None:
            old.channel.close()

    def _refuse(
        self, record: RegisterRecord, context, code: grpc.StatusCode, error: str
    ) -> NoReturn:
        """Record why a registration was refused and abort the call (raises)."""
        with self._lock:
            record.error = error
        log.info("refused registration of %s: %s", record.resource_name, error)
        context.abort(code, error)

    def _watch(self, plugin: _Plugin) -> None:
        """ListAndWatch reader: each message replaces the resource's device list."""
        call = None
        try:
            call = plugin.stub.ListAndWatch(dp.Empty())
            for response in call:
                devices = [_device_from_proto(d) for d in response.devices]
                with self._cond:
                    if plugin.stopped:
                        break
                    if plugin.resource in self._in_flight and plugin.listed:
                        self._in_flight[plugin.resource] = devices  # applied on leaving
                        self._cond.notify_all()
                        continue
                    self._devices[plugin.resource] = devices
                    plugin.listed = True
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            log.info("ListAndWatch of %s ended: %s %s", plugin.resource, exc.code(), exc.details())
        except ValueError as exc:  # the channel was closed before the call started
            log.info("ListAndWatch of %s not started: %s", plugin.resource, exc)
        finally:
            with self._cond:
                if not plugin.stopped:
                    # The stream ended by itself: kubelet marks every device of the
                    # resource unhealthy and never calls ListAndWatch again.
                    plugin.stopped = True
                    self._mark_unhealthy_locked(plugin.resource)
                    self._cond.notify_all()
            if call is not None:
                call.cancel()
            plugin.channel.close()

    def _mark_unhealthy_locked(self, resource: str) -> None:
        for device in self._devices.get(resource, []):
            device.health = UNHEALTHY

    # ------------------------------------------------------------------ observation

    def registrations(self) -> list[RegisterRecord]:
        """Every Register call seen (accepted or refused), in order."""
        with self._lock:
            return [
                dataclasses.replace(
                    r, options=dp.DevicePluginOptions.FromString(r.options.SerializeToString())
                )
                for r in self._registrations
            ]

    def options(self, resource: str) -> dp.DevicePluginOptions:
        """The options the resource's plugin answered to GetDevicePluginOptions."""
        with self._lock:
            plugin = self._plugins.get(resource)
            if plugin is None:
                raise KeyError(f"no plugin registered for {resource}")
            options = dp.DevicePluginOptions()
            options.CopyFrom(plugin.options)
            return options

    def devices(self, resource: str) -> list[Device]:
        """The latest device list from ListAndWatch ([] if none)."""
        with self._lock:
            return _copy_devices(self._devices.get(resource, []))

    def wait_for_resource(self, resource: str, timeout: float = 10.0) -> list[Device]:
        """Wait until ``resource`` is registered and its first list arrived; return it.

        After a re-registration or restart, waits for the new plugin's first list.
        """

        def ready() -> bool:
            plugin = self._plugins.get(resource)
            return plugin is not None and plugin.listed

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise TimeoutError(
                    f"{resource} not registered with a device list within {timeout} s "
                    f"(registrations: {[r.resource_name for r in self._registrations]})"
                )
            return _copy_devices(self._devices.get(resource, []))

    def wait_for_devices(
        self,
        resource: str,
        predicate: Callable[[list[Device]], bool],
        timeout: float = 10.0,
    ) -> list[Device]:
        """Wait until ``predicate(devices(resource))`` holds; return that list."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                devices = _copy_devices(self._devices.get(resource, []))
                if predicate(devices):
                    return devices
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"device list of {resource} did not match within {timeout} s; "
                        f"last: {devices}"
                    )
                self._cond.wait(left)

    @contextlib.contextmanager
    def device_list_in_flight(self, resource: str) -> Iterator[None]:
        """While inside, ``resource``'s device list stays as it is: the plugin's ListAndWatch
        updates are received but applied only on leaving (the latest one), so admissions
        meanwhile see the older list, as while a real update is on its way to kubelet."""
        with self._cond:
            if resource in self._in_flight:
                raise ValueError(f"the updates of {resource} are already held in flight")
            self._in_flight[resource] = None
        try:
            yield
        finally:
            with self._cond:
                latest = self._in_flight.pop(resource, None)
                plugin = self._plugins.get(resource)
                if latest is not None and plugin is not None and not plugin.stopped:
                    self._devices[resource] = latest
                self._cond.notify_all()

    def wait_in_flight(self, resource: str, timeout: float = 10.0) -> list[Device]:
        """Inside ``device_list_in_flight``: wait until an update of ``resource`` has come
        and is held; return it (the list kubelet does not see yet)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._in_flight.get(resource), timeout):
                raise TimeoutError(f"no update of {resource} came within {timeout} s")
            return _copy_devices(self._in_flight[resource] or [])

    def update_node_status(self) -> dict[str, tuple[int, int]]:
        """Publish the node's capacity and allocatable now, as kubelet's node status update
        does (its device manager's GetCapacity): per resource a plugin ever registered, all
        its listed devices and the healthy ones. A resource not listed since the last
        restart counts 0: kubelet starts with empty device sets and fills them only from
        the re-registered plugin's list. Returns what it published."""
        with self._lock:
            status = {}
            for resource in sorted(self._known_resources):
                devices = self._devices.get(resource, [])
                status[resource] = (len(devices), sum(1 for d in devices if d.healthy))
            self._node_status = status
            return dict(status)

    def node_status(self) -> dict[str, tuple[int, int]]:
        """resource -> (capacity, allocatable) as the last node status update published."""
        with self._lock:
            return dict(self._node_status)

    def _update_node_status_every(self, stop: threading.Event, seconds: float) -> None:
        while not stop.wait(seconds):
            self.update_node_status()

    def allocated(self) -> dict[tuple[str, str, str], dict[str, list[str]]]:
        """kubelet's record: (namespace, pod, container) -> resource -> device IDs.

        Every container of every admitted pod is listed, with {} when it holds no
        device.
        """
        with self._lock:
            return {
                (ns, pod, container): {res: list(a.ids) for res, a in resources.items()}
                for (ns, pod), containers in self._pods.items()
                for container, resources in containers.items()
            }

    # ------------------------------------------------------------------ pods

    def admit_pod(
        self,
        namespace: str,
        pod: str,
        containers: list[ContainerSpec],
        order: list[str] | None = None,
        after_allocate: Callable[[str, str], None] | None = None,
    ) -> AdmitResult:
        """Admit a pod like kubelet's device manager.

        Containers are handled in order; a container's resources in ``order``
        (resources it does not name come after, in the container's order) or, without
        it, in a random order drawn per container. A failure rejects the pod for good
        (``UnexpectedAdmissionError``, see the module docstring): its devices are free
        at once, it is listed without devices until ``remove_pod``, and admitting it
        again raises ValueError. ``after_allocate(container, resource)`` is called
        after each successful Allocate (a test's pause between a container's resources).
        """
        key = (namespace, pod)
        for spec in containers:
            for resource, count in spec.requests.items():
                if count < 0:
                    raise ValueError(f"negative request for {resource} in container {spec.name}")
        with self._admit_lock:
            with self._lock:
                if key in self._rejected:
                    raise ValueError(
                        f"pod {namespace}/{pod} was rejected ({UNEXPECTED_ADMISSION_ERROR}): "
                        "kubelet never admits it again; remove_pod it (the pod deleted) first"
                    )
                if key in self._pods:
                    raise ValueError(f"pod {namespace}/{pod} already admitted; remove it first")
                self._pods[key] = {c.name: {} for c in containers}
            log.info("test kubelet (seed %d) admits pod %s/%s", self.seed, namespace, pod)
            admissions: list[ContainerAdmission] = []
            try:
                for spec in containers:
                    admission = ContainerAdmission(name=spec.name)
                    admissions.append(admission)
                    for resource in self._resource_order(spec, order):
                        if self._admit_resource(key, spec, resource, admission) and (
                            after_allocate is not None
                        ):
                            after_allocate(spec.name, resource)
            except _AdmissionFailed as exc:
                message = f"Allocate failed due to {exc}, which is unexpected"
                with self._cond:
                    if key in self._pods:  # unless removed meanwhile
                        # Not active any more: kubelet frees its devices before the next
                        # allocation or PodResources List, and lists it without them.
                        self._pods[key] = {c.name: {} for c in containers}
                        self._rejected[key] = message
                    self._cond.notify_all()
                log.info("test kubelet rejected pod %s/%s: %s", namespace, pod, message)
                return AdmitResult(
                    ok=False,
                    error=message,
                    containers=admissions,
                    reason=UNEXPECTED_ADMISSION_ERROR,
                )
            return AdmitResult(ok=True, error=None, containers=admissions)

    def rejection(self, namespace: str, pod: str) -> str | None:
        """kubelet's message if it rejected the pod at admission, else None."""
        with self._lock:
            return self._rejected.get((namespace, pod))

    def _resource_order(self, spec: ContainerSpec, order: list[str] | None) -> list[str]:
        resources = list(spec.requests)
        if order is None:
            with self._lock:
                self._rng.shuffle(resources)  # a Go map's order: any, each time
            return resources
        rank = {name: i for i, name in enumerate(order)}
        # sorted() is stable: resources not in `order` keep their order, last.
        return sorted(resources, key=lambda r: rank.get(r, len(rank)))

    def _admit_resource(
        self,
        key: tuple[str, str],
        spec: ContainerSpec,
        resource: str,
        admission: ContainerAdmission,
    ) -> bool:
        """Allocate one resource to one container (kubelet's devicesToAllocate + Allocate);
        whether Allocate was called."""
        count = spec.requests[resource]
        if count == 0:
            return False  # kubelet makes no call for a zero request

        with self._lock:
            plugin = self._plugins.get(resource)
            if plugin is None:
                raise _AdmissionFailed(f"can't allocate unregistered device {resource}")
            taken = {
                device_id
                for containers in self._pods.values()
                for resources in containers.values()
                for device_id in (resources[resource].ids if resource in resources else [])
            }
            devices = self._devices.get(resource, [])
            available = [d.id for d in devices if d.healthy and d.id not in taken]
            numa = {d.id: list(d.numa_nodes) for d in devices}
            stopped = plugin.stopped

        # kubelet checks availability first: neither GetPreferredAllocation nor
        # Allocate is called when there are not enough healthy free devices.
        if len(available) < count:
            raise _AdmissionFailed(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {count}, Available: {len(available)}"
            )
        if stopped:
            raise _AdmissionFailed(f"endpoint {plugin.endpoint} has been stopped")

        chosen: list[str] = []
        if plugin.options.get_preferred_allocation_available:
            request = dp.PreferredAllocationRequest(
                container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=[],
                        allocation_size=count,
                    )
                ]
            )
            try:
                response = _call(plugin.stub.GetPreferredAllocation, request)
            except PluginError as exc:
                raise _AdmissionFailed(
                    f"device plugin GetPreferredAllocation rpc failed with err: {go_rpc_error(exc)}"
                ) from exc
            preferred = (
                list(response.container_responses[0].deviceIDs)
                if response.container_responses
                else []
            )
            admission.preferred[resource] = preferred
            # Like kubelet: keep the preferred IDs that are available (a valid
            # answer is used as is), then fill any shortfall ourselves.
            free = set(available)
            for device_id in preferred:
                if len(chosen) < count and device_id in free and device_id not in chosen:
                    chosen.append(device_id)
        for device_id in available:
            if len(chosen) == count:
                break
            if device_id not in chosen:
                chosen.append(device_id)

        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=chosen)]
        )
        try:
            response = _call(plugin.stub.Allocate, request)
        except PluginError as exc:
            raise _AdmissionFailed(go_rpc_error(exc)) from exc
        if not response.container_responses:
            raise _AdmissionFailed("no containers return in allocation response")
        container_response = response.container_responses[0]

        # kubelet records the devices right after Allocate succeeds.
        with self._lock:
            if key in self._pods:  # unless the pod was removed meanwhile
                self._pods[key].setdefault(spec.name, {})[resource] = _Allocation(
                    ids=list(chosen), numa={i: numa.get(i, []) for i in chosen}
                )
            admission.responses[resource] = container_response
            admission.device_ids[resource] = list(chosen)
            self._merge_responses(admission)
        return True

    def _merge_responses(self, admission: ContainerAdmission) -> None:
        """kubelet's deviceRunContainerOptions: the responses in a map's (random) order; the
        first env of a name and the first mount of a container path win. Under the lock."""
        order = list(admission.responses)
        self._rng.shuffle(order)
        envs: dict[str, str] = {}
        mounts: dict[str, dp.Mount] = {}
        for resource in order:
            response = admission.responses[resource]
            for name, value in response.envs.items():
                envs.setdefault(name, value)
            for mount in response.mounts:
                mounts.setdefault(mount.container_path, mount)
        admission.merge_order, admission.envs = order, envs
        admission.mounts = list(mounts.values())

    def remove_pod(self, namespace: str, pod: str) -> None:
        """The pod is gone (deleted, or finished): drop it from kubelet's record. Its
        devices go to the next admission at once (no-op if unknown)."""
        with self._cond:
            self._pods.pop((namespace, pod), None)
            self._rejected.pop((namespace, pod), None)
            self._started = {c for c in self._started if c[:2] != (namespace, pod)}
            self._cond.notify_all()

    def start_container(self, namespace: str, pod: str, container: str) -> None:
        """Start a container as kubelet does: PreStartContainer once for each of its
        resources whose plugin asks for it, in a random order (a Go map's), before
        every start.

        A resource whose plugin has not registered since a kubelet restart is skipped
        (kubelet knows its endpoint only from the checkpoint, without options). Raises
        KeyError for an unknown container, ValueError for a pod kubelet rejected, and
        PluginError when a plugin call fails or a resource has no endpoint at all (kubelet
        fails the start, and retries it later).
        """
        with self._lock:
            if (namespace, pod) in self._rejected:
                raise ValueError(f"pod {namespace}/{pod} was rejected: its containers never start")
            resources = self._pods[(namespace, pod)][container]
            calls = []
            for resource, allocation in resources.items():
                plugin = self._plugins.get(resource)
                if plugin is None:
                    if resource in self._known_resources:
                        continue  # known from the checkpoint only: no options, no call
                    raise PluginError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"endpoint not found in cache for a registered resource: {resource}",
                    )
                if plugin.options.pre_start_required:
                    calls.append((plugin, list(allocation.ids)))
            self._rng.shuffle(calls)
        for plugin, ids in calls:
            if plugin.stopped:
                raise PluginError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"endpoint {plugin.endpoint} of {plugin.resource} has been stopped",
                )
            _call(
                plugin.stub.PreStartContainer,
                dp.PreStartContainerRequest(devices_ids=ids),
                timeout=PRE_START_TIMEOUT_S,
            )
        with self._lock:
            self._started.add((namespace, pod, container))

    def restart_container(self, namespace: str, pod: str, container: str) -> None:
        """The container exited and kubelet starts it again: PreStartContainer for each of
        its resources again, and no Allocate (kubelet reuses the answers it checkpointed).
        The device plugin's side of a restart only: in CRI mode no new container is made.
        ValueError if the container never started."""
        with self._lock:
            if (namespace, pod, container) not in self._started:
                raise ValueError(f"{namespace}/{pod}/{container} never started")
        self.start_container(namespace, pod, container)

    # ------------------------------------------------------------------ CRI mode

    def use_cri(self, endpoint: str, log_root: str) -> None:
        """CRI mode: ``run_pod`` creates pods through the CRI v1 runtime at ``endpoint``
        (``unix://...``, kubelet's --container-runtime-endpoint); pod logs under
        ``log_root``."""
        self._cri_endpoint = endpoint
        self._cri_log_root = log_root

    def _cri_call(self, method: str, request):
        if self._cri_endpoint is None:
            raise RuntimeError("not in CRI mode: call use_cri(endpoint, log_root) first")
        with grpc.insecure_channel(self._cri_endpoint) as channel:
            stub = cri_grpc.RuntimeServiceStub(channel)
            return getattr(stub, method)(request, timeout=CRI_TIMEOUT_S)

    def run_pod(
        self,
        namespace: str,
        pod: str,
        containers: list[ContainerSpec],
        image: str,
        command: list[str],
        uid: str | None = None,
    ) -> CriPod:
        """Admit the pod (``admit_pod``), then create and start it through the CRI like
        kubelet's SyncPod; every container runs ``image`` with ``command``.

        Stops at the first failure (kubelet would retry): the result says which;
        what was created stays until ``stop_pod``.
        """
        if self._cri_endpoint is None:
            raise RuntimeError("not in CRI mode: call use_cri(endpoint, log_root) first")
        uid = uid or str(uuid.uuid4())
        admission = self.admit_pod(namespace, pod, containers)
        result = CriPod(namespace, pod, uid, admission)
        if not admission.ok:
            result.error = f"admission: {admission.error}"
            return result
        sandbox = cri_configs.sandbox_config(namespace, pod, uid, self._cri_log_root)
        try:
            answer = self._cri_call("RunPodSandbox", cri.RunPodSandboxRequest(config=sandbox))
        except grpc.RpcError as exc:
            result.error = f"RunPodSandbox: {exc.details()}"
            return result
        result.sandbox_id = answer.pod_sandbox_id
        with self._lock:
            self._cri_pods[(namespace, pod)] = result
        for admitted in admission.containers:
            result.error = self._run_container(result, sandbox, admitted, image, command)
            if result.error is not None:
                break
        return result

    def _run_container(
        self,
        pod: CriPod,
        sandbox: cri.PodSandboxConfig,
        admitted: ContainerAdmission,
        image: str,
        command: list[str],
    ) -> str | None:
        """PreStartContainer, CreateContainer, StartContainer; why it failed, or None."""
        try:
            self.start_container(pod.namespace, pod.name, admitted.name)
        except PluginError as exc:
            return f"PreStartContainer: {exc}"
        # kubelet's GetDeviceRunContainerOptions: the first env, mount (by container
        # path), device (by container path) and annotation seen wins, in the order the
        # admission merged the responses.
        mounts: dict[str, dp.Mount] = {}
        devices: dict[str, dp.DeviceSpec] = {}
        annotations: dict[str, str] = {}
        for response in (admitted.responses[r] for r in admitted.merge_order):
            for mount in response.mounts:
                mounts.setdefault(mount.container_path, mount)
            for device in response.devices:
                devices.setdefault(device.container_path, device)
            for key, value in response.annotations.items():
                annotations.setdefault(key, value)
        config = cri_configs.container_config(
            sandbox,
            admitted.name,
            image,
            command,
            envs=admitted.envs,
            mounts=mounts.values(),
            devices=devices.values(),
            annotations=annotations,
        )
        try:
            answer = self._cri_call(
                "CreateContainer",
                cri.CreateContainerRequest(
                    pod_sandbox_id=pod.sandbox_id, config=config, sandbox_config=sandbox
                ),
            )
        except grpc.RpcError as exc:
            return f"CreateContainer {admitted.name}: {exc.details()}"
        pod.container_ids[admitted.name] = answer.container_id
        try:
            self._cri_call(
                "StartContainer", cri.StartContainerRequest(container_id=answer.container_id)
            )
        except grpc.RpcError as exc:
            return f"StartContainer {admitted.name}: {exc.details()}"
        return None

    def cri_pod(self, namespace: str, pod: str) -> CriPod:
        """The pod ``run_pod`` created (KeyError if none)."""
        with self._lock:
            return self._cri_pods[(namespace, pod)]

    def stop_pod(self, namespace: str, pod: str) -> None:
        """Remove a pod like kubelet: StopPodSandbox (its containers stop, the runtime runs
        their poststop hooks), RemovePodSandbox, remove the pod's cgroups, then free its
        devices (``remove_pod``)."""
        with self._lock:
            result = self._cri_pods.pop((namespace, pod), None)
        if result is not None and result.sandbox_id is not None:
            request = {"pod_sandbox_id": result.sandbox_id}
            self._cri_call("StopPodSandbox", cri.StopPodSandboxRequest(**request))
            self._cri_call("RemovePodSandbox", cri.RemovePodSandboxRequest(**request))
            cri_configs.remove_pod_cgroups(result.uid)
        self.remove_pod(namespace, pod)

    # ------------------------------------------------------------------ PodResources

    def set_pod_resources_available(self, up: bool) -> None:
        """Make the PodResources server answer normally (True) or UNAVAILABLE (False)."""
        with self._lock:
            self._pod_resources_up = up

    def _check_pod_resources_up(self, context) -> None:
        with self._lock:
            up = self._pod_resources_up
        if not up:
            context.abort(grpc.StatusCode.UNAVAILABLE, "pod resources server unavailable (test)")

    def _pod_resources(self, only: tuple[str, str] | None = None) -> list[pr.PodResources]:
        """kubelet's record as PodResources messages (all pods, or just ``only``)."""
        with self._lock:
            out = []
            for (namespace, name), containers in self._pods.items():
                if only is not None and (namespace, name) != only:
                    continue
                out.append(
                    pr.PodResources(
                        name=name,
                        namespace=namespace,
                        containers=[
                            pr.ContainerResources(
                                name=container,
                                devices=[
                                    entry
                                    for resource, allocation in resources.items()
                                    for entry in _container_devices(
                                        resource, allocation.ids, allocation.numa
                                    )
                                ],
                            )
                            for container, resources in containers.items()
                        ],
                    )
                )
        if self._dra is not None:
            out = self._dra.merge_pod_resources(out, only)
        return out

    def _allocatable(self) -> list[pr.ContainerDevices]:
        """Healthy devices per resource, one entry per device (and NUMA node) like kubelet."""
        with self._lock:
            out = []
            for resource, devices in self._devices.items():
                healthy = [d for d in devices if d.healthy]
                out.extend(
                    _container_devices(
                        resource, [d.id for d in healthy], {d.id: d.numa_nodes for d in healthy}
                    )
                )
            return out


def _container_devices(
    resource: str, ids: list[str], numa: dict[str, list[int]]
) -> list[pr.ContainerDevices]:
    """kubelet's containerDevicesFromResourceDeviceInstances.

    One ContainerDevices per device, and per NUMA node for a device on several;
    a device without topology gets an entry without topology.
    """
    out = []
    for device_id in ids:
        nodes = numa.get(device_id) or []
        if not nodes:
            out.append(pr.ContainerDevices(resource_name=resource, device_ids=[device_id]))
            continue
        for node in nodes:
            out.append(
                pr.ContainerDevices(
                    resource_name=resource,
                    device_ids=[device_id],
                    topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)]),
                )
            )
    return out
