"""The configuration's schema: one frozen dataclass per section of the YAML file.

Every field carries its default and a comment saying its unit and meaning;
``Settings`` is the whole file. Instances are made only by
:mod:`nodemgr.config.loading` (which validates) and passed explicitly to
whoever needs them: nothing reads configuration from globals.

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
    unit: str  # how the operator reads it: "seconds", "MiB"


# Every number of the file, with its range, checked at load and so at every reload.
# Bounded above as well as below: a value that parses but makes the daemon useless
# (1e300 s never wakes a thread, 1e-300 s spins a core, a huge timeout never
# starts MPS) is a configuration error and is refused with the range it must be in.
# kubernetes.placement_trust (nodemgr.domain.extenderchoice.TRUST_MODES, held equal by a test).
PLACEMENT_TRUST_MODES = ("signed", "annotations")

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


# The device plugin sockets gpushare-node serves in kubelet.device_plugin_dir, by resource
# (memory, core, whole card).
PLUGIN_SOCKETS = {
    "memory": "gpushare-memory.sock",
    "core": "gpushare-core.sock",
    "whole": "gpushare-whole.sock",
}


@dataclass(frozen=True)
class KubeletSettings:
    """Where kubelet is and how often gpushare-node compares its state with kubelet's."""

    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"  # kubelet.sock; our sockets too
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    reconcile_interval_seconds: float = 10.0  # > 0: period of the pod-resources reconcile
    allocation_grace_seconds: float = 60.0  # >= 0: age before an unseen allocation is released


@dataclass(frozen=True)
class SimulatedDevice:
    """One fake GPU of the simulated backend."""

    uuid: str  # 1-52 chars of [A-Za-z0-9-], first alnum; unique (device IDs stay <= 63 chars)
    name: str  # model name shown to operators, e.g. "Tesla T4"
    memory_mib: int  # total memory in MiB, > 0


@dataclass(frozen=True)
class SimulatedSettings:
    """The simulated GPU backend, for tests and machines without NVIDIA cards."""

    devices: tuple[SimulatedDevice, ...] = ()
    usage_file: str = ""  # absolute path of the per-process usage JSON; "" = no processes


@dataclass(frozen=True)
class GpuSettings:
    """Where the GPU inventory comes from."""

    backend: str = "nvml"  # "nvml" (real cards) or "simulated"
    simulated: SimulatedSettings = SimulatedSettings()  # only with backend "simulated"


@dataclass(frozen=True)
class ResourceSettings:
    """The extended resources offered to kubelet and how shares are placed on cards."""

    memory: str = "aliyun.com/gpu-mem"  # one unit = memory_unit_mib MiB of one card
    memory_unit_mib: int = 1024  # MiB per unit of the memory resource, > 0
    core: str = "aliyun.com/gpu-core.percentage"  # one unit = 1% of one card's compute
    whole: str = "nvidia.com/gpu"  # one unit = one whole card; "" = whole cards not offered
    placement: str = "binpack"  # "binpack" (fill cards one by one) or "spread" (even out)


@dataclass(frozen=True)
class MpsSettings:
    """One NVIDIA MPS control daemon per shared card, and what containers get of it."""

    enabled: bool = True  # false: no MPS; shared containers get env quotas only
    # The control binary: a name looked up in $PATH, or an absolute path.
    control_binary: str = "nvidia-cuda-mps-control"
    # Who keeps the control daemons alive: "process" (started detached by
    # gpushare-node, adopted after its restart). "systemd" is not built yet.
    supervisor: str = "process"
    # Size of each card's /dev/shm tmpfs (its shared containers and its MPS daemon and servers);
    # 0 = half of RAM shared out among the cards, at least 64 MiB.
    shm_size_mib: int = 0
    # How often each control daemon is asked (finds a hung one or a server in FAULT);
    # a daemon that exits is noticed at once through its pidfd, not by this check.
    health_check_interval_seconds: float = 30.0
    command_timeout_seconds: float = 5.0  # a control command slower than this marks it hung


@dataclass(frozen=True)
class EnforcementSettings:
    """The runtime hook's socket and the watchdog that holds GPU processes to their quotas."""

    # What the watchdog does to a violation: "kill" (SIGKILL the offending
    # processes, newest first, until the container is within quota) or "log".
    action: str = "kill"
    # Period of the full scan of GPU processes while any run (memory grows without an
    # event); with none running and process events flowing, a scan every 1 s at most.
    interval_seconds: float = 0.25
    # >= 0: MiB a container may hold above its quota before it is a violation;
    # covers the driver's per-context overhead that NVML counts for the process.
    grace_mib: int = 128
    hook_socket: str = ""  # absolute path of the runtime hook's socket; "" = <run_dir>/hook.sock


@dataclass(frozen=True)
class StatusSettings:
    """The local status socket that ``nodemgr status`` reads (root-only, mode 0600)."""

    socket: str = ""  # absolute path; "" = <run_dir>/status.sock


@dataclass(frozen=True)
class MetricsSettings:
    """The Prometheus endpoint (``GET /metrics``)."""

    enabled: bool = True  # false: no endpoint
    # host:port to listen on; loopback by default (put a scraper or a proxy on
    # the node, or set 0.0.0.0:PORT deliberately). Port 0 = any free port
    # (tests). A port that cannot be bound is logged; the daemon runs on.
    address: str = "127.0.0.1:9445"


@dataclass(frozen=True)
class KubernetesSettings:
    """The Kubernetes API: pod identity at admission, gpushare annotations, node labels, events.

    Optional: without it (``enabled: false``, or the API server unreachable)
    the daemon is a plain device plugin and nothing waits on the API server.
    """

    enabled: bool = True
    # Credentials: "" = $KUBECONFIG, else the in-cluster service account, else
    # ~/.kube/config. An absolute path names a kubeconfig file.
    kubeconfig: str = ""
    # Prefix of the node labels gpushare-node writes (and the only ones it ever
    # changes or removes), e.g. gpushare.aliyun.com/gpu-model.
    label_prefix: str = "gpushare.aliyun.com/"
    request_timeout_seconds: float = 10.0  # > 0: one API request; a slower one is retried later
    # Whose card choice for a pod the node honours. "signed": only a placement
    # gpushare-scheduler signed (its <label_prefix>placement annotation, checked with
    # placement_public_key); "annotations": also the unsigned gpushare annotations
    # (ALIYUN_COM_GPU_MEM_IDX, _ASSUME_TIME, scheduler.framework.gpushare.allocation)
    # the old gpushare extender writes, which a pod owner can write too.
    placement_trust: str = "signed"
    # Absolute path of gpushare-scheduler's Ed25519 public key (PEM); "" = none, so
    # under "signed" every placement is ignored and the node places by its own policy.
    placement_public_key: str = ""


@dataclass(frozen=True)
class DraSettings:
    """The DRA kubelet plugin: the second front door (docs/dra.md), beside the device plugin.

    kubelet finds the plugin by its registration socket
    ``<plugins_registry_dir>/<driver>-reg.sock`` and calls its DRA service at
    ``<plugins_dir>/<driver>/dra.sock`` (kubelet's --root-dir is /var/lib/kubelet by
    default). Needs ``kubernetes.enabled``: every prepare reads its ResourceClaim.
    """

    enabled: bool = False
    # The DRA driver name: in ResourceSlices, DeviceClass selectors and the CDI kind
    # (<driver>/gpu). A DNS subdomain of at most 63 characters.
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
    """Everything gpushare-node is configured with."""

    node_name: str  # Kubernetes node name; default $NODE_NAME, else the lowercased hostname
    kubelet: KubeletSettings = KubeletSettings()
    state_dir: str = "/var/lib/gpushare"  # absolute; durable state (the ledger)
    run_dir: str = "/run/gpushare"  # absolute; runtime files, lost on reboot
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
        but for what an allocation is given of run_dir: a container reaching the hook or
        status socket, the ledger or a device plugin socket could ask the daemon anything
        (Allocate included)."""
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
            # Its dra.sock unprepares any claim; a spec in the CDI directory is applied by
            # the runtime to whichever container names it. Guarded only with DRA on: other
            # drivers' plugins use these directories (privileged, so node-wide).
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
        """The own paths the runtime hook is told of with ``--guard``: all but those it
        knows already (run_dir, and its socket) and those inside run_dir."""
        run_dir = os.path.normpath(self.run_dir)
        known = {run_dir, os.path.normpath(self.hook_socket)}
        return tuple(
            path
            for path in self.own_paths()
            if path not in known and not path.startswith(run_dir.rstrip("/") + "/")
        )

    def own_directories(self) -> tuple[str, ...]:
        """The directories that hold gpushare-node's own paths (run_dir, state_dir,
        kubelet's device plugin directory): a mount of one of their parents (``/run``,
        ``/var/lib/kubelet``) shows the node's runtime, kubelet's or the node's state
        wholesale, the mark of a node-wide container."""
        directories = (self.run_dir, self.state_dir, self.kubelet.device_plugin_dir)
        return tuple(os.path.normpath(d) for d in directories)
