"""Registration with kubelet over kubelet.sock; the caller retries failures."""

from __future__ import annotations

import threading

import grpc

from nodemgr.errors import GpushareError
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc

API_VERSION = "v1beta1"


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
    """Our server at ``endpoint`` must already serve: kubelet dials back before it
    answers, so the timeout is longer than its 10 s dial-back. Abandoned (False) when
    ``stop`` is set."""
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
