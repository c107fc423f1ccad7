"""Real containers for tests: runc (Debian package) and a busybox rootfs.

``Runtime`` makes OCI bundles whose config.json runs ``gpushare-hook`` at
createRuntime and poststop, exactly as CRI-O or containerd would from the
configs in hooks/, and drives them with the runc binary. Tests that need it
skip when runc, a static busybox or root is missing, except where
GPUSHARE_REQUIRE_RUNC=1 (set by .ci/run): there they fail, so CI never passes
by skipping them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import psutil
import pytest

from nodemgr.config.loading import load_settings
from standins import exitwait
from standins.daemon_proc import CORE, MEMORY, MPS_STANDIN, Node
from standins.kubelet_sim import ContainerSpec, TestKubelet
from standins.paths import REPO

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
APPLETS = ("sh", "sleep", "env", "cat", "true")


def missing() -> str | None:
    """Why real containers cannot run here, or None."""
    if os.geteuid() != 0:
        return "runc containers need root (real cgroups and namespaces)"
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc)"
    if _busybox() is None:
        return "a static busybox is not installed (apt-get install busybox-static)"
    return None


def require() -> None:
    reason = missing()
    if reason is None:
        return
    if os.environ.get("GPUSHARE_REQUIRE_RUNC") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_RUNC=1 but {reason}")
    pytest.skip(reason)


def _busybox() -> str | None:
    """A busybox that runs in an empty rootfs: no ELF interpreter (PT_INTERP) named."""
    for path in BUSYBOX_CANDIDATES:
        if os.path.exists(path):
            with open(path, "rb") as f:
                head = f.read(4096)
            if b"ld-linux" not in head and b"ld-musl" not in head:
                return path
    return None


SHIPPED_HOOKS = os.path.join(REPO, "hooks", "containerd", "gpushare-hooks.json")
SHIPPED_SOCKET = "/run/gpushare/hook.sock"
SHIPPED_PATH = "/etc/gpushare/gpushare-hook"  # render.HOOK_LAUNCHER


def hook_command() -> str:
    """The installed gpushare-hook console script next to this Python."""
    return os.path.join(os.path.dirname(sys.executable), "gpushare-hook")


def write_launcher(directory: str) -> str:
    """The hook launcher nodemgr install writes, for this venv's Python and this source
    tree, in ``directory``; its path."""
    from nodemgr.cli.install.render import hook_launcher

    path = os.path.join(directory, "gpushare-hook")
    with open(path, "w") as f:
        f.write(hook_launcher(sys.executable, REPO))
    os.chmod(path, 0o755)
    return path


def shipped_hooks(socket_path: str, launcher: str, guards: tuple[str, ...] | None = None) -> dict:
    """The ``hooks`` of the shipped containerd snippet, pointed at this test's socket, its
    daemon's own paths (``guards``: the --guard values; None keeps the shipped ones) and a
    launcher for this venv: the tests run what admins install."""
    with open(SHIPPED_HOOKS) as f:
        hooks = json.load(f)["hooks"]
    for entries in hooks.values():
        for hook in entries:
            _point(hook, socket_path, launcher, guards)
    return hooks


def _point(hook: dict, socket_path: str, launcher: str, guards: tuple[str, ...] | None) -> None:
    assert hook["path"] == SHIPPED_PATH
    hook["path"] = launcher
    args = [socket_path if a == SHIPPED_SOCKET else a for a in hook["args"]]
    if guards is not None:
        shipped = [i for i, a in enumerate(args) if a == "--guard"]
        kept = [a for i, a in enumerate(args) if i not in shipped and i - 1 not in shipped]
        given = [a for path in guards for a in ("--guard", path)]
        args = [kept[0], *given, *kept[1:]]
    hook["args"] = args


SHIPPED_OCI_HOOKS = os.path.join(REPO, "hooks", "oci-hooks.d")


def shipped_oci_hooks(
    socket_path: str, launcher: str, guards: tuple[str, ...] | None = None
) -> dict:
    """The ``hooks`` CRI-O and podman put into a container's spec from the shipped
    oci-hooks.d files (one entry per stage), pointed as ``shipped_hooks`` points them."""
    hooks: dict[str, list] = {}
    for name in sorted(os.listdir(SHIPPED_OCI_HOOKS)):
        with open(os.path.join(SHIPPED_OCI_HOOKS, name)) as f:
            document = json.load(f)
        hook = document["hook"]
        _point(hook, socket_path, launcher, guards)
        for stage in document["stages"]:
            hooks.setdefault(stage, []).append(hook)
    return hooks


class Runtime:
    """runc with its own state root under ``root``, and a busybox rootfs."""

    def __init__(
        self, root: str, hook_socket: str | None, hook_guards: tuple[str, ...] | None = None
    ):
        """``hook_guards``: the daemon's own paths the hooks are told of (--guard; None:
        the shipped ones)."""
        self.root = root
        self.hook_guards = hook_guards
        self.state_root = os.path.join(root, "runc-state")
        self.rootfs = os.path.join(root, "rootfs")
        self.hook_socket = hook_socket
        self.launcher = write_launcher(root)
        self._containers: list[str] = []
        os.makedirs(os.path.join(self.rootfs, "bin"), exist_ok=True)
        for directory in ("proc", "dev", "sys", "tmp"):
            os.makedirs(os.path.join(self.rootfs, directory), exist_ok=True)
        shutil.copy(_busybox(), os.path.join(self.rootfs, "bin", "busybox"))
        for applet in APPLETS:
            os.symlink("busybox", os.path.join(self.rootfs, "bin", applet))

    def bundle(
        self,
        name: str,
        env: dict[str, str] | list[str],
        mounts: list[tuple[str, str]] = (),
        args: tuple[str, ...] = ("sleep", "1000"),
        hooks: bool = True,
        annotations: dict[str, str] | None = None,
        edit: Callable[[dict], None] | None = None,
    ) -> str:
        """An OCI bundle; ``annotations`` go into config.json (as a CRI runtime writes
        a pod's identity there) and ``edit`` may change the config last."""
        bundle = os.path.join(self.root, "bundles", name)
        os.makedirs(bundle, exist_ok=True)
        subprocess.run(["runc", "spec", "--bundle", bundle], check=True)
        path = os.path.join(bundle, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["root"] = {"path": self.rootfs, "readonly": True}
        entries = env if isinstance(env, list) else [f"{k}={v}" for k, v in env.items()]
        config["process"]["terminal"] = False
        config["process"]["args"] = list(args)
        config["process"]["env"] = ["PATH=/bin", *entries]
        for container_path, host_path in mounts:
            config["mounts"].append(
                {
                    "destination": container_path,
                    "source": host_path,
                    "type": "bind",
                    "options": ["rbind", "rw"],
                }
            )
        if hooks and self.hook_socket is not None:
            config["hooks"] = shipped_hooks(self.hook_socket, self.launcher, self.hook_guards)
        if annotations:
            config.setdefault("annotations", {}).update(annotations)
        if edit is not None:
            edit(config)
        with open(path, "w") as f:
            json.dump(config, f)
        return bundle

    def _runc(self, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        # exitwait, not subprocess.run: its timed wait polls, and the benchmarks time these.
        return exitwait.run(["runc", "--root", self.state_root, *args], timeout=timeout, **kwargs)

    def run(self, container_id: str, bundle: str) -> subprocess.CompletedProcess:
        """``runc run -d``: returns once the container started or was refused.

        runc's own output goes to a file: a detached container keeps its stdio.
        """
        self._containers.append(container_id)
        log_path = os.path.join(self.root, f"{container_id}.out")
        with open(log_path, "w") as log:
            done = self._runc(
                "run", "-d", "--bundle", bundle, container_id,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60,
            )  # fmt: skip
        with open(log_path) as f:
            done.stdout = f.read()
        return done

    def exec(self, container_id: str, *args: str) -> int:
        """Start one more process in the container; its PID (as the host sees it)."""
        pid_file = os.path.join(self.root, f"{container_id}-{time.monotonic_ns()}.pid")
        self._runc(
            "exec", "-d", "--pid-file", pid_file, container_id, *args,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            check=True, timeout=30,
        )  # fmt: skip
        with open(pid_file) as f:
            return int(f.read())

    def state(self, container_id: str) -> dict | None:
        done = self._runc("state", container_id, capture_output=True, text=True)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def pid(self, container_id: str) -> int:
        return self.state(container_id)["pid"]

    def delete(self, container_id: str) -> subprocess.CompletedProcess:
        """Stop and delete the container (runc runs the poststop hook)."""
        return self._runc("delete", "-f", container_id, capture_output=True, text=True, timeout=60)

    def cleanup(self) -> None:
        for container_id in self._containers:
            if self.state(container_id) is not None:
                self.delete(container_id)


# The pod identity containerd's CRI plugin writes into a container's OCI annotations
# (CRI-O writes io.kubernetes.pod.namespace, .pod.name and .container.name); the runtime
# hook reads either. A container without them cannot be tied to a pod, so it gets no GPU.
CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
CRI_POD = "io.kubernetes.cri.sandbox-name"
CRI_CONTAINER = "io.kubernetes.cri.container-name"


def cri_annotations(namespace: str, pod: str, container: str) -> dict[str, str]:
    """The annotations a CRI runtime gives container ``container`` of pod namespace/pod."""
    return {CRI_NAMESPACE: namespace, CRI_POD: pod, CRI_CONTAINER: container}


def running(pid: int) -> bool:
    """True while the process runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class EnforcementNode:
    """One node (daemon + test kubelet) and a runc runtime with the hook configured."""

    def __init__(
        self,
        action: str = "kill",
        control_binary: str = MPS_STANDIN,
        nofile: int | None = None,
        env: dict[str, str] | None = None,
    ):
        """``control_binary``: the MPS control binary (the stand-in, or NVIDIA's real one);
        ``nofile``: the daemon's RLIMIT_NOFILE (Node.start), None: this process's; ``env``:
        added to the daemon's environment (Node.start)."""
        require()
        self.node = Node(control_binary)
        self.usage_file = os.path.join(self.node.root, "usage.json")
        self.set_usage([])
        self.node.rewrite_config(
            lambda c: (
                c["gpus"]["simulated"].__setitem__("usage_file", self.usage_file),
                c.__setitem__("enforcement", {"action": action}),
            )
        )
        self.hook_socket = os.path.join(self.node.root, "run", "hook.sock")
        self.kubelet = TestKubelet(self.node.device_plugin_dir, self.node.pod_resources_socket)
        self.kubelet.start()
        self.node.start(env=env, nofile=nofile)
        self.kubelet.wait_for_resource(MEMORY, timeout=30)
        self.kubelet.wait_for_resource(CORE, timeout=30)
        guards = load_settings(self.node.config_path).hook_guards()
        self.runtime = Runtime(self.node.root, self.hook_socket, guards)

    def set_usage(self, processes: list[tuple[int, str, int]]) -> None:
        """What the simulated GPUs report: (pid, card, MiB) per process."""
        document = {"processes": [{"pid": p, "gpu": g, "used_mib": m} for p, g, m in processes]}
        tmp = self.usage_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(document, f)
        os.replace(tmp, self.usage_file)

    def admit(self, pod: str, memory_gib: int = 4, core_percent: int = 30):
        """Admit a pod through kubelet; the env and mounts its container gets."""
        # Memory first: this node runs without the Kubernetes API, where the daemon sees one
        # resource at a time and a share placed first may leave no room for the memory
        # (docs/how-it-works.md); these tests are about enforcement, not that order.
        result = self.kubelet.admit_pod(
            "default",
            pod,
            [ContainerSpec("main", {MEMORY: memory_gib, CORE: core_percent})],
            order=[MEMORY, CORE],
        )
        assert result.ok, result.error
        container = result.containers[0]
        mounts = {
            (m.container_path, m.host_path)
            for response in container.responses.values()
            for m in response.mounts
        }
        return dict(container.envs), sorted(mounts)

    def start_container(
        self, name: str, env, mounts=(), **bundle_options
    ) -> subprocess.CompletedProcess:
        """``runc run -d`` of a new bundle; ``bundle_options`` as for ``Runtime.bundle``."""
        return self.runtime.run(name, self.runtime.bundle(name, env, mounts, **bundle_options))

    def start_in_pod(
        self,
        name: str,
        pod: str,
        env,
        mounts=(),
        container: str = "main",
        namespace: str = "default",
        **bundle_options,
    ) -> subprocess.CompletedProcess:
        """``start_container`` as a CRI runtime makes container ``container`` of pod
        namespace/pod: with that pod's identity annotations."""
        annotations = cri_annotations(namespace, pod, container)
        annotations.update(bundle_options.pop("annotations", None) or {})
        return self.start_container(name, env, mounts, annotations=annotations, **bundle_options)

    def registered(self) -> set[str]:
        return {c for a in self.node.allocations() for c in a["containers"]}

    def close(self) -> None:
        self.runtime.cleanup()
        self.node.cleanup()
        self.kubelet.stop()
