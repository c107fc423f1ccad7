"""The CDI spec a DRA claim gets (pure): what the container runtime injects for it.

kubelet passes the CDI ids NodePrepareResources returned to the runtime, which applies
the container edits of those devices from the spec files in ``/etc/cdi`` and
``/var/run/cdi``. One spec file per claim, one device per allocated result, with the
env and mounts the device plugin's Allocate gives (docs/dra.md, "CDI").

Names: kind ``<driver>/gpu``; device ``<claim UID>-<device>[-<share ID>]``, so two
claims or two shares of one card never share a name. Each part is checked against
CDI's rules, so a spec a runtime would refuse at container start is never written.
``cdiVersion`` is the lowest the fields need: runtimes refuse versions they do not know
(podman 4.3 none past 0.5.0), and a name starting with a digit, as claim UIDs often
do, needs 0.5.0. ``spec_problems`` re-checks a whole spec against CDI's schema and
library rules (CDI refuses a file with an unknown field).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodemgr.domain.model import Mount
from nodemgr.errors import CdiError

DEFAULT_DRIVER = "gpushare.aliyun.com"
DEVICE_CLASS = "gpu"

# Oldest first (CDI accepts neither 0.1.0 nor 0.2.0).
KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")

# Vendor and class: ASCII letters, digits, '_', '-', '.'; first a letter, last a letter
# or digit. Device name: also ':', and it may start with a digit.
_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_NAME_PART = re.compile(r"[A-Za-z0-9_.:-]+")

# CDI passes options as they are; without "bind" runc would try a mount of no type.
_MOUNT_OPTIONS = ("nosuid", "nodev", "bind")

_SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
_EDIT_FIELDS = {
    "env",
    "deviceNodes",
    "mounts",
    "hooks",
    "additionalGids",
    "intelRdt",
    "netDevices",
}
_MOUNT_FIELDS = {"hostPath", "containerPath", "type", "options"}
_NODE_FIELDS = {
    "path",
    "hostPath",
    "type",
    "major",
    "minor",
    "fileMode",
    "permissions",
    "uid",
    "gid",
}


@dataclass(frozen=True)
class ClaimDevice:
    """One allocated result of a claim (``share_id`` None: a card given whole)."""

    device: str
    share_id: str | None
    env: Mapping[str, str]
    mounts: tuple[Mount, ...] = ()


def kind(driver: str) -> str:
    """``<driver>/gpu``; CdiError if the driver name is no CDI vendor."""
    if not _VENDOR_OR_CLASS.fullmatch(driver):
        raise CdiError(
            f"driver name {driver!r} is not a valid CDI vendor (letters, digits, '_', '-', "
            "'.'; starting with a letter, ending with a letter or digit)"
        )
    return f"{driver}/{DEVICE_CLASS}"


def device_name(claim_uid: str, device: str, share_id: str | None) -> str:
    """``<claim UID>-<device>[-<share ID>]``; CdiError naming the part CDI would refuse."""
    parts = [("claim UID", claim_uid), ("device", device)]
    if share_id is not None:
        parts.append(("share ID", share_id))
    for what, value in parts:
        if not _NAME_PART.fullmatch(value):
            raise CdiError(
                f"{what} {value!r} cannot be part of a CDI device name (letters, digits, "
                "'_', '-', '.', ':')"
            )
    name = "-".join(value for _, value in parts)
    if not _DEVICE_NAME.fullmatch(name):
        raise CdiError(f"CDI device name {name!r} must start and end with a letter or digit")
    return name


def qualified_id(spec_kind: str, name: str) -> str:
    return f"{spec_kind}={name}"


def qualified_ids(spec: Mapping[str, Any]) -> list[str]:
    """The ids of a spec's devices, in order (what NodePrepareResources returns)."""
    return [qualified_id(spec["kind"], device["name"]) for device in spec["devices"]]


def spec_file_name(driver: str, claim_uid: str) -> str:
    """The claim's spec file name in the CDI directory: one file per claim."""
    kind(driver)
    device_name(claim_uid, "x", None)
    return f"{driver}-{DEVICE_CLASS}_{claim_uid}.json"


def claim_spec(driver: str, claim_uid: str, devices: Sequence[ClaimDevice]) -> dict[str, Any]:
    """The CDI spec of one claim: one device per allocated result, in order.

    Raises CdiError when the claim has no device, two results would get one name, or a
    name, env entry or mount is one CDI refuses.
    """
    spec_kind = kind(driver)
    if not devices:
        raise CdiError(f"claim {claim_uid}: no device to write a CDI spec for")
    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    for device in devices:
        name = device_name(claim_uid, device.device, device.share_id)
        if name in seen:
            raise CdiError(f"claim {claim_uid}: CDI device {name!r} would be written twice")
        seen.add(name)
        entries.append({"name": name, "containerEdits": _edits(name, device)})
    spec: dict[str, Any] = {"cdiVersion": KNOWN_VERSIONS[0], "kind": spec_kind}
    spec["devices"] = entries
    spec["cdiVersion"] = required_version(spec)
    return spec


def _edits(name: str, device: ClaimDevice) -> dict[str, Any]:
    edits: dict[str, Any] = {}
    env = []
    for key, value in device.env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise CdiError(f"CDI device {name}: env {key!r}={value!r} cannot be set")
        env.append(f"{key}={value}")
    if env:
        edits["env"] = env
    mounts = []
    for mount in device.mounts:
        for what, path in (("container", mount.container_path), ("host", mount.host_path)):
            if not path.startswith("/") or "\0" in path:
                raise CdiError(
                    f"CDI device {name}: mount {what} path {path!r} is not an absolute path"
                )
        mounts.append(
            {
                "hostPath": mount.host_path,
                "containerPath": mount.container_path,
                "options": ["ro" if mount.read_only else "rw", *_MOUNT_OPTIONS],
            }
        )
    if mounts:
        edits["mounts"] = mounts
    return edits


def render(spec: Mapping[str, Any]) -> str:
    """JSON, which every CDI reader takes, on one line: indented, it would take Python's
    pure-Python encoder (four times the C one's time, on the NodePrepareResources path)."""
    return json.dumps(spec, separators=(",", ":")) + "\n"


# --------------------------------------------------------------------- versions


def required_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that has every field and name the spec uses."""
    all_edits = [_as_dict(spec.get("containerEdits"))]
    names = []
    annotated = bool(spec.get("annotations"))
    for device in _as_list(spec.get("devices")):
        device = _as_dict(device)
        all_edits.append(_as_dict(device.get("containerEdits")))
        names.append(str(device.get("name", "")))
        annotated = annotated or bool(device.get("annotations"))

    def any_edit(check: Any) -> bool:
        return any(check(edits) for edits in all_edits)

    _, _, spec_class = str(spec.get("kind", "")).partition("/")
    needs = [
        ("1.1.0", any_edit(lambda e: bool(e.get("netDevices")))),
        ("0.7.0", any_edit(lambda e: "intelRdt" in e or bool(e.get("additionalGids")))),
        ("0.6.0", annotated or "." in spec_class),
        (
            "0.5.0",
            any(name[:1].isdigit() for name in names)
            or any_edit(
                lambda e: any(_as_dict(n).get("hostPath") for n in _items(e, "deviceNodes"))
            ),
        ),
        ("0.4.0", any_edit(lambda e: any(_as_dict(m).get("type") for m in _items(e, "mounts")))),
    ]
    return next((version for version, needed in needs if needed), KNOWN_VERSIONS[0])


# --------------------------------------------------------------------- validation


def spec_problems(spec: Any) -> list[str]:
    """What CDI would refuse in this spec (empty: none)."""
    if not isinstance(spec, dict):
        return ["a CDI spec is a JSON object"]
    problems = _unknown(spec, _SPEC_FIELDS, "spec")
    version = spec.get("cdiVersion")
    if version not in KNOWN_VERSIONS:
        problems.append(f"cdiVersion {version!r} is not one of {', '.join(KNOWN_VERSIONS)}")
    spec_kind = spec.get("kind")
    vendor, _, spec_class = spec_kind.partition("/") if isinstance(spec_kind, str) else ("", "", "")
    if not (_VENDOR_OR_CLASS.fullmatch(vendor) and _VENDOR_OR_CLASS.fullmatch(spec_class)):
        problems.append(f"kind {spec_kind!r} is not <vendor>/<class>")
    problems += _annotation_problems(spec.get("annotations"), "spec")
    if "containerEdits" in spec:
        problems += _edit_problems(spec["containerEdits"], "spec containerEdits")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices must be a non-empty list")
        devices = []
    seen: set[str] = set()
    for index, device in enumerate(devices):
        problems += _device_problems(device, f"devices[{index}]", seen)
    if not problems and KNOWN_VERSIONS.index(version) < KNOWN_VERSIONS.index(
        needed := required_version(spec)
    ):
        problems.append(f"cdiVersion {version} is below {needed}, which the fields need")
    return problems


def _device_problems(device: Any, where: str, seen: set[str]) -> list[str]:
    if not isinstance(device, dict):
        return [f"{where} is not an object"]
    problems = _unknown(device, _DEVICE_FIELDS, where)
    name = device.get("name")
    if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
        problems.append(f"{where}: device name {name!r} is not a valid CDI device name")
    elif name in seen:
        problems.append(f"{where}: device name {name!r} appears twice")
    else:
        seen.add(name)
    problems += _annotation_problems(device.get("annotations"), where)
    if "containerEdits" not in device:
        problems.append(f"{where}: containerEdits is required")
    else:
        problems += _edit_problems(device["containerEdits"], f"{where} containerEdits")
    return problems


def _edit_problems(edits: Any, where: str) -> list[str]:
    if not isinstance(edits, dict):
        return [f"{where} is not an object"]
    problems = _unknown(edits, _EDIT_FIELDS, where)
    for field in ("env", "deviceNodes", "mounts", "hooks", "additionalGids", "netDevices"):
        if field in edits and not isinstance(edits[field], list):
            problems.append(f"{where}: {field} must be a list")
    for entry in _items(edits, "env"):
        key, equals, _ = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        if not key or not equals or "\0" in entry:
            problems.append(f"{where}: env entry {entry!r} is not KEY=VALUE")
    for index, mount in enumerate(_items(edits, "mounts")):
        problems += _path_problems(
            mount, _MOUNT_FIELDS, ("hostPath", "containerPath"), f"{where} mounts[{index}]"
        )
    for index, node in enumerate(_items(edits, "deviceNodes")):
        problems += _path_problems(node, _NODE_FIELDS, ("path",), f"{where} deviceNodes[{index}]")
    return problems


def _path_problems(entry: Any, fields: set[str], required: Iterable[str], where: str) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where} is not an object"]
    problems = _unknown(entry, fields, where)
    for field in required:
        value = entry.get(field)
        if not isinstance(value, str) or not value:
            problems.append(f"{where}: {field} is required")
    options = entry.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        problems.append(f"{where}: options must be a list of strings")
    return problems


def _annotation_problems(annotations: Any, where: str) -> list[str]:
    if annotations is None:
        return []
    if not isinstance(annotations, dict) or not all(
        isinstance(v, str) for v in annotations.values()
    ):
        return [f"{where}: annotations must map strings to strings"]
    return []


def _unknown(entry: dict[str, Any], known: set[str], where: str) -> list[str]:
    return [f"{where}: unknown field {key!r}" for key in sorted(set(entry) - known)]


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _items(edits: dict[str, Any], field: str) -> list[Any]:
    return _as_list(edits.get(field))
