"""Running one of scripts/setup-* for the tests: its ``GPUSHARE_*=...`` lines, or why not.

Every real-part setup script prints eval-able ``GPUSHARE_NAME=value`` lines on
success and one line on stderr saying why on failure; this reads either.
"""

from __future__ import annotations

import os
import subprocess


def run_setup(script: str, timeout_seconds: float) -> dict[str, str] | str:
    """The ``GPUSHARE_*`` assignments ``script`` printed, or why it failed (one line)."""
    name = os.path.relpath(script, os.path.dirname(os.path.dirname(script)))
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=timeout_seconds)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{name} did not run: {e}"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return dict(
        line.split("=", 1) for line in done.stdout.splitlines() if line.startswith("GPUSHARE_")
    )
