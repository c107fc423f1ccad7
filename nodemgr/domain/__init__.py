"""The pure logic of GPU sharing: data types and decisions, no I/O.

Device ids, the allocation model, placement of memory and share on one card,
reconciliation with kubelet's record, the env a container gets, pod matching,
the checks of a container's env and processes, violations, the status
document and the CDI spec a DRA claim gets. Everything here is a function of
its arguments: no clock, no files, no sockets, no threads.

What it must not do: import ``os``, ``socket``, ``subprocess``, ``sqlite3``,
gRPC, pynvml or any other nodemgr package but ``nodemgr.errors`` (import-linter
enforces it); read the time (callers pass ``now``).
"""
