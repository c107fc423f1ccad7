"""Contract of the NVML backend with NVIDIA's real ``libnvidia-ml.so.1`` (Debian 12
driver 535, fetched by scripts/setup-real-parts) on a machine without the NVIDIA
kernel driver: pynvml loads the real library, ``nvmlInit`` fails with "Driver Not
Loaded", ``nodemgr.inventory`` turns that into its clear message, and
``gpushare-node`` with ``gpus.backend: nvml`` logs it and exits 1 (docs/real-parts.md: exit 1,
cannot start: no GPUs/NVML). The library is found through LD_LIBRARY_PATH, as
the loader finds the driver's own copy on a GPU node.

Run as root, the library creates ``/dev/nvidiactl`` (char 195:255) when it is
missing, before finding no driver behind it: the fixture removes the node a test
created.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from standins import real_parts
from standins.daemon_proc import Node

NVIDIACTL = "/dev/nvidiactl"
NOT_LOADED = (
    "NVIDIA kernel driver not loaded: is the NVIDIA driver installed and loaded "
    "(nvidia-smi works)? On a machine without GPUs, set gpus.backend: simulated"
)
OPEN_INVENTORY = """
import json
from nodemgr.config.schema import GpuSettings
from nodemgr.errors import InventoryError
from nodemgr.inventory import open_inventory
try:
    open_inventory(GpuSettings(backend="nvml"))
    error = None
except InventoryError as e:
    error = str(e)
with open("/proc/self/maps") as f:
    loaded = sorted({line.split()[-1] for line in f if "libnvidia-ml" in line})
print(json.dumps({"error": error, "loaded": loaded}))
"""


@pytest.fixture
def real_nvml():
    """The real library's parts; skips where a kernel driver is loaded (NVML would work)."""
    parts = real_parts.require()
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("the NVIDIA kernel driver is loaded here: NVML would not fail")
    existed = os.path.lexists(NVIDIACTL)
    yield parts
    if not existed and os.path.lexists(NVIDIACTL):
        st = os.lstat(NVIDIACTL)
        if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 255):
            os.unlink(NVIDIACTL)


def test_inventory_loads_the_real_library_and_says_the_driver_is_not_loaded(real_nvml):
    """open_inventory with backend nvml loads the real libnvidia-ml.so.1 and raises
    InventoryError "NVIDIA kernel driver not loaded" with the hint to fix it."""
    done = subprocess.run(
        [sys.executable, "-c", OPEN_INVENTORY],
        env={**os.environ, "LD_LIBRARY_PATH": real_nvml.nvml_dir},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["loaded"] == [os.path.realpath(real_nvml.nvml_lib)]
    assert result["error"] == NOT_LOADED


def test_gpushare_node_with_the_nvml_backend_exits_1_saying_the_driver_is_not_loaded(real_nvml):
    """gpushare-node with gpus.backend: nvml and the real library exits 1 and logs
    "cannot run: NVIDIA kernel driver not loaded: ..." (the exit code docs/real-parts.md
    gives for no NVML)."""
    node = Node(gpus={"backend": "nvml"})
    try:
        node.start(env={"LD_LIBRARY_PATH": real_nvml.nvml_dir})
        assert node.wait(timeout=60) == 1, node.log()
        assert f"cannot run: {NOT_LOADED}" in node.log()
        assert "Traceback" not in node.log()
    finally:
        node.cleanup()
