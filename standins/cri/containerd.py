"""A private containerd (Debian's 1.6, with its CRI plugin) for the engine tests.

``Containerd(dir, base_spec, archives, sandbox_image)`` writes a config whose
every path is under ``dir``: root, state, the gRPC socket (``grpc.address``),
the runc state root and the CRI plugin's CNI conf_dir (empty: the test pods
use the host network). It never touches the system's containerd. The CRI
plugin runs runc with ``base_runtime_spec`` = ``base_spec``, the JSON that
``make-base-spec`` (written by ``nodemgr install``) prints, so the runtime
hook runs at every container, as on a node. (containerd 1.6 does not apply
``base_runtime_spec`` to the sandbox's pause container: no hook runs there.)
A second runtime, ``PLAIN_RUNTIME``, is the same runc without a base spec: a
sandbox run with that handler gets containerd's own CRI default spec, which
the base spec must equal but for the hooks.

``restrict_oom_score_adj = true`` is required on these machines (no
CAP_SYS_RESOURCE): without it RunPodSandbox fails with "can't get final
child's PID from pipe: EOF".

``start()`` starts the daemon, waits for the CRI ``Version`` to answer, then
imports the image archives (docker-archive, built by scripts/setup-engines)
with ``ctr -n k8s.io images import``. ``runtime`` and ``images`` are the CRI v1
stubs. ``cleanup()`` stops and removes every sandbox (which stops and removes
their containers, running the poststop hooks), stops containerd, kills any
shim left, unmounts what is left under ``dir``, removes the pods' cgroups and
``dir``. Safe to call twice and after a failed start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import grpc
import psutil

from standins.cri import configs
from standins.cri.api import runtime_v1_pb2 as cri
from standins.cri.api import runtime_v1_pb2_grpc as cri_grpc

START_TIMEOUT_SECONDS = 30.0
CALL_TIMEOUT_SECONDS = 60.0
NAMESPACE = "k8s.io"  # the containerd namespace of the CRI plugin
# The runtime handler of the same runc without base_runtime_spec (CRI's default spec).
PLAIN_RUNTIME = "plain"

CONFIG = """\
version = 2
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  level = "info"

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{dir}/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{sandbox_image}"
    restrict_oom_score_adj = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{dir}/cni-bin"
      conf_dir = "{dir}/cni"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      snapshotter = "overlayfs"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        base_runtime_spec = "{base_spec}"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          BinaryName = "runc"
          Root = "{dir}/runc"
          SystemdCgroup = false
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{plain}]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{plain}.options]
          BinaryName = "runc"
          Root = "{dir}/runc"
          SystemdCgroup = false
"""


class Containerd:
    """One private containerd with the CRI plugin, its runc runtime hooked by ``base_spec``."""

    def __init__(self, directory: str, base_spec: str, archives: list[str], sandbox_image: str):
        self.dir = directory
        # Unix socket paths must stay under 108 bytes.
        self.socket = os.path.join(directory, "containerd.sock")
        self.config_path = os.path.join(directory, "config.toml")
        self.log_path = os.path.join(directory, "containerd.log")
        self.log_root = os.path.join(directory, "pod-logs")
        self.archives = archives
        self.sandbox_image = sandbox_image
        self.base_spec = base_spec
        self.process: subprocess.Popen | None = None
        self._channel: grpc.Channel | None = None
        self.runtime: cri_grpc.RuntimeServiceStub | None = None
        self.images: cri_grpc.ImageServiceStub | None = None
        self._pod_uids: set[str] = set()

    @property
    def address(self) -> str:
        return "unix://" + self.socket

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for sub in ("root", "state", "opt", "cni", "cni-bin", "runc", "pod-logs"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write(
                CONFIG.format(
                    dir=self.dir,
                    socket=self.socket,
                    sandbox_image=self.sandbox_image,
                    base_spec=self.base_spec,
                    plain=PLAIN_RUNTIME,
                )
            )
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                ["containerd", "--config", self.config_path],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of pytest does not reach it first
            )
        self._channel = grpc.insecure_channel(self.address)
        self.runtime = cri_grpc.RuntimeServiceStub(self._channel)
        self.images = cri_grpc.ImageServiceStub(self._channel)
        self._wait_ready()
        for archive in self.archives:
            self.ctr("images", "import", archive)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"containerd exited ({self.process.returncode}):\n{self.log()}")
            try:
                self.runtime.Version(cri.VersionRequest(), timeout=2)
                return
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"containerd's CRI did not answer in {START_TIMEOUT_SECONDS} s "
                        f"({e.code().name}):\n{self.log()}"
                    ) from e
            time.sleep(0.1)

    def ctr(self, *args: str) -> str:
        """``ctr --address <ours> -n k8s.io ARGS``; its output (raises on failure)."""
        done = subprocess.run(
            ["ctr", "--address", self.socket, "-n", NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        if done.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    # ------------------------------------------------------------------ CRI calls

    def run_pod_sandbox(self, config: cri.PodSandboxConfig, runtime_handler: str = "") -> str:
        """RunPodSandbox with the runtime ``runtime_handler`` ("": runc with the base spec,
        ``PLAIN_RUNTIME``: without); the sandbox ID. Its cgroups are removed at cleanup."""
        self._pod_uids.add(config.metadata.uid)
        answer = self.runtime.RunPodSandbox(
            cri.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler),
            timeout=CALL_TIMEOUT_SECONDS,
        )
        return answer.pod_sandbox_id

    def create_container(
        self, sandbox_id: str, sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig
    ) -> str:
        answer = self.runtime.CreateContainer(
            cri.CreateContainerRequest(
                pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox
            ),
            timeout=CALL_TIMEOUT_SECONDS,
        )
        return answer.container_id

    def start_container(self, container_id: str) -> None:
        self.runtime.StartContainer(
            cri.StartContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT_SECONDS
        )

    def container_status(self, container_id: str) -> tuple[cri.ContainerStatus, dict]:
        """The container's status and its verbose info (containerd's: ``pid`` ...)."""
        answer = self.runtime.ContainerStatus(
            cri.ContainerStatusRequest(container_id=container_id, verbose=True),
            timeout=CALL_TIMEOUT_SECONDS,
        )
        info = json.loads(answer.info["info"]) if "info" in answer.info else {}
        return answer.status, info

    def pid(self, container_id: str) -> int:
        """The host PID of the container's init process."""
        return self.container_status(container_id)[1]["pid"]

    def stop_container(self, container_id: str, timeout: int = 0) -> None:
        self.runtime.StopContainer(
            cri.StopContainerRequest(container_id=container_id, timeout=timeout),
            timeout=CALL_TIMEOUT_SECONDS,
        )

    def remove_pod_sandbox(self, sandbox_id: str) -> None:
        """StopPodSandbox then RemovePodSandbox, as kubelet removes a pod."""
        self.runtime.StopPodSandbox(
            cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=CALL_TIMEOUT_SECONDS
        )
        self.runtime.RemovePodSandbox(
            cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=CALL_TIMEOUT_SECONDS
        )

    def sandboxes(self) -> list[cri.PodSandbox]:
        return list(
            self.runtime.ListPodSandbox(
                cri.ListPodSandboxRequest(), timeout=CALL_TIMEOUT_SECONDS
            ).items
        )

    def containers(self) -> list[cri.Container]:
        return list(
            self.runtime.ListContainers(
                cri.ListContainersRequest(), timeout=CALL_TIMEOUT_SECONDS
            ).containers
        )

    # ------------------------------------------------------------------ cleanup

    def remove_all_pods(self) -> None:
        """Stop and remove every sandbox (and so every container) this instance holds."""
        for sandbox in self.sandboxes():
            self._pod_uids.add(sandbox.metadata.uid)  # also those kubelet_sim ran
            self.remove_pod_sandbox(sandbox.id)

    def cleanup(self) -> None:
        errors = []
        if self.process is not None and self.process.poll() is None:
            try:
                self.remove_all_pods()
            except grpc.RpcError as e:  # still tear the rest down
                errors.append(f"removing the pods: {e.code().name} {e.details()}")
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._kill_shims()
        self._unmount_all()
        self._remove_cgroups()
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("; ".join(errors))

    def _kill_shims(self) -> None:
        """Shims (and their containers) of this instance left by a failed run."""
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if cmdline and "containerd-shim" in cmdline[0] and self.socket in cmdline:
                try:
                    for child in proc.children(recursive=True):
                        child.kill()
                    proc.kill()
                except psutil.Error:
                    pass

    def _unmount_all(self) -> None:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        for point in sorted(points, key=len, reverse=True):
            if point == self.dir or point.startswith(self.dir + "/"):
                subprocess.run(["umount", "-l", point], check=False, capture_output=True)

    def _remove_cgroups(self) -> None:
        for uid in self._pod_uids:
            configs.remove_pod_cgroups(uid)
