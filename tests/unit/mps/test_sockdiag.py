"""Pins mps.sockdiag: the request is the kernel's ``unix_diag_req`` for one inode; answers
are parsed field by field (peer, bound file, unread bytes, name without its NUL) and what is
not as the kernel writes it (truncated headers, messages, attributes; another family) raises
SockDiagError; an NLMSG_ERROR gives its errno and ENOENT means no such socket. Against the
real kernel: an accepted connection names its peer and the listening socket's file (device
as UNIX_DIAG_VFS encodes it), what a client sent and nobody read is counted, and a socket
accepted for a client in a network namespace of its own is found only there."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

import pytest

from mps import sockdiag
from mps.sockdiag import SockDiagError, UnixSocket

_HEADER = struct.Struct("=IHHII")
_MSG = struct.Struct("=BBBBIII")


def message(kind: int, seq: int, payload: bytes) -> bytes:
    data = _HEADER.pack(_HEADER.size + len(payload), kind, 0, seq, 0) + payload
    return data + b"\0" * (-len(data) % 4)


def attribute(kind: int, value: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(value), kind) + value
    return data + b"\0" * (-len(data) % 4)


def diag_msg(inode: int, *attributes: bytes, state: int = sockdiag.ESTABLISHED) -> bytes:
    return _MSG.pack(socket.AF_UNIX, socket.SOCK_SEQPACKET, state, 0, inode, 0, 0) + b"".join(
        attributes
    )


def test_the_request_asks_for_one_inode_with_peer_file_unread_and_name():
    """nlmsghdr (SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, no dump) + unix_diag_req for AF_UNIX,
    every state, the inode, the show flags and no cookie."""
    data = sockdiag.request(4242, seq=7)
    length, kind, flags, seq, _ = _HEADER.unpack_from(data)
    assert (length, kind, flags, seq) == (len(data), 20, 1, 7)
    family, protocol, _, states, inode, show, c0, c1 = struct.unpack_from(
        "=BBHIIIII", data, _HEADER.size
    )
    assert (family, protocol, states, inode) == (socket.AF_UNIX, 0, 0xFFFFFFFF, 4242)
    assert show == 0x01 | 0x02 | 0x04 | 0x10 and (c0, c1) == (0xFFFFFFFF, 0xFFFFFFFF)


def test_an_answer_is_parsed_field_by_field():
    """Every attribute the request shows is read; a path loses its terminating NUL."""
    payload = diag_msg(
        10,
        attribute(sockdiag.UNIX_DIAG_NAME, b"/run/x/control\0"),
        attribute(sockdiag.UNIX_DIAG_VFS, struct.pack("=II", 77, 254 << 20)),
        attribute(sockdiag.UNIX_DIAG_PEER, struct.pack("=I", 11)),
        attribute(sockdiag.UNIX_DIAG_RQLEN, struct.pack("=II", 9, 0)),
        attribute(99, b"ignored"),
    )
    found, error = sockdiag.parse_answer(message(20, 3, payload), 3)
    assert error is None
    assert found == [
        UnixSocket(10, socket.SOCK_SEQPACKET, 1, b"/run/x/control", (254 << 20, 77), 11, 9)
    ]


def test_an_abstract_name_keeps_its_leading_nul_and_a_bare_socket_has_none_of_the_fields():
    """An abstract address is kept as the kernel gives it; a socket without attributes has
    no name, file, peer or unread count (None, never 0)."""
    abstract = diag_msg(12, attribute(sockdiag.UNIX_DIAG_NAME, b"\0hidden"))
    [record], _ = sockdiag.parse_answer(message(20, 1, abstract), 1)
    assert record.name == b"\0hidden"
    [bare], _ = sockdiag.parse_answer(message(20, 1, diag_msg(13)), 1)
    assert (bare.name, bare.file, bare.peer, bare.unread) == (None, None, None, None)


def test_errors_acknowledgements_and_other_requests():
    """NLMSG_ERROR gives its errno (ENOENT: no such socket), 0 is an acknowledgement, and
    messages of another request's sequence number are skipped."""
    enoent = message(sockdiag.NLMSG_ERROR, 5, struct.pack("=i", -errno.ENOENT) + b"\0" * 16)
    assert sockdiag.parse_answer(enoent, 5) == ([], errno.ENOENT)
    ack = message(sockdiag.NLMSG_ERROR, 5, struct.pack("=i", 0) + b"\0" * 16)
    assert sockdiag.parse_answer(ack, 5) == ([], 0)
    other = message(20, 4, diag_msg(10))
    assert sockdiag.parse_answer(other + message(sockdiag.NLMSG_DONE, 5, b""), 5) == ([], None)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x10\0\0", "truncated netlink message header"),
        (_HEADER.pack(64, 20, 0, 1, 0) + b"\0" * 8, "a netlink message of 64 bytes"),
        (message(20, 1, b"\0" * 8), "truncated unix_diag_msg"),
        (message(20, 1, _MSG.pack(2, 5, 1, 0, 10, 0, 0)), "address family 2"),
        (message(20, 1, diag_msg(10) + b"\x08\0"), "truncated netlink attribute"),
        (message(20, 1, diag_msg(10) + struct.pack("=HH", 40, 2)), "attribute of 40 bytes"),
        (message(20, 1, diag_msg(10, attribute(2, b"\0\0"))), "UNIX_DIAG_PEER of 2 bytes"),
        (message(20, 1, diag_msg(10, attribute(1, b"\0" * 4))), "UNIX_DIAG_VFS of 4 bytes"),
        (message(7, 1, b""), "unexpected netlink message type 7"),
        (message(2, 1, b"\0\0"), "truncated netlink error"),
    ],
)
def test_what_is_not_as_the_kernel_writes_it_is_refused(data, problem):
    """Each malformed answer raises SockDiagError naming what is wrong, never a bare
    struct.error or an IndexError."""
    with pytest.raises(SockDiagError, match=problem):
        sockdiag.parse_answer(data, 1)


# --- the real kernel --------------------------------------------------------------------------


@pytest.fixture
def directory():
    path = tempfile.mkdtemp(prefix="sdiag", dir="/tmp")  # short: unix socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def inode_of(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def test_an_accepted_connection_names_its_peer_and_the_listeners_file(directory):
    """The accepted end carries the listening socket's file (device as UNIX_DIAG_VFS
    encodes it) and names the client's socket as its peer; bytes the client sent and
    nobody read are counted; an inode that is no socket is not found."""
    path = os.path.join(directory, "control")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(path)
        listener.listen()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            client.connect(path)
            accepted, _ = listener.accept()
            with accepted:
                client.send(b"hello")
                st = os.stat(path)
                with sockdiag.DiagSocket() as diag:
                    found = diag.sockets_of([inode_of(accepted), inode_of(listener), st.st_ino])
                    served = found[inode_of(accepted)]
                    assert served.peer == inode_of(client) and served.unread == 5
                    assert served.file == (sockdiag.device_number(st.st_dev), st.st_ino)
                    assert served.state == sockdiag.ESTABLISHED and served.name == path.encode()
                    listening = found[inode_of(listener)]
                    assert listening.state == sockdiag.LISTEN and listening.peer is None
                    assert st.st_ino not in found  # the socket file's inode is no socket
                    client_end = diag.socket_of(inode_of(client))
                    assert client_end.peer == inode_of(accepted) and client_end.file is None


CLIENT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
print("connected", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_a_socket_accepted_for_a_client_in_its_own_network_namespace_lives_there(directory):
    """A client in a network namespace of its own: the accepted end is made in that
    namespace, so our namespace does not find it and the client's does."""
    path = os.path.join(directory, "control")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(path)
        listener.listen()
        client = subprocess.Popen(
            ["unshare", "-n", sys.executable, "-I", "-c", CLIENT, path],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout.readline().strip() == "connected"
            accepted, _ = listener.accept()
            with accepted:
                with sockdiag.DiagSocket() as ours:
                    assert ours.socket_of(inode_of(accepted)) is None
                with sockdiag.DiagSocket(f"/proc/{client.pid}/ns/net") as theirs:
                    record = theirs.socket_of(inode_of(accepted))
                assert record is not None and record.peer is not None
        finally:
            client.kill()
            client.wait()


def test_a_namespace_that_cannot_be_entered_is_an_error(directory):
    """A namespace file that cannot be opened (its process gone) is a SockDiagError."""
    with pytest.raises(SockDiagError, match="cannot ask sock_diag in the network namespace"):
        sockdiag.DiagSocket(os.path.join(directory, "no-such-namespace"))
