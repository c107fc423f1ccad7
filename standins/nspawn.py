"""A real systemd 252 as PID 1, booted in ``systemd-nspawn``, driven from outside with nsenter.

``scripts/setup-systemd-rootfs`` builds (once, cached outside the checkout) a
minimal Debian 12 root file system with systemd; ``find_rootfs`` runs it and
reads the path it prints, and ``require`` skips a test where this cannot work
here (not root, no systemd-nspawn, no root file system), except where
``GPUSHARE_REQUIRE_REAL_PARTS=1`` (CI): there it fails.

``Container`` boots that tree with ``systemd-nspawn -b --register=no
--keep-unit`` (the only way without a systemd and a D-Bus on the host),
``--volatile=overlay`` (every write goes to a tmpfs: the cached tree stays
clean) and ``--private-network``. The checkout and the interpreter of the
venv are bind-mounted read-only at the same paths, so the venv's console
scripts run inside as they are. Commands run inside with ``nsenter -t <PID 1
of the container> -a`` once ``systemctl is-system-running --wait`` answers.

nspawn without a systemd on the host makes its cgroups (``payload``,
``supervisor``) next to itself and leaves them, and its
``/run/systemd/nspawn/propagate/<name>`` directory, behind. So each container
is started inside a cgroup of its own (``gpushare-nspawn-<pid>-<n>`` in every
writable hierarchy that nspawn uses), and ``close`` powers the container off
and removes all of it, always, even after a failure. nspawn gets SIGTERM
(it powers the container off) when the test process dies; what a killed run
still left is removed by the next one.

``python -m standins.nspawn kubelet DEVICE_PLUGIN_DIR POD_RESOURCES_SOCKET
STATE_FILE`` runs the test kubelet (``kubelet_sim.TestKubelet``) inside the
container until SIGTERM, writing the registrations it saw to STATE_FILE (JSON).

Why this module is longer than 400 lines: it is one harness for one real part: booting
systemd in systemd-nspawn, driving it from outside and cleaning up every trace (cgroups,
nspawn state) even after a killed run; the pieces only make sense together.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from standins.paths import REPO
from standins.setup_script import run_setup

SETUP = os.path.join(REPO, "scripts", "setup-systemd-rootfs")
SETUP_TIMEOUT_SECONDS = 600
BOOT_TIMEOUT_SECONDS = 60
COMMAND_TIMEOUT_SECONDS = 60
CGROUP_PREFIX = "gpushare-nspawn-"
NSPAWN_STATE_DIR = "/run/systemd/nspawn"
WORKDIR_PREFIX = "gs-nspawn-"  # /tmp/gs-nspawn-<pid of the test process>-*: the console log
# What commands run inside get: no host environment leaks in.
INSIDE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}

_names = itertools.count()


class NspawnError(Exception):
    """The container could not be booted or driven; the message says what it printed."""


# --- availability ---------------------------------------------------------------------------


@functools.cache
def find_rootfs() -> tuple[str | None, str]:
    """(path of the root file system, "") or (None, why it cannot be had here)."""
    if os.geteuid() != 0:
        return None, "not root (systemd-nspawn and the root file system need root)"
    values = run_setup(SETUP, SETUP_TIMEOUT_SECONDS)
    if isinstance(values, str):
        return None, values
    rootfs = values.get("GPUSHARE_SYSTEMD_ROOTFS", "")
    if not os.path.isfile(os.path.join(rootfs, "lib", "systemd", "systemd")):
        return None, f"scripts/setup-systemd-rootfs printed no usable rootfs ({rootfs!r})"
    if shutil.which("systemd-nspawn") is None:
        return None, "systemd-nspawn not found (apt-get install systemd-container)"
    if shutil.which("nsenter") is None:
        return None, "nsenter not found (util-linux)"
    if not _hierarchies():
        return None, "no writable cgroup hierarchy under /sys/fs/cgroup"
    return rootfs, ""


def require() -> str:
    """The root file system's path; skips the test where it cannot be had (fails under CI)."""
    rootfs, why = find_rootfs()
    if rootfs is not None:
        return rootfs
    reason = f"no systemd to boot in systemd-nspawn: {why}"
    if os.environ.get("GPUSHARE_REQUIRE_REAL_PARTS") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_REAL_PARTS=1 but {reason}")
    pytest.skip(reason)


def _hierarchies() -> list[str]:
    """The cgroup hierarchies nspawn puts its cgroups in: name=systemd and the unified one
    on a hybrid host (cgroup v1), or /sys/fs/cgroup itself on a cgroup v2 host."""
    base = "/sys/fs/cgroup"
    if os.path.exists(os.path.join(base, "cgroup.controllers")):
        return [base]
    return [
        os.path.join(base, name)
        for name in ("systemd", "unified")
        if os.path.exists(os.path.join(base, name, "cgroup.procs"))
    ]


def interpreter_binds() -> list[str]:
    """What the venv's interpreter needs inside: the checkout, the venv (when outside it)
    and the interpreter's own prefix (unless it is the system's /usr, which the tree has)."""
    paths = [REPO]
    if not os.path.realpath(sys.prefix).startswith(REPO + os.sep):
        paths.append(os.path.realpath(sys.prefix))
    base = os.path.realpath(sys.base_prefix)
    if base not in ("/", "/usr"):
        paths.append(base)
    return paths


# --- the container --------------------------------------------------------------------------


class Container:
    """One booted container; ``close`` always leaves nothing behind."""

    def __init__(self, rootfs: str, binds: list[str] | None = None):
        self.rootfs = rootfs
        self.binds = interpreter_binds() if binds is None else binds
        self.name = f"gs-{os.getpid()}-{next(_names)}"
        self.cgroup = f"{CGROUP_PREFIX}{os.getpid()}-{next(_names)}"
        self.workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir="/tmp")
        self.console_log = os.path.join(self.workdir, "console.log")
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None  # the container's PID 1 as the host sees it

    # --- life -------------------------------------------------------------------------------

    def boot(self, timeout: float = BOOT_TIMEOUT_SECONDS) -> None:
        """Start systemd-nspawn and wait until the system inside is up."""
        remove_stale_leftovers()
        hierarchies = _hierarchies()
        for hierarchy in hierarchies:
            os.mkdir(os.path.join(hierarchy, self.cgroup))
        command = [
            "systemd-nspawn",
            "--quiet",
            f"--directory={self.rootfs}",
            f"--machine={self.name}",
            "--boot",
            "--register=no",  # no machined on the host (no system bus)
            "--keep-unit",  # no systemd on the host to make a scope for us
            "--volatile=overlay",  # writes go to a tmpfs; the cached tree stays as built
            "--private-network",  # off the host's ports; the process connector is refused
            "--console=passive",
            *[f"--bind-ro={path}" for path in self.binds],
        ]
        # Into our own cgroup first: nspawn makes its payload/supervisor cgroups next to itself.
        joins = " && ".join(
            f"echo $$ > {shlex.quote(os.path.join(h, self.cgroup, 'cgroup.procs'))}"
            for h in hierarchies
        )
        with open(self.console_log, "wb") as log:
            self.process = subprocess.Popen(
                ["sh", "-c", f'{joins} && exec "$@"', "sh", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches pytest, whose teardown powers off
                preexec_fn=_terminate_with_parent,
            )
        deadline = time.monotonic() + timeout
        self.pid = self._wait_for_init(deadline)
        while True:
            try:
                done = self._nsenter(
                    ["systemctl", "is-system-running", "--wait"],
                    timeout=max(1.0, deadline - time.monotonic()),
                )
                state = done.stdout.strip()
            except subprocess.TimeoutExpired:
                state = "(no answer)"
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise NspawnError(f"the container did not boot ({state!r}):\n{self.console()}")
            time.sleep(0.2)
        if state == "degraded":
            failed = self.run("systemctl", "--failed", "--no-legend", check=False).stdout
            raise NspawnError(f"the container booted degraded; failed units:\n{failed}")

    def _wait_for_init(self, deadline: float) -> int:
        """The host PID of the container's PID 1, once it runs systemd."""
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NspawnError(f"systemd-nspawn exited at once:\n{self.console()}")
            for pid in _children(self.process.pid):
                try:
                    exe = os.readlink(f"/proc/{pid}/exe")
                except OSError:
                    continue
                if exe.endswith("/systemd/systemd"):
                    return pid
            time.sleep(0.05)
        raise NspawnError(f"no systemd started in the container:\n{self.console()}")

    def close(self) -> None:
        """Power off (or kill) the container and remove every trace of it on the host."""
        try:
            self._stop()
        finally:
            self._remove_leftovers()

    def _stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        if self.pid is not None:
            self._nsenter(["systemctl", "poweroff", "--no-block"], timeout=10)
            try:
                process.wait(20)
                return
            except subprocess.TimeoutExpired:
                pass
        process.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to stop
        try:
            process.wait(10)
            return
        except subprocess.TimeoutExpired:
            pass
        for pid in [process.pid, *self._cgroup_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait(10)

    def _cgroup_pids(self) -> list[int]:
        pids = set()
        for hierarchy in _hierarchies():
            pids |= _pids_in(os.path.join(hierarchy, self.cgroup))
        return sorted(pids)

    def _remove_leftovers(self) -> None:
        for pid in self._cgroup_pids():  # anything that survived (should be nothing)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for hierarchy in _hierarchies():
            _remove_cgroup_tree(os.path.join(hierarchy, self.cgroup))
        _remove_nspawn_state(self.name)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- driving it -------------------------------------------------------------------------

    def _nsenter(self, args: list[str], timeout: float = COMMAND_TIMEOUT_SECONDS, **kwargs):
        env = [f"{k}={v}" for k, v in INSIDE_ENV.items()]
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", "env", "-i", *env, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def run(
        self, *args: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_SECONDS, **kwargs
    ) -> subprocess.CompletedProcess:
        """``args`` run inside (all its namespaces), output captured as text."""
        done = self._nsenter(list(args), timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise NspawnError(
                f"{shlex.join(args)} exited {done.returncode}\n"
                f"stdout: {done.stdout}\nstderr: {done.stderr}"
            )
        return done

    def popen(self, *args: str) -> subprocess.Popen:
        """``args`` started inside, not waited for; output captured as text."""
        env = [f"{k}={v}" for k, v in INSIDE_ENV.items()]
        return subprocess.Popen(
            ["nsenter", "-t", str(self.pid), "-a", "env", "-i", *env, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def systemctl(self, *args: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_SECONDS):
        return self.run("systemctl", *args, check=check, timeout=timeout)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        done = self.systemctl("show", unit, *[f"--property={p}" for p in properties])
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, check=False).stdout

    def host_path(self, path: str) -> str:
        """Where a path inside the container is, seen from the host."""
        return f"/proc/{self.pid}/root/{path.lstrip('/')}"

    def read_text(self, path: str) -> str:
        with open(self.host_path(path), encoding="utf-8") as f:
            return f.read()

    def write_text(self, path: str, text: str) -> None:
        target = self.host_path(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)

    def console(self) -> str:
        try:
            with open(self.console_log, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return "(no console log)"

    def wait_for(self, predicate, timeout: float, what: str):
        """``predicate()``'s first true value, polled; fails with ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.2)


# --- host-side cleanup ----------------------------------------------------------------------


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (nspawn then powers
    the container off), so that a killed test run leaves no container running."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _pids_in(cgroup: str) -> set[int]:
    pids: set[int] = set()
    for directory, _, files in os.walk(cgroup):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(directory, "cgroup.procs")) as f:
                    pids |= {int(p) for p in f.read().split()}
            except OSError:
                pass
    return pids


def _remove_cgroup_tree(cgroup: str, timeout: float = 5.0) -> None:
    """rmdir every directory of the tree, deepest first (a cgroup empties as its
    processes are reaped: retried for a while)."""
    deadline = time.monotonic() + timeout
    while os.path.isdir(cgroup):
        for directory, _, _ in sorted(os.walk(cgroup), key=lambda w: -w[0].count("/")):
            try:
                os.rmdir(directory)
            except OSError:
                pass
        if time.monotonic() > deadline:
            return
        if os.path.isdir(cgroup):
            time.sleep(0.1)


def _remove_nspawn_state(name: str) -> None:
    """nspawn's propagation directory of machine ``name``, then its parents when empty."""
    propagate = os.path.join(NSPAWN_STATE_DIR, "propagate", name)
    if name and os.path.isdir(propagate):
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f]
        for mount in sorted((m for m in mounts if m.startswith(propagate)), reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
        shutil.rmtree(propagate, ignore_errors=True)
    for directory in (
        os.path.join(NSPAWN_STATE_DIR, "propagate"),
        os.path.join(NSPAWN_STATE_DIR, "locks"),
        NSPAWN_STATE_DIR,
    ):
        try:
            os.rmdir(directory)  # only when empty: another container may be running
        except OSError:
            pass


_stale_lock = threading.Lock()


def _orphans(directory: str, prefix: str) -> list[str]:
    """Entries of ``directory`` named ``<prefix><pid>-...`` whose process <pid> is gone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        owner = name[len(prefix) :].split("-")[0]
        if name.startswith(prefix) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            found.append(os.path.join(directory, name))
    return found


def remove_stale_leftovers() -> None:
    """What containers of a test process that is gone (a killed run) left behind: their
    cgroups (and any process still in them), nspawn's directories, the console logs."""
    with _stale_lock:
        for hierarchy in _hierarchies():
            for cgroup in _orphans(hierarchy, CGROUP_PREFIX):
                for pid in _pids_in(cgroup):  # a container that outlived its test process
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _remove_cgroup_tree(cgroup)
        for machine in _orphans(os.path.join(NSPAWN_STATE_DIR, "propagate"), "gs-"):
            _remove_nspawn_state(os.path.basename(machine))
        _remove_nspawn_state("")  # only the empty parents
        for workdir in _orphans("/tmp", WORKDIR_PREFIX):
            shutil.rmtree(workdir, ignore_errors=True)


# --- the test kubelet, run inside -----------------------------------------------------------


def _serve_kubelet(device_plugin_dir: str, pod_resources_socket: str, state_file: str) -> int:
    """Runs TestKubelet until SIGTERM; writes what registered to ``state_file``."""
    from standins.kubelet_sim import TestKubelet

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    kubelet = TestKubelet(device_plugin_dir, pod_resources_socket)
    kubelet.start()
    print(f"test kubelet listening on {kubelet.kubelet_socket}", flush=True)
    last = None
    try:
        while not stop.wait(0.2):
            state = {
                "registrations": [r.resource_name for r in kubelet.registrations()],
                "devices": {
                    r.resource_name: len(kubelet.devices(r.resource_name))
                    for r in kubelet.registrations()
                },
            }
            if state != last:
                tmp = state_file + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(state, f)
                os.replace(tmp, state_file)
                print(f"test kubelet: {state}", flush=True)
                last = state
    finally:
        kubelet.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "kubelet":
        sys.exit(_serve_kubelet(*sys.argv[2:]))
    print(
        "usage: python -m standins.nspawn kubelet DEVICE_PLUGIN_DIR POD_RESOURCES_SOCKET "
        "STATE_FILE",
        file=sys.stderr,
    )
    sys.exit(2)
