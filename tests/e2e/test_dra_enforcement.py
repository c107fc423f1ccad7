"""The same enforcement for a DRA claim as for a device plugin allocation, with real runc
containers and the real gpushare-node: the container is made from the claim's CDI spec
(its env and mounts, as the runtime applies them; podman's own CDI injection is
tests/engines/test_podman_cdi.py), the runtime hook ties it to the claim through
kubelet's PodResources ``dynamic_resources`` (the test kubelet's DRA side), a container
of a pod not holding the claim is refused it, and the watchdog kills a process over the
claim's memory, summed over the claim's containers."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.harness import runc_env
from tests.harness.apiserver_sim import TestApiServer
from tests.harness.daemon_proc import CORE, MEMORY, Node
from tests.harness.kubelet_dra import ApiAccess, DraKubelet
from tests.harness.kubelet_sim import TestKubelet

pytestmark = pytest.mark.e2e

DRIVER = "gpushare.aliyun.com"
NODE = "node-a"
CLASS = "gpu.gpushare.aliyun.com"


class DraEnforcementNode:
    def __init__(self):
        runc_env.require()
        self.api = TestApiServer()
        self.api.start()
        self.api.add_node(NODE)
        self.api.add_device_class(CLASS, [f'device.driver == "{DRIVER}"'])
        self.node = Node()
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
        self.kubelet = TestKubelet(self.node.device_plugin_dir, self.node.pod_resources_socket)
        self.dra = DraKubelet(registry, ApiAccess(self.api.url, self.api.token), NODE, 0.05)
        self.kubelet.start()
        self.dra.start()
        self.kubelet.attach_dra(self.dra)
        self.node.start()
        self.kubelet.wait_for_resource(MEMORY, timeout=30)
        self.kubelet.wait_for_resource(CORE, timeout=30)
        self.dra.wait_registered(DRIVER, timeout=15)
        self.node.wait_for(
            lambda: [s for s in self.api.resource_slices(NODE) if len(s["spec"]["devices"]) == 2],
            15,
            "the slice offering both cards (once their MPS is up)",
        )
        self.runtime = runc_env.Runtime(root, os.path.join(root, "run", "hook.sock"))

    def set_usage(self, processes):
        document = {"processes": [{"pid": p, "gpu": g, "used_mib": m} for p, g, m in processes]}
        with open(self.usage_file + ".tmp", "w") as f:
            json.dump(document, f)
        os.replace(self.usage_file + ".tmp", self.usage_file)

    def prepared_pod(self, pod, claim, capacity, claims_of_pod=None):
        """A pod using ``claim`` (made and allocated unless it exists), prepared by kubelet;
        the claim's CDI env and mounts."""
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
        result = self.dra.prepare_pod(created)
        assert result.ok, result.error
        uid = self.api.resource_claim("default", claim)["metadata"]["uid"]
        with open(os.path.join(self.cdi_dir, f"{DRIVER}-gpu_{uid}.json")) as f:
            [device] = json.load(f)["devices"]
        edits = device["containerEdits"]
        env = dict(entry.split("=", 1) for entry in edits["env"])
        mounts = [(m["containerPath"], m["hostPath"]) for m in edits["mounts"]]
        return env, mounts

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


@pytest.fixture
def cluster():
    cluster = DraEnforcementNode()
    yield cluster
    cluster.close()


def wait_gone(pid, seconds):
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not runc_env.running(pid):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def test_a_claims_container_is_tied_to_it_and_killed_over_its_memory(cluster):
    """Made from the claim's CDI spec in the claim's pod: registered on the claim's
    allocation. Over 4 GiB (the claim's consumed memory): killed within 2 s."""
    env, mounts = cluster.prepared_pod("train", "c1", {"memory": "4Gi", "cores": "30"})
    done = cluster.start_in_pod("train", "train", env, mounts)
    assert done.returncode == 0, done.stdout
    [allocation] = cluster.node.allocations()
    assert allocation["containers"] == ["train"] and allocation["claim"]["name"] == "c1"
    pid = cluster.runtime.pid("train")
    card = env["NVIDIA_VISIBLE_DEVICES"]
    cluster.set_usage([(pid, card, 4096)])
    assert wait_gone(pid, 2.5) is None
    cluster.set_usage([(pid, card, 5000)])
    took = wait_gone(pid, 5)
    assert took is not None and took < 2.0, took
    cluster.node.wait_for(lambda: f"killed process {pid}" in cluster.node.log(), what="the kill")


def test_a_container_of_a_pod_without_the_claim_is_refused_it(cluster):
    """The claim's env copied into another pod's container: kubelet's record does not
    list that pod with the claim's device, so the hook refuses it."""
    env, mounts = cluster.prepared_pod("train", "c1", {"memory": "2Gi"})
    done = cluster.start_in_pod("thief", "thief", env, mounts)
    assert done.returncode != 0
    assert "not to pod default/thief" in done.stdout


def test_a_claim_shared_by_two_pods_ties_both_and_sums_their_memory(cluster):
    """One claim reserved for two pods: both pods' containers are tied to it, and its
    4 GiB is their sum: together over it, the newest process is killed."""
    env, mounts = cluster.prepared_pod("a", "shared", {"memory": "4Gi"})
    env_b, mounts_b = cluster.prepared_pod("b", "shared", {"memory": "4Gi"})
    assert env_b == env
    assert cluster.start_in_pod("a", "a", env, mounts).returncode == 0
    assert cluster.start_in_pod("b", "b", env_b, mounts_b).returncode == 0
    [allocation] = cluster.node.allocations()
    assert sorted(allocation["containers"]) == ["a", "b"]
    card = env["NVIDIA_VISIBLE_DEVICES"]
    first, second = cluster.runtime.pid("a"), cluster.runtime.pid("b")
    cluster.set_usage([(first, card, 3000), (second, card, 2000)])
    assert wait_gone(second, 5) is not None
    assert runc_env.running(first)
