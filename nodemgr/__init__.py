"""gpushare-node: the node daemon that lets Kubernetes containers share GPUs.

The package is the daemon (``gpushare-node``) and its CLI (``nodemgr``):
configuration, GPU inventory, the durable allocation ledger, placement, the
kubelet device plugin servers and the kubelet clients.

Layers (enforced by import-linter, see pyproject.toml), top to bottom:
daemon/cli wire things together; plugin translates gRPC to calls on the
allocator; kubelet holds the kubelet clients; allocator owns the allocation
state; ledger and inventory do storage and GPU I/O; placement, reconcile and
deviceids are pure logic with no I/O; config and errors are plain data.

What it must not do: import pynvml anywhere but ``nodemgr.inventory.nvml``;
call anything slow (network, API server, subprocess) on the Allocate path.
"""
