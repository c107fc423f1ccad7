"""Does a container's OCI spec stay within its allocation? (pure)

From the spec facts the hook sends (:mod:`hooks.specfacts`), a container may see:

- its own cards' ``/dev/nvidia<minor>`` (c 195:<minor>) and the control nodes
  (/dev/nvidiactl 195:255, /dev/nvidia-modeset 195:254, and nvidia-uvm's and
  nvidia-caps' dynamic majors, ``NodeGpus.control_majors``);
- with a shared allocation and MPS on: its card's MPS client directory (what Allocate
  mounts), never another card's;
- entries of the NVIDIA toolkit's device list naming its own cards.

Anything else of a GPU is refused, and anything of a GPU at all without an allocation: other
cards' nodes and MPS directories, its own card's pipe directory (it holds
``control_privileged``) and /dev/shm tmpfs (its MPS control daemon's and server's alone: a
container's /dev/shm is its runtime's own), the MPS root or a directory above it (a parent
shows all below it), ``/dev`` or ``/``, rules allowing other minors, ``c 195:*`` or every
char device, and numbers outside Linux's range (runc would truncate them, maybe to 195). The
devices cgroup is what really stops a process opening a node; this check keeps the spec from
asking for more than the allocation, so a node is judged by type and numbers, never its
name: one named as NVIDIA's with other numbers (``/dev/nvidia-uvm`` as ``c 1:1``,
/dev/mem) must be the host's node of that name (``NodeGpus.host_nodes``), else refused.

No container may mount a path of the daemon's own (:class:`DaemonPaths`) or a directory
above one: through them it could register containers, read every allocation or call
Allocate itself.

Node-wide containers asking for no GPU at all are the exception: a privileged one (a
rule allowing every device) or one mounting the host's ``/``, ``/dev`` or a parent of
gpushare-node's directories (``/run``, ``/var/lib/kubelet``). Such a container
(kube-proxy, CNI agents, node-exporter, NVIDIA's device plugin, DCGM) is root on the
node in all but name: no spec check can fence it and refusing it would break the node;
keeping tenants out of that is the cluster's job (Pod Security Admission ``baseline``).
What it names of a GPU in particular is still refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from hooks.specfacts import (
    CONTROL_MINORS,
    CONTROL_NODES,
    DEVICE_LIST_DIRS,
    NVIDIA_MAJOR,
    NVIDIA_NODE_PREFIX,
    covers,
    in_range,
    normpath,
    nvidia_named,
    rule_may_allow_nvidia,
    under,
)
from hooks.textsafe import quote

NO_ALLOCATION_FIX = (
    "GPUs on this node are given only through the device plugin resources (request "
    "aliyun.com/gpu-mem, aliyun.com/gpu-core.percentage or whole cards in the pod spec)"
)


@dataclass(frozen=True)
class CardNode:
    uuid: str
    index: int
    minor: int  # /dev/nvidia<minor>: NVML's minor number, else the index (simulated cards)

    def __str__(self) -> str:
        return f"GPU {self.index} ({self.uuid})"


@dataclass(frozen=True)
class DaemonPaths:
    """gpushare-node's own host paths (nodemgr.config.schema.Settings.own_paths)."""

    paths: Mapping[str, str] = field(default_factory=dict)  # path -> what it is
    # run_dir, state_dir, kubelet's device plugin dir: mounting a parent is node-wide
    directories: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostNode:
    """The host's device node of a name (type ``-``: not a device)."""

    type: str
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.type} {self.major}:{self.minor}" if self.type != "-" else "no device node"


@dataclass(frozen=True)
class NodeGpus:
    """The node's cards, MPS directories (mps.layout; root None: MPS off) and the daemon's
    own paths."""

    cards: tuple[CardNode, ...]
    mps_root: str | None = None
    client_dirs: Mapping[str, str] = field(default_factory=dict)  # by card UUID
    shm_dirs: Mapping[str, str] = field(default_factory=dict)  # by card UUID
    retired_shm_dir: str | None = None  # MpsLayout.retired_shm_dir: no one's
    daemon: DaemonPaths = DaemonPaths()
    # From the host now (nodemgr.enforcement.hostdevices); host_nodes: None where the host
    # has no node of that name.
    control_majors: frozenset[int] = frozenset()
    host_nodes: Mapping[str, HostNode | None] = field(default_factory=dict)

    def wide_directories(self) -> tuple[str, ...]:
        if self.daemon.directories:
            return tuple(normpath(d) for d in self.daemon.directories)
        return (normpath(self.mps_root.rsplit("/", 1)[0] or "/"),) if self.mps_root else ()

    def by_minor(self, minor: int) -> CardNode | None:
        return next((c for c in self.cards if c.minor == minor), None)

    def by_name(self, name: str) -> CardNode | None:
        return next((c for c in self.cards if name in (c.uuid, str(c.index))), None)


@dataclass(frozen=True)
class Grant:
    allocation_id: str
    cards: tuple[str, ...]
    shared: bool

    def holds(self, card: CardNode | None) -> bool:
        return card is not None and card.uuid in self.cards


@dataclass(frozen=True)
class MountFact:
    destination: str
    sources: tuple[str, ...]  # host paths it shows
    nodes: tuple[tuple[int, int], ...] = ()  # (major, minor) of char device nodes among them


@dataclass(frozen=True)
class DeviceFact:
    path: str
    type: str
    major: int
    minor: int


@dataclass(frozen=True)
class RuleFact:
    allow: bool
    type: str
    major: int | None  # None: any
    minor: int | None
    access: str


@dataclass(frozen=True)
class SpecFacts:
    mounts: tuple[MountFact, ...] = ()
    devices: tuple[DeviceFact, ...] = ()
    rules: tuple[RuleFact, ...] = ()


# (what shows it, what it shows) of the first GPU thing beyond a grant; None for none.
Shown = tuple[str, str] | None


def spec_problem(
    spec: SpecFacts, grant: Grant | None, node: NodeGpus, env_asks_gpus: bool = True
) -> str | None:
    """Why the spec shows more than ``grant`` (None: no allocation) gives; None if not.
    A container whose env asks for no GPU gets none through its spec either (it would
    not be registered, so not watched)."""
    if grant is None and not env_asks_gpus:
        spec = _without_node_wide(spec, node)
    shown = _first_shown(spec, grant if env_asks_gpus else None, node)
    if shown is None:
        return None
    what, thing = shown
    if grant is None:
        return f"{what} shows {thing} without a gpushare allocation: {NO_ALLOCATION_FIX}"
    if not env_asks_gpus:
        return (
            f"{what} shows {thing} while its env asks for no GPU: a container holding "
            f"allocation {grant.allocation_id} gets its GPUs through its env "
            "(NVIDIA_VISIBLE_DEVICES), so that gpushare-node registers and watches it"
        )
    held = ", ".join(str(node.by_name(uuid) or uuid) for uuid in grant.cards)
    return (
        f"{what} shows {thing}, beyond allocation {grant.allocation_id} ({held}): a "
        "container may see only its own cards' device nodes and MPS client directory; "
        "remove it (gpushare-node and the NVIDIA runtime give the container what "
        "it holds)"
    )


def is_node_wide(spec: SpecFacts, node: NodeGpus) -> bool:
    return any(_allows_every_device(rule) for rule in spec.rules) or any(
        _host_wide(mount, node) for mount in spec.mounts
    )


def _allows_every_device(rule: RuleFact) -> bool:
    return rule.allow and rule.major is None and rule.minor is None and rule.type in ("a", "c")


def _host_wide(mount: MountFact, node: NodeGpus) -> bool:
    """A mount of the host's /, /dev or a strict parent of the daemon's directories, and
    nothing narrower of a GPU."""
    if mount.nodes or not mount.sources:
        return False
    destination = normpath(mount.destination)
    if any(under(destination, directory) for directory in DEVICE_LIST_DIRS):
        return False
    directories = node.wide_directories()
    for source in map(normpath, mount.sources):
        wide = source in ("/", "/dev") or any(
            under(directory, source) and source != directory for directory in directories
        )
        if not wide:
            return False
    return True


def _without_node_wide(spec: SpecFacts, node: NodeGpus) -> SpecFacts:
    if any(_allows_every_device(rule) for rule in spec.rules):
        return SpecFacts()
    mounts = tuple(m for m in spec.mounts if not _host_wide(m, node))
    return SpecFacts(mounts, spec.devices, spec.rules)


def _first_shown(spec: SpecFacts, grant: Grant | None, node: NodeGpus) -> Shown:
    for mount in spec.mounts:
        shown = _mount_shown(mount, grant, node)
        if shown:
            return shown
    for device in spec.devices:
        shown = _device_shown(device, grant, node)
        if shown:
            return shown
    for rule in spec.rules:
        shown = _rule_shown(rule, grant, node)
        if shown:
            return shown
    return None


def _mount_shown(mount: MountFact, grant: Grant | None, node: NodeGpus) -> Shown:
    destination = normpath(mount.destination)
    for directory in DEVICE_LIST_DIRS:
        if under(destination, directory):
            what = f"the mount at {quote(destination)}"
            return _device_list_shown(what, destination, directory, grant, node)
    for source in mount.sources:
        shown = _path_shown(normpath(source), destination, grant, node)
        if shown:
            return shown
    named = [source for source in map(normpath, mount.sources) if nvidia_named(source)]
    for major, minor in mount.nodes:
        what = f"the mount at {quote(destination)}"
        if not in_range(major, minor):
            return what, f"device {major}:{minor} (outside Linux's range)"
        if major == NVIDIA_MAJOR:
            shown = _minor_shown(what, minor, grant, node)
            if shown:
                return shown
        elif major in node.control_majors:
            if grant is None:
                return what, f"an NVIDIA control node (c {major}:{minor})"
        elif named:
            return what, (
                f"c {major}:{minor} under the NVIDIA name {quote(named[0])}, which is no "
                "NVIDIA node (a node is judged by its numbers, not its name)"
            )
    return None


def _path_shown(path: str, destination: str, grant: Grant | None, node: NodeGpus) -> Shown:
    what = f"the mount of {quote(path)} at {quote(destination)}"
    if node.mps_root is not None and covers(path, node.mps_root):
        return _mps_shown(what, path, grant, node)
    for own in sorted(node.daemon.paths, key=len, reverse=True):  # the narrowest named
        if covers(path, normpath(own)):
            return what, f"{node.daemon.paths[own]} {own}"
    if under(NVIDIA_NODE_PREFIX, path):  # "/" or "/dev"
        return what, "every /dev/nvidia* node (every card)"
    if path.startswith(NVIDIA_NODE_PREFIX):
        return _node_path_shown(what, path, grant, node)
    for directory in DEVICE_LIST_DIRS:
        if under(path, directory):
            return _device_list_shown(what, path, directory, grant, node)
    return None


def _mps_shown(what: str, path: str, grant: Grant | None, node: NodeGpus) -> Shown:
    root = node.mps_root
    assert root is not None
    if grant is not None and grant.shared:
        allowed = [node.client_dirs[c] for c in grant.cards if c in node.client_dirs]
        if any(under(path, normpath(d)) for d in allowed):
            return None
    if under(root, path):
        return what, f"every card's MPS directory (it holds gpushare-node's MPS root {root})"
    name = path[len(root) :].strip("/").split("/")[0]
    card = node.by_name(name)
    card_shm = None if card is None else node.shm_dirs.get(card.uuid)
    if card_shm is not None and under(path, normpath(card_shm)):
        return what, (
            f"{card}'s /dev/shm tmpfs, its MPS control daemon's and server's alone (earlier "
            "versions gave it to the card's shared containers: recreate the pod; its /dev/shm "
            "is then its runtime's own)"
        )
    if card is not None:
        return what, f"{card}'s MPS directory {quote(path[len(root) :].strip('/'))}"
    if node.retired_shm_dir is not None and under(path, normpath(node.retired_shm_dir)):
        return what, (
            "the /dev/shm that earlier versions shared between every card's containers "
            "(recreate the pod: it gets its card's own)"
        )
    return what, f"gpushare-node's MPS directory {quote(name)}"


def _node_path_shown(what: str, path: str, grant: Grant | None, node: NodeGpus) -> Shown:
    if any(under(path, control) for control in CONTROL_NODES):
        return None if grant is not None else (what, f"{quote(path)}, a GPU node")
    number = path[len(NVIDIA_NODE_PREFIX) :]
    if not (number.isascii() and number.isdigit()):
        return what, f"{quote(path)}, not a node gpushare-node gives"
    return _minor_shown(what, int(number), grant, node)


def _minor_shown(what: str, minor: int, grant: Grant | None, node: NodeGpus) -> Shown:
    if minor in CONTROL_MINORS:
        shown = f"{CONTROL_MINORS[minor]} (c {NVIDIA_MAJOR}:{minor})"
        return None if grant is not None else (what, shown)
    card = node.by_minor(minor)
    if grant is not None and grant.holds(card):
        return None
    owner = str(card) if card is not None else "no card of this node"
    return what, f"/dev/nvidia{minor} (c {NVIDIA_MAJOR}:{minor}, {owner})"


def _device_list_shown(
    what: str, path: str, directory: str, grant: Grant | None, node: NodeGpus
) -> Shown:
    name = path[len(directory) :].strip("/").split("/")[0]
    if not name:
        return what, f"the NVIDIA device list {directory} (every card)"
    card = node.by_name(name)
    if grant is not None and grant.holds(card):
        return None
    owner = str(card) if card is not None else "every card or none of this node"
    return what, f"{directory}/{quote(name)} in the NVIDIA device list ({owner})"


def _device_shown(device: DeviceFact, grant: Grant | None, node: NodeGpus) -> Shown:
    path = normpath(device.path)
    numbers = f"{quote(device.type)} {device.major}:{device.minor}"
    what = f"its linux.devices node {quote(path)} ({numbers})"
    char = device.type in ("c", "u")
    if char and not in_range(device.major, device.minor):
        return what, "a device number outside Linux's range (runc would truncate it)"
    if char and device.major == NVIDIA_MAJOR:
        return _minor_shown(what, device.minor, grant, node)
    control = char and device.major in node.control_majors
    if nvidia_named(path) and not control:
        host = node.host_nodes.get(path)
        made = HostNode("c" if char else device.type, device.major, device.minor)
        if host is None:
            return what, (
                "a node named as NVIDIA's that cannot be verified: the host has no "
                f"{quote(path)} (a node is judged by its type and numbers, and one named as "
                "an NVIDIA node must be the host's node of that name)"
            )
        if host != made:
            return what, (
                f"a node named as NVIDIA's that is not the host's {quote(path)} ({host}): it "
                f"is {made} (a node is judged by its type and numbers, not its name)"
            )
        control = True
    if control and grant is None:
        return what, "an NVIDIA control node"
    return None


def _rule_shown(rule: RuleFact, grant: Grant | None, node: NodeGpus) -> Shown:
    if not rule_may_allow_nvidia(asdict(rule), node.control_majors):
        return None
    major = "*" if rule.major is None else rule.major
    minor = "*" if rule.minor is None else rule.minor
    what = (
        f"its device rule allowing {quote(rule.type)} {major}:{minor} {quote(rule.access or 'rwm')}"
    )
    if rule.major is None:
        return what, "every character device, every card's /dev/nvidia* too"
    if not in_range(rule.major, rule.minor):
        return what, "a device number outside Linux's range (runc would truncate it)"
    if rule.major in node.control_majors:
        return None if grant is not None else (what, f"NVIDIA's control nodes (c {major}:*)")
    if rule.minor is None:
        return what, f"c {NVIDIA_MAJOR}:*, every card's /dev/nvidia*"
    return _minor_shown(what, rule.minor, grant, node)
