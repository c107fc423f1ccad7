"""A node with the DRA front door on and real runc containers made from claims' CDI specs.

The real gpushare-node with dra.enabled against the test API server, kubelet's DRA side
(standins/kubelet_dra.py) and its device plugin side (standins/kubelet_sim.py),
simulated per-process GPU memory (a usage file), and runc with the shipped hook. A claim's
container is made from its CDI spec (its env and mounts, as the runtime applies them) in
its pod, with the pod's CRI identity, so the hook ties it to the claim through kubelet's
PodResources ``dynamic_resources``.

Shared by the DRA enforcement tests (tests/e2e/test_dra_enforcement.py) and the DRA
sockets' floods (tests/hostile/test_exhaustion.py).
"""

from __future__ import annotations

import json
import os

from standins import runc_env
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import CORE, MEMORY, MPS_STANDIN, Node
from standins.kubelet_dra import ApiAccess, DraKubelet
from standins.kubelet_sim import ContainerSpec, TestKubelet

DRIVER = "gpushare.aliyun.com"
NODE = "node-a"
CLASS = "gpu.gpushare.aliyun.com"


class DraEnforcementNode:
    def __init__(self, control_binary: str = MPS_STANDIN, nofile: int | None = None):
        """``control_binary``: the MPS control binary (the stand-in, or NVIDIA's real one);
        ``nofile``: the daemon's RLIMIT_NOFILE (Node.start), None: this process's."""
        runc_env.require()
        self.api = TestApiServer()
        self.api.start()
        self.api.add_node(NODE)
        self.api.add_device_class(CLASS, [f'device.driver == "{DRIVER}"'])
        self.node = Node(control_binary)
        root = self.node.root
        self.usage_file = os.path.join(root, "usage.json")
        self.set_usage([])
        self.cdi_dir = os.path.join(root, "cdi")
        registry = os.path.join(root, "plugins_registry")
        kubeconfig = self.api.write_kubeconfig(os.path.join(root, "kubeconfig"))
        dra = {"enabled": True, "plugins_registry_dir": registry,
               "plugins_dir": os.path.join(root, "plugins"), "cdi_dir": self.cdi_dir}  # fmt: skip

        def configure(c):
            c["gpus"]["simulated"]["usage_file"] = self.usage_file
            c.update(kubernetes={"kubeconfig": kubeconfig}, dra=dra)

        self.node.rewrite_config(configure)
        self.hook_socket = os.path.join(root, "run", "hook.sock")
        self.kubelet = TestKubelet(self.node.device_plugin_dir, self.node.pod_resources_socket)
        self.dra = DraKubelet(registry, ApiAccess(self.api.url, self.api.token), NODE, 0.05)
        self.kubelet.start()
        self.dra.start()
        self.kubelet.attach_dra(self.dra)
        self.node.start(nofile=nofile)
        self.kubelet.wait_for_resource(MEMORY, timeout=30)
        self.kubelet.wait_for_resource(CORE, timeout=30)
        self.dra.wait_registered(DRIVER, timeout=15)
        self.node.wait_for(
            lambda: [s for s in self.api.resource_slices(NODE) if len(s["spec"]["devices"]) == 2],
            15,
            "the slice offering both cards (once their MPS is up)",
        )
        self.runtime = runc_env.Runtime(root, self.hook_socket)

    def set_usage(self, processes):
        """What the simulated GPUs report: (pid, card, MiB) per process."""
        document = {"processes": [{"pid": p, "gpu": g, "used_mib": m} for p, g, m in processes]}
        with open(self.usage_file + ".tmp", "w") as f:
            json.dump(document, f)
        os.replace(self.usage_file + ".tmp", self.usage_file)

    def prepared_pod(self, pod, claim, capacity, retry_seconds: float = 0.0):
        """A pod using ``claim`` (made and allocated unless it exists), prepared by kubelet
        (tried again for ``retry_seconds``, as kubelet retries a pod start); the claim's
        CDI env and mounts."""
        if self.api.resource_claim("default", claim) is None:
            request = {"name": "gpu", "deviceClassName": CLASS, "capacity": capacity}
            self.api.add_resource_claim("default", claim, [request])
        containers = [{"name": "main", "claims": [{"name": claim}]}]
        claims = [{"name": claim, "resourceClaimName": claim}]
        created = self.api.add_pod(
            "default", pod, NODE, containers=containers, resource_claims=claims
        )
        if (self.api.resource_claim("default", claim).get("status") or {}).get("allocation"):
            self.api.reserve_claim("default", claim, created)
        else:
            self.api.allocate_claim("default", claim, NODE, created)
        if retry_seconds:
            result = self.dra.wait_prepared(created, timeout=retry_seconds)
        else:
            result = self.dra.prepare_pod(created)
        assert result.ok, result.error
        uid = self.api.resource_claim("default", claim)["metadata"]["uid"]
        with open(os.path.join(self.cdi_dir, f"{DRIVER}-gpu_{uid}.json")) as f:
            [device] = json.load(f)["devices"]
        edits = device["containerEdits"]
        env = dict(entry.split("=", 1) for entry in edits["env"])
        mounts = [(m["containerPath"], m["hostPath"]) for m in edits["mounts"]]
        return env, mounts

    def dp_admit(self, pod, requests):
        """A device plugin pod (one container ``main``), bound in the API, then admitted
        through kubelet's device plugin side; kubelet's result."""
        self.api.add_pod("default", pod, NODE, containers=[
            {"name": "main", "requests": {r: str(q) for r, q in requests.items()}}])  # fmt: skip
        return self.kubelet.admit_pod("default", pod, [ContainerSpec("main", requests)])

    def start_in_pod(self, name, pod, env, mounts):
        annotations = runc_env.cri_annotations("default", pod, "main")
        bundle = self.runtime.bundle(name, env, mounts, annotations=annotations)
        return self.runtime.run(name, bundle)

    def close(self):
        self.runtime.cleanup()
        self.dra.stop()
        self.kubelet.stop()
        self.node.cleanup()
        self.api.stop()
