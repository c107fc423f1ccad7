"""gpushare-node: the node daemon that lets Kubernetes containers share GPUs.

The package is the daemon (``gpushare-node``) and its CLI (``nodemgr``),
one sub-package per flow. Layers, top to bottom (enforced by import-linter,
see pyproject.toml; a package may import only those below it):

- ``extender``: ``gpushare-scheduler``, the cluster side, a top layer of its own
  beside ``runtime`` and ``cli``;
- ``runtime``, ``cli``: the daemon (argv, signals, wiring, systemd notify) and the
  operator's command line;
- ``status``: the status socket and the metrics endpoint;
- ``dra``: the DRA kubelet plugin (on kubelet's plugin API and loop);
- ``kubelet``, ``enforcement``, ``kubernetes``, ``supervision``: the four
  edges of the daemon, which never import each other;
- ``allocation``: the allocation state, its ledger and admission;
- ``inventory``: the GPUs (NVML or simulated);
- ``domain``: pure logic and data, no I/O;
- ``config``, ``common``, ``errors``: the configuration; small building blocks
  (worker lifecycle, change notification, unix servers); the error hierarchy.

What it must not do: import pynvml anywhere but ``nodemgr.inventory.nvml``,
the kubernetes client anywhere but ``nodemgr.kubernetes``, prometheus_client
anywhere but ``nodemgr.status.metrics``; call anything slow (network, API
server, subprocess) on the Allocate path.
"""
