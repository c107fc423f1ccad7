"""The daemon's open-file limit: raised to what it may be, then checked against the budget.

systemd gives a unit without ``LimitNOFILE=`` a soft limit of 1024 and a far higher hard
one; a process serving sockets to untrusted clients should raise the soft one (the
shipped unit also sets ``LimitNOFILE=``). A budget that does not fit
(nodemgr.domain.fdbudget) exits 2, as a bad config: a restart cannot fix it. The daemon
uses epoll, never select(), so descriptors above 1024 are fine.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass

from nodemgr.domain.fdbudget import RESERVE, needed, shortfall
from nodemgr.errors import GpushareError

log = logging.getLogger("gpushare-node")


class FdLimitError(GpushareError):
    """The open-file limit cannot hold what the daemon's listeners and enforcement need."""


@dataclass(frozen=True)
class FdLimit:
    soft: int  # after raising
    hard: int
    raised_from: int | None  # None: not raised
    needed: int


def prepare(caps: Mapping[str, int], reserve: int = RESERVE) -> FdLimit:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised_from = None
    if hard == resource.RLIM_INFINITY:
        target = _kernel_max()  # no process may open more than fs.nr_open
    else:
        target = hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            raised_from, soft = soft, target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    open_now = open_files()
    need = needed(open_now, caps, reserve)
    problem = shortfall(soft, open_now, caps, reserve)
    if problem is not None:
        raise FdLimitError(problem)
    log.info(
        "open-file limit %d%s (hard %s); listeners, enforcement reserve and open files "
        "need at most %d",
        soft,
        "" if raised_from is None else f", raised from {raised_from}",
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        need,
    )
    return FdLimit(soft, hard, raised_from, need)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own


def _kernel_max() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1024 * 1024
