"""The allocation state: which container holds how much of which card.

- ``allocator``: the one owner of the state, behind one lock; what the gRPC
  servicer, the enforcement and the status readers ask of it;
- ``admission``: the carry-over of a container's second shared resource to
  the card its first one chose;
- ``usage``: per-card sums of what is allocated;
- ``claims``: DRA claims' allocations placed on free device IDs, and the narrow
  interface the DRA driver sees (``ClaimLedger``);
- ``ledger``: the durable SQLite record, written in one transaction per change.

What it must not do: speak gRPC, Kubernetes or NVML itself (it is handed
cards and a pod source); do anything slow while holding its lock.
"""
