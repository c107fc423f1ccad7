"""The floor for Allocate latency: a trivial unary gRPC call over a unix socket.

Run as its own process (``python -m bench.floor_server SOCKET``), like the
daemon, with the daemon's server kind (a ``grpc.aio`` server on an asyncio loop in
one thread, ``unix://`` address, as nodemgr.kubelet.servicer's PluginServer):
GetDevicePluginOptions answers a constant, so a call
costs only what gRPC, the socket and Python cost. Allocate's latency divided
by this one's, both measured in the same run, is the figure that survives a
noisy machine. Serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import os

# As in the daemon: no gRPC core chatter on stderr (read when grpc is imported).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import asyncio  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import grpc.aio  # noqa: E402

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc  # noqa: E402
from nodemgr.kubelet.servicer import OPTIONS  # noqa: E402


class FloorServicer(dp_grpc.DevicePluginServicer):
    """Answers GetDevicePluginOptions with the daemon's constant; nothing else."""

    async def GetDevicePluginOptions(self, request, context):  # noqa: N802 (gRPC method name)
        return OPTIONS


async def serve(socket_path: str) -> None:
    server = grpc.aio.server()  # as PluginServer
    dp_grpc.add_DevicePluginServicer_to_server(FloorServicer(), server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(None)


def main() -> None:
    asyncio.run(serve(sys.argv[1]))


if __name__ == "__main__":
    main()
