"""What a container's environment asks of the GPUs (pure; standard library only).

Shared by the runtime hook (to let non-GPU containers through without asking
the daemon) and the daemon (to check GPU containers), so both read an env the
same way.
"""

from __future__ import annotations

import re

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ALLOCATION_ID = "GPUSHARE_ALLOCATION_ID"
PINNED_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
# A "legacy" CUDA image (CUDA_VERSION set, NVIDIA_REQUIRE_CUDA unset) without
# NVIDIA_VISIBLE_DEVICES gets every GPU from the NVIDIA container toolkit.
CUDA_VERSION = "CUDA_VERSION"
REQUIRE_CUDA = "NVIDIA_REQUIRE_CUDA"

# The env names the hook passes on to the daemon; nothing else leaves the hook.
GPU_ENV_NAMES = (
    VISIBLE_DEVICES,
    ALLOCATION_ID,
    PINNED_MEM_LIMIT,
    ACTIVE_THREAD_PERCENTAGE,
    PIPE_DIRECTORY,
    CUDA_VERSION,
    REQUIRE_CUDA,
)

_NO_GPU_VALUES = ("", "void", "none")
# ASCII digits only (str.isdigit accepts other scripts' digits), bounded length.
_PINNED_ENTRY = re.compile(r"([0-9]{1,3})\s*=\s*([0-9]{1,9})([MmGg])")


class EnvError(ValueError):
    """An env that cannot be read unambiguously (the message names the variable)."""


def env_from_list(entries: list[str]) -> dict[str, str]:
    """The GPU-relevant names of an OCI ``process.env`` list (``NAME=value`` strings).

    A name given twice with different values is an EnvError: which one a
    program sees depends on its C library, so neither can be trusted.
    """
    env: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str):
            raise EnvError(f"process.env holds a non-string entry {entry!r}")
        name, _, value = entry.partition("=")
        if name not in GPU_ENV_NAMES:
            continue
        if name in env and env[name] != value:
            raise EnvError(f"{name} is set twice, to {env[name]!r} and {value!r}")
        env[name] = value
    return env


def requested_gpus(env: dict[str, str]) -> list[str] | None:
    """The GPUs the NVIDIA container toolkit would give this env; None for none.

    ``["all"]`` for every GPU, otherwise the listed UUIDs or indexes.
    """
    value = env.get(VISIBLE_DEVICES)
    if value is None:
        if env.get(CUDA_VERSION) and not env.get(REQUIRE_CUDA):
            return ["all"]
        return None
    if value.strip().lower() in _NO_GPU_VALUES:
        return None
    return [item.strip() for item in value.split(",") if item.strip()] or None


def needs_daemon(env: dict[str, str]) -> bool:
    """Whether the daemon must see this container: it asks for GPUs or claims an allocation."""
    return requested_gpus(env) is not None or ALLOCATION_ID in env


def parse_pinned_limit(value: str) -> dict[str, int]:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` as {device ordinal: MiB}.

    Accepts ``0=4096M``, ``0=4G`` and comma-separated lists; EnvError otherwise.
    """
    limits: dict[str, int] = {}
    for item in value.split(","):
        match = _PINNED_ENTRY.fullmatch(item.strip())
        if match is None:
            raise EnvError(
                f"{PINNED_MEM_LIMIT}={value!r}: {item.strip()!r} is not like 0=4096M or 0=4G"
            )
        ordinal, number, unit = match.groups()
        if ordinal in limits:
            # Which entry MPS honours is not documented: refuse the ambiguity.
            raise EnvError(f"{PINNED_MEM_LIMIT}={value!r}: device {ordinal} is named twice")
        limits[ordinal] = int(number) * (1024 if unit in "Gg" else 1)
    return limits
