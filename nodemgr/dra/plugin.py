"""The DRA kubelet plugin's two gRPC servers, on the plugin event loop.

- Registration (``pluginregistration``) on ``<plugins_registry_dir>/<driver>-reg.sock``:
  ``GetInfo`` answers type ``DRAPlugin``, the driver name, the service socket's path
  and the DRA services served, most preferred first (``v1.DRAPlugin``,
  ``v1beta1.DRAPlugin``: kubelet takes the first it knows); kubelet's verdict,
  ``NotifyRegistrationStatus``, is logged and kept (``registered``).
- DRAPlugin, ``k8s.io.kubelet.pkg.apis.dra.v1`` and ``v1beta1``, on
  ``<plugins_dir>/<driver>/dra.sock``: NodePrepareResources and
  NodeUnprepareResources.

The servicers only translate between protobuf and :class:`~nodemgr.dra.driver.DraDriver`,
whose calls run in one worker thread (they read the API server and must not stall
the device plugins' loop). kubelet's deadline, less a margin, bounds a prepare batch:
claims not reached are left out of the answer and kubelet asks for them again.

kubelet finds the plugin by its registration socket (a plugin watcher), dials the
service socket insecurely, and deregisters it when the socket goes. This worker's
thread checks every second that both sockets are still the ones it bound, and binds
them again when one was removed (kubelet then registers the plugin again). Both are
removed on stop.

Only root (kubelet) can connect: both sockets are bound as the device plugin sockets
are (:func:`~nodemgr.kubelet.rootsocket.serve_root_only`: 0600, never wider, whatever
the umask). Both servers keep to ``BUDGET``, the device plugin servers' budget but for
the message size: ``MAX_CONNECTIONS`` connections, ``HANDSHAKE_SECONDS`` for the HTTP/2
handshake, a connection without a call for ``IDLE_SECONDS`` closed, ``MAX_STREAMS`` calls
per connection and ``MAX_CALLS`` per server at once, and requests of at most
``MAX_RECEIVE_BYTES``: ``MAX_CLAIMS`` claims, each named as long as the API allows. A
request naming more than ``MAX_CLAIMS`` claims is refused as a whole: kubelet sends one
batch per pod, and ``MAX_CLAIMS`` claims of ``MAX_RESULTS`` devices each, every name as
long as the API allows, make an answer under the 4 MiB a gRPC client reads unless told
otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import Any

import grpc
import grpc.aio

from nodemgr.common.changes import wakes_deferred
from nodemgr.common.connbudget import ListenerStats
from nodemgr.common.workers import ThreadWorker
from nodemgr.config.schema import DraSettings
from nodemgr.dra.driver import ClaimKey, DraDriver, Prepared
from nodemgr.kubelet import servicer as device_plugins
from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from nodemgr.kubelet.pluginloop import PLUGIN_LOOP
from nodemgr.kubelet.rootsocket import serve_root_only

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
V1, V1BETA1 = "v1.DRAPlugin", "v1beta1.DRAPlugin"
SUPPORTED_VERSIONS = (V1, V1BETA1)  # most preferred first: kubelet takes the first it knows
# Claims in one call: kubelet sends one batch per pod, of the pod's claims for this driver.
MAX_CLAIMS = 128
# Devices of one claim in an answer: an allocation has at most 32 results.
MAX_RESULTS = 32
# One Claim of a request, framed: namespace (a DNS label, 63), UID (36), name (a DNS
# subdomain, 253), with room to spare.
CLAIM_BYTES = 512
# The budget of both servers: the device plugin servers' (kubelet dials them the same way:
# one connection to the service socket, two for a moment when it restarts, the
# registration socket for GetInfo and NotifyRegistrationStatus, one call per pod it
# starts), but for what a request may hold: MAX_CLAIMS claims.
MAX_CONNECTIONS = device_plugins.MAX_CONNECTIONS
HANDSHAKE_SECONDS = device_plugins.HANDSHAKE_SECONDS
IDLE_SECONDS = device_plugins.IDLE_SECONDS
MAX_STREAMS = device_plugins.MAX_STREAMS
MAX_CALLS = device_plugins.MAX_CALLS
MAX_METADATA_BYTES = device_plugins.MAX_METADATA_BYTES
MAX_RECEIVE_BYTES = MAX_CLAIMS * CLAIM_BYTES
BUDGET = replace(device_plugins.BUDGET, max_receive_bytes=MAX_RECEIVE_BYTES)
# Kept from kubelet's deadline for the answer to travel back: claims still waiting then
# are left out of it (kubelet asks again) rather than the whole call timing out.
DEADLINE_MARGIN_SECONDS = 2.0
CHECK_PERIOD_SECONDS = 1.0
START_TIMEOUT_SECONDS = 10.0
STOP_GRACE_SECONDS = 0.2


class _DriverThread(Executor):
    """One daemon thread running the driver's calls in order. Not a ThreadPoolExecutor:
    its threads are joined at interpreter exit, and a prepare waiting on a hung API
    server must not hold up the daemon's exit.

    The changes a call makes (a claim admitted or released moves the allocation
    state) wake the threads that follow them (ListAndWatch streams on the plugin
    loop, the MPS supervisor, the publishers) once the call's answer is handed to the
    loop (``wakes_deferred``), not in the middle of the call: each of them takes the
    GIL, and the answer still has to travel through that loop."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, lambda: fn(*args, **kwargs), ()))
        return future

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, call, _ = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with wakes_deferred():
                    try:
                        future.set_result(call())
                    except BaseException as e:  # handed to the awaiting servicer
                        future.set_exception(e)
            except Exception:  # a listener that raised: the answer is out, the thread lives
                log.exception("waking the threads a DRA call's changes concern failed")

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPlugin):
        self._plugin = plugin

    async def GetInfo(self, request, context):
        return self._plugin.info()

    async def NotifyRegistrationStatus(self, request, context):
        self._plugin.notified(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class _DraService:
    """NodePrepareResources and NodeUnprepareResources of one API version."""

    def __init__(self, pb: Any, driver: DraDriver, executor: Executor, share_ids: bool):
        self._pb, self._driver, self._executor = pb, driver, executor
        self._share_ids = share_ids  # v1 has Device.share_id; v1beta1 does not

    async def NodePrepareResources(self, request, context):
        claims = await self._claims(request, context)
        remaining = context.time_remaining()
        deadline = None
        if remaining is not None:
            deadline = time.monotonic() + max(remaining - DEADLINE_MARGIN_SECONDS, 0.0)
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self._executor, self._driver.prepare, claims, deadline)
        response = self._pb.NodePrepareResourcesResponse()
        for uid, entry in answer.items():
            self._fill(response.claims[uid], entry)
        return response

    async def NodeUnprepareResources(self, request, context):
        claims = await self._claims(request, context)
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self._executor, self._driver.unprepare, claims)
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in answer.items():
            entry = response.claims[uid]
            entry.SetInParent()
            if error:
                entry.error = error
        return response

    async def _claims(self, request, context) -> list[ClaimKey]:
        if len(request.claims) > MAX_CLAIMS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.claims)} claims in one call; gpushare-node takes at most "
                f"{MAX_CLAIMS}",
            )
        return [ClaimKey(c.namespace, c.uid, c.name) for c in request.claims]

    def _fill(self, out, entry: Prepared) -> None:
        out.SetInParent()  # an empty entry is a success: it must be in the map
        if entry.error is not None:
            out.error = entry.error
            return
        for device in entry.devices:
            added = out.devices.add(
                request_names=list(device.request_names),
                pool_name=device.pool,
                device_name=device.device,
                cdi_device_ids=list(device.cdi_ids),
            )
            if self._share_ids and device.share_id is not None:
                added.share_id = device.share_id


def _v1(driver: DraDriver, executor: Executor) -> dra_v1_pb2_grpc.DRAPluginServicer:
    service = _DraService(dra_v1_pb2, driver, executor, share_ids=True)

    class Servicer(dra_v1_pb2_grpc.DRAPluginServicer):
        NodePrepareResources = staticmethod(service.NodePrepareResources)
        NodeUnprepareResources = staticmethod(service.NodeUnprepareResources)

    return Servicer()


def _v1beta1(driver: DraDriver, executor: Executor) -> dra_v1beta1_pb2_grpc.DRAPluginServicer:
    service = _DraService(dra_v1beta1_pb2, driver, executor, share_ids=False)

    class Servicer(dra_v1beta1_pb2_grpc.DRAPluginServicer):
        NodePrepareResources = staticmethod(service.NodePrepareResources)
        NodeUnprepareResources = staticmethod(service.NodeUnprepareResources)

    return Servicer()


class DraPlugin(ThreadWorker):
    """The two servers, served while this worker runs; bound again if a socket goes."""

    def __init__(self, settings: DraSettings, driver: DraDriver):
        super().__init__("dra-plugin")
        self.settings = settings
        self.driver = driver
        self._executor = _DriverThread("dra-driver")
        self._servers: list[grpc.aio.Server] = []
        self._inodes: dict[str, int] = {}
        self._state_lock = threading.Lock()
        # kubelet's last verdict: None before any, True registered, False refused.
        self.registered: bool | None = None
        self.registration_error = ""

    # --- registration ---------------------------------------------------------------

    def info(self) -> Any:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.settings.driver,
            endpoint=self.settings.service_socket,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def notified(self, registered: bool, error: str) -> None:
        with self._state_lock:
            self.registered, self.registration_error = registered, error
        if registered:
            log.info("kubelet registered DRA driver %s", self.settings.driver)
        else:
            log.error("kubelet refused DRA driver %s: %s", self.settings.driver, error)

    # --- life cycle -----------------------------------------------------------------

    def start(self) -> None:
        """Bind and serve both sockets, then watch them from the worker's thread."""
        self._serve()
        super().start()

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(CHECK_PERIOD_SECONDS):
                if not self.sockets_present():
                    log.warning(
                        "a DRA plugin socket (%s, %s) was removed or replaced: serving again",
                        self.settings.registration_socket,
                        self.settings.service_socket,
                    )
                    self._shutdown()
                    self._serve()
        finally:
            self._shutdown()
            self._executor.shutdown(wait=False)

    def stop(self) -> None:
        super().stop()
        if self._thread is None:  # never started its thread: nothing else stops them
            self._shutdown()

    def sockets_present(self) -> bool:
        for path, inode in self._inodes.items():
            try:
                if os.stat(path).st_ino != inode:
                    return False
            except FileNotFoundError:
                return False
        return bool(self._inodes)

    def _serve(self) -> None:
        settings = self.settings
        os.makedirs(settings.plugins_registry_dir, mode=0o750, exist_ok=True)
        os.makedirs(os.path.dirname(settings.service_socket), mode=0o750, exist_ok=True)
        # The service first: kubelet dials it as soon as the registration socket appears.
        # A socket left by a crash is replaced by the rename into place.
        self._servers.append(PLUGIN_LOOP.run(self._service_server(), START_TIMEOUT_SECONDS))
        self._servers.append(PLUGIN_LOOP.run(self._registration_server(), START_TIMEOUT_SECONDS))
        for path in (settings.service_socket, settings.registration_socket):
            self._inodes[path] = os.stat(path).st_ino
        log.info(
            "DRA driver %s serving %s (registration %s)",
            settings.driver,
            settings.service_socket,
            settings.registration_socket,
        )

    async def _service_server(self) -> grpc.aio.Server:
        server = BUDGET.server()
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_v1(self.driver, self._executor), server)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
            _v1beta1(self.driver, self._executor), server
        )
        await serve_root_only(server, self.settings.service_socket)
        return server

    async def _registration_server(self) -> grpc.aio.Server:
        server = BUDGET.server()
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        await serve_root_only(server, self.settings.registration_socket)
        return server

    def _shutdown(self) -> None:
        """Stop both servers and remove our sockets (kubelet then deregisters us)."""
        servers, self._servers = self._servers, []
        for server in servers:
            with contextlib.suppress(Exception):
                PLUGIN_LOOP.run(server.stop(STOP_GRACE_SECONDS), START_TIMEOUT_SECONDS)
        for path, inode in list(self._inodes.items()):
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == inode:
                    _remove(path)
        self._inodes.clear()

    def state(self) -> dict[str, Any]:
        """For the status document."""
        with self._state_lock:
            registered, error = self.registered, self.registration_error
        return {
            "driver": self.settings.driver,
            "serving": self.alive and self.sockets_present(),
            "registered": registered,
            "registration_error": error or None,
        }


def budget_stats() -> ListenerStats:
    """Either server's budget; gRPC does not say how many connections are open or what it
    refused (unknown, never zero)."""
    return {
        "connections": None,
        "max_connections": MAX_CONNECTIONS,
        "deadline_seconds": None,
        "refused": {},
    }


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
