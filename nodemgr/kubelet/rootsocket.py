"""gRPC servers on root-only unix sockets, each with a budget: kubelet's plugin sockets.

Every socket kubelet dials (the three device plugin sockets, the DRA plugin's
registration and service sockets) is served the same way, because the gRPC server has
no authentication of its own and kubelet runs as root:

- the socket is bound in a private directory (mode 0700, a short random name starting
  with ``.`` next to its final path), made 0600 there and only then renamed into place,
  so at no moment does kubelet's directory hold one of ours that another user could
  connect to, whatever the umask. kubelet's plugin watcher skips names starting with
  ``.``, and sees the renamed socket appear. The staging path is never longer than the
  final one for the names used here (``/.xxxx/s``, 8 bytes, against ``/dra.sock``, 9), so
  a path the config accepted can always be bound;
- the server keeps to a :class:`GrpcBudget`, because root clients can misbehave too:
  a connection cap (gRPC closes the rest at once), a deadline for the HTTP/2 handshake,
  an idle connection closed, calls per connection and per server at once (the server
  refuses the rest RESOURCE_EXHAUSTED at once), and a message and metadata size limit
  (a larger message is refused before the servicer sees it). No budget is a
  per-connection deadline: kubelet's ListAndWatch stream lives as long as kubelet, and
  none of these arms a timer while a stream is open and nothing happens.

What it must not do: know the services it serves; change the process's umask (a
process-wide setting other threads create files under).
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass

import grpc
import grpc.aio

SOCKET_MODE = 0o600
STAGING_MODE = 0o700
_STAGING_TRIES = 100


@dataclass(frozen=True)
class GrpcBudget:
    """What one gRPC server gives its peers (all of them root: kubelet, or a root agent
    misbehaving)."""

    max_connections: int  # open at once; gRPC closes the rest at once
    handshake_seconds: float  # the HTTP/2 handshake, from accept
    idle_seconds: float  # a connection with no call for this long is closed
    max_streams: int  # calls at once on one connection
    max_calls: int  # calls at once on the server; the rest refused RESOURCE_EXHAUSTED
    max_receive_bytes: int  # one message; a larger one is refused unread
    max_metadata_bytes: int  # one call's headers

    def options(self) -> tuple[tuple[str, int], ...]:
        """The ``grpc.aio.server`` channel arguments that hold the budget."""
        return (
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_seconds * 1000)),
            ("grpc.max_connection_idle_ms", int(self.idle_seconds * 1000)),
            ("grpc.max_concurrent_streams", self.max_streams),
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
        )

    def server(self) -> grpc.aio.Server:
        """A new server on this budget (on the running event loop)."""
        return grpc.aio.server(options=self.options(), maximum_concurrent_rpcs=self.max_calls)


async def serve_root_only(server: grpc.aio.Server, path: str) -> None:
    """Bind ``server`` at ``path`` as root's alone (0600, never wider) and start it; a
    socket already at ``path`` is replaced by the rename. On failure the server is stopped
    and nothing is left at ``path``'s directory."""
    staging = _private_directory(os.path.dirname(path))
    try:
        bound = os.path.join(staging, "s")
        server.add_insecure_port(f"unix://{bound}")
        await server.start()
        os.chmod(bound, SOCKET_MODE)
        os.rename(bound, path)
    except BaseException:
        await server.stop(None)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _private_directory(parent: str) -> str:
    """A new directory ``<parent>/.<4 hex digits>``, 0700 whatever the umask (mkdir only
    takes bits away from its mode)."""
    for _ in range(_STAGING_TRIES):
        path = os.path.join(parent, "." + secrets.token_hex(2))
        try:
            os.mkdir(path, STAGING_MODE)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for a staging directory in {parent}")
