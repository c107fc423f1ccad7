"""Doctor's GPU checks: the driver and NVML, each card's compute capability and MIG mode,
and the MPS control binary.

A failure names the missing piece: the kernel module, or the user-space library of the
same version.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result, worst
from nodemgr.config.schema import Settings
from nodemgr.errors import InventoryError
from nodemgr.inventory import Card, open_inventory
from nodemgr.inventory.driverversion import NVIDIA_DRIVER_VERSION_FILE, parse_driver_version

# MPS's per-client address-space isolation and active-thread percentage, which
# the quotas rest on, need Volta (7.0) or newer (docs/mps.md, "Faults and
# limits"); before Volta a client's fault also kills the server.
MPS_MIN_COMPUTE_CAPABILITY = (7, 0)


# --- the driver and the cards ------------------------------------------------------------


def check_gpus(settings: Settings, host: Host) -> list[Result]:
    driver = read_driver_version(host)
    try:
        inventory = open_inventory(settings.gpus)
        try:
            cards = inventory.cards()
        finally:
            inventory.close()
    except InventoryError as e:
        return [gpus_result(settings.gpus.backend, None, str(e), driver)]
    results = [gpus_result(settings.gpus.backend, cards, None, driver)]
    if settings.gpus.backend == "nvml":  # simulated cards have no real facts to check
        results += [card_result(card, settings.mps.enabled) for card in cards]
    return results


def read_driver_version(host: Host) -> str | None:
    try:
        with open(host.path(NVIDIA_DRIVER_VERSION_FILE), encoding="utf-8") as f:
            return parse_driver_version(f.read())
    except OSError:
        return None


def gpus_result(
    backend: str, cards: tuple[Card, ...] | None, error: str | None, driver: str | None
) -> Result:
    if backend == "simulated":
        if cards is None:
            return Result("GPUs", FAIL, f"simulated backend: {error}", "correct gpus.simulated")
        return Result(
            "GPUs",
            WARN,
            f"simulated: not a real GPU node ({_card_list(cards)} from gpus.simulated.devices; "
            "compute capability and MIG not checked)",
            "on a GPU node set gpus.backend: nvml (the default)",
        )
    if cards is None:
        problem = _without_nvml_hint(error or "NVML failed")
        if driver is None:
            return Result(
                "GPUs",
                FAIL,
                f"{problem}; no NVIDIA kernel module loaded ({NVIDIA_DRIVER_VERSION_FILE} absent)",
                "install the NVIDIA driver and load it (`modprobe nvidia`; `nvidia-smi` must "
                "list the cards); on a machine without GPUs set gpus.backend: simulated",
            )
        return Result(
            "GPUs",
            FAIL,
            f"{problem}; the kernel module {driver} is loaded",
            f"install the driver's user-space libraries of the same version {driver} "
            "(libnvidia-ml.so.1; `nvidia-smi` must list the cards), or run as root if "
            "permission was denied",
        )
    driver_text = f"driver {driver}, " if driver else ""
    if not cards:
        return Result(
            "GPUs",
            FAIL,
            f"NVML works ({driver_text}no cards): nothing to share",
            "check `nvidia-smi -L` lists the cards (not passed through to a VM, not disabled)",
        )
    return Result("GPUs", PASS, f"NVML: {driver_text}{_card_list(cards)}")


def _card_list(cards: Iterable[Card]) -> str:
    cards = list(cards)
    listed = ", ".join(f"GPU{c.index} {c.name} {c.memory_mib} MiB" for c in cards)
    return f"{len(cards)} card{'s' if len(cards) != 1 else ''}: {listed}"


def _without_nvml_hint(message: str) -> str:
    """Without the generic driver hint: the fix says it better."""
    cut = message.find(": is the NVIDIA driver installed")
    return message[:cut] if cut > 0 else message


def card_result(card: Card, mps_enabled: bool) -> Result:
    name = f"GPU{card.index}"
    found = [card.name]
    problems: list[tuple[str, str, str]] = []  # (status, text, fix)
    capability = _capability(card.compute_capability)
    if mps_enabled:
        if capability is None:
            problems.append(
                (
                    WARN,
                    f"compute capability unknown (NVML reported {card.compute_capability!r}); "
                    "MPS limits need >= 7.0",
                    f"check `nvidia-smi -i {card.index} --query-gpu=compute_cap --format=csv`; "
                    "below 7.0 set mps.enabled: false",
                )
            )
        elif capability < MPS_MIN_COMPUTE_CAPABILITY:
            problems.append(
                (
                    FAIL,
                    f"compute capability {card.compute_capability} < 7.0: MPS before Volta has "
                    "no per-client address-space isolation or active-thread percentage, which "
                    "the quotas rely on (docs/mps.md)",
                    "set mps.enabled: false (shared containers then get env quotas only) or "
                    "use cards of compute capability 7.0 or newer",
                )
            )
        else:
            found.append(f"compute capability {card.compute_capability} (MPS needs >= 7.0)")
    elif card.compute_capability:
        found.append(f"compute capability {card.compute_capability} (MPS off)")
    if card.mig_enabled:
        problems.append(
            (
                WARN,
                "MIG mode is on: gpushare-node does not share MIG cards (CUDA needs a MIG "
                "instance, not the whole card's UUID, and MIG and MPS are not combined here)",
                f"disable MIG: `nvidia-smi -i {card.index} -mig 0`, then reset the card",
            )
        )
    elif card.mig_enabled is False:
        found.append("MIG off")
    if not problems:
        return Result(name, PASS, ", ".join(found))
    status = worst(p[0] for p in problems)
    return Result(
        name,
        status,
        f"{card.name}: " + "; ".join(p[1] for p in problems),
        "; ".join(p[2] for p in problems),
    )


def _capability(text: str | None) -> tuple[int, int] | None:
    major, dot, minor = (text or "").partition(".")
    if dot and major.isdigit() and minor.isdigit():
        return int(major), int(minor)
    return None


# --- the MPS control binary --------------------------------------------------------------


def check_mps_binary(settings: Settings, host: Host) -> Result:
    binary = settings.mps.control_binary
    if not settings.mps.enabled:
        return mps_binary_result(False, binary, None, None, False, settings.gpus.backend)
    if os.path.isabs(binary):
        if not os.path.exists(binary):
            problem = "does not exist"
        elif not os.path.isfile(binary):
            problem = "is not a file"
        elif not os.access(binary, os.X_OK):
            problem = "is not executable"
        else:
            problem = None
        found = None if problem else binary
    else:
        found = shutil.which(binary, path=host.search_path)
        problem = None if found else "is not in $PATH"
    return mps_binary_result(
        True, binary, found, problem, _is_script(found) if found else False, settings.gpus.backend
    )


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def mps_binary_result(
    enabled: bool,
    binary: str,
    found: str | None,
    problem: str | None,
    is_script: bool,
    backend: str,
) -> Result:
    name = "MPS control binary"
    if not enabled:
        return Result(name, PASS, "mps.enabled: false: MPS not used (env quotas only)")
    if found is None:
        return Result(
            name,
            FAIL,
            f"{binary} {problem}: no card can be shared with MPS limits",
            "install the NVIDIA driver utilities that ship nvidia-cuda-mps-control and set "
            "mps.control_binary to its absolute path (the daemon's $PATH under systemd is not "
            "your shell's), or set mps.enabled: false (env quotas only)",
        )
    shown = found if found == binary else f"{binary} → {found}"
    if is_script and backend == "nvml":
        # NVIDIA ships an ELF binary; a script here is most likely the test stand-in
        # copied with a simulated config, which would make real cards look healthy.
        return Result(
            name,
            WARN,
            f"{shown} is a script, not NVIDIA's binary (the test stand-in?) on a real GPU node",
            "set mps.control_binary to NVIDIA's nvidia-cuda-mps-control",
        )
    if is_script:
        return Result(name, PASS, f"{shown} (a script: the stand-in, fine with simulated GPUs)")
    return Result(name, PASS, shown)
