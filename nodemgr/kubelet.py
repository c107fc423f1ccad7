"""Clients of kubelet: device plugin Registration and the PodResources API.

Both speak gRPC over kubelet's unix sockets. Failures become
``KubeletUnavailable`` with the socket and what to check; callers retry.
"""

from __future__ import annotations

import threading

import grpc

from nodemgr.errors import GpushareError
from nodemgr.kubeapi import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubeapi import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubeapi import podresources_v1_pb2 as pr
from nodemgr.kubeapi import podresources_v1_pb2_grpc as pr_grpc
from nodemgr.model import ContainerRef

API_VERSION = "v1beta1"
KubeletRecord = dict[ContainerRef, dict[str, list[str]]]


class KubeletUnavailable(GpushareError):
    """kubelet did not answer on its socket (not running, restarting, or refused us)."""


def register(
    kubelet_socket: str,
    resource_name: str,
    endpoint: str,
    options: dp.DevicePluginOptions,
    stop: threading.Event,
    timeout_seconds: float = 15.0,
) -> bool:
    """Register one resource; our server at ``endpoint`` must already be serving.

    kubelet dials back and calls GetDevicePluginOptions before it answers, so
    the timeout is longer than kubelet's own 10 s dial-back timeout. A hung
    kubelet never delays a stop: the call is abandoned when ``stop`` is set
    (returns False).
    """
    request = dp.RegisterRequest(
        version=API_VERSION, endpoint=endpoint, resource_name=resource_name, options=options
    )
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        call = dp_grpc.RegistrationStub(channel).Register.future(request, timeout=timeout_seconds)
        while not call.done():
            if stop.wait(0.1):
                call.cancel()
                return False
        try:
            call.result()
            return True
        except grpc.RpcError as e:
            raise KubeletUnavailable(
                f"registering {resource_name} with kubelet at {kubelet_socket} failed: "
                f"{e.code().name}: {e.details()}"
            ) from e


class PodResourcesClient:
    """kubelet's own record of which container holds which device IDs."""

    def __init__(self, socket_path: str, timeout_seconds: float = 2.0):
        self.socket_path = socket_path
        self._timeout_seconds = timeout_seconds
        # The channel reconnects by path, so it survives kubelet recreating the socket.
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = pr_grpc.PodResourcesListerStub(self._channel)

    def list(self) -> KubeletRecord:
        try:
            response = self._stub.List(pr.ListPodResourcesRequest(), timeout=self._timeout_seconds)
        except grpc.RpcError as e:
            raise KubeletUnavailable(
                f"kubelet PodResources API at {self.socket_path} did not answer: "
                f"{e.code().name}: {e.details()} (is kubelet running? is the path in "
                "kubelet.pod_resources_socket right?)"
            ) from e
        record: KubeletRecord = {}
        for pod in response.pod_resources:
            for container in pod.containers:
                ref = ContainerRef(pod.namespace, pod.name, container.name)
                for devices in container.devices:
                    ids = record.setdefault(ref, {}).setdefault(devices.resource_name, [])
                    ids.extend(devices.device_ids)
        return record

    def close(self) -> None:
        self._channel.close()
