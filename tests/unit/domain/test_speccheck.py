"""Pins nodemgr.domain.speccheck: a container's spec may show only its own cards' device nodes
(by minor number, whatever a node is called), the control nodes, its own card's MPS client
directory (shared allocations; never another card's), and device-list entries naming its own
cards, never a card's /dev/shm tmpfs (its MPS control daemon's and server's) nor the
node-wide one of earlier versions, never the control daemon's own pipe directory; a
container without an allocation may show none of them, and one whose env asks for no GPU
none either. Paths are judged after ``..``, ``//`` and trailing slashes, and a parent
directory shows everything below it; a rule allowing another card's minor, c 195:*, every
char device or a number outside Linux's range is refused. Each refusal names the mount, node
or rule and the card."""

import dataclasses

import pytest

from nodemgr.domain.speccheck import (
    CardNode,
    DaemonPaths,
    DeviceFact,
    Grant,
    HostNode,
    MountFact,
    NodeGpus,
    RuleFact,
    SpecFacts,
    spec_problem,
)
from standins.cards import GPU0, GPU1

RUN = "/run/gpushare"
MPS = f"{RUN}/mps"
NODE = NodeGpus(
    cards=(CardNode(GPU0, 0, 0), CardNode(GPU1, 1, 1)),
    mps_root=MPS,
    client_dirs={GPU0: f"{MPS}/{GPU0}/client", GPU1: f"{MPS}/{GPU1}/client"},
    shm_dirs={GPU0: f"{MPS}/{GPU0}/shm", GPU1: f"{MPS}/{GPU1}/shm"},
    retired_shm_dir=f"{MPS}/shm",
    control_majors=frozenset({510}),  # nvidia-uvm's major on this host (/proc/devices)
)
SHARED0 = Grant("ga-1", (GPU0,), shared=True)
WHOLE0 = Grant("ga-2", (GPU0,), shared=False)
WHOLE01 = Grant("ga-3", (GPU0, GPU1), shared=False)


def mounts(*pairs, nodes=()):
    """SpecFacts with one mount per (destination, source)."""
    return SpecFacts(mounts=tuple(MountFact(d, (s,), tuple(nodes)) for d, s in pairs))


def devices(*numbers, path="/dev/nvidia0", type_="c"):
    return SpecFacts(devices=tuple(DeviceFact(path, type_, ma, mi) for ma, mi in numbers))


def rules(*entries):
    """RuleFacts from (type, major, minor, access)."""
    return SpecFacts(rules=tuple(RuleFact(True, t, ma, mi, a) for t, ma, mi, a in entries))


# --- what an allocation may show -------------------------------------------------------------


def test_a_spec_without_gpu_things_passes_with_or_without_an_allocation():
    """Ordinary mounts, nodes and rules (hosts, /dev/null, c 1:3) are no problem for anyone."""
    spec = SpecFacts(
        mounts=(MountFact("/etc/hosts", ("/var/lib/kubelet/pods/x/etc-hosts",)),),
        devices=(DeviceFact("/dev/null", "c", 1, 3),),
        rules=(RuleFact(True, "c", 1, 3, "rwm"), RuleFact(True, "c", None, None, "m")),
    )
    assert spec_problem(spec, None, NODE) is None
    assert spec_problem(spec, SHARED0, NODE) is None


def test_a_shared_container_may_show_its_client_directory_nodes_and_rules():
    """What gpushare-node and the NVIDIA runtime give a shared container on card 0 passes."""
    spec = SpecFacts(
        mounts=(
            MountFact("/tmp/nvidia-mps", (f"{MPS}/{GPU0}/client",)),
            MountFact("/dev/nvidia0", ("/dev/nvidia0",), ((195, 0),)),
            MountFact("/dev/nvidiactl", ("/dev/nvidiactl",), ((195, 255),)),
            MountFact("/dev/nvidia-uvm", ("/dev/nvidia-uvm",), ((510, 0),)),
            MountFact(f"/var/run/nvidia-container-devices/{GPU0}", ("/dev/null",), ((1, 3),)),
            MountFact("/var/run/nvidia-container-devices/0", ("/dev/null",), ((1, 3),)),
        ),
        devices=(
            DeviceFact("/dev/nvidia0", "c", 195, 0),
            DeviceFact("/dev/nvidia-modeset", "c", 195, 254),
        ),
        rules=(RuleFact(True, "c", 195, 0, "rw"), RuleFact(True, "c", 195, 255, "rw")),
    )  # fmt: skip
    assert spec_problem(spec, SHARED0, NODE) is None


def test_a_whole_allocation_may_show_all_its_cards_nodes():
    """A two-card whole allocation may show both cards' nodes (by minor) and rules."""
    spec = SpecFacts(
        devices=(DeviceFact("/dev/nvidia0", "c", 195, 0), DeviceFact("/dev/nvidia1", "c", 195, 1)),
        rules=(RuleFact(True, "c", 195, 1, "rw"),),
    )
    assert spec_problem(spec, WHOLE01, NODE) is None


def test_a_card_is_known_by_its_minor_number_not_its_index():
    """The minor number decides: card 1 with minor 0 owns c 195:0, card 0 (minor 3) does not."""
    node = NodeGpus(cards=(CardNode(GPU0, 0, 3), CardNode(GPU1, 1, 0)))
    assert spec_problem(devices((195, 3)), WHOLE0, node) is None
    problem = spec_problem(devices((195, 0)), WHOLE0, node)
    assert problem is not None and f"GPU 1 ({GPU1})" in problem


# --- another card ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "shown"),
    [
        (f"{MPS}/{GPU1}/client", "client"),
        (f"{MPS}/{GPU1}/client/", "client"),
        (f"{MPS}//{GPU1}/./client", "client"),
        (f"{MPS}/{GPU0}/client/../../{GPU1}/client", "client"),
        (f"{MPS}/{GPU1}/pipe", "pipe"),
        (f"{MPS}/{GPU1}/log", "log"),
        (f"{MPS}/{GPU1}", ""),
    ],
)
def test_another_cards_mps_directory_is_refused_however_written(source, shown):
    """Card 1's client, pipe or log directory, written with //, ., .. or a trailing slash, is
    refused for card 0's allocation, naming the mount, the directory and card 1."""
    problem = spec_problem(mounts(("/tmp/nvidia-mps", source)), SHARED0, NODE)
    assert problem is not None
    assert "at /tmp/nvidia-mps" in problem
    assert f"GPU 1 ({GPU1})'s MPS directory {GPU1}/{shown}".rstrip("/") in problem
    assert "beyond allocation ga-1" in problem and f"GPU 0 ({GPU0})" in problem


def test_its_own_cards_pipe_directory_is_refused():
    """The control daemon's own pipe directory (control_privileged: quit) is the node
    daemon's, not its card's containers'."""
    problem = spec_problem(mounts(("/tmp/nvidia-mps", f"{MPS}/{GPU0}/pipe")), SHARED0, NODE)
    assert problem is not None and f"GPU 0 ({GPU0})'s MPS directory {GPU0}/pipe" in problem


@pytest.mark.parametrize("source", [MPS, f"{MPS}/", RUN, "/run", "/", "/run/gpushare/mps/.."])
def test_a_parent_of_the_mps_root_shows_every_card(source):
    """The MPS root or any directory above it shows every card's MPS directory: refused."""
    problem = spec_problem(mounts(("/mnt", source)), SHARED0, NODE)
    assert problem is not None and "every card's MPS directory" in problem


def test_mps_directories_are_only_for_shared_allocations():
    """A whole-card container may not mount its card's client directory."""
    client = spec_problem(mounts(("/tmp/nvidia-mps", f"{MPS}/{GPU0}/client")), WHOLE0, NODE)
    assert client is not None and f"GPU 0 ({GPU0})'s MPS directory" in client


@pytest.mark.parametrize("source", [f"{MPS}/{GPU1}/shm", f"{MPS}/{GPU1}/shm/sub", f"{MPS}/{GPU1}"])
def test_another_cards_shm_is_refused(source):
    """A container on card 0 mounting card 1's /dev/shm tmpfs (or anything of it, or the
    card's whole MPS directory) is refused, naming card 1."""
    problem = spec_problem(mounts(("/dev/shm", source)), SHARED0, NODE)
    assert problem is not None and f"GPU 1 ({GPU1})'s" in problem, problem
    assert "beyond allocation ga-1" in problem


@pytest.mark.parametrize("grant", [SHARED0, WHOLE0])
@pytest.mark.parametrize(
    "source", [f"{MPS}/{GPU0}/shm", f"{MPS}/{GPU0}/shm/", f"{MPS}/{GPU0}/shm/a/../b"]
)
def test_its_own_cards_shm_is_refused(grant, source):
    """Card 0's tmpfs, or a directory in it, is the /dev/shm of card 0's MPS control daemon
    and server alone: even card 0's own shared container mounting it is refused, told what
    it is and what to do (a kubelet restarting a container of a pod admitted before the
    upgrade still names it)."""
    problem = spec_problem(mounts(("/dev/shm", source)), grant, NODE)
    assert problem is not None, source
    assert f"GPU 0 ({GPU0})'s /dev/shm tmpfs" in problem, problem
    assert "its MPS control daemon's and server's alone" in problem, problem
    assert "recreate the pod" in problem, problem


@pytest.mark.parametrize("grant", [SHARED0, WHOLE0, None])
def test_the_node_wide_shm_of_earlier_versions_is_refused_to_everyone(grant):
    """``<run_dir>/mps/shm``, the one tmpfs earlier versions gave every card's containers,
    is nobody's now: refused, with what to do (a kubelet that restarts a container of a pod
    admitted before the upgrade still names it)."""
    problem = spec_problem(mounts(("/dev/shm", f"{MPS}/shm")), grant, NODE)
    assert problem is not None, grant
    assert "the /dev/shm that earlier versions shared between every card's containers" in problem
    assert "recreate the pod" in problem


def test_without_mps_the_run_dir_is_not_judged():
    """With MPS off there are no MPS directories; a mount under the run dir is no GPU thing."""
    node = NodeGpus(cards=NODE.cards)
    assert spec_problem(mounts(("/mnt", f"{MPS}/{GPU1}/client")), SHARED0, node) is None


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (devices((195, 1), path="/dev/nvidia1"), "/dev/nvidia1 (c 195:1, GPU 1"),
        (devices((195, 1), path="/dev/innocent"), "/dev/nvidia1 (c 195:1, GPU 1"),
        (devices((195, 7)), "/dev/nvidia7 (c 195:7, no card of this node)"),
        (devices((195, 1), type_="u"), "c 195:1"),
        (mounts(("/dev/x", "/dev/nvidia1")), "the mount of /dev/nvidia1 at /dev/x"),
        (mounts(("/dev/x", "/tmp/n"), nodes=[(195, 1)]), "the mount at /dev/x shows /dev/nvidia1"),
        (mounts(("/dev/x", "/dev/nvidia-nvswitch0")), "not a node gpushare-node gives"),
        (rules(("c", 195, 1, "rw")), "allowing c 195:1 rw"),
        (rules(("c", 195, 1, "")), "allowing c 195:1 rwm"),
        (rules(("a", 195, 1, "r")), "allowing a 195:1 r"),
    ],
)  # fmt: skip
def test_another_cards_node_is_refused_whatever_it_is_called(spec, fragment):
    """A node, bind-mounted node or rule of another card's minor (or of no card) is refused,
    named by its number; the node's name in the container does not matter."""
    problem = spec_problem(spec, SHARED0, NODE)
    assert problem is not None and fragment in problem, problem


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (mounts(("/host", "/")), "every card"),
        (mounts(("/host/dev", "/dev/")), "every /dev/nvidia* node"),
        (rules(("c", None, None, "rw")), "every character device"),
        (rules(("a", None, None, "rwm")), "every character device"),
        (rules(("c", None, 1, "w")), "every character device"),
        (rules(("c", 195, None, "rw")), "c 195:*"),
        (rules(("c", 4291, 0, "rw")), "outside Linux's range"),
        (devices((195 + 4096, 1)), "outside Linux's range"),
        (devices((195, 1 << 20)), "outside Linux's range"),
        (mounts(("/dev/x", "/tmp/node"), nodes=[(-1, 0)]), "outside Linux's range"),
    ],
)
def test_every_card_at_once_is_refused_even_with_an_allocation(spec, fragment):
    """/dev or / mounted, rules allowing every char device or every minor of 195, and numbers
    runc would truncate (4291 is 195 again) are refused even for a whole two-card allocation."""
    problem = spec_problem(spec, WHOLE01, NODE)
    assert problem is not None and fragment in problem, problem


def test_rules_that_allow_only_mknod_or_block_devices_pass():
    """c *:* m (mknod only: containerd's default) and b *:* rwm allow no GPU use."""
    spec = SpecFacts(
        rules=(RuleFact(True, "c", None, None, "m"), RuleFact(True, "b", None, None, "rwm"))
    )
    assert spec_problem(spec, None, NODE) is None


def test_deny_rules_are_no_problem():
    """A rule that denies (allow false) allows nothing, whatever it names."""
    spec = SpecFacts(rules=(RuleFact(False, "a", None, None, "rwm"),))
    assert spec_problem(spec, None, NODE) is None


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        (f"/var/run/nvidia-container-devices/{GPU1}", f"GPU 1 ({GPU1})"),
        ("/run/nvidia-container-devices/1", f"GPU 1 ({GPU1})"),
        ("/var/run/nvidia-container-devices/all", "every card or none of this node"),
        ("/var/run/nvidia-container-devices", "(every card)"),
        ("/run/nvidia-container-devices/", "(every card)"),
    ],
)
def test_device_list_entries_of_other_cards_are_refused(path, fragment):
    """A mount at (or of) a device-list entry naming another card, all, or the whole list
    is refused for card 0's allocation; its own card's entry passes."""
    at = spec_problem(mounts((path, "/dev/null")), SHARED0, NODE)
    assert at is not None and "NVIDIA device list" in at and fragment in at
    of = spec_problem(mounts(("/mnt", path)), SHARED0, NODE)
    assert of is not None and fragment in of
    own = f"/var/run/nvidia-container-devices/{GPU0}"
    assert spec_problem(mounts((own, "/dev/null")), SHARED0, NODE) is None


# --- no allocation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (mounts(("/tmp/nvidia-mps", f"{MPS}/{GPU0}/client")), f"GPU 0 ({GPU0})'s MPS directory"),
        (mounts(("/dev/shm", f"{MPS}/{GPU0}/shm")), f"GPU 0 ({GPU0})'s /dev/shm tmpfs"),
        (mounts(("/dev/nvidiactl", "/dev/nvidiactl")), "/dev/nvidiactl, a GPU node"),
        (mounts(("/dev/uvm", "/dev/nvidia-uvm")), "/dev/nvidia-uvm, a GPU node"),
        (devices((195, 255), path="/dev/nvidiactl"), "/dev/nvidiactl (c 195:255)"),
        (devices((510, 0), path="/dev/nvidia-uvm"), "an NVIDIA control node"),
        (rules(("c", 195, 0, "rw")), f"GPU 0 ({GPU0})"),
        (mounts((f"/run/nvidia-container-devices/{GPU0}", "/dev/null")), "NVIDIA device list"),
    ],
)
def test_any_gpu_thing_without_an_allocation_is_refused(spec, fragment):
    """Without an allocation even card 0's pipe directory, the control nodes and card 0's
    minor are refused, naming what and saying how GPUs are given."""
    problem = spec_problem(spec, None, NODE)
    assert problem is not None and fragment in problem, problem
    assert "without a gpushare allocation" in problem
    assert "aliyun.com/gpu-mem" in problem


def test_an_allocation_whose_env_asks_for_no_gpu_gets_none_through_its_spec():
    """A container holding card 0's allocation whose env asks for no GPU may not show even
    card 0's node: it would run unregistered, unwatched."""
    problem = spec_problem(devices((195, 0)), SHARED0, NODE, env_asks_gpus=False)
    assert problem is not None and "while its env asks for no GPU" in problem
    assert "allocation ga-1" in problem
    assert spec_problem(SpecFacts(), SHARED0, NODE, env_asks_gpus=False) is None


def test_the_first_problem_is_named():
    """With several problems, the message names the first mount (mounts, then nodes, rules)."""
    spec = SpecFacts(
        mounts=(MountFact("/a", (f"{MPS}/{GPU1}/client",)),),
        devices=(DeviceFact("/dev/nvidia1", "c", 195, 1),),
    )
    problem = spec_problem(spec, SHARED0, NODE)
    assert problem is not None and problem.startswith(f"the mount of {MPS}/{GPU1}/client at /a")


# --- node-wide containers that ask for no GPU ------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        rules(("a", None, None, "rwm")),
        SpecFacts(
            devices=devices((195, 0), path="/dev/nvidia0").devices
            + devices((195, 1), path="/dev/nvidia1").devices,
            rules=rules(("a", None, None, "rwm")).rules,
        ),
        mounts(("/host", "/")),
        mounts(("/host/run", "/run")),
        mounts(("/host/dev", "/dev")),
    ],
)
def test_a_node_wide_container_that_asks_for_no_gpu_is_let_through(spec):
    """A privileged container (every device allowed, every host node listed, as containerd
    makes it) or one mounting the host's /, /run or /dev, with no GPU env and no allocation,
    is root on the node in all but name (kube-proxy, CNI, node-exporter, DCGM): no spec
    check fences it and refusing it would break the node, so it passes."""
    assert spec_problem(spec, None, NODE, env_asks_gpus=False) is None


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (mounts(("/host", "/"), ("/mps", MPS)), "every card's MPS directory"),
        (mounts(("/host", "/"), ("/x", f"{MPS}/{GPU1}/pipe")), f"GPU 1 ({GPU1})"),
        (mounts(("/host", RUN)), "every card's MPS directory"),
        (devices((195, 1), path="/dev/nvidia1"), "/dev/nvidia1 (c 195:1"),
    ],
)
def test_what_a_no_gpu_container_names_of_a_gpu_is_still_refused(spec, fragment):
    """Without the privileged rule, a node from the GPU, the MPS directories or run_dir
    itself named in particular are refused, host-wide mounts beside them or not."""
    problem = spec_problem(spec, None, NODE, env_asks_gpus=False)
    assert problem is not None and fragment in problem, problem


def test_a_privileged_container_asking_for_a_gpu_gets_no_exception():
    """With GPU env (an allocation), every device allowed is refused as before."""
    problem = spec_problem(rules(("a", None, None, "rwm")), SHARED0, NODE)
    assert problem is not None and "every character device" in problem


# --- the daemon's own paths ----------------------------------------------------------------

PLUGINS = "/var/lib/kubelet/device-plugins"
OWN = DaemonPaths(
    paths={
        RUN: "gpushare-node's run_dir",
        "/var/lib/gpushare": "gpushare-node's state_dir (its ledger)",
        f"{RUN}/hook.sock": "gpushare-node's hook socket",
        "/srv/gs/status.sock": "gpushare-node's status socket",
        f"{PLUGINS}/gpushare-memory.sock": "gpushare-node's device plugin socket (memory)",
    },
    directories=(RUN, "/var/lib/gpushare", PLUGINS),
)
GUARDED = dataclasses.replace(NODE, daemon=OWN)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        (f"{RUN}/hook.sock", f"gpushare-node's hook socket {RUN}/hook.sock"),
        (f"{RUN}/status.sock", f"gpushare-node's run_dir {RUN}"),
        (f"{RUN}/anything", f"gpushare-node's run_dir {RUN}"),
        ("/srv/gs/status.sock", "gpushare-node's status socket /srv/gs/status.sock"),
        ("/srv/gs", "gpushare-node's status socket /srv/gs/status.sock"),
        ("/var/lib/gpushare/ledger.sqlite", "gpushare-node's state_dir (its ledger)"),
        (f"{PLUGINS}/gpushare-memory.sock", "device plugin socket (memory)"),
        (PLUGINS, "device plugin socket (memory)"),
    ],
)
@pytest.mark.parametrize("grant", [None, SHARED0], ids=["no-allocation", "shared"])
def test_the_daemons_own_paths_are_refused_to_everyone(source, fragment, grant):
    """Its sockets wherever configured, anything in run_dir but the allocation's MPS
    directories, the ledger, its device plugin sockets and directories above any of them:
    refused with or without an allocation, naming the path and what it is."""
    asks = grant is not None
    problem = spec_problem(mounts(("/mnt", source)), grant, GUARDED, env_asks_gpus=asks)
    assert problem is not None and fragment in problem, problem


DRA_OWN = DaemonPaths(
    paths={
        **OWN.paths,
        "/var/lib/kubelet/plugins_registry/gpushare.aliyun.com-reg.sock": (
            "gpushare-node's DRA registration socket"
        ),
        "/var/lib/kubelet/plugins/gpushare.aliyun.com": (
            "gpushare-node's DRA plugin directory (its dra.sock)"
        ),
        "/var/run/cdi": "the CDI spec directory (gpushare-node writes its claims' specs there)",
    },
    directories=OWN.directories,
)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("/var/lib/kubelet/plugins/gpushare.aliyun.com/dra.sock", "DRA plugin directory"),
        ("/var/lib/kubelet/plugins", "DRA plugin directory"),
        ("/var/lib/kubelet/plugins_registry", "DRA registration socket"),
        ("/var/run/cdi", "the CDI spec directory"),
        ("/var/run/cdi/k8s.gpushare.aliyun.com-gpu_1.json", "the CDI spec directory"),
    ],
)
def test_the_dra_doors_paths_are_refused_when_it_is_on(source, fragment):
    """With the DRA door on, its sockets (dra.sock unprepares any claim) and the CDI spec
    directory (a spec there is applied to whichever container names it) are the daemon's
    own: a container without GPUs mounting one, or a directory above it short of the
    node-wide ones, is refused."""
    node = dataclasses.replace(NODE, daemon=DRA_OWN)
    problem = spec_problem(mounts(("/mnt", source)), None, node, env_asks_gpus=False)
    assert problem is not None and fragment in problem, problem


def test_what_an_allocation_is_given_in_run_dir_still_passes():
    """The shared allocation's own client directory, under run_dir."""
    spec = mounts(("/tmp/nvidia-mps", f"{MPS}/{GPU0}/client"))
    assert spec_problem(spec, SHARED0, GUARDED) is None


@pytest.mark.parametrize("source", ["/run", "/var/lib", "/var/lib/kubelet", "/var", "/"])
def test_a_parent_of_the_daemons_directories_is_node_wide(source):
    """/run, /var/lib, /var/lib/kubelet (kubelet's PKI, every pod's volumes): a container
    mounting one is root on the node in all but name; with no GPU env it passes."""
    assert spec_problem(mounts(("/host", source)), None, GUARDED, env_asks_gpus=False) is None


def test_the_device_plugin_directory_itself_is_not_node_wide():
    """Mounting kubelet's device plugin directory (as another device plugin would) reaches
    the daemon's sockets: refused unless the container is privileged."""
    spec = mounts(("/var/lib/kubelet/device-plugins", PLUGINS))
    assert spec_problem(spec, None, GUARDED, env_asks_gpus=False) is not None
    privileged = SpecFacts(spec.mounts, rules=rules(("a", None, None, "rwm")).rules)
    assert spec_problem(privileged, None, GUARDED, env_asks_gpus=False) is None


def test_a_path_in_a_message_is_shown_safely():
    """A mount source with a newline is shown as an escaped literal."""
    problem = spec_problem(mounts(("/mnt", f"{RUN}/x\nCRITICAL")), None, GUARDED)
    assert problem is not None and "\n" not in problem and "x\\nCRITICAL" in problem


# --- device nodes by their type and numbers ----------------------------------------------------


def with_host(**nodes: HostNode | None) -> NodeGpus:
    """NODE whose host has these nodes (keyword: the name after /dev/, ``_`` for ``-``)."""
    host = {f"/dev/{name.replace('_', '-')}": node for name, node in nodes.items()}
    return dataclasses.replace(NODE, host_nodes=host)


@pytest.mark.parametrize(
    ("spec", "node", "fragment"),
    [
        (
            devices((1, 1), path="/dev/nvidia-uvm"),
            with_host(nvidia_uvm=None),
            "cannot be verified: the host has no /dev/nvidia-uvm",
        ),
        (
            devices((10, 200), path="/dev/nvidia-uvm-tools"),
            with_host(nvidia_uvm_tools=HostNode("c", 510, 1)),
            "not the host's /dev/nvidia-uvm-tools (c 510:1): it is c 10:200",
        ),
        (
            devices((1, 1), path="/dev/nvidia0"),
            with_host(nvidia0=HostNode("c", 195, 0)),
            "not the host's /dev/nvidia0 (c 195:0): it is c 1:1",
        ),
        (
            devices((510, 0), path="/dev/nvidia-uvm", type_="b"),
            with_host(nvidia_uvm=HostNode("c", 510, 0)),
            "it is b 510:0",
        ),
        (
            mounts(("/dev/nvidia-uvm", "/dev/nvidia-uvm"), nodes=[(1, 1)]),
            NODE,
            "c 1:1 under the NVIDIA name /dev/nvidia-uvm, which is no NVIDIA node",
        ),
    ],
    ids=["uvm-as-mem-unverifiable", "uvm-tools-as-tun", "card-as-mem", "block", "bind-mounted"],
)
def test_a_node_named_as_nvidias_is_judged_by_its_numbers(spec, node, fragment):
    """A node named as NVIDIA's but made with other numbers is refused, even with an
    allocation: compared with the host's node of that name, or, where the host has none,
    refused as unverifiable; a bind-mounted node by the numbers the hook read."""
    problem = spec_problem(spec, SHARED0, node)
    assert problem is not None and fragment in problem, problem


def test_the_hosts_own_node_of_an_nvidia_name_is_a_control_node():
    """A node exactly as the host's node of that NVIDIA name: a control node, fine with an
    allocation, refused without."""
    node = NodeGpus(NODE.cards, host_nodes={"/dev/nvidia-uvm": HostNode("c", 511, 0)})
    spec = devices((511, 0), path="/dev/nvidia-uvm")
    assert spec_problem(spec, SHARED0, node) is None
    problem = spec_problem(spec, None, node)
    assert problem is not None and "an NVIDIA control node" in problem


@pytest.mark.parametrize(
    "spec",
    [
        devices((510, 1), path="/dev/anything"),
        rules(("c", 510, None, "rw")),
        mounts(("/dev/u", "/srv/u"), nodes=[(510, 0)]),
    ],
    ids=["device", "rule", "bind-mounted"],
)
def test_nvidia_control_majors_are_judged_whatever_the_name(spec):
    """nvidia-uvm's major (read from the host): a node, a rule or a bind-mounted node of it
    is fine with an allocation and refused without one, whatever it is called."""
    assert spec_problem(spec, SHARED0, NODE) is None
    problem = spec_problem(spec, None, NODE)
    assert problem is not None and "NVIDIA" in problem and "control node" in problem, problem
