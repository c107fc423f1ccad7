"""What a container's OCI spec shows of the GPUs (pure; standard library only).

The hook and the daemon share it, so both read a spec the same way. ``read_facts`` reads
config.json's mounts, ``linux.devices`` and ``linux.resources.devices`` as runc does (Go's
encoding/json) into the facts the hook sends (:mod:`hooks.protocol`):

- ``mounts``: every mount that shows host paths (a bind mount's source, resolved against the
  bundle when relative; overlay's lowerdir/upperdir/workdir; ``/dev`` for devtmpfs; any
  absolute source) or whose destination is in an NVIDIA device-list directory; each with its
  destination and its host paths, lexically normal. The hook adds each path's real path
  (symlinks resolved) and the device numbers of a char device node it names;
- ``devices``: the ``linux.devices`` nodes that may be NVIDIA's (char, major 195 or another
  major /proc/devices gives NVIDIA's drivers, such as nvidia-uvm's; or a path under
  /dev/nvidia, whatever its numbers; or a number outside Linux's range, which runc would
  truncate);
- ``rules``: the ``linux.resources.devices`` rules that allow reading or writing a char
  device of one of NVIDIA's majors or of any major (a wildcard, or ``a``: every device).

``touches_gpu`` says cheaply whether the facts touch a GPU or a path of the daemon's own
(then the hook asks the daemon even without GPU env); :mod:`nodemgr.domain.speccheck`
decides whether they stay within an allocation.

Where Go reads a document differently from Python the spec is refused (``SpecError``): a
key that differs from a field runc reads only in case (Go matches field names
case-insensitively, ``ſ`` as ``s``, the Kelvin sign as ``k``), or a value of the wrong
JSON type (runc would fail on it anyway).
"""

import posixpath

NVIDIA_MAJOR = 195  # /dev/nvidia<minor> and the control nodes below
CONTROL_MINORS = {255: "/dev/nvidiactl", 254: "/dev/nvidia-modeset"}
NVIDIA_NODE_PREFIX = "/dev/nvidia"  # /dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm, ...
# Nodes every GPU container needs besides its cards' (dynamic majors for uvm and caps).
CONTROL_NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
    "/dev/nvidia-caps",
)
# The NVIDIA container toolkit's "volume-mounts" device list: entries named by a card's UUID
# or index (or "all") under this directory in the container give it those cards.
DEVICE_LIST_DIRS = ("/var/run/nvidia-container-devices", "/run/nvidia-container-devices")
# Linux device numbers: 12-bit major, 20-bit minor. runc passes a bigger number truncated
# (uint32, then the kernel's 32-bit dev_t), so 4291 would be major 195 again.
MAX_MAJOR = 0xFFF
MAX_MINOR = 0xFFFFF
# The most entries of each list the hook sends (the daemon refuses more).
MAX_ENTRIES = 1024


class SpecError(ValueError):
    """config.json cannot be read as runc reads it; the message names the field."""


def normpath(path: str) -> str:
    """An absolute path, lexically normal: ``.``, ``..``, ``//`` and trailing slashes
    resolved as the kernel resolves them in a path without symlinks."""
    normal = posixpath.normpath("/" + path)
    return "/" + normal.lstrip("/")  # normpath keeps a leading "//" (POSIX leaves it open)


def under(path: str, root: str) -> bool:
    """``path`` is ``root`` or inside it (both normal)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def covers(path: str, target: str) -> bool:
    """Mounting ``path`` shows ``target``: it is ``target``, inside it, or a parent of it."""
    return under(path, target) or under(target, path)


def _fold(key: str) -> str:
    """A key as Go's encoding/json compares it with a field name (simple case folding)."""
    return key.lower().replace("\u017f", "s")  # "\u212a" (Kelvin) lowers to "k" already


def _fields(value: object, names: tuple[str, ...], where: str) -> dict:
    """``value`` as an object whose keys name runc's fields exactly; {} for null."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where} is not an object")
    folded = {_fold(name): name for name in names}
    for key in value:
        name = folded.get(_fold(key))
        if name is not None and key != name:
            raise SpecError(
                f"{where} has the key {key!r}, which runc reads as {name!r} (Go matches "
                f"field names without regard to case): write it {name!r}"
            )
    return value


def _list(value: object, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{where} is not a list")
    return value


def _string(entry: dict, key: str, where: str) -> str:
    value = entry.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SpecError(f"{where}.{key} is not a string")
    return value


def _integer(entry: dict, key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"{where}.{key} is not an integer")
    return value


def top_level(config: dict) -> dict:
    """The fields of config.json the hook reads, checked as runc reads them."""
    return _fields(config, ("process", "mounts", "linux", "annotations"), "config.json")


def process_env(config: dict) -> list:
    """``process.env`` (checked as runc reads it)."""
    process = _fields(top_level(config).get("process"), ("env",), "process")
    return _list(process.get("env"), "process.env")


def nvidia_majors(proc_devices: str) -> frozenset[int]:
    """The char majors ``/proc/devices`` gives NVIDIA's drivers besides 195 (nvidia-uvm,
    nvidia-caps, ...: chosen when the module loads, so only the host can say them)."""
    majors = set()
    in_char = False
    for line in proc_devices.splitlines():
        if line.strip().endswith("devices:"):
            in_char = line.strip() == "Character devices:"
            continue
        number, _, name = line.strip().partition(" ")
        if in_char and name.strip().startswith("nvidia") and number.isdigit():
            majors.add(int(number))
    majors.discard(NVIDIA_MAJOR)
    return frozenset(majors)


# The kernel's dynamic char majors (CHRDEV_MAJOR_DYN_END..254, then 384..511): a driver
# that asks for "any major", as nvidia-uvm, nvidia-caps and nvidia-nvswitch do, gets one
# of these, so no other number can be one of NVIDIA's besides 195.
DYNAMIC_MAJORS = (range(234, 255), range(384, 512))


class HostMajors:
    """NVIDIA's majors besides 195 for ``in``, read once (a subclass's :meth:`read`) and only
    when a number of the dynamic range is asked: ordinary rules (1, 5, 10, 136) never make
    the hook read /proc/devices."""

    _majors: frozenset[int] | None = None

    def read(self) -> frozenset[int]:
        raise NotImplementedError

    def __contains__(self, major: object) -> bool:
        if not isinstance(major, int) or not any(major in r for r in DYNAMIC_MAJORS):
            return False
        if self._majors is None:
            self._majors = self.read()
        return major in self._majors


Majors = frozenset[int] | HostMajors


def read_facts(config: dict, bundle: str, majors: Majors = frozenset()) -> dict:
    """The mounts, devices and rules of config.json that may touch a GPU (see the module)."""
    config = top_level(config)
    linux = _fields(config.get("linux"), ("devices", "resources"), "linux")
    resources = _fields(linux.get("resources"), ("devices",), "linux.resources")
    facts = {
        "mounts": _mounts(_list(config.get("mounts"), "mounts"), bundle),
        "devices": _devices(_list(linux.get("devices"), "linux.devices"), majors),
        "rules": _rules(_list(resources.get("devices"), "linux.resources.devices"), majors),
    }
    for name, entries in facts.items():
        if len(entries) > MAX_ENTRIES:
            raise SpecError(
                f"config.json has {len(entries)} {name} that may touch a GPU, over the "
                f"{MAX_ENTRIES} gpushare-hook checks"
            )
    return facts


def _mounts(entries: list, bundle: str) -> list[dict]:
    facts = []
    names = ("destination", "source", "type", "options")
    for i, entry in enumerate(entries):
        where = f"mounts[{i}]"
        entry = _fields(entry, names, where)
        options = _list(entry.get("options"), f"{where}.options")
        if not all(isinstance(o, str) for o in options):
            raise SpecError(f"{where}.options holds a non-string")
        kind = _string(entry, "type", where)
        destination = normpath(_string(entry, "destination", where))
        sources = host_paths(_string(entry, "source", where), kind, options, bundle)
        if sources or any(under(destination, d) for d in DEVICE_LIST_DIRS):
            facts.append({"destination": destination, "sources": sources, "nodes": []})
    return facts


def host_paths(source: str, kind: str, options: list[str], bundle: str) -> list[str]:
    """The host paths a mount shows in the container, lexically normal."""
    bind = kind == "bind" or "bind" in options or "rbind" in options
    paths = []
    if source.startswith("/"):
        paths.append(source)
    elif bind and source:
        paths.append(posixpath.join(bundle, source))  # runc resolves it in the bundle
    for option in options:
        for prefix in ("lowerdir=", "upperdir=", "workdir="):
            if option.startswith(prefix):
                for path in option[len(prefix) :].split(":"):
                    paths.append(path if path.startswith("/") else posixpath.join(bundle, path))
    if kind == "devtmpfs":
        paths.append("/dev")  # the host's device nodes, all of them
    normal = []
    for path in paths:
        path = normpath(path)
        if path not in normal:
            normal.append(path)
    return normal


def in_range(major: int | None, minor: int | None) -> bool:
    """A Linux device number (None: a rule's wildcard)."""
    return (major is None or 0 <= major <= MAX_MAJOR) and (minor is None or 0 <= minor <= MAX_MINOR)


def _devices(entries: list, majors: Majors) -> list[dict]:
    facts = []
    for i, entry in enumerate(entries):
        where = f"linux.devices[{i}]"
        entry = _fields(entry, ("path", "type", "major", "minor"), where)
        device = {
            "path": normpath(_string(entry, "path", where)),
            "type": _string(entry, "type", where),
            "major": _integer(entry, "major", where) or 0,  # Go's zero value
            "minor": _integer(entry, "minor", where) or 0,
        }
        if device_may_be_nvidia(device, majors):
            facts.append(device)
    return facts


def nvidia_named(path: str) -> bool:
    """A path named as an NVIDIA device node (/dev/nvidia*, lexically normal)."""
    return under(path, "/dev") and path.startswith(NVIDIA_NODE_PREFIX)


def device_may_be_nvidia(device: dict, majors: Majors = frozenset()) -> bool:
    """A linux.devices node that is, or may be, NVIDIA's (see the module)."""
    char = device["type"] in ("c", "u")
    major = device["major"]
    return nvidia_named(device["path"]) or (
        char and (major == NVIDIA_MAJOR or major in majors or not in_range(major, device["minor"]))
    )


def _rules(entries: list, majors: Majors) -> list[dict]:
    facts = []
    for i, entry in enumerate(entries):
        where = f"linux.resources.devices[{i}]"
        entry = _fields(entry, ("allow", "type", "major", "minor", "access"), where)
        allow = entry.get("allow", False)
        if allow is None:
            allow = False
        if not isinstance(allow, bool):
            raise SpecError(f"{where}.allow is not true or false")
        major, minor = _integer(entry, "major", where), _integer(entry, "minor", where)
        rule = {
            "allow": allow,
            "type": _string(entry, "type", where) or "a",  # runc: no type is every device
            # runc: a missing number, or -1, is the wildcard; any negative one matches
            # nothing or everything, so it is read as the wildcard.
            "major": None if major is None or major < 0 else major,
            "minor": None if minor is None or minor < 0 else minor,
            "access": _string(entry, "access", where),
        }
        if rule_may_allow_nvidia(rule, majors):
            facts.append(rule)
    return facts


def rule_grants_use(rule: dict) -> bool:
    """The rule allows reading or writing (not only mknod) a char device."""
    access = rule["access"]
    uses = "r" in access or "w" in access or not access or set(access) - set("rwm")
    return bool(rule["allow"] and rule["type"] != "b" and uses)


def rule_may_allow_nvidia(rule: dict, majors: Majors = frozenset()) -> bool:
    """An allow rule for reading or writing major 195 or another of NVIDIA's ``majors``, any
    major, or a number runc would truncate."""
    if not rule_grants_use(rule):
        return False
    return (
        rule["major"] is None
        or rule["major"] == NVIDIA_MAJOR
        or rule["major"] in majors
        or not in_range(rule["major"], rule["minor"])
    )


def path_touches_gpu(path: str, mps_root: str | None, guarded: tuple[str, ...] = ()) -> bool:
    """A host path whose mount shows GPU things: the MPS root or anything in or above it,
    an NVIDIA node (or /dev or /), an NVIDIA device-list directory; or one of the daemon's
    own ``guarded`` paths (its run_dir, sockets, state_dir), in or above it."""
    if mps_root is not None and covers(path, mps_root):
        return True
    if any(covers(path, own) for own in guarded):
        return True
    if under(NVIDIA_NODE_PREFIX, path) or path.startswith(NVIDIA_NODE_PREFIX):
        return True
    return any(under(path, d) for d in DEVICE_LIST_DIRS)


def touches_gpu(
    facts: dict,
    mps_root: str | None,
    guarded: tuple[str, ...] = (),
    majors: Majors = frozenset(),
) -> str | None:
    """What in the facts touches a GPU or one of the daemon's ``guarded`` paths, or None."""
    for mount in facts["mounts"]:
        if any(under(mount["destination"], d) for d in DEVICE_LIST_DIRS):
            return f"mount at {mount['destination']}"
        for path in mount["sources"]:
            if path_touches_gpu(path, mps_root, guarded):
                return f"mount of {path} at {mount['destination']}"
        for major, minor in mount["nodes"]:
            if major == NVIDIA_MAJOR or major in majors or not in_range(major, minor):
                return f"mount of device {major}:{minor} at {mount['destination']}"
    for device in facts["devices"]:
        return f"device {device['path']}"
    for rule in facts["rules"]:
        return f"device rule {rule['type']} {rule['major']}:{rule['minor']}"
    return None
