"""Pins doctor's GPU checks: the driver version read from /proc; NVML missing FAILs naming the
missing piece (kernel module or user-space library) and the fix; found and simulated cards;
each card's compute capability for MPS (>= 7.0, pointing at docs/mps.md) and MIG mode; and
the MPS control binary, as verdicts and found in a fake $PATH."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

from nodemgr.cli.doctor import gpu
from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.inventory import Card
from standins.daemon_proc import MPS_STANDIN
from tests.unit.cli.doctor.support import write

T4 = Card(0, "GPU-0", "Tesla T4", 15360, compute_capability="7.5", mig_enabled=False)

NVML_NOT_FOUND = (  # what nodemgr.inventory.nvml raises on a machine without the driver
    "NVML library (libnvidia-ml.so.1) not found: is the NVIDIA driver installed and loaded "
    "(nvidia-smi works)? On a machine without GPUs, set gpus.backend: simulated"
)


def test_driver_version_from_proc():
    """The kernel module's version is the dotted number on the NVRM line of
    /proc/driver/nvidia/version."""
    text = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert gpu.parse_driver_version(text) == "550.54.14"
    assert gpu.parse_driver_version("garbage\n") is None


def test_gpus_without_nvml_name_the_missing_piece_and_the_fix():
    """Without NVML the FAIL says whether the kernel module is loaded and gives the matching fix."""
    no_module = gpu.gpus_result("nvml", None, NVML_NOT_FOUND, None)
    assert no_module.status == FAIL
    assert no_module.detail == (
        "NVML library (libnvidia-ml.so.1) not found; no NVIDIA kernel module loaded "
        "(/proc/driver/nvidia/version absent)"
    )
    assert "modprobe nvidia" in no_module.fix and "gpus.backend: simulated" in no_module.fix
    module_only = gpu.gpus_result("nvml", None, NVML_NOT_FOUND, "550.54.14")
    assert module_only.status == FAIL and "kernel module 550.54.14 is loaded" in module_only.detail
    assert "same version 550.54.14" in module_only.fix
    no_cards = gpu.gpus_result("nvml", (), None, "550.54.14")
    assert no_cards.status == FAIL and "nvidia-smi -L" in no_cards.fix


def test_gpus_found_and_simulated():
    """Real cards pass with the driver and card list; simulated cards WARN that this is no GPU
    node."""
    found = gpu.gpus_result("nvml", (T4,), None, "550.54.14")
    assert found == Result("GPUs", PASS, "NVML: driver 550.54.14, 1 card: GPU0 Tesla T4 15360 MiB")
    simulated = gpu.gpus_result("simulated", (T4, T4), None, None)
    assert simulated.status == WARN
    assert simulated.detail.startswith("simulated: not a real GPU node (2 cards:")
    assert "gpus.backend: nvml" in simulated.fix


def test_card_compute_capability_for_mps():
    """With MPS a card below compute capability 7.0 FAILs (citing docs/mps.md); unknown WARNs."""
    assert gpu.card_result(T4, mps_enabled=True) == Result(
        "GPU0", PASS, "Tesla T4, compute capability 7.5 (MPS needs >= 7.0), MIG off"
    )
    pascal = Card(1, "GPU-1", "Tesla P4", 7680, compute_capability="6.1")
    old = gpu.card_result(pascal, mps_enabled=True)
    assert old.check == "GPU1" and old.status == FAIL
    assert "6.1 < 7.0" in old.detail and "docs/mps.md" in old.detail
    assert "mps.enabled: false" in old.fix
    # Without MPS the capability limits nothing.
    assert gpu.card_result(pascal, mps_enabled=False).status == PASS
    unknown = gpu.card_result(Card(2, "GPU-2", "X", 1024), mps_enabled=True)
    assert unknown.status == WARN and "compute_cap" in unknown.fix


def test_mig_cards_are_not_shared():
    """A card in MIG mode WARNs with the command to disable it; with an old capability it FAILs."""
    mig = Card(0, "GPU-0", "A100", 40960, compute_capability="8.0", mig_enabled=True)
    result = gpu.card_result(mig, mps_enabled=True)
    assert result.status == WARN and "MIG mode is on" in result.detail
    assert "nvidia-smi -i 0 -mig 0" in result.fix
    both = gpu.card_result(
        Card(3, "GPU-3", "P", 1024, compute_capability="6.0", mig_enabled=True), mps_enabled=True
    )
    assert both.status == FAIL and "MIG" in both.detail and "6.0 < 7.0" in both.detail


def test_mps_binary_verdicts():
    """The MPS control binary: off passes, missing FAILs, found passes, a script WARNs on real
    GPUs."""
    off = gpu.mps_binary_result(False, "nvidia-cuda-mps-control", None, None, False, "nvml")
    assert off.status == PASS and "mps.enabled: false" in off.detail
    missing = gpu.mps_binary_result(
        True, "nvidia-cuda-mps-control", None, "is not in $PATH", False, "nvml"
    )
    assert missing.status == FAIL
    assert missing.detail.startswith("nvidia-cuda-mps-control is not in $PATH")
    assert "mps.control_binary" in missing.fix and "mps.enabled: false" in missing.fix
    found = gpu.mps_binary_result(True, "x", "/usr/bin/x", None, False, "nvml")
    assert found == Result("MPS control binary", PASS, "x → /usr/bin/x")
    # The stand-in is fine with simulated cards and suspicious on a real node.
    assert gpu.mps_binary_result(True, "/s", "/s", None, True, "simulated").status == PASS
    assert gpu.mps_binary_result(True, "/s", "/s", None, True, "nvml").status == WARN


def test_mps_binary_probe(tmp_path):
    """check_mps_binary searches the given $PATH and refuses an absolute path that is not
    executable."""
    on = SimpleNamespace(enabled=True, control_binary="nvidia-cuda-mps-control")
    settings = SimpleNamespace(mps=on, gpus=SimpleNamespace(backend="simulated"))
    assert gpu.check_mps_binary(settings, Host(search_path=str(tmp_path))).status == FAIL
    shutil.copy(MPS_STANDIN, tmp_path / "nvidia-cuda-mps-control")
    found = gpu.check_mps_binary(settings, Host(search_path=str(tmp_path)))
    assert found.status == PASS and str(tmp_path) in found.detail
    plain = write(str(tmp_path / "plain"), "x", 0o644)
    settings.mps = SimpleNamespace(enabled=True, control_binary=plain)
    not_exec = gpu.check_mps_binary(settings, Host())
    assert not_exec.status == FAIL and "is not executable" in not_exec.detail
