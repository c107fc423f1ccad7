"""Configuration of gpushare-node: load and validate its YAML file.

Every problem raises :class:`~nodemgr.errors.ConfigError` with the dotted key
(``gpus.simulated.devices[1].uuid``), what was found and what is allowed. Unknown and
duplicate keys are refused: a setting that would do nothing is never accepted silently.

No I/O besides reading the file, ``$NODE_NAME`` and the hostname (the default node name).
Longer than 400 lines: one validator per section, all sharing the key-path error shape.
"""

import dataclasses
import os
import re
import socket
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import yaml

from nodemgr.config import values as rules
from nodemgr.config.schema import (
    NUMBER_RANGES,
    PLACEMENT_TRUST_MODES,
    DraSettings,
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
    "CONFIG_HELP",
    "config_error_line",
    "load_settings",
    "settings_from_mapping",
]

# Every command's --config help.
CONFIG_HELP = (
    "the daemon's YAML config, e.g. /etc/gpushare/config.yaml as nodemgr install writes it "
    "(the sockets, state_dir and run_dir are read from it; default: the built-in defaults, "
    "which name /run/gpushare and /var/lib/gpushare)"
)


_Check = Callable[[str, Any], Any]  # (dotted key, raw value) -> validated value


def load_settings(path: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate the config file; ``path`` None gives all defaults.
    ``environ`` (default ``os.environ``): only ``NODE_NAME`` is read."""
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
        raise ConfigError(where, f"must be a YAML mapping of settings (got {rules.show(data)})")
    return settings_from_mapping(data, environ)


def settings_from_mapping(data: object, environ: Mapping[str, str] | None = None) -> Settings:
    """Validate an already-parsed YAML document (None or {} gives all defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            "(top level)", f"must be a YAML mapping of settings (got {rules.show(data)})"
        )
    values = _values(
        "",
        data,
        Settings,
        {
            "node_name": rules.node_name_value,
            "kubelet": _kubelet,
            "state_dir": rules.path_value,
            "run_dir": rules.path_value,
            "gpus": _gpus,
            "resources": _resources,
            "mps": _mps,
            "enforcement": _enforcement,
            "status": _status,
            "metrics": _metrics,
            "kubernetes": _kubernetes,
            "dra": _dra,
        },
    )
    if "node_name" not in values:
        values["node_name"] = _default_node_name(os.environ if environ is None else environ)
    settings = Settings(**values)
    if settings.dra.enabled and not settings.kubernetes.enabled:
        raise ConfigError(
            "dra.enabled",
            "needs kubernetes.enabled: true (NodePrepareResources reads each ResourceClaim "
            "from the API server, and the node's ResourceSlice is published there)",
        )
    return settings


def config_error_line(err: ConfigError) -> str:
    """The one line the daemon prints for a config error before exiting with status 2."""
    line = f"gpushare-node: config error: {err.key}: {err.problem}"
    return re.sub(r"\s*[\r\n]+\s*", " ", line).strip()


# --- sections -------------------------------------------------------------------------


def _values(
    key: str, data: object, cls: type, checks: dict[str, _Check], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The checked values ``data`` (a mapping of ``cls``'s fields; None: empty) gives;
    absent keys are left out (the default applies) unless ``required``."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(key, f"must be a mapping (got {rules.show(data)})")
    known = [field.name for field in dataclasses.fields(cls)]
    for name in data:
        if name not in known:
            raise ConfigError(
                rules.join_key(key, str(name)), f"unknown key; known keys: {', '.join(known)}"
            )
    for name in required:
        if name not in data:
            raise ConfigError(rules.join_key(key, name), "is required")
    return {name: checks[name](rules.join_key(key, name), value) for name, value in data.items()}


def _kubelet(key: str, data: object) -> KubeletSettings:
    return KubeletSettings(
        **_values(
            key,
            data,
            KubeletSettings,
            {
                "device_plugin_dir": rules.path_value,
                "pod_resources_socket": rules.path_value,
                "reconcile_interval_seconds": _number("kubelet.reconcile_interval_seconds"),
                "allocation_grace_seconds": _number("kubelet.allocation_grace_seconds"),
            },
        )
    )


def _gpus(key: str, data: object) -> GpuSettings:
    backend_check = rules.one_of("nvml", "simulated")
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
                "usage_file": partial(rules.path_value, empty_ok=True),
            },
        )
    )


def _devices(key: str, data: object) -> tuple[SimulatedDevice, ...]:
    if not isinstance(data, list):
        raise ConfigError(key, f"must be a list of devices (got {rules.show(data)})")
    devices: list[SimulatedDevice] = []
    index_of_uuid: dict[str, int] = {}
    for index, item in enumerate(data):
        item_key = f"{key}[{index}]"
        device = SimulatedDevice(
            **_values(
                item_key,
                item,
                SimulatedDevice,
                {
                    "uuid": rules.card_uuid,
                    "name": rules.string_value,
                    "memory_mib": _integer("gpus.simulated.devices[].memory_mib"),
                },
                required=("uuid", "name", "memory_mib"),
            )
        )
        if device.uuid in index_of_uuid:
            raise ConfigError(
                f"{item_key}.uuid",
                f"must be unique (got {rules.show(device.uuid)}, "
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
                "memory": rules.resource_name,
                "memory_unit_mib": _integer("resources.memory_unit_mib"),
                "core": rules.resource_name,
                "whole": partial(rules.resource_name, empty_ok=True),
                "placement": rules.one_of("binpack", "spread"),
            },
        )
    )
    field_of_name: dict[str, str] = {}
    for field in ("memory", "core", "whole"):
        name = getattr(resources, field)
        if name in field_of_name:
            raise ConfigError(
                f"{key}.{field}",
                f"must differ from {key}.{field_of_name[name]} (both are {rules.show(name)})",
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
                "enabled": rules.boolean_value,
                "control_binary": rules.command_value,
                "supervisor": rules.supervisor_value,
                "shm_size_mib": _integer("mps.shm_size_mib"),
                "health_check_interval_seconds": _number("mps.health_check_interval_seconds"),
                "command_timeout_seconds": _number("mps.command_timeout_seconds"),
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
                "action": rules.one_of("kill", "log"),
                "interval_seconds": _number("enforcement.interval_seconds"),
                "grace_mib": _integer("enforcement.grace_mib"),
                "hook_socket": partial(rules.path_value, empty_ok=True),
            },
        )
    )


def _status(key: str, data: object) -> StatusSettings:
    return StatusSettings(
        **_values(key, data, StatusSettings, {"socket": partial(rules.path_value, empty_ok=True)})
    )


def _metrics(key: str, data: object) -> MetricsSettings:
    return MetricsSettings(
        **_values(
            key,
            data,
            MetricsSettings,
            {"enabled": rules.boolean_value, "address": rules.host_port},
        )
    )


def _kubernetes(key: str, data: object) -> KubernetesSettings:
    return KubernetesSettings(
        **_values(
            key,
            data,
            KubernetesSettings,
            {
                "enabled": rules.boolean_value,
                "kubeconfig": partial(rules.path_value, empty_ok=True),
                "label_prefix": rules.label_prefix,
                "request_timeout_seconds": _number("kubernetes.request_timeout_seconds"),
                "placement_trust": rules.one_of(*PLACEMENT_TRUST_MODES),
                "placement_public_key": partial(rules.path_value, empty_ok=True),
            },
        )
    )


def _dra(key: str, data: object) -> DraSettings:
    dra = DraSettings(
        **_values(
            key,
            data,
            DraSettings,
            {
                "enabled": rules.boolean_value,
                "driver": rules.driver_name,
                "plugins_registry_dir": rules.path_value,
                "plugins_dir": rules.path_value,
                "cdi_dir": rules.path_value,
            },
        )
    )
    for field, path in (
        ("plugins_registry_dir", dra.registration_socket),
        ("plugins_dir", dra.service_socket),
    ):
        if len(path.encode()) > rules.MAX_SOCKET_PATH:
            raise ConfigError(
                f"{key}.{field}",
                f"makes the socket path {rules.show(path)} {len(path.encode())} bytes long; a "
                f"unix socket path is at most {rules.MAX_SOCKET_PATH}",
            )
    return dra


def _default_node_name(environ: Mapping[str, str]) -> str:
    name, source = environ.get("NODE_NAME", ""), "$NODE_NAME"
    if not name:  # kubelet's default node name is the trimmed, lowercased hostname
        name, source = socket.gethostname().strip().lower(), "the hostname"
    try:
        return rules.node_name_value("node_name", name)
    except ConfigError as err:
        raise ConfigError(
            "node_name", f"{err.problem} from {source}; set node_name in the config file"
        ) from None


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key given twice in one mapping."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {rules.show(key)} twice",
                    key_node.start_mark,
                )
            seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)


def _number(range_key: str) -> Callable[[str, object], Any]:
    return rules.number_in(NUMBER_RANGES[range_key])


def _integer(range_key: str) -> Callable[[str, object], Any]:
    return rules.number_in(NUMBER_RANGES[range_key], integer=True)
