"""The pure logic of GPU sharing: data types and decisions, no I/O.

- ``deviceids``: device IDs of the three resources, and the card each names;
- ``model``: the allocation record;
- ``placement``: the one card that fits a container's memory and share;
- ``reconcile``: the ledger compared with kubelet's PodResources record;
- ``envs``: the env an Allocate response gives a container;
- ``podmatch``: which container kubelet is admitting;
- ``extenderchoice``: the scheduler extender's card choice, and whether to believe it;
- ``containercheck``, ``speccheck``, ``podtie``: a container's env, OCI spec and pod
  checked against its allocation;
- ``violations``: which GPU processes break their quota, and which to kill;
- ``isolation``: how far the node really isolates an allocation;
- ``statusdoc``: the status document;
- ``invariants``: the ledger's invariants;
- ``cdi``, ``claims``, ``slices``, ``quantity``: DRA: the CDI spec a claim gets, what a
  claim asks, the node's ResourceSlice, resource quantities;
- ``fdbudget``: whether the open-file limit holds what the daemon may need.

Everything here is a function of its arguments: no clock, no files, no sockets, no
threads.

What it must not do: import ``os``, ``socket``, ``subprocess``, ``sqlite3``,
gRPC, pynvml or any other nodemgr package but ``nodemgr.errors`` (import-linter
enforces it); read the time (callers pass ``now``).
"""
