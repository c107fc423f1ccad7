"""Configuration of gpushare-node: load and validate its YAML file.

The file is read once at start-up into the frozen dataclasses below
(``Settings`` and its sections), which are passed explicitly to whoever needs
them; nothing reads configuration from globals later. Every problem raises
:class:`~nodemgr.errors.ConfigError` with the dotted key
(``gpus.simulated.devices[1].uuid``) and a sentence saying what was found and
what is allowed. Unknown keys, duplicate keys and sections of features this
version does not have are refused: a setting that would do nothing is never
accepted silently.

No I/O besides reading the file, ``$NODE_NAME`` and the hostname (for the
default node name). Imports only the standard library, PyYAML and
nodemgr.errors.
"""

import dataclasses
import json
import os
import re
import socket
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import yaml

from nodemgr.config.schema import (
    EnforcementSettings,
    GpuSettings,
    KubeletSettings,
    KubernetesSettings,
    MetricsSettings,
    MpsSettings,
    ResourceSettings,
    Settings,
    SimulatedDevice,
    SimulatedSettings,
    StatusSettings,
)
from nodemgr.errors import ConfigError

__all__ = [
    "config_error_line",
    "load_settings",
    "settings_from_mapping",
]

# Sections of later versions: refused by name so that nobody believes they work.
_FUTURE_SECTIONS: tuple[str, ...] = ()

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,51}")

_Check = Callable[[str, Any], Any]  # (dotted key, raw value) -> validated value


def load_settings(path: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate the config file; ``path`` None gives all defaults.

    ``environ`` defaults to ``os.environ``; only ``NODE_NAME`` is read from it.
    """
    if path is None:
        return settings_from_mapping(None, environ)
    where = str(path)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as err:
        raise ConfigError(where, f"cannot read the file: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(where, f"not UTF-8 text (bad byte at offset {err.start})") from err
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(where, f"not valid YAML{at}: {problem or err}") from err
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(where, f"must be a YAML mapping of settings (got {_show(data)})")
    return settings_from_mapping(data, environ)


def settings_from_mapping(data: object, environ: Mapping[str, str] | None = None) -> Settings:
    """Validate an already-parsed YAML document (None or {} gives all defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("(top level)", f"must be a YAML mapping of settings (got {_show(data)})")
    for name in _FUTURE_SECTIONS:
        if name in data:
            raise ConfigError(
                name,
                f"unknown key: the {name} section is not supported by "
                "this version of gpushare-node",
            )
    values = _values(
        "",
        data,
        Settings,
        {
            "node_name": _node_name,
            "kubelet": _kubelet,
            "state_dir": _path,
            "run_dir": _path,
            "gpus": _gpus,
            "resources": _resources,
            "mps": _mps,
            "enforcement": _enforcement,
            "status": _status,
            "metrics": _metrics,
            "kubernetes": _kubernetes,
        },
    )
    if "node_name" not in values:
        values["node_name"] = _default_node_name(os.environ if environ is None else environ)
    return Settings(**values)


def config_error_line(err: ConfigError) -> str:
    """The one line the daemon prints for a config error before exiting with status 2."""
    line = f"gpushare-node: config error: {err.key}: {err.problem}"
    return re.sub(r"\s*[\r\n]+\s*", " ", line).strip()


# --- sections -------------------------------------------------------------------------


def _values(
    key: str, data: object, cls: type, checks: dict[str, _Check], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check that ``data`` is a mapping of ``cls``'s fields; return the checked values given.

    None counts as an empty mapping. Absent keys are left out (the dataclass
    default applies) unless they are ``required``.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(key, f"must be a mapping (got {_show(data)})")
    known = [field.name for field in dataclasses.fields(cls)]
    for name in data:
        if name not in known:
            raise ConfigError(
                join_key(key, str(name)), f"unknown key; known keys: {', '.join(known)}"
            )
    for name in required:
        if name not in data:
            raise ConfigError(join_key(key, name), "is required")
    return {name: checks[name](join_key(key, name), value) for name, value in data.items()}


def _kubelet(key: str, data: object) -> KubeletSettings:
    return KubeletSettings(
        **_values(
            key,
            data,
            KubeletSettings,
            {
                "device_plugin_dir": _path,
                "pod_resources_socket": _path,
                "reconcile_interval_seconds": _number,
                "allocation_grace_seconds": partial(_number, zero_ok=True),
            },
        )
    )


def _gpus(key: str, data: object) -> GpuSettings:
    backend_check = _one_of("nvml", "simulated")
    if isinstance(data, Mapping) and "simulated" in data:  # refuse before looking inside
        if backend_check(f"{key}.backend", data.get("backend", "nvml")) != "simulated":
            raise ConfigError(f"{key}.simulated", "only allowed with backend: simulated")
    gpus = GpuSettings(
        **_values(
            key,
            data,
            GpuSettings,
            {
                "backend": backend_check,
                "simulated": _simulated,
            },
        )
    )
    if gpus.backend == "simulated" and not gpus.simulated.devices:
        raise ConfigError(
            f"{key}.simulated.devices", "at least one device is needed with backend: simulated"
        )
    return gpus


def _simulated(key: str, data: object) -> SimulatedSettings:
    return SimulatedSettings(
        **_values(
            key,
            data,
            SimulatedSettings,
            {
                "devices": _devices,
                "usage_file": partial(_path, empty_ok=True),
            },
        )
    )


def _devices(key: str, data: object) -> tuple[SimulatedDevice, ...]:
    if not isinstance(data, list):
        raise ConfigError(key, f"must be a list of devices (got {_show(data)})")
    devices: list[SimulatedDevice] = []
    index_of_uuid: dict[str, int] = {}
    for index, item in enumerate(data):
        item_key = f"{key}[{index}]"
        device = SimulatedDevice(
            **_values(
                item_key,
                item,
                SimulatedDevice,
                {"uuid": _uuid, "name": _string, "memory_mib": partial(_number, integer=True)},
                required=("uuid", "name", "memory_mib"),
            )
        )
        if device.uuid in index_of_uuid:
            raise ConfigError(
                f"{item_key}.uuid",
                f"must be unique (got {_show(device.uuid)}, "
                f"already used by {key}[{index_of_uuid[device.uuid]}])",
            )
        index_of_uuid[device.uuid] = index
        devices.append(device)
    return tuple(devices)


def _resources(key: str, data: object) -> ResourceSettings:
    resources = ResourceSettings(
        **_values(
            key,
            data,
            ResourceSettings,
            {
                "memory": _resource_name,
                "memory_unit_mib": partial(_number, integer=True),
                "core": _resource_name,
                "whole": partial(_resource_name, empty_ok=True),
                "placement": _one_of("binpack", "spread"),
            },
        )
    )
    field_of_name: dict[str, str] = {}
    for field in ("memory", "core", "whole"):
        name = getattr(resources, field)
        if name in field_of_name:
            raise ConfigError(
                f"{key}.{field}",
                f"must differ from {key}.{field_of_name[name]} (both are {_show(name)})",
            )
        if name:
            field_of_name[name] = field
    return resources


def _mps(key: str, data: object) -> MpsSettings:
    return MpsSettings(
        **_values(
            key,
            data,
            MpsSettings,
            {
                "enabled": _boolean,
                "control_binary": _command,
                "supervisor": _supervisor,
                "shm_size_mib": partial(_number, integer=True, zero_ok=True),
                "health_check_interval_seconds": _number,
                "command_timeout_seconds": _number,
            },
        )
    )


def _enforcement(key: str, data: object) -> EnforcementSettings:
    return EnforcementSettings(
        **_values(
            key,
            data,
            EnforcementSettings,
            {
                "action": _one_of("kill", "log"),
                "interval_seconds": _number,
                "grace_mib": partial(_number, integer=True, zero_ok=True),
                "hook_socket": partial(_path, empty_ok=True),
            },
        )
    )


def _status(key: str, data: object) -> StatusSettings:
    return StatusSettings(
        **_values(key, data, StatusSettings, {"socket": partial(_path, empty_ok=True)})
    )


def _metrics(key: str, data: object) -> MetricsSettings:
    return MetricsSettings(
        **_values(key, data, MetricsSettings, {"enabled": _boolean, "address": _host_port})
    )


def _kubernetes(key: str, data: object) -> KubernetesSettings:
    return KubernetesSettings(
        **_values(
            key,
            data,
            KubernetesSettings,
            {
                "enabled": _boolean,
                "kubeconfig": partial(_path, empty_ok=True),
                "label_prefix": _label_prefix,
                "request_timeout_seconds": _number,
            },
        )
    )


def _label_prefix(key: str, value: object) -> str:
    """A label key prefix: ``<DNS subdomain>/`` (the name part is appended to it)."""
    text = _string(key, value)
    domain, slash, rest = text.partition("/")
    if not slash or rest or len(domain) > 253 or not _DNS_SUBDOMAIN.fullmatch(domain):
        raise ConfigError(
            key,
            "must be a DNS subdomain followed by '/', e.g. gpushare.aliyun.com/ "
            f"(got {_show(text)})",
        )
    if (
        domain == "kubernetes.io"
        or domain.endswith((".kubernetes.io", ".k8s.io"))
        or domain == "k8s.io"
    ):
        raise ConfigError(
            key, f"the kubernetes.io and k8s.io prefixes are reserved (got {_show(text)})"
        )
    return text


def _host_port(key: str, value: object) -> str:
    """``host:port`` (``[v6]:port`` for IPv6) with a port from 0 to 65535."""
    text = _string(key, value)
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            key, f"must be host:port, e.g. 127.0.0.1:9445 or [::1]:9445 (got {_show(text)})"
        )
    if ":" in host and not text.startswith("["):
        raise ConfigError(
            key, f"an IPv6 host must be in brackets, e.g. [::1]:9445 (got {_show(text)})"
        )
    return text


def _supervisor(key: str, value: object) -> str:
    if value == "systemd":
        raise ConfigError(
            key,
            'systemd is not supported by this version of gpushare-node yet (use "process")',
        )
    return _one_of("process")(key, value)


# --- values ---------------------------------------------------------------------------


def _string(key: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string (got {_show(value)})")
    if not value and not empty_ok:
        raise ConfigError(key, 'must not be empty (got "")')
    return value


def _boolean(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false (got {_show(value)})")
    return value


def _command(key: str, value: object) -> str:
    """A program: a bare name (looked up in $PATH when run) or an absolute path."""
    command = _string(key, value)
    if "/" in command and not os.path.isabs(command):
        raise ConfigError(
            key, f"must be a name in $PATH or an absolute path (got {_show(command)})"
        )
    return command


def _path(key: str, value: object, *, empty_ok: bool = False) -> str:
    path = _string(key, value, empty_ok=empty_ok)
    if path and not os.path.isabs(path):
        raise ConfigError(key, f"must be an absolute path (got {_show(path)})")
    return path


def _number(key: str, value: object, *, integer: bool = False, zero_ok: bool = False) -> Any:
    """A finite number > 0 (>= 0 with ``zero_ok``); only an int if ``integer``."""
    wanted = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float)):
        raise ConfigError(key, f"must be {wanted} (got {_show(value)})")
    if not integer and not abs(value) < 1e308:  # inf, nan, or an int too big for a float
        raise ConfigError(key, f"must be {wanted} (got {_show(value)})")
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(key, f"must be {'>= 0' if zero_ok else '> 0'} (got {_show(value)})")
    return value if integer else float(value)


def _one_of(*choices: str) -> _Check:
    def check(key: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(choices)} (got {_show(value)})")
        return value

    return check


def _matching(pattern: re.Pattern[str], max_length: int, rule: str) -> _Check:
    """A check for a non-empty string of at most ``max_length`` that ``pattern`` matches."""

    def check(key: str, value: object) -> str:
        text = _string(key, value)
        if len(text) > max_length or not pattern.fullmatch(text):
            raise ConfigError(key, f"must be {rule} (got {_show(text)})")
        return text

    return check


_uuid = _matching(_UUID, 52, "1 to 52 letters, digits and '-', starting with a letter or digit")
_node_name = _matching(
    _DNS_SUBDOMAIN,
    253,
    "a node name: lowercase letters, digits, '-' and '.', at most 253 characters",
)


def _resource_name(key: str, value: object, *, empty_ok: bool = False) -> str:
    """A Kubernetes extended resource name, ``domain/name``, outside kubernetes.io."""
    text = _string(key, value, empty_ok=empty_ok)
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
        f"must be an extended resource name like example.com/gpu-mem: "
        f"{problem} (got {_show(text)})",
    )


def _default_node_name(environ: Mapping[str, str]) -> str:
    name, source = environ.get("NODE_NAME", ""), "$NODE_NAME"
    if not name:  # kubelet's default node name is the trimmed, lowercased hostname
        name, source = socket.gethostname().strip().lower(), "the hostname"
    try:
        return _node_name("node_name", name)
    except ConfigError as err:
        raise ConfigError(
            "node_name", f"{err.problem} from {source}; set node_name in the config file"
        ) from None


# --- helpers --------------------------------------------------------------------------


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _show(value: object) -> str:
    """A found value for a message: YAML-like (quoted strings, true, null), at most 60 chars."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen: set[object] = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {_show(key)} twice",
                    key_node.start_mark,
                )
            seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)
