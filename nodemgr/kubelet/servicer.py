"""The device plugin gRPC servers: one per resource, each on its own socket.

The servicer only translates: protobuf in, a call on the allocation state's
narrow interface (:class:`~nodemgr.allocation.resources.ResourceManager`),
protobuf out; our errors become gRPC status codes with the allocator's message, which
kubelet shows in the pod's events (for GetPreferredAllocation and Allocate followed by
``REFUSAL_IS_FINAL``: kubelet fails the pod on those for good). How long Allocate took
is reported through a plain callback (``observe_allocate``); the servicer knows nothing
of metrics.

The servers are ``grpc.aio`` servers on one event loop in one thread
(:mod:`nodemgr.kubelet.pluginloop`): idle, that thread and gRPC's poller sleep
until a call or a change comes. A synchronous ``grpc.server`` polls its
completion queue five times a second per server, which was most of an idle
node's CPU. The allocation calls run on that loop as they are (they are short and
take the allocator's lock, which serialises them anyway; kubelet admits one
container at a time); ListAndWatch waits for device changes on an asyncio event
that the change counter sets.

Only kubelet may talk to these sockets, and only root can: each is served by
:func:`~nodemgr.kubelet.rootsocket.serve_root_only` (bound in a private directory, made
0600 there and renamed into place, so none wider is ever in the device plugin directory,
whatever the umask). That is the authentication (kubelet runs as root; the gRPC server
has none of its own). On top of it each server keeps to ``BUDGET`` (README, Device
plugin sockets), because root clients can misbehave too: ``MAX_CONNECTIONS`` connections
(the rest closed at once by gRPC), a connection that has not finished its HTTP/2
handshake in ``HANDSHAKE_SECONDS`` or has had no call for ``IDLE_SECONDS`` is closed,
``MAX_STREAMS`` calls per connection and ``MAX_CALLS`` per server at once (kubelet needs
its ListAndWatch stream and one call at a time), and messages of at most
``MAX_RECEIVE_BYTES``. No budget is a per-connection deadline: kubelet's ListAndWatch
stream lives as long as kubelet.

What it must not do: decide anything or hold state beyond one stream's last sent list;
block the loop on anything slower than the allocation state's own calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
import grpc.aio

from nodemgr.allocation.resources import DeviceInfo, ResourceManager
from nodemgr.common.connbudget import ListenerStats
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.errors import (
    AllocationError,
    ConflictError,
    GpushareError,
    NoFitError,
    UnknownDeviceError,
    final_refusal,
)
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.pluginloop import PLUGIN_LOOP
from nodemgr.kubelet.rootsocket import GrpcBudget, serve_root_only

log = logging.getLogger(__name__)

# (resource name, seconds, ok) for each Allocate call; ok is False when it was refused or failed.
ObserveAllocate = Callable[[str, float, bool], None]

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
OPTIONS = dp.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

# kubelet fails the pod for good on an error of these (UnexpectedAdmissionError).
_ADMISSION_CALLS = frozenset({"preferred", "allocate"})

_STATUS = [
    (NoFitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnknownDeviceError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (AllocationError, grpc.StatusCode.FAILED_PRECONDITION),
    (GpushareError, grpc.StatusCode.INTERNAL),
]


class DevicePluginServicer(dp_grpc.DevicePluginServicer):
    """The DevicePlugin service of one resource, served on the plugin loop.

    Each call goes straight to the allocation state (``ResourceManager``); a refusal
    becomes the call's gRPC status in one place, ``_refuse``."""

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

    async def GetDevicePluginOptions(self, request, context):
        return OPTIONS

    async def ListAndWatch(self, request, context) -> AsyncIterator[dp.ListAndWatchResponse]:
        log.info("kubelet is watching %s", self._name)
        changes = self._resources.device_changes
        moved = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:  # called by whichever thread bumped: must not block or raise
            try:
                loop.call_soon_threadsafe(moved.set)
            except RuntimeError:
                pass  # the loop is closed: this stream is over

        changes.add_listener(wake)
        try:
            watch = _DeviceWatch(self._resources, self._kind)
            while not self._stopping.is_set():
                moved.clear()  # before reading the generation: no change slips between
                message = watch.message(changes.generation)
                if message is not None:
                    yield message
                    continue  # look again: something may have moved while sending
                # Until a change, a stop (wake_all) or the stream's end (the call is
                # cancelled here): no timer wakes it.
                await moved.wait()
        finally:
            changes.remove_listener(wake)

    async def GetPreferredAllocation(self, request, context):
        response = dp.PreferredAllocationResponse()
        try:
            for req in request.container_requests:
                ids = self._resources.preferred(
                    self._kind,
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                )
                response.container_responses.add(deviceIDs=ids)
        except Exception as error:
            await self._refuse(context, "preferred", error)
        return response

    async def Allocate(self, request, context):
        started = time.perf_counter()
        response = dp.AllocateResponse()
        try:
            for req in request.container_requests:
                result = self._resources.allocate(self._kind, list(req.devices_ids))
                container = response.container_responses.add(envs=result.envs)
                for mount in result.mounts:
                    container.mounts.add(
                        container_path=mount.container_path,
                        host_path=mount.host_path,
                        read_only=mount.read_only,
                    )
        except Exception as error:
            self._observe(time.perf_counter() - started, ok=False)
            await self._refuse(context, "allocate", error)
        self._observe(time.perf_counter() - started, ok=True)
        return response

    async def PreStartContainer(self, request, context):
        try:
            self._resources.check_known(self._kind, list(request.devices_ids))
        except Exception as error:
            await self._refuse(context, "check_known", error)
        return dp.PreStartContainerResponse()

    async def _refuse(
        self, context: grpc.aio.ServicerContext, call: str, error: Exception
    ) -> NoReturn:
        """End the call with a gRPC status: our errors with the code kubelet shows the user
        and the allocator's message; anything else (a bug) as INTERNAL, logged with its
        traceback, and the server lives on. kubelet fails the pod for good on any error of
        an admission call and never retries it, so their messages say so."""
        said = final_refusal if call in _ADMISSION_CALLS else str
        if isinstance(error, GpushareError):
            code = next(code for cls, code in _STATUS if isinstance(error, cls))
            log.warning("%s: refused %s: %s", self._name, call, error)
            await context.abort(code, said(str(error)))
        log.error("%s: %s failed", self._name, call, exc_info=error)
        await context.abort(
            grpc.StatusCode.INTERNAL, said(f"gpushare-node internal error: {error!r}")
        )

    def _observe(self, seconds: float, ok: bool) -> None:
        if self._observe_allocate is None:
            return
        try:
            self._observe_allocate(self._name, seconds, ok)
        except Exception:  # a metrics bug must not turn an answer into an error
            log.exception("%s: observing Allocate failed", self._name)


class _DeviceWatch:
    """What one ListAndWatch stream sends: the device list, rebuilt only when the card
    state moved (thousands of devices on a big node), sent only when it differs."""

    def __init__(self, resources: ResourceManager, kind: ResourceKind):
        self._resources, self._kind = resources, kind
        self._seen: int | None = None
        self._sent: list[DeviceInfo] | None = None

    def message(self, generation: int) -> dp.ListAndWatchResponse | None:
        """The message to send for the state at ``generation``; None when none is due."""
        if generation == self._seen:
            return None
        self._seen = generation
        devices = self._resources.devices(self._kind)
        # The allocator hands back the same list while it shows the same: no compare then.
        if devices is self._sent or devices == self._sent:
            return None
        self._sent = devices
        return dp.ListAndWatchResponse(devices=[_device(d) for d in devices])


def _device(info: DeviceInfo) -> dp.Device:
    device = dp.Device(ID=info.id, health=HEALTHY if info.healthy else UNHEALTHY)
    if info.numa_node is not None:
        device.topology.nodes.add(ID=info.numa_node)
    return device


class PluginServer:
    """One resource's gRPC server on ``<device_plugin_dir>/<socket_name>``; its calls are
    served on the plugin loop."""

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
        self.socket_path = socket_path
        self._resources = resources
        self._observe_allocate = observe_allocate
        self._stopping = threading.Event()
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None

    @property
    def endpoint(self) -> str:
        """What kubelet wants in RegisterRequest: the socket's name in its directory."""
        return os.path.basename(self.socket_path)

    def start(self) -> None:
        _remove(self.socket_path)  # a socket left by a crash would refuse the bind
        self._server = PLUGIN_LOOP.run(self._serve(), START_TIMEOUT_SECONDS)
        self._inode = os.stat(self.socket_path).st_ino

    async def _serve(self) -> grpc.aio.Server:
        server = BUDGET.server()
        servicer = DevicePluginServicer(
            self._resources, self.kind, self._stopping, self._observe_allocate
        )
        dp_grpc.add_DevicePluginServicer_to_server(servicer, server)
        await serve_root_only(server, self.socket_path)
        return server

    def socket_present(self) -> bool:
        """False once kubelet (restarting) has deleted or replaced our socket."""
        try:
            return os.stat(self.socket_path).st_ino == self._inode
        except FileNotFoundError:
            return False

    def stop(self, grace_seconds: float = 1.0) -> None:
        self._stopping.set()
        self._resources.device_changes.wake_all()  # open ListAndWatch streams end
        if self._server is not None:
            server, self._server = self._server, None
            PLUGIN_LOOP.run(server.stop(grace_seconds), grace_seconds + START_TIMEOUT_SECONDS)
        if self.socket_present():
            _remove(self.socket_path)

    def join(self, timeout_seconds: float) -> bool:
        """``stop`` already waited for the server's grace period: nothing is left."""
        return self._server is None

    @property
    def alive(self) -> bool:
        """Serving: started, not stopped, and the plugin loop runs."""
        return self._server is not None and not self._stopping.is_set() and PLUGIN_LOOP.running


# How long starting a server, or stopping one beyond its grace, may take on the loop.
START_TIMEOUT_SECONDS = 10.0

# The budget of each device plugin server (README, Device plugin sockets). kubelet holds
# one connection per plugin (two for a moment when it restarts).
MAX_CONNECTIONS = 8
HANDSHAKE_SECONDS = 5.0
IDLE_SECONDS = 30.0
MAX_STREAMS = 16
MAX_CALLS = 32
# kubelet's own limit for what it reads; an Allocate or GetPreferredAllocation names at
# most every device of the resource (devicelists keeps that list under 1 MiB).
MAX_RECEIVE_BYTES = 4 * 1024 * 1024
MAX_METADATA_BYTES = 16 * 1024
BUDGET = GrpcBudget(
    max_connections=MAX_CONNECTIONS,
    handshake_seconds=HANDSHAKE_SECONDS,
    idle_seconds=IDLE_SECONDS,
    max_streams=MAX_STREAMS,
    max_calls=MAX_CALLS,
    max_receive_bytes=MAX_RECEIVE_BYTES,
    max_metadata_bytes=MAX_METADATA_BYTES,
)


def budget_stats() -> ListenerStats:
    """A device plugin server's budget; gRPC does not say how many connections are open
    or what it refused (unknown, never zero)."""
    return {
        "connections": None,
        "max_connections": MAX_CONNECTIONS,
        "deadline_seconds": None,
        "refused": {},
    }


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
