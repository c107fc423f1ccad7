"""The test kubelet's DRA side: plugin registration, the DRA node API as kubelet's DRA
manager calls it, and the claims' part of PodResources, over real unix sockets.

It copies, for what a DRA kubelet plugin can observe, kubelet's plugin manager
(pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go, reconciler/reconciler.go,
operationexecutor/operation_generator.go), its DRA plugin manager
(pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, dra_plugin.go) and its DRA manager
(pkg/kubelet/cm/dra/manager.go, claiminfo.go), as described in docs/dra.md:

* **Discovery**: ``registry_dir`` (kubelet's plugins_registry, subdirectories too) is
  polled every ``poll_interval`` seconds for unix sockets whose name does not start
  with ``.``; sockets there at start are found by the first scan. A new socket is
  registered, a vanished one deregistered, one removed and created again (a plugin
  restart: another inode or ctime) deregistered and registered again.
* **Registration** of one socket, in a thread of its own: dial (10 s), ``GetInfo``
  (1 s deadline), then refuse an unknown ``type`` (only ``DRAPlugin``), an empty name,
  an empty or unsupported ``supported_versions`` (the first entry of the plugin's list
  that kubelet supports wins: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin``), and an endpoint
  another instance of the driver registered; an empty endpoint is the registration
  socket itself. Every outcome is told with ``NotifyRegistrationStatus`` (5 s).
  Failures before the plugin is added (dial, GetInfo, type, validation) are retried
  from the start with a growing delay (0.5 s, doubling, at most 122 s) while the socket
  is there; a refused endpoint is not retried until the socket is created again.
  The driver's endpoint is then dialled as ``unix:<endpoint>``, insecurely; whether
  that connection is up is followed. (The empty-name refusal is this stand-in's: kubelet
  would register under "" a driver no claim can name.)
* **Instances**: several may serve one driver; calls go to the newest connected one,
  else the newest.
* **Slices**: with ``api`` and ``node_name``, every ResourceSlice of the node is deleted
  at start (deletecollection, field selector spec.nodeName), and a driver's slices of
  the node ``wiping_delay`` seconds (30) after its last connected instance went away,
  unless one is back by then.
* **Prepare** (``prepare_pod``, one pod at a time): each claim of the pod
  (spec.resourceClaims; a template's claim named in status.resourceClaimStatuses must
  be owned by the pod) is read from the API server; the pod fails to start when a
  claim cannot be read, is not allocated, does not reserve the pod, or names a driver
  that is not registered, and nothing is called then. Then one
  ``NodePrepareResources`` per driver (45 s) with the pod's claims that are not
  prepared yet, v1 or v1beta1 as chosen at registration. A gRPC error, an entry for a
  UID that was not asked for, a per-claim error, or a missing entry ("skipped N
  ResourceClaims") fails the pod start; the next try asks again for every claim not
  marked prepared. A claim shared by pods is prepared once.
* **Unprepare** (``unprepare_pod``, ``remove_pod``, ``reconcile``): a claim another
  pod still uses only loses this pod; the others go in one ``NodeUnprepareResources``
  per driver, with the same error rules; the claim object is not read (it may be gone).
* **Restart** (``restart``): plugins are forgotten and register again from the scan;
  claims stay recorded (kubelet's checkpoint) but none counts as prepared, so a
  running pod's next ``prepare_pod`` prepares its claims again.
* **PodResources**: ``merge_pod_resources`` adds the DRA pods and each container's
  ``dynamic_resources`` to the test kubelet's answer (``kubelet_sim.TestKubelet.
  attach_dra``): per claim the container names, every device recorded from the
  prepare answers, with kubelet's quirks: a driver's later devices repeat the CDI ids
  of its earlier ones, and a retried prepare records its devices again.
* ``cdi_devices``: the CDI ids the CRI would get for a container (its claims' devices
  whose request names hold the container's request, all when it names none).

Simplified: pods are prepared and unprepared one at a time (kubelet's pod workers run
in parallel), and the pod start is not retried by itself (``wait_prepared`` retries).

Why this module is longer than 400 lines: it stands in for three parts of kubelet that
one DRA plugin talks to (the plugin watcher and registration, the DRA plugin manager
with its slice wiping, the DRA manager with its claim cache and PodResources view);
they share one state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from nodemgr.kubelet.api import podresources_v1_pb2 as pr

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
V1, V1BETA1 = "v1.DRAPlugin", "v1beta1.DRAPlugin"
KUBELET_SERVICES = (V1, V1BETA1)  # most recent first
DIAL_TIMEOUT_S = 10.0
GET_INFO_TIMEOUT_S = 1.0
NOTIFY_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 45.0
WIPING_DELAY_S = 30.0
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 122.0
THREAD_PREFIX = "kubelet-sim-dra"
JOIN_TIMEOUT_S = 5.0

_MODULES = {V1: (dra_v1_pb2, dra_v1_pb2_grpc), V1BETA1: (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}


# ---------------------------------------------------------------------------- records


@dataclass
class RegistrationRecord:
    """One registration attempt of a socket: what GetInfo said, kubelet's verdict
    (``error`` None: registered), the service chosen, and whether the plugin took the
    NotifyRegistrationStatus call."""

    socket: str
    time: float
    info: reg.PluginInfo | None = None
    error: str | None = None
    service: str | None = None
    notified: bool = False


@dataclass
class CallRecord:
    """One NodePrepareResources/NodeUnprepareResources call: to which driver instance,
    with which claims (namespace, name, uid), and what came of it (None: success)."""

    method: str
    driver: str
    endpoint: str
    service: str
    claims: list[tuple[str, str, str]]
    error: str | None = None


@dataclass
class Device:
    """A device kubelet recorded from a NodePrepareResources answer."""

    pool: str
    device: str
    share_id: str | None
    request_names: list[str]
    cdi_ids: list[str]


@dataclass
class ClaimInfo:
    """kubelet's record of one claim (its checkpointed ClaimInfoState)."""

    namespace: str
    name: str
    uid: str
    pod_uids: set[str]
    drivers: dict[str, list[Device]]  # driver -> devices, in the order recorded
    prepared: bool = False


@dataclass
class Result:
    """The outcome of a pod's prepare or unprepare: ``error`` None when it succeeded."""

    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class _Failed(Exception):
    """Internal: stops a prepare or unprepare with kubelet's error message."""


@dataclass
class _Plugin:
    driver: str
    endpoint: str
    socket: str
    service: str
    channel: grpc.Channel
    stub: object
    order: int
    connected: bool = False
    callback: Callable | None = None


@dataclass
class _Desired:
    """A registration socket seen in the directory (kubelet's desired state)."""

    identity: tuple
    registered: bool = False  # added to the plugin store (or refused for good)
    next_try: float = 0.0
    delay: float = RETRY_INITIAL_S
    attempting: bool = False


# ---------------------------------------------------------------------------- API access


class ApiFailure(Exception):
    """A request to the API server failed: the HTTP status (None: no answer) and the
    Status message."""

    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status = status


class ApiAccess:
    """kubelet's client of the API server, over HTTP with a bearer token (the test API
    server's ``url`` and ``token``): it reads claims and deletes ResourceSlices."""

    def __init__(self, url: str, token: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _request(self, method: str, path: str) -> dict:
        request = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("message", str(e))
            except ValueError:
                message = str(e)
            raise ApiFailure(e.code, message) from None
        except OSError as e:
            raise ApiFailure(None, str(e)) from None

    def get_claim(self, namespace: str, name: str) -> dict:
        path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
        return self._request("GET", path)

    def delete_slices(self, node: str, driver: str | None = None) -> None:
        selector = f"spec.nodeName={node}" + (f",spec.driver={driver}" if driver else "")
        query = urllib.parse.urlencode({"fieldSelector": selector})
        self._request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices?{query}")


# ---------------------------------------------------------------------------- helpers


def _status_text(exc: grpc.RpcError) -> str:
    """A gRPC error as Go's status error prints: rpc error: code = X desc = Y."""
    code = "".join(part.capitalize() for part in exc.code().name.split("_"))
    return f"rpc error: code = {code} desc = {exc.details() or ''}"


def claim_name(pod: dict, pod_claim: dict) -> tuple[str | None, bool]:
    """(the claim's name or None when no claim is needed, whether the pod must own it):
    resourceclaim.Name. Raises _Failed when a template's claim is not created yet."""
    meta = pod["metadata"]
    if pod_claim.get("resourceClaimName"):
        return pod_claim["resourceClaimName"], False
    if pod_claim.get("resourceClaimTemplateName"):
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if status.get("name") == pod_claim.get("name"):
                return status.get("resourceClaimName"), True
        raise _Failed(f'pod "{meta["namespace"]}/{meta["name"]}": ResourceClaim not created yet')
    raise _Failed(
        f'pod "{meta["namespace"]}/{meta["name"]}", spec.resourceClaim '
        f'"{pod_claim.get("name")}": unknown ResourceClaim API'
    )


def _copy_info(info: ClaimInfo) -> ClaimInfo:
    return dataclasses.replace(
        info,
        pod_uids=set(info.pod_uids),
        drivers={d: [dataclasses.replace(x) for x in devs] for d, devs in info.drivers.items()},
    )


# ---------------------------------------------------------------------------- kubelet


class DraKubelet:
    """kubelet's DRA side (see the module docstring). ``start()`` scans and watches
    ``registry_dir``; ``stop()`` stops that, closes every plugin connection and joins
    every thread it started."""

    def __init__(
        self,
        registry_dir: str,
        api: ApiAccess | None = None,
        node_name: str | None = None,
        poll_interval: float = 0.1,
        wiping_delay: float = WIPING_DELAY_S,
    ):
        self.registry_dir = os.path.abspath(registry_dir)
        self.api = api
        self.node_name = node_name
        self.poll_interval = poll_interval
        self.wiping_delay = wiping_delay

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pod_lock = threading.Lock()  # prepare/unprepare one pod at a time
        self._lifecycle_lock = threading.Lock()
        # --- guarded by self._lock ---
        self._running = False
        self._generation = 0  # bumped by stop(): a registration of an older one is dropped
        self._desired: dict[str, _Desired] = {}
        self._plugins: dict[str, list[_Plugin]] = {}
        self._order = 0
        self._wipe_at: dict[str, float] = {}  # driver -> when its slices get deleted
        self._registrations: list[RegistrationRecord] = []
        self._calls: list[CallRecord] = []
        self._claims: dict[tuple[str, str], ClaimInfo] = {}  # (namespace, name) -> info
        self._pods: dict[str, dict] = {}  # active pods by UID
        self._threads: list[threading.Thread] = []
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Wipe the node's slices (with an API), then watch the registry directory."""
        with self._lifecycle_lock:
            with self._lock:
                if self._running:
                    raise RuntimeError("DRA kubelet already running")
                self._running = True
                generation = self._generation
            os.makedirs(self.registry_dir, exist_ok=True)
            self._wipe(None)
            watcher = threading.Thread(
                target=self._watch, args=(generation,), name=f"{THREAD_PREFIX}-watcher", daemon=True
            )
            with self._lock:
                self._watcher = watcher
            watcher.start()

    def stop(self) -> None:
        """Stop watching, forget the registration sockets and the plugins, close every
        plugin connection (the kubelet process is gone). Claims stay recorded. Safe when
        not running."""
        with self._lifecycle_lock:
            with self._cond:
                if not self._running:
                    return
                self._running = False
                self._generation += 1
                watcher, self._watcher = self._watcher, None
                threads = list(self._threads)
                plugins = [p for ps in self._plugins.values() for p in ps]
                self._plugins.clear()
                self._desired.clear()
                self._wipe_at.clear()
                self._cond.notify_all()
            for plugin in plugins:
                self._close(plugin)
            for thread in [watcher, *threads]:
                if thread is not None:
                    thread.join(JOIN_TIMEOUT_S)
                    if thread.is_alive():
                        log.warning("DRA kubelet thread %s did not exit", thread.name)
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]

    def restart(self) -> None:
        """A kubelet restart: plugins forgotten (they register again from the scan),
        claims kept but none prepared, the node's slices wiped at start."""
        self.stop()
        with self._cond:
            for info in self._claims.values():
                info.prepared = False
            self._cond.notify_all()
        self.start()

    def _close(self, plugin: _Plugin) -> None:
        if plugin.callback is not None:
            try:
                plugin.channel.unsubscribe(plugin.callback)
            except ValueError:
                pass
        plugin.channel.close()

    # ------------------------------------------------------------------ discovery

    def _watch(self, generation: int) -> None:
        while True:
            with self._cond:
                if generation != self._generation:
                    return
            try:
                self._scan(generation)
                self._wipe_due()
            except Exception:  # a bug here must not end discovery silently
                log.exception("DRA kubelet scan failed")
            with self._cond:
                if generation != self._generation:
                    return
                self._cond.wait(self.poll_interval)

    def _sockets(self) -> dict[str, tuple]:
        found = {}
        for directory, _, names in os.walk(self.registry_dir):
            for name in names:
                if name.startswith("."):
                    continue
                path = os.path.join(directory, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(st.st_mode):
                    found[path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
        return found

    def _scan(self, generation: int) -> None:
        found = self._sockets()
        gone: list[_Plugin] = []
        start: list[str] = []
        now = time.monotonic()
        with self._cond:
            if generation != self._generation:
                return
            for path in list(self._desired):
                if found.get(path) != self._desired[path].identity:
                    del self._desired[path]  # removed, or created again: deregister
                    gone += self._deregister_locked(path)
            for path, identity in found.items():
                desired = self._desired.setdefault(path, _Desired(identity, next_try=now))
                due = not desired.registered and not desired.attempting
                if due and now >= desired.next_try:
                    desired.attempting = True
                    start.append(path)
            self._cond.notify_all()
        for plugin in gone:
            self._close(plugin)
        for path in start:
            thread = threading.Thread(
                target=self._register,
                args=(path, generation),
                name=f"{THREAD_PREFIX}-register-{os.path.basename(path)}",
                daemon=True,
            )
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _deregister_locked(self, socket: str) -> list[_Plugin]:
        gone = []
        for driver, plugins in list(self._plugins.items()):
            removed = [p for p in plugins if p.socket == socket]
            if not removed:
                continue
            gone += removed
            keep = [p for p in plugins if p.socket != socket]
            if keep:
                self._plugins[driver] = keep
            else:
                del self._plugins[driver]
            self._sync_locked(driver)
        return gone

    # ------------------------------------------------------------------ registration

    def _register(self, path: str, generation: int) -> None:
        record = RegistrationRecord(socket=path, time=time.monotonic())
        with self._cond:
            self._registrations.append(record)
        added, error = False, None
        channel = grpc.insecure_channel("unix://" + path)
        try:
            client = reg_grpc.RegistrationStub(channel)
            try:
                self._dial(channel, generation)
                info = client.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
            except (grpc.FutureTimeoutError, grpc.RpcError) as e:
                details = _status_text(e) if isinstance(e, grpc.RpcError) else "dial timed out"
                error = (
                    "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at "
                    f"socket {path}, err: {details}"
                )
                return
            record.info = reg.PluginInfo.FromString(info.SerializeToString())
            error, service = self._validate(info, path)
            if error is None:
                error, added = self._add(info, path, service, generation, record)
            else:
                self._notify(client, record, False, error)
            if added:
                self._notify(client, record, error is None, error or "")
        finally:
            channel.close()
            self._registered(path, record, error, added, generation)

    def _dial(self, channel: grpc.Channel, generation: int) -> None:
        """Wait for the connection (10 s, as kubelet's blocking dial), giving up at once
        when the kubelet stops."""
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + DIAL_TIMEOUT_S
        while True:
            try:
                ready.result(timeout=min(self.poll_interval, DIAL_TIMEOUT_S))
                return
            except grpc.FutureTimeoutError:
                with self._lock:
                    stopping = generation != self._generation
                if stopping or time.monotonic() > deadline:
                    ready.cancel()
                    raise

    def _validate(self, info: reg.PluginInfo, path: str) -> tuple[str | None, str | None]:
        if info.type != PLUGIN_TYPE:
            return (
                f"RegisterPlugin error -- no handler registered for plugin type: {info.type} "
                f"at socket {path}"
            ), None
        endpoint = info.endpoint or path
        prefix = (
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC "
            f"versions of DRA driver plugin {info.name} at endpoint {endpoint}: "
        )
        if not info.name:
            return (
                "RegisterPlugin error -- plugin validation failed with err: empty driver name",
                None,
            )
        if not info.supported_versions:
            return prefix + "empty list of supported gRPC services (aka supported versions)", None
        for service in info.supported_versions:
            if service in KUBELET_SERVICES:
                return None, service
        plugin_list = json.dumps(list(info.supported_versions))
        return (
            prefix + f"none of services supported by the plugin ({plugin_list}) are supported by "
            f"the kubelet ({json.dumps(list(KUBELET_SERVICES))})"
        ), None

    def _add(
        self, info, path: str, service: str, generation: int, record
    ) -> tuple[str | None, bool]:
        """Add the plugin to the store (kubelet's RegisterPlugin): (error, added)."""
        endpoint = info.endpoint or path
        module, grpc_module = _MODULES[service]
        with self._cond:
            if generation != self._generation:
                return "kubelet stopping", False
            for other in self._plugins.get(info.name, []):
                if other.endpoint == endpoint:
                    message = (
                        "RegisterPlugin error -- plugin registration failed with err: endpoint "
                        f"{endpoint} already registered for DRA driver plugin {info.name}"
                    )
                    return message, True  # in kubelet's actual state: not retried
            self._order += 1
            channel = grpc.insecure_channel("unix:" + endpoint)
            plugin = _Plugin(
                info.name,
                endpoint,
                path,
                service,
                channel,
                grpc_module.DRAPluginStub(channel),
                self._order,
            )
            self._plugins.setdefault(info.name, []).append(plugin)
            record.service = service
            self._sync_locked(info.name)

        def connectivity(state, plugin=plugin):
            with self._cond:
                plugin.connected = state == grpc.ChannelConnectivity.READY
                if any(p is plugin for p in self._plugins.get(plugin.driver, [])):
                    self._sync_locked(plugin.driver)
                self._cond.notify_all()

        plugin.callback = connectivity
        channel.subscribe(connectivity, try_to_connect=True)
        return None, True

    def _notify(self, client, record: RegistrationRecord, ok: bool, error: str) -> None:
        try:
            client.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=ok, error=error), timeout=NOTIFY_TIMEOUT_S
            )
            with self._lock:
                record.notified = True
        except grpc.RpcError as e:
            log.info("NotifyRegistrationStatus to %s failed: %s", record.socket, _status_text(e))

    def _registered(self, path, record, error, added, generation) -> None:
        with self._cond:
            record.error = error
            desired = self._desired.get(path)
            if desired is not None and generation == self._generation:
                desired.attempting = False
                if added:
                    desired.registered = True
                else:  # retried with a growing delay while the socket is there
                    desired.next_try = time.monotonic() + desired.delay
                    desired.delay = min(desired.delay * 2, RETRY_MAX_S)
            self._cond.notify_all()
        if error:
            log.info("DRA registration of %s refused: %s", path, error)

    # ------------------------------------------------------------------ slices

    def _sync_locked(self, driver: str) -> None:
        """A driver with no connected instance gets its slices wiped after the delay;
        one connected again cancels that."""
        if any(p.connected for p in self._plugins.get(driver, [])):
            self._wipe_at.pop(driver, None)
        elif driver not in self._wipe_at:
            self._wipe_at[driver] = time.monotonic() + self.wiping_delay

    def _wipe_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [d for d, at in self._wipe_at.items() if at <= now]
            for driver in due:
                del self._wipe_at[driver]
        for driver in due:
            self._wipe(driver)

    def _wipe(self, driver: str | None) -> None:
        if self.api is None or not self.node_name:
            return
        try:
            self.api.delete_slices(self.node_name, driver)
        except ApiFailure as e:
            log.warning("deleting the ResourceSlices of %s failed: %s", driver or "the node", e)

    # ------------------------------------------------------------------ observation

    def registrations(self) -> list[RegistrationRecord]:
        """Every registration attempt, in order (copies)."""
        with self._lock:
            return [dataclasses.replace(r) for r in self._registrations]

    def calls(self) -> list[CallRecord]:
        """Every NodePrepareResources/NodeUnprepareResources call, in order (copies)."""
        with self._lock:
            return [dataclasses.replace(c, claims=list(c.claims)) for c in self._calls]

    def plugins(self, driver: str) -> list[tuple[str, str, bool]]:
        """The driver's registered instances: (endpoint, service, connected), oldest first."""
        with self._lock:
            return [(p.endpoint, p.service, p.connected) for p in self._plugins.get(driver, [])]

    def claims(self) -> dict[tuple[str, str], ClaimInfo]:
        """kubelet's claim records by (namespace, name) (copies)."""
        with self._lock:
            return {k: _copy_info(v) for k, v in self._claims.items()}

    def wait_registered(self, driver: str, timeout: float = 10.0, connected: bool = True) -> None:
        """Wait until ``driver`` has an instance (a connected one with ``connected``)."""

        def ready() -> bool:
            plugins = self._plugins.get(driver, [])
            return any(p.connected for p in plugins) if connected else bool(plugins)

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise TimeoutError(
                    f"DRA driver {driver} not registered within {timeout} s; attempts: "
                    f"{[(r.socket, r.error) for r in self._registrations]}"
                )

    def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Wait until ``predicate()`` holds (it is called with no lock held)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what or 'condition'} not met within {timeout} s")
            with self._cond:
                self._cond.wait(min(self.poll_interval, max(deadline - time.monotonic(), 0)))

    def _plugin(self, driver: str) -> _Plugin:
        """GetPlugin: the newest connected instance, else the newest."""
        if not driver:
            raise _Failed("DRA driver name is empty")
        with self._lock:
            plugins = self._plugins.get(driver, [])
            if not plugins:
                raise _Failed(f"DRA driver {driver} is not registered")
            connected = [p for p in plugins if p.connected]
            return (connected or plugins)[-1]

    # ------------------------------------------------------------------ prepare

    def prepare_pod(self, pod: dict) -> Result:
        """Prepare the pod's claims as kubelet does before its containers start; the pod
        becomes active (listed by PodResources) whatever the outcome."""
        with self._pod_lock:
            with self._cond:
                self._pods[pod["metadata"]["uid"]] = pod
            try:
                self._prepare(pod)
            except _Failed as e:
                return Result(f"prepare dynamic resources: {e}")
            return Result()

    def wait_prepared(self, pod: dict, timeout: float = 10.0, interval: float = 0.2) -> Result:
        """``prepare_pod`` again and again (kubelet retries a failed pod start) until it
        succeeds or ``timeout`` passes; the last result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.prepare_pod(pod)
            if result.ok or time.monotonic() + interval > deadline:
                return result
            time.sleep(interval)

    def _prepare(self, pod: dict) -> None:
        meta = pod["metadata"]
        infos = []
        for pod_claim in pod["spec"].get("resourceClaims") or []:
            name, must_own = claim_name(pod, pod_claim)
            if name is None:
                continue
            infos.append(self._checked_claim(pod, name, must_own))
        batches: dict[int, tuple[_Plugin, list[ClaimInfo]]] = {}
        with self._lock:
            for info, plugins in infos:
                known = self._claims.get((info.namespace, info.name))
                if known is None:
                    known = self._claims[(info.namespace, info.name)] = info
                elif known.uid != info.uid:
                    raise _Failed(
                        f"old ResourceClaim with same name {info.name} and different UID "
                        f"{known.uid} still exists (previous pod force-deleted?!)"
                    )
                known.pod_uids.add(meta["uid"])
                if known.prepared:
                    continue
                for plugin in plugins:
                    batches.setdefault(id(plugin), (plugin, []))[1].append(known)
        for plugin, claims in batches.values():
            self._prepare_batch(plugin, claims)
        with self._lock:
            for _, claims in batches.values():
                for info in claims:
                    info.prepared = True

    def _checked_claim(self, pod: dict, name: str, must_own: bool) -> tuple[ClaimInfo, list]:
        meta = pod["metadata"]
        try:
            claim = self.api.get_claim(meta["namespace"], name) if self.api else None
        except ApiFailure as e:
            raise _Failed(f"fetch ResourceClaim {name}: {e}") from None
        if claim is None:
            raise _Failed(f"fetch ResourceClaim {name}: no API server")
        claim_meta, status = claim["metadata"], claim.get("status") or {}
        if must_own and not any(
            ref.get("uid") == meta["uid"] and ref.get("controller")
            for ref in claim_meta.get("ownerReferences") or []
        ):
            raise _Failed(
                f"ResourceClaim {name} was not created for pod {meta['namespace']}/{meta['name']} "
                "(pod is not owner)"
            )
        if not any(
            r.get("resource") == "pods" and r.get("uid") == meta["uid"]
            for r in status.get("reservedFor") or []
        ):
            raise _Failed(
                f"pod {meta['name']} ({meta['uid']}) is not allowed to use ResourceClaim "
                f"{name} ({claim_meta['uid']})"
            )
        allocation = status.get("allocation")
        if allocation is None:
            raise _Failed(f"ResourceClaim {name}: not allocated")
        drivers = {r["driver"] for r in (allocation.get("devices") or {}).get("results") or []}
        info = ClaimInfo(
            meta["namespace"], name, claim_meta["uid"], set(), {d: [] for d in drivers}
        )
        return info, [self._plugin(driver) for driver in sorted(drivers)]

    def _prepare_batch(self, plugin: _Plugin, claims: list[ClaimInfo]) -> None:
        def keep(info: ClaimInfo, answer) -> None:
            with self._lock:
                for device in answer.devices:
                    share = device.share_id if plugin.service == V1 else ""
                    has_share = plugin.service == V1 and device.HasField("share_id")
                    info.drivers.setdefault(plugin.driver, []).append(
                        Device(
                            device.pool_name,
                            device.device_name,
                            share if has_share else None,
                            list(device.request_names),
                            list(device.cdi_device_ids),
                        )
                    )

        self._call("NodePrepareResources", plugin, claims, keep)

    def _call(self, method: str, plugin: _Plugin, claims: list[ClaimInfo], keep=None) -> None:
        """One NodePrepareResources or NodeUnprepareResources call and kubelet's checks of
        its answer; ``keep(info, entry)`` for each claim's accepted entry. Raises _Failed
        with kubelet's message."""
        module, _ = _MODULES[plugin.service]
        request_type = getattr(module, f"{method}Request")
        request = request_type(
            claims=[module.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        record = self._record(method, plugin, claims)
        try:
            try:
                response = getattr(plugin.stub, method)(request, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                raise _Failed(f"{method}: {_status_text(e)}") from None
            except ValueError as e:  # the channel was closed (deregistration, stop)
                raise _Failed(f"{method}: {e}") from None
            asked = {c.uid: c for c in claims}
            for uid, answer in response.claims.items():
                if uid not in asked:
                    raise _Failed(f"{method} returned result for unknown claim UID {uid}")
                if answer.error:
                    name = asked[uid].name
                    raise _Failed(f"{method} failed for ResourceClaim {name}: {answer.error}")
                if keep is not None:
                    keep(asked[uid], answer)
            if len(claims) != len(response.claims):
                missing = len(claims) - len(response.claims)
                raise _Failed(f"{method} skipped {missing} ResourceClaims")
        except _Failed as e:
            self._finish(record, str(e))
            raise
        self._finish(record, None)

    def _record(self, method: str, plugin: _Plugin, claims: list[ClaimInfo]) -> CallRecord:
        record = CallRecord(
            method, plugin.driver, plugin.endpoint, plugin.service,
            [(c.namespace, c.name, c.uid) for c in claims],
        )  # fmt: skip
        with self._cond:
            self._calls.append(record)
        return record

    def _finish(self, record: CallRecord, error: str | None) -> None:
        with self._cond:
            record.error = error
            self._cond.notify_all()

    # ------------------------------------------------------------------ unprepare

    def unprepare_pod(self, pod: dict) -> Result:
        """Unprepare the pod's claims as kubelet does once its containers are gone (the
        pod stays active; see ``remove_pod``)."""
        with self._pod_lock:
            try:
                self._unprepare(pod["metadata"]["uid"], pod["metadata"]["namespace"], pod)
            except _Failed as e:
                return Result(f"unprepare dynamic resources: {e}")
            return Result()

    def remove_pod(self, pod: dict) -> Result:
        """The pod is gone: no longer active, its claims unprepared (a failure is retried
        by ``reconcile``)."""
        with self._cond:
            self._pods.pop(pod["metadata"]["uid"], None)
        return self.unprepare_pod(pod)

    def reconcile(self) -> list[Result]:
        """kubelet's reconcile loop: unprepare the claims of pods that are not active."""
        with self._lock:
            stale: dict[str, tuple[str, list[str]]] = {}
            for info in self._claims.values():
                for uid in info.pod_uids - set(self._pods):
                    stale.setdefault(uid, (info.namespace, []))[1].append(info.name)
        results = []
        for uid, (namespace, names) in stale.items():
            with self._pod_lock:
                try:
                    self._unprepare_names(uid, namespace, names)
                    results.append(Result())
                except _Failed as e:
                    results.append(Result(f"unprepare dynamic resources: {e}"))
        return results

    def _unprepare(self, uid: str, namespace: str, pod: dict) -> None:
        with self._lock:
            names = [i.name for i in self._claims.values() if uid in i.pod_uids]
        if not names:  # kubelet lost its record: the claim names from the pod
            for pod_claim in pod["spec"].get("resourceClaims") or []:
                name, _ = claim_name(pod, pod_claim)
                if name is not None:
                    names.append(name)
        self._unprepare_names(uid, namespace, names)

    def _unprepare_names(self, uid: str, namespace: str, names: list[str]) -> None:
        batches: dict[str, list[ClaimInfo]] = {}
        with self._lock:
            for name in names:
                info = self._claims.get((namespace, name))
                if info is None:
                    continue
                if len(info.pod_uids) > 1:
                    info.pod_uids.discard(uid)
                    continue
                for driver in sorted(info.drivers):
                    batches.setdefault(driver, []).append(info)
        for driver, claims in batches.items():
            self._call("NodeUnprepareResources", self._plugin(driver), claims)
        with self._cond:
            for claims in batches.values():
                for info in claims:
                    self._claims.pop((info.namespace, info.name), None)
            self._cond.notify_all()

    # ------------------------------------------------------------------ containers

    def _container_claims(
        self, pod: dict, container: dict
    ) -> list[tuple[ClaimInfo | None, list[str]]]:
        """(kubelet's record of the claim or None, the requests named) per claim the
        container names, in the pod's claim order."""
        named: dict[str, list[str]] = {}
        for ref in (container.get("resources") or {}).get("claims") or []:
            named.setdefault(ref["name"], []).append(ref.get("request", ""))
        out = []
        for pod_claim in pod["spec"].get("resourceClaims") or []:
            if pod_claim.get("name") not in named:
                continue
            try:
                name, _ = claim_name(pod, pod_claim)
            except _Failed:
                name = None
            if name is None:
                continue
            info = self._claims.get((pod["metadata"]["namespace"], name))
            out.append((info, named[pod_claim["name"]]))
        return out

    def cdi_devices(self, pod: dict, container_name: str) -> list[str]:
        """The CDI ids the CRI gets for the container (GetResources): the devices of its
        claims whose request names hold the request it names (all when it names none, or
        when the device names none)."""
        container = next(c for c in pod["spec"]["containers"] if c["name"] == container_name)
        ids = []
        with self._lock:
            for info, requests in self._container_claims(pod, container):
                if info is None:
                    raise KeyError(f"no claim info for a claim of container {container_name}")
                for request in requests:
                    for devices in info.drivers.values():
                        for device in devices:
                            if (
                                not request
                                or not device.request_names
                                or request in device.request_names
                            ):
                                ids += device.cdi_ids
        return ids

    def _dynamic_resources(self, pod: dict, container: dict) -> list[pr.DynamicResource]:
        """GetDynamicResources of one container (the lock held)."""
        claims = self._container_claims(pod, container)
        if any(info is None for info, _ in claims):
            return []  # kubelet logs the error and lists nothing for the container
        out = []
        for info, _ in claims:
            resources = []
            for driver in sorted(info.drivers):
                cdi: list[pr.CDIDevice] = []  # kubelet's quirk: it grows across devices
                for device in info.drivers[driver]:
                    cdi += [pr.CDIDevice(name=i) for i in device.cdi_ids]
                    resource = pr.ClaimResource(
                        cdi_devices=list(cdi),
                        driver_name=driver,
                        pool_name=device.pool,
                        device_name=device.device,
                    )
                    if device.share_id is not None:
                        resource.share_id = device.share_id
                    resources.append(resource)
            out.append(
                pr.DynamicResource(
                    claim_name=info.name, claim_namespace=info.namespace, claim_resources=resources
                )
            )
        return out

    def merge_pod_resources(
        self, listed: list[pr.PodResources], only: tuple[str, str] | None = None
    ) -> list[pr.PodResources]:
        """The test kubelet's PodResources answer with the DRA pods added (every
        container of each active pod) and each container's dynamic_resources."""
        by_key = {(p.namespace, p.name): p for p in listed}
        out = list(listed)
        with self._lock:
            for pod in self._pods.values():
                key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
                if only is not None and key != only:
                    continue
                entry = by_key.get(key)
                if entry is None:
                    entry = pr.PodResources(name=key[1], namespace=key[0])
                    out.append(entry)
                containers = {c.name: c for c in entry.containers}
                for container in pod["spec"]["containers"]:
                    if container["name"] not in containers:
                        containers[container["name"]] = entry.containers.add(name=container["name"])
                    containers[container["name"]].dynamic_resources.extend(
                        self._dynamic_resources(pod, container)
                    )
        return out
