"""The hook socket protocol between ``gpushare-hook`` and the daemon (standard library only).

One request per connection: the hook writes one JSON object and a newline,
the daemon answers one JSON object and a newline, and closes.

Requests::

    {"stage": "createRuntime", "container_id": "...", "pid": 1234,
     "env": {<GPU env names only>}, "identity": {"namespace", "pod", "container"},
     "cgroup": "<text of /proc/<pid>/cgroup>"}
    {"stage": "poststop", "container_id": "..."}

Answer: ``{"allowed": true|false, "message": "..."}``; when not allowed,
``message`` is the one line the runtime shows the user.
"""

from __future__ import annotations

import json
import socket

MAX_MESSAGE_BYTES = 256 * 1024  # env, cgroup and identity of one container fit easily
CREATE = "createRuntime"  # the stages, as in gpushare_hook
POSTSTOP = "poststop"


class ProtocolError(Exception):
    """The peer sent something that is not one protocol message."""


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    if len(data) > max_bytes:
        raise ProtocolError(f"message over {max_bytes} bytes")
    try:
        message = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    return message


def read_message(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """One newline-terminated message from ``sock`` (its timeout applies)."""
    chunks, size = [], 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > max_bytes:
            raise ProtocolError(f"message over {max_bytes} bytes")
    if not chunks:
        raise ProtocolError("connection closed before a message")
    return decode(b"".join(chunks), max_bytes)


def call(socket_path: str, message: dict, timeout_seconds: float) -> dict:
    """Send one request and return the answer; OSError or ProtocolError on failure."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_seconds)
        sock.connect(socket_path)
        sock.sendall(encode(message))
        answer = read_message(sock)
    if not isinstance(answer.get("allowed"), bool) or not isinstance(answer.get("message"), str):
        raise ProtocolError(f"answer without allowed/message: {answer!r}")
    return answer
