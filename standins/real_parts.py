"""NVIDIA's real MPS control binary and NVML library, for the contract tests.

``scripts/setup-real-parts`` fetches them from Debian's non-free archive
(packages ``nvidia-cuda-mps`` and ``libnvidia-ml1``, driver 535) and unpacks
them into a cache outside the checkout (``$GPUSHARE_REAL_PARTS_DIR``, default
/var/cache/gpushare-real-parts). Both run without a GPU. ``find`` runs that
script once per test session (fast once cached: no network) and reads the paths
it prints. Tests that need the parts call ``require``: it skips with the
script's reason where they cannot be had (no root, no apt, no network), except
where GPUSHARE_REQUIRE_REAL_PARTS=1 (CI): there it fails, so CI never passes by
skipping them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest

from standins.paths import REPO
from standins.setup_script import run_setup

SETUP = os.path.join(REPO, "scripts", "setup-real-parts")
SETUP_TIMEOUT_SECONDS = 600


@dataclass(frozen=True)
class RealParts:
    version: str  # the nvidia-cuda-mps package version, e.g. 535.261.03-1
    mps_control: str  # path of nvidia-cuda-mps-control
    nvml_lib: str  # path of libnvidia-ml.so.1

    @property
    def nvml_dir(self) -> str:
        return os.path.dirname(self.nvml_lib)


@functools.cache
def find() -> RealParts | str:
    """The real parts, or why they cannot be had here (one line)."""
    values = run_setup(SETUP, SETUP_TIMEOUT_SECONDS)
    if isinstance(values, str):
        return values
    try:
        parts = RealParts(
            values["GPUSHARE_REAL_PARTS_VERSION"],
            values["GPUSHARE_REAL_MPS_CONTROL"],
            values["GPUSHARE_REAL_NVML_LIB"],
        )
    except KeyError as e:
        return f"scripts/setup-real-parts printed no {e.args[0]}"
    if not os.access(parts.mps_control, os.X_OK):
        return f"{parts.mps_control} is missing or not executable"
    if not os.path.isfile(parts.nvml_lib):
        return f"{parts.nvml_lib} is missing"
    return parts


def require() -> RealParts:
    """The real parts; skips the test where they cannot be had (fails under CI)."""
    found = find()
    if isinstance(found, RealParts):
        return found
    reason = f"NVIDIA's real MPS binary and NVML library are not available: {found}"
    if os.environ.get("GPUSHARE_REQUIRE_REAL_PARTS") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_REAL_PARTS=1 but {reason}")
    pytest.skip(reason)
