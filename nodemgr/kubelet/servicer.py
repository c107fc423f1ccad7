"""The device plugin gRPC servers: one per resource, each on its own socket.

The servicer only translates: protobuf in, a call on the allocation state's
narrow interface (:class:`~nodemgr.allocation.resources.ResourceManager`),
protobuf out; our errors become gRPC status codes with the allocator's message, which
kubelet shows in the pod's events. How long Allocate took is reported through a
plain callback (``observe_allocate``); the servicer knows nothing of metrics.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from nodemgr.allocation.resources import DeviceInfo, ResourceManager
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.errors import (
    AllocationError,
    ConflictError,
    GpushareError,
    NoFitError,
    UnknownDeviceError,
)
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc

log = logging.getLogger(__name__)

# (resource name, seconds, ok) for each Allocate call; ok is False when it was refused or failed.
ObserveAllocate = Callable[[str, float, bool], None]

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
OPTIONS = dp.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

_STATUS = [
    (NoFitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownDeviceError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (AllocationError, grpc.StatusCode.FAILED_PRECONDITION),
    (GpushareError, grpc.StatusCode.INTERNAL),
]


class DevicePluginServicer(dp_grpc.DevicePluginServicer):
    def __init__(
        self,
        resources: ResourceManager,
        kind: ResourceKind,
        stopping: threading.Event,
        observe_allocate: ObserveAllocate | None = None,
    ):
        self._resources = resources
        self._kind = kind
        self._name = resources.resource_names[kind]
        self._stopping = stopping
        self._observe_allocate = observe_allocate

    def GetDevicePluginOptions(self, request, context):
        return OPTIONS

    def ListAndWatch(self, request, context) -> Iterator[dp.ListAndWatchResponse]:
        log.info("kubelet is watching %s", self._name)
        sent = None
        changes = self._resources.device_changes
        generation, seen = changes.generation, None
        while not self._stopping.is_set() and context.is_active():
            # The list is rebuilt only when the card state moved (thousands of devices on
            # a big node); the 1 s wake-ups only notice a stop or a gone stream.
            if generation != seen:
                seen = generation
                devices = self._resources.devices(self._kind)
                if devices != sent:
                    yield dp.ListAndWatchResponse(devices=[_device(d) for d in devices])
                    sent = devices
            generation = changes.wait_for_change(generation, timeout=1.0)

    def GetPreferredAllocation(self, request, context):
        response = dp.PreferredAllocationResponse()
        for req in request.container_requests:
            ids = self._call(
                context,
                self._resources.preferred,
                self._kind,
                list(req.available_deviceIDs),
                list(req.must_include_deviceIDs),
                req.allocation_size,
            )
            response.container_responses.add(deviceIDs=ids)
        return response

    def Allocate(self, request, context):
        started = time.perf_counter()
        ok = False
        try:
            response = self._allocate(request, context)
            ok = True
            return response
        finally:
            # context.abort raises: a refusal lands here with ok False.
            self._observe(time.perf_counter() - started, ok)

    def _allocate(self, request, context):
        response = dp.AllocateResponse()
        for req in request.container_requests:
            result = self._call(
                context, self._resources.allocate, self._kind, list(req.devices_ids)
            )
            container = response.container_responses.add(envs=result.envs)
            for mount in result.mounts:
                container.mounts.add(
                    container_path=mount.container_path,
                    host_path=mount.host_path,
                    read_only=mount.read_only,
                )
        return response

    def PreStartContainer(self, request, context):
        self._call(context, self._resources.check_known, self._kind, list(request.devices_ids))
        return dp.PreStartContainerResponse()

    def _observe(self, seconds: float, ok: bool) -> None:
        if self._observe_allocate is None:
            return
        try:
            self._observe_allocate(self._name, seconds, ok)
        except Exception:  # a metrics bug must not turn an answer into an error
            log.exception("%s: observing Allocate failed", self._name)

    def _call(self, context, method, *args):
        """Run an allocator call; our errors become a gRPC status kubelet shows the user."""
        try:
            return method(*args)
        except GpushareError as e:
            code = next(code for cls, code in _STATUS if isinstance(e, cls))
            log.warning("%s: refused %s: %s", self._name, method.__name__, e)
            context.abort(code, str(e))
        except Exception as e:  # a bug must not kill the server thread silently
            log.exception("%s: %s failed", self._name, method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"gpushare-node internal error: {e!r}")


def _device(info: DeviceInfo) -> dp.Device:
    device = dp.Device(ID=info.id, health=HEALTHY if info.healthy else UNHEALTHY)
    if info.numa_node is not None:
        device.topology.nodes.add(ID=info.numa_node)
    return device


class PluginServer:
    """One resource's gRPC server on ``<device_plugin_dir>/<socket_name>``."""

    def __init__(
        self,
        resources: ResourceManager,
        kind: ResourceKind,
        socket_path: str,
        observe_allocate: ObserveAllocate | None = None,
    ):
        self.kind = kind
        self.resource_name = resources.resource_names[kind]
        self.name = f"device-plugin {self.resource_name}"
        self.name = f"device-plugin {self.resource_name}"
        self.socket_path = socket_path
        self._resources = resources
        self._observe_allocate = observe_allocate
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._inode: int | None = None

    @property
    def endpoint(self) -> str:
        """What kubelet wants in RegisterRequest: the socket's name in its directory."""
        return os.path.basename(self.socket_path)

    def start(self) -> None:
        _remove(self.socket_path)  # a socket left by a crash would refuse the bind
        # ListAndWatch holds a worker for as long as kubelet watches; leave room.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_DevicePluginServicer_to_server(
            DevicePluginServicer(
                self._resources, self.kind, self._stopping, self._observe_allocate
            ),
            self._server,
        )
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        self._server.start()
        self._inode = os.stat(self.socket_path).st_ino

    def socket_present(self) -> bool:
        """False once kubelet (restarting) has deleted or replaced our socket."""
        try:
            return os.stat(self.socket_path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def stop(self, grace_seconds: float = 1.0) -> None:
        self._stopping.set()
        self._resources.device_changes.wake_all()
        if self._server is not None:
            self._server.stop(grace_seconds).wait()
            self._server = None
        if self.socket_present():
            _remove(self.socket_path)

    def join(self, timeout_seconds: float) -> bool:
        """``stop`` already waited for the server's grace period: nothing is left."""
        return self._server is None

    @property
    def alive(self) -> bool:
        return self._server is not None and not self._stopping.is_set()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
