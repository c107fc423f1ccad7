"""The checks of single config values: each takes the dotted key and the raw value.

Each returns the validated value or raises :class:`~nodemgr.errors.ConfigError` saying
what was found and what is allowed. No I/O.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

from nodemgr.config.schema import NumberRange
from nodemgr.errors import ConfigError

StrCheck = Callable[[str, Any], str]  # (dotted key, raw value) -> validated string

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,51}")


def label_prefix(key: str, value: object) -> str:
    """A label key prefix: ``<DNS subdomain>/`` (the name part is appended to it)."""
    text = string_value(key, value)
    domain, slash, rest = text.partition("/")
    if not slash or rest or len(domain) > 253 or not _DNS_SUBDOMAIN.fullmatch(domain):
        raise ConfigError(
            key,
            "must be a DNS subdomain followed by '/', e.g. gpushare.aliyun.com/ "
            f"(got {show(text)})",
        )
    if (
        domain == "kubernetes.io"
        or domain.endswith((".kubernetes.io", ".k8s.io"))
        or domain == "k8s.io"
    ):
        raise ConfigError(
            key, f"the kubernetes.io and k8s.io prefixes are reserved (got {show(text)})"
        )
    return text


def host_port(key: str, value: object) -> str:
    """``host:port`` (``[v6]:port`` for IPv6) with a port from 0 to 65535."""
    text = string_value(key, value)
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            key, f"must be host:port, e.g. 127.0.0.1:9445 or [::1]:9445 (got {show(text)})"
        )
    if ":" in host and not text.startswith("["):
        raise ConfigError(
            key, f"an IPv6 host must be in brackets, e.g. [::1]:9445 (got {show(text)})"
        )
    return text


# The longest path a unix socket can be bound at (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
# A DRA driver name is also the CDI vendor of its kind (<driver>/gpu).
_CDI_VENDOR = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


def driver_name(key: str, value: object) -> str:
    """A DRA driver name: a DNS subdomain of at most 63 characters (the API's rule) that
    starts with a letter (CDI's rule for the vendor of the specs it names)."""
    text = string_value(key, value)
    if len(text) > 63 or not _DNS_SUBDOMAIN.fullmatch(text) or not _CDI_VENDOR.fullmatch(text):
        raise ConfigError(
            key,
            "must be a DNS subdomain of at most 63 characters starting with a letter, e.g. "
            f"gpushare.aliyun.com (got {show(text)})",
        )
    return text


def supervisor_value(key: str, value: object) -> str:
    if value == "systemd":
        raise ConfigError(
            key,
            'systemd is not supported by this version of gpushare-node yet (use "process")',
        )
    return one_of("process")(key, value)


# --- values ---------------------------------------------------------------------------


def string_value(key: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string (got {show(value)})")
    if not value and not empty_ok:
        raise ConfigError(key, 'must not be empty (got "")')
    return value


def boolean_value(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false (got {show(value)})")
    return value


def command_value(key: str, value: object) -> str:
    """A program: a bare name (looked up in $PATH when run) or an absolute path."""
    command = string_value(key, value)
    if "/" in command and not os.path.isabs(command):
        raise ConfigError(key, f"must be a name in $PATH or an absolute path (got {show(command)})")
    return command


def path_value(key: str, value: object, *, empty_ok: bool = False) -> str:
    path = string_value(key, value, empty_ok=empty_ok)
    if path and not os.path.isabs(path):
        raise ConfigError(key, f"must be an absolute path (got {show(path)})")
    return path


def number_value(key: str, value: object, *, integer: bool = False, zero_ok: bool = False) -> Any:
    """A finite number > 0 (>= 0 with ``zero_ok``); only an int if ``integer``."""
    wanted = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float)):
        raise ConfigError(key, f"must be {wanted} (got {show(value)})")
    if not integer and not abs(value) < 1e308:  # inf, nan, or an int too big for a float
        raise ConfigError(key, f"must be {wanted} (got {show(value)})")
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(key, f"must be {'>= 0' if zero_ok else '> 0'} (got {show(value)})")
    return value if integer else float(value)


def number_in(allowed: NumberRange, *, integer: bool = False) -> Callable[[str, object], Any]:

    def check(key: str, value: object) -> Any:
        number = number_value(key, value, integer=integer, zero_ok=allowed.minimum <= 0)
        if not allowed.minimum <= number <= allowed.maximum:
            raise ConfigError(
                key,
                f"must be between {_plain(allowed.minimum)} and {_plain(allowed.maximum)} "
                f"{allowed.unit} (got {show(value)})",
            )
        return number

    return check


def _plain(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


def one_of(*choices: str) -> StrCheck:
    def check(key: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(choices)} (got {show(value)})")
        return value

    return check


def matching(pattern: re.Pattern[str], max_length: int, rule: str) -> StrCheck:

    def check(key: str, value: object) -> str:
        text = string_value(key, value)
        if len(text) > max_length or not pattern.fullmatch(text):
            raise ConfigError(key, f"must be {rule} (got {show(text)})")
        return text

    return check


card_uuid = matching(_UUID, 52, "1 to 52 letters, digits and '-', starting with a letter or digit")
node_name_value = matching(
    _DNS_SUBDOMAIN,
    253,
    "a node name: lowercase letters, digits, '-' and '.', at most 253 characters",
)


def resource_name(key: str, value: object, *, empty_ok: bool = False) -> str:
    """A Kubernetes extended resource name, ``domain/name``, outside kubernetes.io."""
    text = string_value(key, value, empty_ok=empty_ok)
    if not text:
        return text
    domain, slash, name = text.partition("/")
    if not slash or "/" in name:
        problem = "needs exactly one '/' between domain and name"
    elif len(domain) > 253 or not _DNS_SUBDOMAIN.fullmatch(domain):
        problem = "the domain must be a lowercase DNS name (letters, digits, '-', '.')"
    elif domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        problem = "the kubernetes.io domain is reserved for Kubernetes"
    elif len(name) > 63 or not _RESOURCE_NAME.fullmatch(name):
        problem = (
            "the name must be at most 63 letters, digits, '-', '_', '.', "
            "starting and ending with a letter or digit"
        )
    else:
        return text
    raise ConfigError(
        key,
        f"must be an extended resource name like example.com/gpu-mem: {problem} (got {show(text)})",
    )


# --- helpers --------------------------------------------------------------------------


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def show(value: object) -> str:
    """A found value for a message: YAML-like (quoted strings, true, null), at most 60 chars."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
