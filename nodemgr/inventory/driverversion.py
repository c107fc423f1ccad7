"""The loaded NVIDIA kernel module's version, from /proc/driver/nvidia/version.

None when no module is loaded: unknown, never guessed.
"""

from __future__ import annotations

NVIDIA_DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"


def read_driver_version(path: str = NVIDIA_DRIVER_VERSION_FILE) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_driver_version(f.read())
    except OSError:
        return None


def parse_driver_version(text: str) -> str | None:
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024"
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            for word in line.split():
                if word[:1].isdigit() and "." in word:
                    return word
    return None
