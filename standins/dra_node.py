"""A node with the DRA front door on, for end-to-end tests: the real gpushare-node with
dra.enabled, the test API server (resource.k8s.io/v1), kubelet's DRA side
(standins/kubelet_dra.py) and its device plugin side (standins/kubelet_sim.py),
in one short directory (unix socket paths stay under 108 bytes)."""

from __future__ import annotations

import json
import os

from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import CORE, MEMORY, MPS_STANDIN, WHOLE, Node
from standins.kubelet_dra import ApiAccess, DraKubelet
from standins.kubelet_sim import ContainerSpec, TestKubelet

DRIVER = "gpushare.aliyun.com"
NODE = "node-a"
SHARED_CLASS = "gpu.gpushare.aliyun.com"


class DraCluster:
    """The daemon with DRA on, the test API server, kubelet's DRA side and its device
    plugin side (both doors), in one short directory."""

    def __init__(
        self,
        wiping_delay: float = 30.0,
        driver: str = DRIVER,
        cdi_dir: str | None = None,
        control_binary: str = MPS_STANDIN,
    ):
        """``driver`` and ``cdi_dir`` (default: a directory of the node's own) as the
        config's dra.driver and dra.cdi_dir; ``control_binary``: the MPS control binary
        (the stand-in, or NVIDIA's real one from standins.real_parts)."""
        self.driver = driver
        self.api = TestApiServer()
        self.api.start()
        self.api.add_node(NODE)
        self.node = Node(control_binary)
        root = self.node.root
        self.registry = os.path.join(root, "plugins_registry")
        self.cdi_dir = cdi_dir or os.path.join(root, "cdi")
        kubeconfig = self.api.write_kubeconfig(os.path.join(root, "kubeconfig"))
        dra = {
            "enabled": True,
            "driver": driver,
            "plugins_registry_dir": self.registry,
            "plugins_dir": os.path.join(root, "plugins"),
            "cdi_dir": self.cdi_dir,
        }
        self.node.rewrite_config(lambda c: c.update(kubernetes={"kubeconfig": kubeconfig}, dra=dra))
        self.kubelet = TestKubelet(self.node.device_plugin_dir, self.node.pod_resources_socket)
        self.dra = DraKubelet(
            self.registry, ApiAccess(self.api.url, self.api.token), NODE, poll_interval=0.05,
            wiping_delay=wiping_delay,
        )  # fmt: skip
        self.api.add_device_class(SHARED_CLASS, [f'device.driver == "{driver}"'])

    def start(self) -> None:
        self.kubelet.start()
        self.dra.start()
        self.kubelet.attach_dra(self.dra)  # PodResources lists the DRA pods; restart() both
        self.node.start()
        for resource in (MEMORY, CORE, WHOLE):
            self.kubelet.wait_for_resource(resource, timeout=20)
        self.dra.wait_registered(self.driver, timeout=15)
        self.wait_slice()

    def wait_slice(self, predicate=lambda s: len(s["spec"]["devices"]) == 2, timeout=15.0):
        """The node's one slice once ``predicate`` holds (by default: both cards offered,
        which they are once their MPS is up)."""

        def found():
            slices = self.api.resource_slices(NODE)
            return slices[0] if len(slices) == 1 and predicate(slices[0]) else None

        return self.node.wait_for(found, timeout, "the node's ResourceSlice")

    def claimed_pod(self, pod, claim, capacity=None, containers=None):
        """A pod with one claim from the shared class asking ``capacity``, allocated by
        the scheduler from the stored slices and reserved for the pod."""
        request = {"name": "gpu", "deviceClassName": SHARED_CLASS}
        if capacity:
            request["capacity"] = capacity
        self.api.add_resource_claim("ns", claim, [request])
        containers = containers or [{"name": "main", "claims": [{"name": claim}]}]
        claims = [{"name": claim, "resourceClaimName": claim}]
        created = self.api.add_pod("ns", pod, NODE, containers=containers, resource_claims=claims)
        self.api.allocate_claim("ns", claim, NODE, created)
        return created

    def dp_admit(self, pod, requests):
        """A device plugin pod (one container ``main``), bound in the API, then admitted."""
        self.api.add_pod("ns", pod, NODE, containers=[
            {"name": "main", "requests": {r: str(q) for r, q in requests.items()}}])  # fmt: skip
        result = self.kubelet.admit_pod("ns", pod, [ContainerSpec("main", requests)])
        if result.ok:
            self.kubelet.start_container("ns", pod, "main")
        return result

    def claim(self, name):
        return self.api.resource_claim("ns", name)

    def cdi_spec(self, claim_name):
        uid = self.claim(claim_name)["metadata"]["uid"]
        with open(os.path.join(self.cdi_dir, f"{self.driver}-gpu_{uid}.json")) as f:
            return json.load(f)

    def close(self):
        self.dra.stop()
        self.kubelet.stop()
        self.node.cleanup()
        self.api.stop()
