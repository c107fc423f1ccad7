"""What a container's environment asks of the GPUs (pure; standard library only).

The runtime hook (letting non-GPU containers through unasked) and the daemon (checking
GPU containers) both use it, so both read an env the same way.
"""

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
# Exact ASCII forms: ASCII digits only (isdigit, int() and float() also take other
# scripts' digits) and only space and tab around them (str.strip() also takes NBSP). MPS
# reads these with atoi/strtod, which would read such values differently, so they are
# refused. Each character is checked against these sets.
_SPACES = " \t"
_PINNED_UNITS = "MmGg"
PINNED_LIMIT_FORM = "ASCII digits as 0=4096M or 0=4G (comma-separated per device)"
THREAD_PERCENTAGE_FORM = "ASCII digits only, as 30 or 29.5"


class EnvError(ValueError):
    """An env that cannot be read unambiguously (the message names the variable)."""


def env_from_list(entries: list[str]) -> dict[str, str]:
    """The GPU-relevant names of an OCI ``process.env`` list (``NAME=value`` strings).

    EnvError for a name given twice with different values (which one a program sees
    depends on its C library) and, when the container needs the daemon, for a quota
    value not in its exact form (:func:`quota_env_form_problem`).
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
    if needs_daemon(env):
        problem = quota_env_form_problem(env)
        if problem is not None:
            raise EnvError(problem)
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
        entry = _pinned_entry(item.strip(_SPACES))
        if entry is None:
            raise EnvError(
                f"{PINNED_MEM_LIMIT}={value!r}: {item.strip(_SPACES)!r} is not like 0=4096M "
                f"or 0=4G (allowed: {PINNED_LIMIT_FORM})"
            )
        ordinal, number, unit = entry
        if ordinal in limits:
            # Which entry MPS honours is not documented: refuse the ambiguity.
            raise EnvError(f"{PINNED_MEM_LIMIT}={value!r}: device {ordinal} is named twice")
        limits[ordinal] = int(number) * (1024 if unit in "Gg" else 1)
    return limits


def parse_thread_percentage(value: str) -> float:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` as a number, read only in its exact form.

    ASCII digits, at most three, with an optional ASCII decimal part (``30``,
    ``29.5``); no sign, exponent, space, underscore, nan or inf. EnvError
    otherwise. Whether the number fits the allocation is for the caller.
    """
    whole, dot, fraction = value.partition(".")
    if not _digits(whole, 3) or (dot and not _digits(fraction, 6)):
        raise EnvError(
            f"{ACTIVE_THREAD_PERCENTAGE}={value[:40]!r} is not a percentage in its exact "
            f"form (allowed: {THREAD_PERCENTAGE_FORM})"
        )
    return float(value)


def _digits(text: str, most: int) -> bool:
    return 0 < len(text) <= most and text.isascii() and text.isdigit()


def _pinned_entry(item: str) -> tuple[str, str, str] | None:
    """(ordinal, number, unit) of one ``0=4096M`` entry, spaces or tabs allowed around
    ``=``; None when it is not in that exact form."""
    ordinal, equals, amount = item.partition("=")
    ordinal, amount = ordinal.rstrip(_SPACES), amount.lstrip(_SPACES)
    if not equals or not amount or amount[-1] not in _PINNED_UNITS:
        return None
    number = amount[:-1]
    if not _digits(ordinal, 3) or not _digits(number, 9):
        return None
    return ordinal, number, amount[-1]


def quota_env_form_problem(env: dict[str, str]) -> str | None:
    """Why a quota env value present in ``env`` is not in its exact ASCII form; or None.

    Only the form: a missing value, or one that raises the quota, is for the
    daemon to judge against the allocation.
    """
    try:
        if PINNED_MEM_LIMIT in env:
            parse_pinned_limit(env[PINNED_MEM_LIMIT])
        if ACTIVE_THREAD_PERCENTAGE in env:
            parse_thread_percentage(env[ACTIVE_THREAD_PERCENTAGE])
    except EnvError as e:
        return str(e)
    return None
