"""CUDA client processes for the GPU tests: a Python program (torch) started with a given
environment, talked to over its stdin and stdout, ended by closing its stdin."""

from __future__ import annotations

import subprocess
import sys


def start_client(code: str, env: dict) -> subprocess.Popen:
    """``code`` run by this Python (the one with torch) with ``env``; pipes on all three."""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> str:
    """Close the client's stdin (it then exits) and return what it printed; it must exit 0."""
    if proc.stdin is not None:
        proc.stdin.close()
        proc.stdin = None  # communicate() would flush it
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out
