"""SIGHUP: which keys a running daemon applies from a re-read config file.

Pure. A key outside ``RELOADABLE_KEYS`` keeps its running value until a restart, so
the daemon never runs half-changed.
"""

import dataclasses
from typing import Any

from nodemgr.config.schema import Settings
from nodemgr.config.values import join_key

__all__ = [
    "RELOADABLE_KEYS",
    "reload_settings",
]

RELOADABLE_KEYS = frozenset(
    {
        "kubelet.reconcile_interval_seconds",
        "kubelet.allocation_grace_seconds",
        "mps.health_check_interval_seconds",
        "enforcement.action",
        "enforcement.interval_seconds",
        "enforcement.grace_mib",
    }
)


def reload_settings(running: Settings, loaded: Settings) -> tuple[Settings, list[str], list[str]]:
    """(settings now in force, keys applied, keys that need a restart)."""
    applied: list[str] = []
    restart: list[str] = []

    def merge(key: str, old: Any, new: Any) -> Any:
        if old == new:
            return old
        if (
            dataclasses.is_dataclass(old)
            and not isinstance(old, type)
            and key not in RELOADABLE_KEYS
        ):
            changes = {
                f.name: merge(join_key(key, f.name), getattr(old, f.name), getattr(new, f.name))
                for f in dataclasses.fields(old)
            }
            return dataclasses.replace(old, **changes)
        if key in RELOADABLE_KEYS:
            applied.append(key)
            return new
        restart.append(key)
        return old

    return merge("", running, loaded), applied, restart
