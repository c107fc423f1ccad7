"""The mount namespace a card's MPS control daemon runs in: the host's, with the card's
tmpfs at /dev/shm.

MPS servers inherit their control daemon's mount namespace, so a daemon in the host's
gives them the host's /dev/shm, shared with every process of the host. NVIDIA's
Kubernetes device plugin gives each MPS daemon a host tmpfs that its clients get too; here
no client gets it (an MPS client passes nothing to its server through /dev/shm, measured
on driver 580, docs/gpu-tests.md), and the daemon runs on the host, in a namespace that
differs from the host's in one mount: the card's tmpfs (mps.shm) over /dev/shm.

``CardNamespace.create``: a helper, ``unshare --mount --propagation slave``, binds the
tmpfs over /dev/shm and waits; its /proc/PID/ns/mnt is bind-mounted at
``<run_dir>/mps/ns/<card UUID>``, keeping the namespace after it exits; ``nsenter
--mount=<that file>`` runs ``<control binary> -d`` there. Slave propagation: what the host
unmounts goes there too (no copy of a container's rootfs is kept) and nothing mounted
there reaches the host. The kernel refuses to bind a namespace file on a mount that
propagates into that namespace, so ``<run_dir>/mps/ns`` is a private mount
(``prepare_directory``), made first.

The kernel also binds a mount namespace's file only from a namespace with a lower id.
Since Linux 6.18 ids come from batches each CPU holds, so a namespace made later on
another CPU can have a lower id than the caller's: the bind fails (EINVAL) where the
caller's namespace is not the host's first one (a container's, a sandboxed unit's). The
CPU that made the caller's namespace hands out higher ids from then on, so a refused bind
is tried again with the helper pinned to each CPU in turn (``taskset``).

Only root in the host's mount namespace can bind there, never a container, so
mps.identity trusts a daemon in that namespace as one in the host's. Each start binds a
new namespace in place of the last, so one never outlives its daemon by more than one
restart.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import time

from mps import mounts
from mps.control import MpsUnavailable
from mps.identity import FileId
from mps.mounts import MountError

TOOLS = ("unshare", "nsenter", "mount", "taskset")
READY = "ready"
# /dev/shm becomes the card's tmpfs, then the helper waits until its stdin closes.
HELPER = 'mount --bind -- "$0" /dev/shm && echo ' + READY + " && exec cat >/dev/null"


def nsfs_device() -> int | None:
    """The device every namespace file is on (a bind of one is on it too)."""
    try:
        return os.stat("/proc/self/ns/mnt").st_dev
    except OSError:
        return None


def prepare_directory(directory: str) -> None:
    """``directory`` (0700) as a private mount of itself, so namespace files can be bound
    in it."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    top = mounts.top_mount(os.path.abspath(directory))
    if top is None:
        mounts.run(["mount", "--bind", directory, directory])
    mounts.run(["mount", "--make-private", directory])


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


class _BindRefused(MountError):
    """mount(8) refused to bind the helper's namespace file (another CPU's may do)."""


class CardNamespace:
    """One card's namespace: kept at ``path``, its /dev/shm the tmpfs at ``shm_dir``."""

    def __init__(self, path: str, shm_dir: str, timeout_seconds: float):
        self.path = path
        self.shm_dir = shm_dir
        self.timeout_seconds = timeout_seconds

    def bound(self) -> FileId | None:
        """The namespace bound at ``path``; None when none is (a plain file, nothing)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        if st.st_dev != nsfs_device():
            return None
        return FileId(st.st_dev, st.st_ino)

    def command(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--mount={self.path}", "--", *argv]

    def create(self) -> FileId:
        """A new namespace for the card, bound at ``path`` in place of the last one."""
        missing = missing_tools()
        if missing:
            raise MpsUnavailable(
                f"cannot give the MPS control daemon of {self.shm_dir} its own /dev/shm: "
                f"{', '.join(missing)} not found (util-linux)"
            )
        try:
            self._unbind()
            return self._bind_new()
        except (MountError, OSError) as e:
            raise MpsUnavailable(
                f"cannot make the mount namespace for the MPS control daemon (its /dev/shm "
                f"on {self.shm_dir}, kept at {self.path}): {e}"
            ) from e

    def remove(self) -> bool:
        """Unbind the namespace (its daemon, if one still runs, keeps it); False if none."""
        try:
            return self._unbind()
        except MountError:
            return False

    def _unbind(self) -> bool:
        if mounts.top_mount(os.path.abspath(self.path)) is None:
            return False
        mounts.run(["umount", "--lazy", self.path])
        return True

    def _bind_new(self) -> FileId:
        """Unpinned first, then pinned to each CPU while the kernel refuses the bind."""
        refused: list[str] = []
        for cpu in (None, *range(os.cpu_count() or 1)):
            try:
                return self._bind_new_on(cpu)
            except _BindRefused as e:
                refused.append(f"unpinned: {e}" if cpu is None else f"CPU {cpu}: {e}")
            except MountError as e:
                if cpu is None:
                    raise  # the helper itself failed: not a matter of CPUs
                refused.append(f"CPU {cpu}: {e}")  # one outside this daemon's cpuset
        raise MountError(
            f"the kernel refused to bind every new namespace at {self.path} "
            f"({len(refused)} tries; the last {refused[-1]})"
        )

    def _bind_new_on(self, cpu: int | None) -> FileId:
        pinned = [] if cpu is None else ["taskset", "--cpu-list", str(cpu)]
        helper = subprocess.Popen(
            [
                *pinned,
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "--",
                "sh",
                "-c",
                HELPER,
                self.shm_dir,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            self._wait_ready(helper)
            source = f"/proc/{helper.pid}/ns/mnt"
            made = os.stat(source)
            with open(self.path, "a"):
                pass
            os.chmod(self.path, 0o600)
            try:
                mounts.run(["mount", "--bind", source, self.path])
            except MountError as e:
                raise _BindRefused(str(e)) from e
            kept = self.bound()
            if kept is None or (kept.dev, kept.ino) != (made.st_dev, made.st_ino):
                raise MountError(f"{self.path} does not hold the new namespace after the bind")
            return kept
        finally:
            with contextlib.suppress(OSError):
                helper.stdin.close()  # type: ignore[union-attr]
            try:
                helper.wait(self.timeout_seconds)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
            for stream in (helper.stdout, helper.stderr):
                if stream is not None:
                    stream.close()

    def _wait_ready(self, helper: subprocess.Popen) -> None:
        """Until the helper says its /dev/shm is the card's; MountError with what it said."""
        assert helper.stdout is not None
        assert helper.stderr is not None
        deadline = time.monotonic() + self.timeout_seconds
        said = b""
        while not said.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([helper.stdout], [], [], max(0.0, left))
            if not ready:
                raise MountError(
                    f"the namespace helper did not answer in {self.timeout_seconds:g} s"
                )
            chunk = os.read(helper.stdout.fileno(), 64)
            if not chunk:
                helper.wait(self.timeout_seconds)
                error = helper.stderr.read(4096).decode("utf-8", "replace").strip()
                raise MountError(
                    f"unshare --mount failed: {error or f'exit status {helper.returncode}'}"
                )
            said += chunk
        if said.strip() != READY.encode():
            raise MountError(f"the namespace helper said {said!r}")
