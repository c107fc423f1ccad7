"""gRPC servers on root-only unix sockets, each with a budget: kubelet's plugin sockets.

The gRPC server has no authentication of its own and kubelet runs as root, so root-only
is the authentication:

- the socket is bound in a private directory (0700, ``.`` and a short random name next
  to its final path), made 0600 there and only then renamed into place, so kubelet's
  directory never holds one another user could connect to, whatever the umask.
  kubelet's plugin watcher skips names starting with ``.``. The staging path
  (``/.xxxx/s``) is never longer than the final one (``/dra.sock``), so a path the
  config accepted can always be bound;
- each server keeps to a :class:`GrpcBudget`, because root clients can misbehave too.
  None of it is a per-connection deadline: kubelet's ListAndWatch stream lives as long
  as kubelet, and nothing arms a timer while a stream idles.

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
    max_connections: int  # gRPC closes the rest at once
    handshake_seconds: float  # HTTP/2, from accept
    idle_seconds: float  # a connection with no call for this long is closed
    max_streams: int  # calls at once on one connection
    max_calls: int  # on the server; the rest refused RESOURCE_EXHAUSTED
    max_receive_bytes: int  # a larger message is refused unread
    max_metadata_bytes: int

    def options(self) -> tuple[tuple[str, int], ...]:
        return (
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_seconds * 1000)),
            ("grpc.max_connection_idle_ms", int(self.idle_seconds * 1000)),
            ("grpc.max_concurrent_streams", self.max_streams),
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
        )

    def server(self) -> grpc.aio.Server:
        """On the running event loop."""
        return grpc.aio.server(options=self.options(), maximum_concurrent_rpcs=self.max_calls)


async def serve_root_only(server: grpc.aio.Server, path: str) -> None:
    """A socket already at ``path`` is replaced; on failure the server is stopped and
    nothing is left in ``path``'s directory."""
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
    """``<parent>/.<4 hex digits>``, 0700 whatever the umask (mkdir only takes bits away)."""
    for _ in range(_STAGING_TRIES):
        path = os.path.join(parent, "." + secrets.token_hex(2))
        try:
            os.mkdir(path, STAGING_MODE)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for a staging directory in {parent}")
