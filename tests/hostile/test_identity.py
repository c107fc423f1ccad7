"""Runtime identity and spec checks under attack: the attacks of docs/attacks.md's table "Runtime
identity and spec checks", each recorded from what it observed.

The node is the real gpushare-node with NVIDIA's real MPS control binary, the test kubelet and
real runc containers whose specs are written as the runtimes write them: CRI-O's annotations
(standins/crio.py) and the hooks of the shipped oci-hooks.d files, or containerd's
annotations and hooks. The CRI-O identity attack runs once more under the real podman 4.3
(its hooks dir as ``nodemgr install`` writes it, the annotations given with ``--annotation``).
Each test records one row (tests/hostile/tenant.py turns refusals and kills into the row's
words); the last test compares the table with that file (``scripts/update-tables`` rewrites
it). An attack that still gets something is an xfail(strict=True) naming why.
"""

from __future__ import annotations

import os

import pytest

from nodemgr.config.loading import load_settings
from nodemgr.config.schema import PLUGIN_SOCKETS
from standins import crio, runc_env
from standins.daemon_proc import GPU0, GPU1, WHOLE
from standins.kubelet_sim import ContainerSpec
from standins.outcome_table import OutcomeTable
from tests.engines import conftest as engines
from tests.hostile import tenant
from tests.hostile.tenant import refusal

pytestmark = [pytest.mark.e2e, pytest.mark.outcome_table]

FORGED_SHARED = (
    "CRI-O: a pod without GPUs annotates itself as another pod (containerd's "
    "`io.kubernetes.cri.sandbox-*` keys) and copies that pod's card, quota env and mounts, "
    "with a made-up allocation id"
)
FORGED_WHOLE = (
    "CRI-O: the same against a pod holding a whole card (`NVIDIA_VISIBLE_DEVICES` = its "
    "card, a made-up allocation id)"
)
FORGED_PODMAN = "the same under podman 4.3, the annotations given with `--annotation`"

OWN_PATHS = {
    "hook": "a pod without GPUs mounts the daemon's hook socket (hostPath `<run_dir>/hook.sock`)",
    "status": "… its status socket (`<run_dir>/status.sock`)",
    "ledger": "… its ledger (`<state_dir>/ledger.sqlite`)",
    "plugin": "… its memory device plugin socket (`<device_plugin_dir>/gpushare-memory.sock`)",
    "plugins": "… kubelet's device plugin directory (its sockets and `kubelet.sock`)",
}

UVM_AS_MEM = (
    "`linux.devices` `/dev/nvidia-uvm` as `c 1:1` (that is `/dev/mem`) in a container "
    "holding an allocation"
)
UVM_TOOLS_AS_TUN = "… `/dev/nvidia-uvm-tools` as `c 10:200` (that is `/dev/net/tun`)"

FORGED_LINE = "2026-11-27 10:00:00,000 CRITICAL nodemgr.enforcement.watchdog: killed process 1"
FORGED_ENV = (
    "`NVIDIA_VISIBLE_DEVICES=<its card>,1<newline>2026-… CRITICAL … killed process 1` with its "
    "pod's own allocation"
)
FORGED_PATH = (
    "a pod without GPUs mounts `<run_dir>/x<CR><ESC>[2K<ESC>[1A2026-… CRITICAL …` (terminal "
    "controls in a hostPath)"
)

TABLE = OutcomeTable(
    "hostile-identity",
    "tests/hostile/test_identity.py",
    "docs/attacks.md",
    ("attack", "result", "what the attacker got"),
    (
        FORGED_SHARED,
        FORGED_WHOLE,
        FORGED_PODMAN,
        *OWN_PATHS.values(),
        UVM_AS_MEM,
        UVM_TOOLS_AS_TUN,
        FORGED_ENV,
        FORGED_PATH,
    ),
)

NOTHING_STARTED = "nothing: the container did not start"
MADE_UP_ID = "ga-0000000000000000"


def crio_hooks(cluster):
    """The spec's hooks as CRI-O puts them there from the shipped oci-hooks.d files."""

    def edit(config: dict) -> None:
        runtime = cluster.runtime
        config["hooks"] = runc_env.shipped_oci_hooks(
            cluster.hook_socket, runtime.launcher, runtime.hook_guards
        )

    return edit


def start_as_crio(cluster, name: str, pod: str, env, mounts=(), pod_annotations=None):
    """``runc run -d`` of container ``main`` of pod default/``pod`` as CRI-O makes it: its
    annotations exactly as CRI-O writes them and the hooks of the oci-hooks.d files."""
    annotations = crio.container_annotations(
        "default", pod, "main", container_id=name, pod_annotations=pod_annotations
    )
    return cluster.start_container(
        name, env, mounts, annotations=annotations, edit=crio_hooks(cluster)
    )


def two_pods(done, name: str, real: str, claimed: str) -> str:
    """The row's words for a refusal because the annotations name two pods: the runtime's
    keys naming ``real``, the other family's ``claimed``."""
    reason = refusal(done, name)
    said = tenant.hook_said(done.stdout)
    assert f"CRI-O, the runtime this hook was installed for, names {real} " in said, said
    assert f"but containerd's keys name {claimed} " in said, said
    return f"{reason}: CRI-O's own keys name {real}, the pod's containerd keys {claimed}"


# --- item 1: the pod identity a container claims ----------------------------------------


def test_a_crio_pod_posing_as_another_by_its_annotations_is_refused(site):
    """Under CRI-O every pod annotation lands in the container's OCI annotations. A pod with
    no GPU request writes containerd's identity keys naming a victim pod that holds 8 GiB on
    GPU0, copies the victim's card, quota env (its pinned limit lowered to 1 GiB) and mounts,
    and makes up an allocation id. Refused, naming both pods: the identity comes from CRI-O's
    own keys, which name the attacker. A pod whose own annotations name itself starts."""
    cluster = site.cluster
    env, mounts = site.admit("victim", memory_gib=8)
    assert start_as_crio(cluster, "victim", "victim", env, mounts).returncode == 0
    forged = {
        **env,
        "GPUSHARE_ALLOCATION_ID": MADE_UP_ID,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M",
    }
    posing = crio.containerd_family("default", "victim", "main")
    done = start_as_crio(cluster, "intruder", "intruder", forged, mounts, posing)
    reason = two_pods(done, "intruder", "default/intruder/main", "default/victim/main")
    tenant.not_started(cluster, "intruder")
    honest = crio.containerd_family("default", "victim", "main")
    assert start_as_crio(cluster, "second", "victim", env, mounts, honest).returncode == 0
    TABLE.record(FORGED_SHARED, reason, NOTHING_STARTED)


def test_a_crio_pod_posing_as_a_whole_card_holder_is_refused(site):
    """As above against a pod holding GPU0 whole: the attacker's env names the card and a
    made-up allocation id (the daemon would take the id for one gone stale and look for the
    claimed pod's allocation on that card). Refused, naming both pods."""
    cluster = site.cluster
    result = cluster.kubelet.admit_pod("default", "holder", [ContainerSpec("main", {WHOLE: 1})])
    assert result.ok, result.error
    env = dict(result.containers[0].envs)
    assert env["NVIDIA_VISIBLE_DEVICES"] in (GPU0, GPU1)
    assert start_as_crio(cluster, "holder", "holder", env).returncode == 0
    forged = {"NVIDIA_VISIBLE_DEVICES": env["NVIDIA_VISIBLE_DEVICES"]}
    forged["GPUSHARE_ALLOCATION_ID"] = MADE_UP_ID
    posing = crio.containerd_family("default", "holder", "main")
    done = start_as_crio(cluster, "grabber", "grabber", forged, pod_annotations=posing)
    reason = two_pods(done, "grabber", "default/grabber/main", "default/holder/main")
    tenant.not_started(cluster, "grabber")
    TABLE.record(FORGED_WHOLE, reason, NOTHING_STARTED)


@pytest.fixture
def podman_node():
    """A node of its own with ``nodemgr install``'s hooks dir, and podman reading it."""
    found = engines.require()
    node = engines.EngineNode()
    podman = engines.Podman(os.path.join(node.node.root, "pm"), node.hooks_dir, found.rootfs)
    try:
        yield node, podman
    finally:
        podman.cleanup()
        node.close()


def test_a_pod_posing_as_another_under_podman_is_refused(podman_node):
    """The CRI-O attack under the real podman 4.3: its hooks dir as ``nodemgr install``
    writes it, every annotation CRI-O would write given with ``--annotation``, the victim's
    env and mounts with a made-up allocation id. Refused, naming both pods; the victim's
    own container (the same annotations without the forged keys) runs."""
    node, podman = podman_node
    env, mounts = node.admit("victim", memory_gib=8)
    own = crio.container_annotations("default", "victim", "main", container_id="victim")
    ran = podman.run("victim", env, mounts, own)
    assert ran.returncode == 0, ran.stderr
    forged = {**env, "GPUSHARE_ALLOCATION_ID": MADE_UP_ID}
    posing = crio.containerd_family("default", "victim", "main")
    annotations = crio.container_annotations(
        "default", "intruder", "main", container_id="intruder", pod_annotations=posing
    )
    done = podman.run("intruder", forged, mounts, annotations)
    assert done.returncode != 0, "intruder started"
    said = done.stderr.split("gpushare-hook: ", 1)[1]
    assert "CRI-O, the runtime this hook was installed for, names default/intruder/main" in said
    assert "containerd's keys name default/victim/main" in said, said
    state = podman.inspect("intruder")
    assert state is None or not state["State"]["Running"]
    assert node.registered() == {ran.id}
    reason = said.split(": ", 2)[1].split(":")[0]  # after "gpushare-node refused container …"
    TABLE.record(
        FORGED_PODMAN,
        f"refused by the daemon: {reason}: CRI-O's own keys name default/intruder/main, the "
        "pod's containerd keys default/victim/main",
        NOTHING_STARTED,
    )


# --- item 9: the daemon's own paths --------------------------------------------------------


def own_path(node, case: str) -> str:
    """The host path of ``case`` (OWN_PATHS) on this node."""
    settings = load_settings(node.config_path)
    plugins = settings.kubelet.device_plugin_dir
    return {
        "hook": settings.hook_socket,
        "status": settings.status_socket,
        "ledger": os.path.join(settings.state_dir, "ledger.sqlite"),
        "plugin": os.path.join(plugins, PLUGIN_SOCKETS["memory"]),
        "plugins": plugins,
    }[case]


@pytest.mark.parametrize("case", list(OWN_PATHS))
def test_a_mount_of_the_daemons_own_paths_is_refused(site, case):
    """A container without GPU env (and not node-wide) bind-mounts one of the daemon's own
    paths, which exists: refused, naming it. Through it the container could register
    containers, read every allocation or call Allocate."""
    cluster = site.cluster
    path = own_path(cluster.node, case)
    assert os.path.exists(path), path  # the mount itself would work
    done = cluster.start_container("reach", {"HOME": "/"}, [(f"/mnt/{case}", path)])
    reason = refusal(done, "reach")
    tenant.not_started(cluster, "reach")
    assert "gpushare-node's" in reason, reason
    TABLE.record(OWN_PATHS[case], reason, NOTHING_STARTED)


# --- item 10: device nodes by their numbers --------------------------------------------------


@pytest.mark.parametrize(
    ("case", "path", "major", "minor"),
    [(UVM_AS_MEM, "/dev/nvidia-uvm", 1, 1), (UVM_TOOLS_AS_TUN, "/dev/nvidia-uvm-tools", 10, 200)],
    ids=["uvm-as-mem", "uvm-tools-as-tun"],
)
def test_a_control_node_name_on_other_numbers_is_refused(site, case, path, major, minor):
    """A container holding an allocation lists a node named as an NVIDIA control node but
    made with another device's numbers: refused. A node is judged by its type and numbers;
    one named as NVIDIA's must be the host's node of that name, which this GPU-less host
    does not have: it cannot be verified, so it is refused, saying so."""
    cluster = site.cluster
    env, mounts = site.admit("nodes")
    node = {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666,
            "uid": 0, "gid": 0}  # fmt: skip

    def edit(config: dict) -> None:
        config["linux"].setdefault("devices", []).append(node)

    done = cluster.start_in_pod("nodes", "nodes", env, mounts, edit=edit)
    reason = refusal(done, "nodes")
    tenant.not_started(cluster, "nodes")
    said = tenant.hook_said(done.stdout)
    assert f"the host has no {path}" in said, said
    TABLE.record(case, f"{reason}: the host has no {path} to compare it with", NOTHING_STARTED)


# --- item 11: values from containers in the log -------------------------------------------


def shortened(done):
    """``done`` with the forged line shortened in runc's output, for the row's words."""
    done.stdout = done.stdout.replace(FORGED_LINE, "2026-… CRITICAL … killed process 1")
    return done


def forged_lines(log: str) -> list[str]:
    """Lines of the daemon's log that begin with the forged text (lines it never wrote)."""
    return [line for line in log.splitlines() if line.startswith(FORGED_LINE[:24])]


def test_a_log_line_forged_in_an_env_value_stays_inside_its_line(site):
    """The container's card list carries a newline and a whole log line after it: refused
    (its cards differ from the allocation's); the daemon's log and the hook's message show
    the value escaped on one line, and no line of the log begins with the forged text."""
    cluster = site.cluster
    before = len(cluster.node.log())
    env, mounts = site.admit("scribe")
    cards = f"{env['NVIDIA_VISIBLE_DEVICES']},1\n{FORGED_LINE}"
    done = cluster.start_in_pod(
        "scribe", "scribe", {**env, "NVIDIA_VISIBLE_DEVICES": cards}, mounts
    )
    said = tenant.hook_said(done.stdout)
    reason = refusal(shortened(done), "scribe")
    tenant.not_started(cluster, "scribe")
    assert "\n" not in said and ",1\\n2026-11-27 10:00:00,000 CRITICAL" in said, said
    log = site.wait_log("gpushare-node refused container scribe")[before:]
    assert forged_lines(log) == [], forged_lines(log)
    assert ",1\\n2026-11-27 10:00:00,000 CRITICAL" in log
    TABLE.record(
        FORGED_ENV,
        f"{reason}; logged and passed on with the value escaped on its line (`\\n`)",
        "no line of the daemon's log of its own",
    )


def test_terminal_controls_in_a_mount_path_are_shown_escaped(site):
    """A pod without GPUs mounts a directory in run_dir whose name holds a carriage return
    and terminal escapes (erase the line, move up) before a forged line: refused; neither
    the daemon's log nor the hook's message holds a raw control character."""
    cluster = site.cluster
    before = len(cluster.node.log())
    name = f"x\r\x1b[2K\x1b[1A{FORGED_LINE}"
    path = os.path.join(cluster.node.root, "run", name)
    os.mkdir(path)
    try:
        done = cluster.start_container("painter", {"HOME": "/"}, [("/mnt/painter", path)])
        said = tenant.hook_said(done.stdout)
        reason = refusal(shortened(done), "painter")
        tenant.not_started(cluster, "painter")
    finally:
        os.rmdir(path)
    assert "\r" not in said and "\x1b" not in said and "x\\r\\x1b[2K" in said, said
    log = site.wait_log("gpushare-node refused container painter")[before:]
    assert "\r" not in log and "\x1b" not in log
    assert forged_lines(log) == []
    TABLE.record(
        FORGED_PATH,
        f"{reason}; the path shown escaped (`\\r`, `\\x1b`), in the log too",
        "no line of the daemon's log rewritten",
    )


# --- the docs table ---------------------------------------------------------------------------


def test_docs_table_says_what_was_observed():
    """After a complete run, the table in docs/attacks.md is what this module observed."""
    if not TABLE.complete:
        missing = [c for c in TABLE.expected_cases if c not in TABLE.rows]
        pytest.skip(f"partial run, the docs table is not judged (no row for {missing})")
    problem = TABLE.check_or_update()
    assert problem is None, problem
