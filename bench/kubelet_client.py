"""The bench's side of kubelet's device manager: admission RPCs, each timed.

The test kubelet (standins/kubelet_sim.py) registers the daemon's resources and
serves PodResources; it times whole admissions, not single calls. To compare
one Allocate call with one floor call, the bench makes those calls itself, as
kubelet does: per container and resource, GetPreferredAllocation with every
free healthy device then Allocate with the chosen IDs, over a
``grpc.insecure_channel("unix://...")`` to the plugin's socket (the channel
kind the test kubelet uses), waiting for each answer before the next call.

It keeps kubelet's record of who holds which device for the pods it admitted;
``remove`` frees a pod's devices for the next admissions, as kubelet does when
a pod is deleted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict, deque

import grpc

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONNECT_TIMEOUT_S = 30.0


def plugin_stub(socket_path: str) -> tuple[grpc.Channel, dp_grpc.DevicePluginStub]:
    """A connected channel and stub to a device plugin socket, as the test kubelet dials."""
    channel = grpc.insecure_channel(f"unix://{os.path.abspath(socket_path)}")
    stub = dp_grpc.DevicePluginStub(channel)
    stub.GetDevicePluginOptions(dp.Empty(), timeout=CONNECT_TIMEOUT_S, wait_for_ready=True)
    return channel, stub


def timed(call, request) -> tuple[object, float]:
    """Call a unary RPC; its answer and the seconds it took, seen by the caller."""
    started = time.perf_counter()
    response = call(request)
    return response, time.perf_counter() - started


class DeviceManager:
    """Admits containers to the daemon's plugins and keeps which devices pods hold.

    ``timings`` maps an RPC name (``Allocate``, ``GetPreferredAllocation``) to the
    seconds of every call made.
    """

    def __init__(self, sockets: dict[str, str], devices: dict[str, list[str]]):
        self._channels = {}
        self._stubs = {}
        for resource, path in sockets.items():
            self._channels[resource], self._stubs[resource] = plugin_stub(path)
        self._devices = {resource: list(ids) for resource, ids in devices.items()}
        self._held: dict[str, set[str]] = defaultdict(set)
        self._pods: dict[str, dict[str, list[str]]] = {}
        self._order: deque[str] = deque()  # pods in admission order
        self.timings: dict[str, list[float]] = defaultdict(list)

    @property
    def pods(self) -> int:
        return len(self._pods)

    def admit(self, pod: str, requests: dict[str, int]) -> None:
        """One container's resources, in order; raises grpc.RpcError on a refusal."""
        record: dict[str, list[str]] = {}
        self._pods[pod] = record
        self._order.append(pod)
        for resource, count in requests.items():
            stub = self._stubs[resource]
            available = [i for i in self._devices[resource] if i not in self._held[resource]]
            preferred, seconds = timed(
                stub.GetPreferredAllocation,
                dp.PreferredAllocationRequest(
                    container_requests=[
                        dp.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available, allocation_size=count
                        )
                    ]
                ),
            )
            self.timings["GetPreferredAllocation"].append(seconds)
            free = set(available)
            chosen = [i for i in preferred.container_responses[0].deviceIDs if i in free][:count]
            chosen += [i for i in available if i not in chosen][: count - len(chosen)]
            _, seconds = timed(
                stub.Allocate,
                dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=chosen)]
                ),
            )
            self.timings["Allocate"].append(seconds)
            record[resource] = chosen
            self._held[resource].update(chosen)

    def remove_oldest(self) -> str:
        """Delete the oldest pod: its devices are free for the next admissions. Its name."""
        pod = self._order.popleft()
        for resource, ids in self._pods.pop(pod).items():
            self._held[resource].difference_update(ids)
        return pod

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


class FloorServer:
    """bench/floor_server.py in its own process, on ``socket_path``."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.floor_server", socket_path], cwd=REPO
        )
        self.channel, self.stub = plugin_stub(socket_path)

    def call(self) -> float:
        """Seconds of one GetDevicePluginOptions call."""
        return timed(self.stub.GetDevicePluginOptions, dp.Empty())[1]

    def close(self) -> None:
        self.channel.close()
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
