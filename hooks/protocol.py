"""The hook socket protocol between ``gpushare-hook`` and the daemon (standard library only).

One request per connection: the hook writes one JSON object and a newline,
the daemon answers one JSON object and a newline, and closes.

Requests::

    {"stage": "createRuntime", "container_id": "...", "pid": 1234,
     "env": {<GPU env names only>},
     "identity": {"namespace", "pod", "container", "uid"},
     "identity_annotations": {<the identity keys of both runtimes found, as written>},
     "runtime": "containerd" | "cri-o" | null,
     "cgroup": "<text of /proc/<pid>/cgroup>",
     "spec": {"mounts": [...], "devices": [...], "rules": [...]}}
    {"stage": "poststop", "container_id": "..."}

``identity`` is what the hook read (:mod:`hooks.podidentity`; {} for none) from the
``identity_annotations`` it also sends, for the ``runtime`` its configuration names (null:
none named). The daemon reads the annotations again and refuses a container whose
annotations name two pods or disagree with ``identity``.

``spec`` holds what the container's config.json shows of the GPUs
(:mod:`hooks.specfacts`), at most ``specfacts.MAX_ENTRIES`` entries per list:

- ``mounts``: ``{"destination": "/tmp/nvidia-mps", "sources": [host paths, lexically
  normal, then their real paths], "nodes": [[major, minor] of each char device node
  among them]}`` for every mount that shows host paths or lands in an NVIDIA
  device-list directory;
- ``devices``: ``{"path", "type", "major", "minor"}`` of the ``linux.devices`` nodes
  that may be NVIDIA's;
- ``rules``: ``{"allow", "type", "major", "minor", "access"}`` of the
  ``linux.resources.devices`` rules that may allow using one (``null``: any number).

A createRuntime request without ``spec`` or ``identity_annotations`` is refused (the
hook and the daemon ship together).

Answer: ``{"allowed": true|false, "message": "..."}``; when not allowed,
``message`` is the one line the runtime shows the user.

Timeouts are deadlines for the whole exchange, never per read, so a peer sending a
byte at a time cannot stretch them. Messages are JSON as :mod:`hooks.wirejson` reads
and writes it.
"""

import socket
import time

from hooks import wirejson

# The hook refuses a container whose request would be bigger (thousands of long mounts).
MAX_MESSAGE_BYTES = 1024 * 1024
CREATE = "createRuntime"
POSTSTOP = "poststop"


class ProtocolError(Exception):
    """The peer sent something that is not one protocol message."""


class ClosedError(ProtocolError):
    """The peer closed the connection before sending anything."""


class TooLargeError(ProtocolError):
    """The peer sent more than one message may hold."""


def encode(message: dict) -> bytes:
    return wirejson.dumps(message).encode() + b"\n"


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    if len(data) > max_bytes:
        raise TooLargeError(f"message over {max_bytes} bytes")
    try:
        message = wirejson.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    return message


def read_message(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES, deadline: float | None = None
) -> dict:
    """One newline-terminated message from ``sock``.

    ``deadline`` (a ``time.monotonic()`` value) bounds the whole read: TimeoutError
    once it passed; without one, the socket's own timeout applies to each read.
    """
    chunks, size = [], 0
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole message in time")
            sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > max_bytes:
            raise TooLargeError(f"message over {max_bytes} bytes")
    if not chunks:
        raise ClosedError("connection closed before a message")
    return decode(b"".join(chunks), max_bytes)


# Pauses between tries when the daemon closed a connection unread (at its cap).
_RETRY_FIRST_SECONDS = 0.01
_RETRY_MAX_SECONDS = 0.2


def call(socket_path: str, message: dict | bytes, timeout_seconds: float) -> dict:
    """Send one request (a message, or ``encode``'s bytes) and return the answer; OSError
    or ProtocolError on failure.

    ``timeout_seconds`` bounds the whole call. A connection closed or reset unanswered
    (the daemon is at its connection cap) is tried again while time is left; a daemon
    that is not there is not waited for.
    """
    deadline = time.monotonic() + timeout_seconds
    data = message if isinstance(message, bytes) else encode(message)
    pause = _RETRY_FIRST_SECONDS
    while True:
        try:
            answer = _call_once(socket_path, data, deadline)
            break
        except (ClosedError, ConnectionResetError, BrokenPipeError):
            if time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _RETRY_MAX_SECONDS)
    if not isinstance(answer.get("allowed"), bool) or not isinstance(answer.get("message"), str):
        raise ProtocolError(f"answer without allowed/message: {answer!r}")
    return answer


def _call_once(socket_path: str, data: bytes, deadline: float) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        sock.settimeout(left)
        sock.connect(socket_path)
        sock.sendall(data)
        return read_message(sock, deadline=deadline)
    finally:
        sock.close()
