"""The faults of the matrix, each made the way it happens on a node, not simulated inside
the daemon:

- ``GarbageControl``: the MPS control pipe answers garbage. NVIDIA's client (and the
  stand-in, which follows it) connects to ``control_privileged`` first; a socket that
  answers nonsense is bound there while the real control daemon's socket is kept aside
  under a hard link (a unix socket is reached through its inode), and put back after;
- ``ApiDown``: the API server stopped;
- ``HungApiServer``: the API server's port accepts TCP connections and never answers
  (its listen backlog takes them; nothing reads them);
- ``Ext4Image``: state_dir on an ext4 file system (a loop-mounted image) mounted with
  ``errors=remount-ro``; ``fail`` makes the kernel record a file system error through
  ext4's ``trigger_fs_error``, and the kernel turns the mount read-only under the open
  ledger, as it does for a real disk error; ``repair`` is the operator's way back
  (unmount, ``e2fsck -fy``, mount);
- ``mount_tmpfs``/``fill``: state_dir on a small tmpfs, then filled up;
- ``AllocateBurst``: a thread admitting pods through the test kubelet one after another,
  as kubelet does when many pods land on a node at once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import threading
import time
from urllib.parse import urlsplit

from standins.daemon_proc import CORE, MEMORY
from standins.kubelet_sim import ContainerSpec
from tests.faults.survival import CONTAINER, MEMORY_FIRST, NAMESPACE, Pod, pod_from

GARBAGE = b"@@@ \xfe\xff garbage 12abc @@@\n"


class GarbageControl:
    """While entered, ``<pipe_dir>/control_privileged`` answers every command with garbage."""

    def __init__(self, pipe_dir: str):
        self.path = os.path.join(pipe_dir, "control_privileged")
        self.aside = self.path + ".fault-aside"
        self.answered = 0
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GarbageControl:
        os.link(self.path, self.aside)
        os.unlink(self.path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        server.listen(16)
        server.settimeout(0.1)
        self._server = server
        self._thread = threading.Thread(target=self._serve, name="fault-garbage", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(GARBAGE)
                    self.answered += 1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._server is not None:
            self._server.close()
        os.unlink(self.path)
        os.rename(self.aside, self.path)


class ApiDown:
    """While entered, the test API server is stopped: its port refuses connections."""

    def __init__(self, api):
        self.api = api

    def __enter__(self) -> ApiDown:
        self.api.stop()
        return self

    def __exit__(self, *exc) -> None:
        self.api.start()


class HungApiServer:
    """While entered, the test API server's port accepts connections and answers nothing."""

    def __init__(self, api):
        self.api = api
        self.unanswered = 0  # connections the daemon made that never got an answer
        self._sock: socket.socket | None = None

    def __enter__(self) -> HungApiServer:
        port = urlsplit(self.api.url).port
        self.api.stop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        self._sock = sock
        return self

    def __exit__(self, *exc) -> None:
        if self._sock is not None:
            self.unanswered = _drain(self._sock)
            self._sock.close()
        self.api.start()


def _drain(sock: socket.socket) -> int:
    """Accept and close the connections waiting in ``sock``'s backlog; how many there were."""
    sock.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=True)


class Ext4Image:
    """An ext4 file system in ``image``, loop-mounted at ``mountpoint``."""

    def __init__(self, image: str, mountpoint: str, size_mib: int = 16):
        self.image = image
        self.mountpoint = mountpoint
        _run("truncate", "-s", f"{size_mib}M", image)
        _run("mkfs.ext4", "-q", "-F", image)

    def mount(self) -> None:
        os.makedirs(self.mountpoint, exist_ok=True)
        _run("mount", "-o", "loop,errors=remount-ro", self.image, self.mountpoint)
        os.chmod(self.mountpoint, 0o700)

    @property
    def read_only(self) -> bool:
        """Whether a file can be made there. ext4's emergency read-only state does not show
        in statvfs (the mount flags stay rw): only a write tells."""
        probe = os.path.join(self.mountpoint, ".fault-probe")
        try:
            with open(probe, "w"):
                pass
        except OSError as e:
            if e.errno == errno.EROFS:
                return True
            raise
        os.unlink(probe)
        return False

    def fail(self) -> None:
        """A file system error: the kernel remounts it read-only (errors=remount-ro)."""
        device = _run("findmnt", "-n", "-o", "SOURCE", self.mountpoint).stdout.strip()
        trigger = f"/sys/fs/ext4/{os.path.basename(device)}/trigger_fs_error"
        with open(trigger, "w") as f:
            f.write("gpushare fault matrix: ledger read-only\n")

    def repair(self) -> None:
        """What an operator does (the daemon stopped first): unmount, fsck, mount."""
        _run("umount", self.mountpoint)
        fsck = subprocess.run(["e2fsck", "-fy", self.image], capture_output=True, text=True)
        assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr  # 1: errors corrected
        self.mount()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", self.mountpoint], capture_output=True)


def mount_tmpfs(mountpoint: str, size: str) -> None:
    os.makedirs(mountpoint, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "gpushare-fault", mountpoint)


def fill(directory: str) -> str:
    """Write a file into ``directory`` until its file system is full; the file's path."""
    path = os.path.join(directory, "filler")
    block = b"\0" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, block)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return path


class AllocateBurst:
    """Admits pods ``<prefix>-<n>`` (1 GiB + 5 % each) one after another until stopped, as
    kubelet does when pods come and go fast: past ``keep`` live pods the oldest is removed
    (it finished), and a refused pod is removed at once (kubelet rejects it)."""

    def __init__(self, kubelet, prefix: str, keep: int):
        self.kubelet = kubelet
        self.prefix = prefix
        self.keep = keep
        self.live: list[Pod] = []
        self.admitted = 0
        self.refused: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-burst", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            name = f"{self.prefix}-{n}"
            n += 1
            spec = ContainerSpec(CONTAINER, {MEMORY: 1, CORE: 5})
            result = self.kubelet.admit_pod(NAMESPACE, name, [spec], order=MEMORY_FIRST)
            if result.ok:
                self.live.append(pod_from(name, result))
                self.admitted += 1
                if len(self.live) > self.keep:
                    self.kubelet.remove_pod(NAMESPACE, self.live.pop(0).name)
            else:
                self.refused.append(result.error or "")
                self.kubelet.remove_pod(NAMESPACE, name)
            time.sleep(0.02)

    def wait_admitted(self, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` pods were admitted since the burst began."""
        deadline = time.monotonic() + timeout
        while self.admitted < count:
            assert self._thread.is_alive(), f"the burst ended after {self.admitted} pods"
            assert time.monotonic() < deadline, (
                f"{self.admitted} of {count} pods admitted in {timeout} s; "
                f"refusals: {self.refused[-3:]}"
            )
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
