"""The configuration's schema: one frozen dataclass per section of the YAML file.

Every field carries its default and, where its name does not say it, its unit and
meaning. Instances are made only by :mod:`nodemgr.config.loading` (which validates) and
passed explicitly: nothing reads configuration from globals.

What it must not do: any I/O, or validation (that is loading's job).
"""

import os
from dataclasses import dataclass

__all__ = [
    "DraSettings",
    "EnforcementSettings",
    "GpuSettings",
    "KubeletSettings",
    "KubernetesSettings",
    "NUMBER_RANGES",
    "NumberRange",
    "PLACEMENT_TRUST_MODES",
    "MetricsSettings",
    "MpsSettings",
    "ResourceSettings",
    "Settings",
    "SimulatedDevice",
    "SimulatedSettings",
    "StatusSettings",
]


@dataclass(frozen=True)
class NumberRange:
    """The values one numeric key may take, both ends included."""

    minimum: float
    maximum: float
    unit: str  # "seconds", "MiB"


# nodemgr.domain.extenderchoice.TRUST_MODES (held equal by a test).
PLACEMENT_TRUST_MODES = ("signed", "annotations")

# Bounded above too: a value that parses but makes the daemon useless (1e300 s never
# wakes a thread, 1e-300 s spins a core) is refused with the range it must be in.
NUMBER_RANGES: dict[str, NumberRange] = {
    "kubelet.reconcile_interval_seconds": NumberRange(0.1, 3600, "seconds"),
    "kubelet.allocation_grace_seconds": NumberRange(0, 86400, "seconds"),
    "gpus.simulated.devices[].memory_mib": NumberRange(1, 16 * 1024 * 1024, "MiB"),
    "resources.memory_unit_mib": NumberRange(1, 1024 * 1024, "MiB"),
    "mps.shm_size_mib": NumberRange(0, 1024 * 1024, "MiB"),
    "mps.health_check_interval_seconds": NumberRange(0.1, 3600, "seconds"),
    "mps.command_timeout_seconds": NumberRange(0.1, 300, "seconds"),
    "enforcement.interval_seconds": NumberRange(0.1, 300, "seconds"),
    "enforcement.grace_mib": NumberRange(0, 1024 * 1024, "MiB"),
    "kubernetes.request_timeout_seconds": NumberRange(0.1, 300, "seconds"),
}


# In kubelet.device_plugin_dir.
PLUGIN_SOCKETS = {
    "memory": "gpushare-memory.sock",
    "core": "gpushare-core.sock",
    "whole": "gpushare-whole.sock",
}


@dataclass(frozen=True)
class KubeletSettings:
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"  # kubelet.sock; our sockets too
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    reconcile_interval_seconds: float = 10.0  # period of the pod-resources reconcile
    allocation_grace_seconds: float = 60.0  # age before an unseen allocation is released


@dataclass(frozen=True)
class SimulatedDevice:
    uuid: str  # 1-52 chars of [A-Za-z0-9-], first alnum; unique (device IDs stay <= 63 chars)
    name: str  # model name, e.g. "Tesla T4"
    memory_mib: int


@dataclass(frozen=True)
class SimulatedSettings:
    """The simulated GPU backend, for tests and machines without NVIDIA cards."""

    devices: tuple[SimulatedDevice, ...] = ()
    usage_file: str = ""  # absolute path of the per-process usage JSON; "" = no processes


@dataclass(frozen=True)
class GpuSettings:
    backend: str = "nvml"  # "nvml" (real cards) or "simulated"
    simulated: SimulatedSettings = SimulatedSettings()  # only with backend "simulated"


@dataclass(frozen=True)
class ResourceSettings:
    memory: str = "aliyun.com/gpu-mem"  # one unit = memory_unit_mib MiB of one card
    memory_unit_mib: int = 1024
    core: str = "aliyun.com/gpu-core.percentage"  # one unit = 1% of one card's compute
    whole: str = "nvidia.com/gpu"  # one unit = one whole card; "" = whole cards not offered
    placement: str = "binpack"  # "binpack" (fill cards one by one) or "spread" (even out)


@dataclass(frozen=True)
class MpsSettings:
    enabled: bool = True  # false: no MPS; shared containers get env quotas only
    control_binary: str = "nvidia-cuda-mps-control"  # a name in $PATH or an absolute path
    # "process": started detached by gpushare-node, adopted after its restart. "systemd"
    # is not built.
    supervisor: str = "process"
    # Each card's /dev/shm tmpfs, its MPS control daemon's and servers' (no container's);
    # 0 = half of RAM shared out among the cards, >= 64 MiB.
    shm_size_mib: int = 0
    # Finds a hung daemon or a server in FAULT; an exit is seen at once through its pidfd.
    health_check_interval_seconds: float = 30.0
    command_timeout_seconds: float = 5.0  # a control command slower than this marks it hung


@dataclass(frozen=True)
class EnforcementSettings:
    # "kill" (SIGKILL the offending processes, newest first, until within quota) or "log".
    action: str = "kill"
    # Full scan period while GPU processes run (memory grows without an event); with
    # none running and process events flowing, a scan every 1 s at most.
    interval_seconds: float = 0.25
    # Held above the quota before it is a violation: the driver's per-context overhead
    # that NVML counts for the process.
    grace_mib: int = 128
    hook_socket: str = ""  # absolute path of the runtime hook's socket; "" = <run_dir>/hook.sock


@dataclass(frozen=True)
class StatusSettings:
    """The socket ``nodemgr status`` reads (root-only, mode 0600)."""

    socket: str = ""  # absolute path; "" = <run_dir>/status.sock


@dataclass(frozen=True)
class MetricsSettings:
    """The Prometheus endpoint (``GET /metrics``)."""

    enabled: bool = True
    # Loopback by default (a scraper or proxy on the node, or 0.0.0.0:PORT deliberately);
    # port 0 = any free port. A port that cannot be bound is logged; the daemon runs on.
    address: str = "127.0.0.1:9445"


@dataclass(frozen=True)
class KubernetesSettings:
    """The Kubernetes API: pod identity at admission, gpushare annotations, node labels, events.

    Without it (disabled or unreachable) the daemon is a plain device plugin and
    nothing waits on the API server.
    """

    enabled: bool = True
    # Credentials: "" = $KUBECONFIG, else the in-cluster service account, else
    # ~/.kube/config. An absolute path names a kubeconfig file.
    kubeconfig: str = ""
    # Of the node labels gpushare-node writes, the only ones it changes or removes.
    label_prefix: str = "gpushare.aliyun.com/"
    request_timeout_seconds: float = 10.0  # one API request; a slower one is retried later
    # Whose card choice the node honours. "signed": only gpushare-scheduler's signed
    # <label_prefix>placement annotation; "annotations": also the unsigned gpushare
    # annotations (ALIYUN_COM_GPU_MEM_IDX, ...) of the gpushare extender, which a pod
    # owner can write too.
    placement_trust: str = "signed"
    # gpushare-scheduler's Ed25519 public key (PEM); "" = none: under "signed" every
    # placement is ignored and the node places by its own policy.
    placement_public_key: str = ""


@dataclass(frozen=True)
class DraSettings:
    """The DRA kubelet plugin beside the device plugin (docs/dra.md). Needs
    ``kubernetes.enabled``: every prepare reads its ResourceClaim."""

    enabled: bool = False
    # In ResourceSlices, DeviceClass selectors and the CDI kind (<driver>/gpu).
    driver: str = "gpushare.aliyun.com"
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"  # kubelet watches it
    plugins_dir: str = "/var/lib/kubelet/plugins"  # the service socket goes in <driver>/
    cdi_dir: str = "/var/run/cdi"  # one CDI spec per prepared claim (the runtime reads it)

    @property
    def registration_socket(self) -> str:
        return os.path.join(self.plugins_registry_dir, f"{self.driver}-reg.sock")

    @property
    def service_socket(self) -> str:
        return os.path.join(self.plugins_dir, self.driver, "dra.sock")


@dataclass(frozen=True)
class Settings:
    node_name: str  # Kubernetes node name; default $NODE_NAME, else the lowercased hostname
    kubelet: KubeletSettings = KubeletSettings()
    state_dir: str = "/var/lib/gpushare"  # durable state (the ledger)
    run_dir: str = "/run/gpushare"  # runtime files, lost on reboot
    gpus: GpuSettings = GpuSettings()
    resources: ResourceSettings = ResourceSettings()
    mps: MpsSettings = MpsSettings()
    enforcement: EnforcementSettings = EnforcementSettings()
    status: StatusSettings = StatusSettings()
    metrics: MetricsSettings = MetricsSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()
    dra: DraSettings = DraSettings()

    @property
    def hook_socket(self) -> str:
        return self.enforcement.hook_socket or os.path.join(self.run_dir, "hook.sock")

    @property
    def status_socket(self) -> str:
        return self.status.socket or os.path.join(self.run_dir, "status.sock")

    def own_paths(self) -> dict[str, str]:
        """gpushare-node's own host paths (path -> what it is), which no container may reach
        beyond what an allocation gives of run_dir: through them it could ask the daemon
        anything, Allocate included."""
        paths = {
            self.run_dir: "gpushare-node's run_dir",
            self.state_dir: "gpushare-node's state_dir (its ledger)",
            self.hook_socket: "gpushare-node's hook socket",
            self.status_socket: "gpushare-node's status socket",
        }
        for resource, name in PLUGIN_SOCKETS.items():
            path = os.path.join(self.kubelet.device_plugin_dir, name)
            paths[path] = f"gpushare-node's device plugin socket ({resource})"
        if self.dra.enabled:
            # dra.sock unprepares any claim; a CDI spec applies to whichever container names
            # it. Only with DRA on: other drivers' (node-wide) plugins use these directories.
            dra = self.dra
            registration = os.path.join(dra.plugins_registry_dir, f"{dra.driver}-reg.sock")
            paths[registration] = "gpushare-node's DRA registration socket"
            plugin_dir = os.path.join(dra.plugins_dir, dra.driver)
            paths[plugin_dir] = "gpushare-node's DRA plugin directory (its dra.sock)"
            paths[dra.cdi_dir] = (
                "the CDI spec directory (gpushare-node writes its claims' specs there)"
            )
        return {os.path.normpath(path): what for path, what in paths.items()}

    def hook_guards(self) -> tuple[str, ...]:
        """The own paths the hook gets as ``--guard``: all but run_dir, its socket and
        what is inside run_dir (the hook knows those)."""
        run_dir = os.path.normpath(self.run_dir)
        known = {run_dir, os.path.normpath(self.hook_socket)}
        return tuple(
            path
            for path in self.own_paths()
            if path not in known and not path.startswith(run_dir.rstrip("/") + "/")
        )

    def own_directories(self) -> tuple[str, ...]:
        """The directories holding gpushare-node's own paths: mounting a parent of one
        (``/run``, ``/var/lib/kubelet``) is the mark of a node-wide container."""
        directories = (self.run_dir, self.state_dir, self.kubelet.device_plugin_dir)
        return tuple(os.path.normpath(d) for d in directories)
