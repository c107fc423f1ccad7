"""CUDA client processes for the GPU tests: a Python program (torch) started with a given
environment (``client_env``: a card and an MPS pipe directory), talked to over its stdin and
stdout, ended by closing its stdin."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from mps import CardDaemon


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


def client_env(daemon: CardDaemon | None, pipe_dir: str | None = None, **env: str) -> dict:
    """A client's environment: the card by UUID, the MPS pipe directory (``pipe_dir``,
    else the daemon's; with no daemon, an empty directory: the client runs outside MPS)."""
    if pipe_dir is None:
        pipe_dir = daemon.pipe_dir if daemon is not None else tempfile.mkdtemp(prefix="nomps-")
    card = daemon.card_uuid if daemon is not None else env.pop("CUDA_VISIBLE_DEVICES")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": card, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir, **env}
