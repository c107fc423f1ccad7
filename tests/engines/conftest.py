"""The real container engines: podman 4.3 and containerd 1.6 (CRI), both over runc.

``scripts/setup-engines`` installs them (Debian packages) and builds the local
images once (cached outside the checkout); ``engines`` runs it once per test
session and skips every engine test with its reason where they cannot be had
(not root, no apt), except where GPUSHARE_REQUIRE_REAL_PARTS=1 (CI): there it
fails, so CI never passes by skipping them.

Every node here is the real gpushare-node on simulated cards with the test
kubelet (``runc_env.EnforcementNode``), and the hook configs the engines read
are the ones ``nodemgr install --root <node>/install`` writes for that node's
config: the oci-hooks.d files for podman, the base runtime spec that
``make-base-spec`` prints for containerd.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

import pytest

from standins import runc_env
from standins.cri.containerd import Containerd
from standins.paths import REPO
from standins.setup_script import run_setup

SETUP = os.path.join(REPO, "scripts", "setup-engines")
SETUP_TIMEOUT_SECONDS = 600
NODEMGR = os.path.join(os.path.dirname(runc_env.hook_command()), "nodemgr")
# podman needs every flag before `--rootfs DIR`: the first argument after the flags is
# the rootfs, and everything after it is the container's command.
PODMAN_RLIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")
# CRI-O's OCI annotations of a pod's identity (what the hook reads under CRI-O).
CRIO_NAMESPACE = "io.kubernetes.pod.namespace"
CRIO_POD = "io.kubernetes.pod.name"
CRIO_CONTAINER = "io.kubernetes.container.name"


@dataclass(frozen=True)
class Engines:
    rootfs: str  # a busybox rootfs dir, for podman --rootfs
    busybox_archive: str  # docker-archive of the busybox image
    busybox_image: str  # its reference
    pause_archive: str
    pause_image: str


@functools.cache
def find() -> Engines | str:
    """The engines and images, or why they cannot be had here (one line)."""
    if os.geteuid() != 0:
        return "the engine tests need root (real cgroups, namespaces, mounts)"
    values = run_setup(SETUP, SETUP_TIMEOUT_SECONDS)
    if isinstance(values, str):
        return values
    try:
        found = Engines(
            values["GPUSHARE_ENGINES_ROOTFS"],
            values["GPUSHARE_ENGINES_BUSYBOX_ARCHIVE"],
            values["GPUSHARE_ENGINES_BUSYBOX_IMAGE"],
            values["GPUSHARE_ENGINES_PAUSE_ARCHIVE"],
            values["GPUSHARE_ENGINES_PAUSE_IMAGE"],
        )
    except KeyError as e:
        return f"scripts/setup-engines printed no {e.args[0]}"
    for tool in ("podman", "containerd", "ctr", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed after scripts/setup-engines"
    return found


def require() -> Engines:
    found = find()
    if isinstance(found, Engines):
        return found
    reason = f"the real container engines (podman, containerd) are not available: {found}"
    if os.environ.get("GPUSHARE_REQUIRE_REAL_PARTS") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_REAL_PARTS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def engines() -> Engines:
    return require()


class EngineNode(runc_env.EnforcementNode):
    """A node (daemon + test kubelet) with ``nodemgr install`` run for its config under
    ``<root>/install``: the hook configs an admin would install, pointing at this node."""

    def __init__(self, action: str = "kill"):
        super().__init__(action)
        try:
            self._install()
        except BaseException:
            self.close()
            raise

    def _install(self) -> None:
        self.install_root = os.path.join(self.node.root, "install")
        os.makedirs(os.path.join(self.install_root, "etc", "gpushare"))
        shutil.copy(
            self.node.config_path,
            os.path.join(self.install_root, "etc", "gpushare", "config.yaml"),
        )
        done = subprocess.run(
            [NODEMGR, "install", "--root", self.install_root], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        self.hooks_dir = os.path.join(self.install_root, "etc", "containers", "oci", "hooks.d")
        self.containerd_dir = os.path.join(self.install_root, "etc", "gpushare", "containerd")
        # The hook configs run the launcher install wrote at its node path, which is under
        # the install root here: point them there (the engines read them on this host).
        launcher = os.path.join(self.install_root, "etc", "gpushare", "gpushare-hook")
        for directory in (self.hooks_dir, self.containerd_dir):
            for name in os.listdir(directory):
                if name.endswith(".json"):
                    path = os.path.join(directory, name)
                    with open(path) as f:
                        text = f.read()
                    with open(path, "w") as f:
                        f.write(text.replace('"/etc/gpushare/gpushare-hook"', json.dumps(launcher)))

    def base_runtime_spec(self) -> str:
        """Run the installed ``make-base-spec``; the path of the spec it printed."""
        path = os.path.join(self.node.root, "base-spec.json")
        done = subprocess.run(
            [os.path.join(self.containerd_dir, "make-base-spec")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        spec = json.loads(done.stdout)
        assert spec["hooks"]["createRuntime"][0]["args"][2] == self.hook_socket
        with open(path, "w") as f:
            f.write(done.stdout)
        return path


@dataclass
class Ran:
    """What ``podman run -d`` said: exit status, the container ID (stdout), stderr."""

    returncode: int
    id: str
    stderr: str


class Podman:
    """podman with a private store (root, runroot, tmpdir) under ``directory``, the runc
    runtime, cgroupfs, and the hooks of ``hooks_dir``."""

    def __init__(self, directory: str, hooks_dir: str, rootfs: str):
        self.dir = directory
        self.rootfs = rootfs
        self.global_flags = [
            "--root", os.path.join(directory, "root"),
            "--runroot", os.path.join(directory, "run"),  # at most 50 characters
            "--tmpdir", os.path.join(directory, "tmp"),
            "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "none",
            "--runtime", "runc",
            "--hooks-dir", hooks_dir,
        ]  # fmt: skip
        assert len(os.path.join(directory, "run")) <= 50, directory

    def podman(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["podman", *self.global_flags, *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )

    def run(
        self,
        name: str,
        env: dict[str, str] | None = None,
        mounts: list[tuple[str, str]] = (),
        annotations: dict[str, str] | None = None,
        command: tuple[str, ...] = ("sleep", "1000"),
    ) -> Ran:
        """``podman run -d`` the busybox rootfs; returns once it started or was refused."""
        flags = ["--name", name, "--network", "none", *PODMAN_RLIMITS]
        for key, value in (env or {}).items():
            flags += ["--env", f"{key}={value}"]
        for container_path, host_path in mounts:
            flags += ["--volume", f"{host_path}:{container_path}"]
        for key, value in (annotations or {}).items():
            flags += ["--annotation", csv_field(f"{key}={value}")]
        done = self.podman("run", "-d", *flags, "--rootfs", self.rootfs, *command)
        return Ran(done.returncode, done.stdout.strip(), done.stderr)

    def inspect(self, name: str) -> dict | None:
        done = self.podman("inspect", "--type", "container", name)
        return json.loads(done.stdout)[0] if done.returncode == 0 else None

    def pid(self, name: str) -> int:
        return self.inspect(name)["State"]["Pid"]

    def remove(self, name: str) -> subprocess.CompletedProcess:
        """``podman rm -f -t 0``: kill, then clean up (podman runs the poststop hook)."""
        return self.podman("rm", "-f", "-t", "0", name)

    def cleanup(self) -> None:
        self.podman("rm", "-a", "-f", "-t", "0")
        # Leftover mounts (a failed run) before the store goes.
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        for point in sorted(points, key=len, reverse=True):
            if point.startswith(self.dir + "/"):
                subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def csv_field(text: str) -> str:
    """``text`` as one field of a CSV line: podman reads each ``--annotation`` as a list of
    them (a JSON value's quotes and commas would split it otherwise)."""
    if not any(ch in text for ch in '",\n'):
        return text
    return '"' + text.replace('"', '""') + '"'


@pytest.fixture
def node(engines):
    node = EngineNode()
    yield node
    node.close()


@pytest.fixture
def podman(engines, node):
    podman = Podman(os.path.join(node.node.root, "pm"), node.hooks_dir, engines.rootfs)
    yield podman
    podman.cleanup()


@pytest.fixture
def containerd(engines, node):
    containerd = Containerd(
        os.path.join(node.node.root, "ctrd"),
        node.base_runtime_spec(),
        [engines.pause_archive, engines.busybox_archive],
        engines.pause_image,
    )
    try:
        containerd.start()
        yield containerd
    finally:
        containerd.cleanup()


def new_uid() -> str:
    return str(uuid.uuid4())


def leftover_cgroups(uid: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/kubepods/besteffort/pod{uid}")
