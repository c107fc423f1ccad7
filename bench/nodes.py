"""The simulated node the benchmarks run on: 8 NVIDIA H200 cards (141 GiB each).

An H200 node is the largest common case for the device list (141 GiB of
memory units per card) and for MPS (48 clients per card); ``h200_cards(n)``
and ``h200_node(cards=n)`` give other card counts (bench/scale.py). The daemon
is the real ``gpushare-node`` process (standins/daemon_proc.py); cards are
simulated and MPS runs through the stand-in control binary, as in the
end-to-end tests.
``H200_CARDS`` carry the NUMA node a real board reports (the ListAndWatch
sizing uses them); the simulated backend reports none.
"""

from __future__ import annotations

import os

import yaml

from bench.apiserver_process import ApiServerProcess
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.inventory import Card
from nodemgr.runtime.loop import SOCKET_NAMES
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import MPS_STANDIN, Node

H200_MEMORY_MIB = 141 * 1024  # 144384 MiB
CARD_COUNT = 8
CARDS_PER_NUMA_NODE = 4


def h200_cards(count: int = CARD_COUNT) -> list[Card]:
    """``count`` H200 cards, four per NUMA node as on an HGX H200 board (two sockets
    of four): the device list carries each device's NUMA node, which adds to its size."""
    return [
        Card(
            index=i,
            uuid=f"GPU-{i:08x}-4a1c-4e6b-9d2f-{0x200B0000 + i:012x}",
            name="NVIDIA H200",
            memory_mib=H200_MEMORY_MIB,
            numa_node=i // CARDS_PER_NUMA_NODE,
        )
        for i in range(count)
    ]


H200_CARDS = h200_cards()


def h200_node(
    production_intervals: bool = False,
    kubelet: dict | None = None,
    resources: dict | None = None,
    mps: dict | None = None,
    api: TestApiServer | ApiServerProcess | None = None,
    control_binary: str = MPS_STANDIN,
    cards: int = CARD_COUNT,
    name: str | None = None,
) -> Node:
    """A Node (not started) with ``cards`` H200 cards (8 by default), named ``name``
    (default: the harness's node-a; two daemons on one test API server need two names).

    The test config speeds up reconcile and MPS health checks;
    ``production_intervals`` puts the defaults back (what idle cost is about).
    ``kubelet``, ``resources`` and ``mps`` are merged into those sections.
    With ``api`` (a started test API server) the daemon's Kubernetes adapter talks
    to it; without, the adapter is off (``kubernetes.enabled: false``): a plain
    device plugin, not one that keeps trying an API server that is not there.
    ``control_binary``: the MPS control binary (NVIDIA's real one for bench/mps_probe.py).
    """
    devices = [
        {"uuid": c.uuid, "name": c.name, "memory_mib": c.memory_mib} for c in h200_cards(cards)
    ]
    node = Node(control_binary, gpus={"backend": "simulated", "simulated": {"devices": devices}})

    def change(config: dict) -> None:
        if production_intervals:
            config["kubelet"].pop("reconcile_interval_seconds")
            config["kubelet"].pop("allocation_grace_seconds")
            config["mps"].pop("health_check_interval_seconds")
            config["mps"].pop("command_timeout_seconds")
        config["kubelet"].update(kubelet or {})
        config.setdefault("resources", {}).update(resources or {})
        config["mps"].update(mps or {})
        config["kubernetes"] = {"enabled": False}
        if name is not None:
            config["node_name"] = name

    node.rewrite_config(change)
    if api is not None:
        api.add_node(node_name(node))
        kubeconfig = api.write_kubeconfig(os.path.join(node.root, "kubeconfig"))
        node.rewrite_config(lambda c: c.update(kubernetes={"kubeconfig": kubeconfig}))
    return node


def node_name(node: Node) -> str:
    with open(node.config_path) as f:
        return yaml.safe_load(f)["node_name"]


def plugin_socket(node: Node, kind: ResourceKind) -> str:
    """Where the daemon serves ``kind`` (kubelet learns it at registration)."""
    return os.path.join(node.device_plugin_dir, SOCKET_NAMES[kind])
