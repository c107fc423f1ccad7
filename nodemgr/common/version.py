"""The installed gpushare-node's version, for ``--version`` and the status document."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "gpushare-node"


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
