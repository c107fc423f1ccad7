"""Pins standins.paths, and that the stand-ins ship with the project's distribution.

``paths.REPO`` is the checkout (what the harnesses of scripts/, hooks/ and deploy/ read)
and ``paths.MPS_STANDIN`` the stand-in control binary beside its server. Built into a
wheel as ``pip`` builds it and installed (not editable) into a directory of its own, the
package carries its stand-ins as package data: the MPS stand-in binaries (executable,
``MPS_STANDIN`` pointing at the installed copy, which runs as a control daemon), the
CRI proto and stubs, and the test kubelet that scripts/demo-kubelet imports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from standins import paths

# What the project's wheel is built from (pyproject.toml's packages and the files its
# metadata names); the copy keeps the checkout's own build/ out of the wheel.
PROJECT_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "nodemgr", "mps", "hooks", "standins")


def test_paths_name_the_checkout_and_the_standin_binaries():
    """REPO is the checkout holding the package (its pyproject.toml, scripts/ and hooks/);
    MPS_STANDIN is the executable stand-in control binary, its server beside it."""
    repo = Path(paths.REPO)
    assert (repo / "pyproject.toml").is_file()
    assert (repo / "scripts" / "setup-real-parts").is_file()
    assert (repo / "standins" / "paths.py").resolve() == Path(paths.__file__).resolve()
    assert Path(paths.MPS_STANDIN) == Path(paths.FAKES) / "nvidia-cuda-mps-control"
    for name in ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        assert os.access(Path(paths.FAKES) / name, os.X_OK), name


def installed_copy(tmp_path: Path) -> Path:
    """The project built into a wheel and installed into ``tmp_path/site``; its path."""
    src, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    src.mkdir()
    for name in PROJECT_SOURCES:
        source = Path(paths.REPO) / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=ignore)
        else:
            shutil.copy2(source, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = wheels.glob("*.whl")
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    return site


def alive(pid: int) -> bool:
    """Running (a zombie left for a non-reaping init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [arg.decode() for arg in f.read().split(b"\0") if arg]


PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import standins, standins.kubelet_sim
from standins import paths
from standins.cri.api import runtime_v1_pb2
print(json.dumps({
    "package": standins.__file__,
    "kubelet_sim": standins.kubelet_sim.__file__,
    "mps_standin": paths.MPS_STANDIN,
    "cri_api": runtime_v1_pb2.__file__,
}))
"""


def test_an_installed_package_carries_the_standins_and_runs_the_mps_standin(tmp_path):
    """From a wheel installed into a directory of its own: standins, its test kubelet and
    the CRI client import from there (not from the checkout), the CRI proto and stubs
    are there, and MPS_STANDIN names the installed stand-in, executable with its server
    beside it: it starts a control daemon that answers and quits."""
    site = installed_copy(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-P", "-c", PROBE, str(site)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    found = {key: Path(value) for key, value in json.loads(probe.stdout).items()}
    for key, path in found.items():
        assert path.is_relative_to(site), (key, path)
    api = found["cri_api"].parent
    assert (api / "runtime_v1.proto").is_file() and (api / "runtime_v1_pb2.pyi").is_file()
    control = found["mps_standin"]
    assert control == site / "standins" / "fakes" / "nvidia-cuda-mps-control"
    for binary in (control, control.with_name("nvidia-cuda-mps-server")):
        assert os.access(binary, os.X_OK), binary

    root = tempfile.mkdtemp(prefix="mps")  # unix socket paths stay under 108 bytes
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log"),
    }

    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(control), *args], input=stdin, env=env, capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip

    pid = None
    try:
        started = run("-d")
        assert (started.returncode, started.stderr) == (0, ""), started
        answer = run(stdin="sim_pid\n")
        assert answer.returncode == 0, answer.stderr
        pid = int(answer.stdout)
        assert str(control) in cmdline(pid)  # the installed copy runs, not the checkout's
        assert run(stdin="quit\n").returncode == 0
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the installed stand-in did not quit"
        pid = None
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, 9)
        shutil.rmtree(root, ignore_errors=True)
