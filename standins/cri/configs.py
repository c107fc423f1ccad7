"""The CRI v1 messages kubelet sends for a pod: its sandbox config and its containers' configs.

Built as kubelet's kuberuntime manager does (generatePodSandboxConfig,
generateContainerConfig), reduced to what a test pod on the host network
needs: the pod's identity in metadata and labels, its cgroup parent
(cgroupfs driver: ``/kubepods/besteffort/pod<uid>``), and for each container
the envs, mounts, devices and annotations of the device plugins' Allocate
answers. A host-network sandbox gets no hostname (the runtime uses the
node's). Runtimes add their own OCI annotations from these (containerd:
``io.kubernetes.cri.sandbox-namespace`` ...), which the runtime hook reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from standins.cri.api import runtime_v1_pb2 as cri

# kubelet's labels (pkg/kubelet/types/labels.go).
POD_NAME = "io.kubernetes.pod.name"
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"
CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_parent(uid: str) -> str:
    """The pod's cgroup under kubelet's cgroupfs driver, for a BestEffort pod."""
    return f"/kubepods/besteffort/pod{uid}"


def remove_pod_cgroups(uid: str) -> None:
    """Remove the pod's cgroup in every hierarchy, as kubelet does once the runtime removed
    the pod (runc removes only each container's), then kubelet's parents while they are
    empty. A cgroup still in use (not empty) is left alone."""
    for hierarchy in os.listdir(CGROUP_ROOT):
        pod = os.path.join(CGROUP_ROOT, hierarchy) + cgroup_parent(uid)
        for path in (pod, os.path.dirname(pod), os.path.dirname(os.path.dirname(pod))):
            try:
                os.rmdir(path)
            except OSError:
                break  # busy or gone: leave it and its parents


def _host_network() -> cri.NamespaceOption:
    return cri.NamespaceOption(
        network=cri.NamespaceMode.NODE, pid=cri.NamespaceMode.CONTAINER, ipc=cri.NamespaceMode.POD
    )


def sandbox_config(namespace: str, name: str, uid: str, log_root: str) -> cri.PodSandboxConfig:
    """A host-network pod's sandbox config; its logs under ``log_root``."""
    log_directory = os.path.join(log_root, f"{namespace}_{name}_{uid}")
    os.makedirs(log_directory, exist_ok=True)
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
        log_directory=log_directory,
        labels={POD_NAME: name, POD_NAMESPACE: namespace, POD_UID: uid},
        annotations={"kubernetes.io/config.source": "api", "kubernetes.io/config.seen": "test"},
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent(uid),
            security_context=cri.LinuxSandboxSecurityContext(namespace_options=_host_network()),
        ),
    )


def container_config(
    sandbox: cri.PodSandboxConfig,
    name: str,
    image: str,
    command: Iterable[str],
    envs: Mapping[str, str] = (),
    mounts: Iterable = (),
    devices: Iterable = (),
    annotations: Mapping[str, str] = (),
) -> cri.ContainerConfig:
    """A container of ``sandbox``'s pod. ``mounts`` and ``devices``: the device plugin's
    ``Mount`` and ``DeviceSpec`` messages (or anything with the same fields)."""
    envs = dict(envs)
    return cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name, attempt=0),
        image=cri.ImageSpec(image=image),
        command=list(command),
        # KeyValue.value is bytes in the newest proto (string before; same wire format).
        envs=[cri.KeyValue(key=key, value=value.encode()) for key, value in envs.items()],
        mounts=[
            cri.Mount(container_path=m.container_path, host_path=m.host_path, readonly=m.read_only)
            for m in mounts
        ],
        devices=[
            cri.Device(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in devices
        ],
        labels={
            CONTAINER_NAME: name,
            POD_NAME: sandbox.metadata.name,
            POD_NAMESPACE: sandbox.metadata.namespace,
            POD_UID: sandbox.metadata.uid,
        },
        annotations={"io.kubernetes.container.restartCount": "0", **dict(annotations)},
        log_path=f"{name}/0.log",
        linux=cri.LinuxContainerConfig(
            security_context=cri.LinuxContainerSecurityContext(namespace_options=_host_network())
        ),
    )
