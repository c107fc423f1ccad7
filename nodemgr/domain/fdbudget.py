"""Whether the daemon's open-file limit holds what it may need at once (pure arithmetic).

Every listener has a connection cap, one descriptor per connection. The caps, what was
open at start and a reserve no listener may take must fit the soft RLIMIT_NOFILE, else
the daemon refuses to start rather than run where a flood of connections could leave
enforcement without a descriptor.
"""

from __future__ import annotations

from collections.abc import Mapping

# Descriptors no listener may take: the watchdog (a /proc file and a pidfd at a time),
# MPS supervision (a control command's pipes per card), the kubelet and Kubernetes API
# clients, the ledger, the systemd notify socket, and room to spare for what a library
# opens on its own.
RESERVE = 256


def needed(open_at_start: int, caps: Mapping[str, int], reserve: int = RESERVE) -> int:
    return open_at_start + sum(caps.values()) + reserve


def shortfall(
    limit: int, open_at_start: int, caps: Mapping[str, int], reserve: int = RESERVE
) -> str | None:
    """Why ``limit`` (the soft RLIMIT_NOFILE) is too small; None when it holds all."""
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
