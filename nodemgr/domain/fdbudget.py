"""Whether the daemon's open-file limit holds what it may need at once (pure arithmetic).

Every listener has a connection cap (nodemgr.common.connbudget, the gRPC options of the
device plugin servers): at most that many of its connections are open at once, one file
descriptor each. What the daemon holds besides (the ledger, the netlink process events,
kubelet and API clients, the MPS control daemons' pipes, the watchdog's /proc reads and
pidfds) is what was open at start plus a reserve that no listener may take. The caps
together, what was open at start and the reserve must fit the soft RLIMIT_NOFILE; when
they do not, the daemon refuses to start, naming the numbers and the fix, rather than
run where a flood of connections could leave enforcement without a descriptor.
"""

from __future__ import annotations

from collections.abc import Mapping

# Descriptors no listener may take: the watchdog (a /proc file and a pidfd at a time),
# MPS supervision (a control command's pipes per card), the kubelet and Kubernetes API
# clients, the ledger, the systemd notify socket, and room to spare for what a library
# opens on its own.
RESERVE = 256


def needed(open_at_start: int, caps: Mapping[str, int], reserve: int = RESERVE) -> int:
    """Descriptors the daemon may hold at once: those open at start, every listener at its
    cap, and the reserve."""
    return open_at_start + sum(caps.values()) + reserve


def shortfall(
    limit: int, open_at_start: int, caps: Mapping[str, int], reserve: int = RESERVE
) -> str | None:
    """Why ``limit`` (the soft RLIMIT_NOFILE) is too small, or None when it holds all."""
    need = needed(open_at_start, caps, reserve)
    if limit >= need:
        return None
    listeners = ", ".join(f"{name} {cap}" for name, cap in sorted(caps.items()))
    return (
        f"the open-file limit (RLIMIT_NOFILE) is {limit}, under the {need} this daemon may "
        f"hold at once: {open_at_start} open at start, its listeners at their connection "
        f"caps ({listeners}) and {reserve} kept for enforcement, MPS and its clients; raise "
        f"LimitNOFILE= of the unit (`systemctl edit gpushare-node`) to {need} or more"
    )
