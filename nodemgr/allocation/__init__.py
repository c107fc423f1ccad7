"""The allocation state: which container holds how much of which card.

- ``allocator``: the one owner of the state, behind one lock: every change is
  made there; what the gRPC servicer (``resources.ResourceManager``), the
  enforcement (their own narrow Protocols) and the status readers ask of it;
- ``ledger``: the durable SQLite record, one transaction per change, and its
  committed image in memory, which holds the allocations once (the allocator
  reads them there under its lock);
- ``resources``: that narrow interface of the device plugin servers;
- ``admission``: which container is asking, and the carry-over of a container's
  second shared resource to the card its first one chose;
- ``usage``: per-card sums of what is allocated, kept change by change;
- ``backlog``: what the next reconcile must judge (what changed since the
  last one), so that its cost follows the changes, not the allocations held;
- ``recovery``: a ledger made at this start takes back the running
  containers' registrations and allocation IDs;
- ``claims``: DRA claims' allocations placed on free device IDs, and the narrow
  interface the DRA driver sees (``ClaimLedger``);
- ``ledgerfile``: the ledger file's schema, its rows as SQL, and what can be told
  about a file;
- ``audit``: a ledger on disk judged against its invariants (``nodemgr
  check-ledger``, doctor).

What it must not do: speak gRPC, Kubernetes or NVML itself (it is handed
cards, a pod source, kubelet's record and the cgroup marks); do anything slow
while holding its lock.
"""
