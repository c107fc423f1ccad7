"""The floor for Allocate latency: a trivial unary gRPC call over a unix socket.

Run as its own process (``python -m bench.floor_server SOCKET``), like the
daemon, with the daemon's server settings (grpcio, a thread pool of 8 workers,
``unix://`` address): GetDevicePluginOptions answers a constant, so a call
costs only what gRPC, the socket and Python cost. Allocate's latency divided
by this one's, both measured in the same run, is the figure that survives a
noisy machine. Serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import os

# As in the daemon: no gRPC core chatter on stderr (read when grpc is imported).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from concurrent import futures  # noqa: E402

import grpc  # noqa: E402

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc  # noqa: E402
from nodemgr.kubelet.servicer import OPTIONS  # noqa: E402


class FloorServicer(dp_grpc.DevicePluginServicer):
    """Answers GetDevicePluginOptions with the daemon's constant; nothing else."""

    def GetDevicePluginOptions(self, request, context):  # noqa: N802 (gRPC method name)
        return OPTIONS


def main() -> None:
    socket_path = sys.argv[1]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))  # as PluginServer
    dp_grpc.add_DevicePluginServicer_to_server(FloorServicer(), server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.stop(None).wait()


if __name__ == "__main__":
    main()
