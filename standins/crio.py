"""A container's OCI annotations exactly as CRI-O writes them for kubelet (docs/real-parts.md,
"What CRI-O writes into a container's annotations").

CRI-O builds them in this order, a later key replacing an earlier one:

1. every annotation of the pod's sandbox, i.e. the pod's own ``metadata.annotations``
   (kubelet passes them as PodSandboxConfig.annotations): whatever the pod's author wrote;
2. its own ``io.kubernetes.cri-o.*`` keys (image, container and sandbox id and name,
   container type, log path, metadata, labels and volumes as JSON, ...) and
   ``io.container.manager: cri-o``;
3. the container's annotations from kubelet (``io.kubernetes.container.hash``,
   ``restartCount``, ``terminationMessagePath``/``Policy``,
   ``io.kubernetes.pod.terminationGracePeriod``, and what device plugins returned);
4. the container's labels from kubelet, last: ``io.kubernetes.pod.name``,
   ``io.kubernetes.pod.namespace``, ``io.kubernetes.pod.uid``,
   ``io.kubernetes.container.name``; so these four name the real pod whatever step 1 said;
5. the pod's IPs as ``io.kubernetes.cri-o.IP.<n>``.

Keys of containerd's family (``io.kubernetes.cri.*``) are never written by CRI-O: they are
there only when the pod's author put them in step 1.
"""

from __future__ import annotations

import json
import uuid

# Step 4: what gpushare-hook reads under CRI-O (--runtime cri-o).
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_NAME = "io.kubernetes.pod.name"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"
# containerd's family, as a hostile pod's own annotations would carry it.
CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
CRI_NAME = "io.kubernetes.cri.sandbox-name"
CRI_UID = "io.kubernetes.cri.sandbox-uid"
CRI_CONTAINER = "io.kubernetes.cri.container-name"


def containerd_family(namespace: str, pod: str, container: str) -> dict[str, str]:
    """containerd's identity keys naming ``namespace/pod/container`` (as pod annotations)."""
    return {CRI_NAMESPACE: namespace, CRI_NAME: pod, CRI_CONTAINER: container}


def container_annotations(
    namespace: str,
    pod: str,
    container: str,
    container_id: str,
    pod_annotations: dict[str, str] | None = None,
    pod_uid: str | None = None,
) -> dict[str, str]:
    """The OCI annotations CRI-O gives container ``container`` (id ``container_id``) of pod
    ``namespace/pod`` whose own annotations are ``pod_annotations`` (see the module)."""
    uid = pod_uid or str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{pod}"))
    sandbox_id = uuid.uuid5(uuid.NAMESPACE_URL, f"sandbox/{uid}").hex * 2
    labels = {
        CONTAINER_NAME: container,
        POD_NAME: pod,
        POD_NAMESPACE: namespace,
        POD_UID: uid,
    }
    kube = {
        "io.kubernetes.container.hash": "6f3ae7c1",
        "io.kubernetes.container.restartCount": "0",
        "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
        "io.kubernetes.container.terminationMessagePolicy": "File",
        "io.kubernetes.pod.terminationGracePeriod": "30",
    }
    storage = "/var/lib/containers/storage"
    annotations = dict(pod_annotations or {})  # step 1
    annotations.update(
        {
            "io.kubernetes.cri-o.Image": "docker.io/library/busybox:1.36",
            "io.kubernetes.cri-o.ImageName": "docker.io/library/busybox:1.36",
            "io.kubernetes.cri-o.ImageRef": "sha256:" + "ab" * 32,
            "io.kubernetes.cri-o.Name": f"k8s_{container}_{pod}_{namespace}_{uid}_0",
            "io.kubernetes.cri-o.ContainerID": container_id,
            "io.kubernetes.cri-o.SandboxID": sandbox_id,
            "io.kubernetes.cri-o.SandboxName": f"k8s_{pod}_{namespace}_{uid}_0",
            "io.kubernetes.cri-o.ContainerType": "container",
            "io.kubernetes.cri-o.LogPath": "/var/log/pods/"
            + f"{namespace}_{pod}_{uid}/{container}/0.log",
            "io.kubernetes.cri-o.TTY": "false",
            "io.kubernetes.cri-o.Stdin": "false",
            "io.kubernetes.cri-o.StdinOnce": "false",
            "io.kubernetes.cri-o.ResolvPath": "/run/containers/storage/overlay-containers/"
            + f"{sandbox_id}/userdata/resolv.conf",
            "io.container.manager": "cri-o",
            "io.kubernetes.cri-o.MountPoint": f"{storage}/overlay/{container_id}/merged",
            "io.kubernetes.cri-o.SeccompProfilePath": "RuntimeDefault",
            "io.kubernetes.cri-o.Created": "2026-11-27T10:00:00.000000000Z",
            "io.kubernetes.cri-o.Metadata": json.dumps({"name": container}),
            "io.kubernetes.cri-o.Labels": json.dumps(labels),
            "io.kubernetes.cri-o.Volumes": "[]",
            "io.kubernetes.cri-o.Annotations": json.dumps(kube),
        }
    )  # step 2
    annotations.update(kube)  # step 3
    annotations.update(labels)  # step 4
    annotations["io.kubernetes.cri-o.IP.0"] = "10.88.0.7"  # step 5
    return annotations
