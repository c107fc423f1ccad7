"""Pins ``nodemgr doctor``: each verdict (what was found -> PASS/WARN/FAIL, with the fix for
WARN/FAIL) as a pure function; the probes against real files and real unix sockets in a fake
node tree (hooks.d, containerd config and base spec, cgroup mounts, /proc status); the daemon
probe against the real hook server, which it must leave unchanged; the Kubernetes API check
against the test API server (tests/harness/apiserver_sim.py, the real client end to end): all
of nodemgr.kubernetes.adapter.API_PERMISSIONS allowed passes, a missing verb FAILs naming it
and the RBAC
fix, a rejected token, a stopped server and missing credentials FAIL, an unknown node WARNs,
``kubernetes.enabled: false`` WARNs without a request; a simulated node with a listening
kubelet and pod-resources socket, the stand-in MPS binary, a valid CRI-O hook, a running
hook server and an API server that knows it passes (exit 0: only the simulated-GPU WARN
remains); a node without NVML or kubelet FAILs with the reason and the fix (exit 1, through
the real ``nodemgr`` command); a bad config is one FAIL line naming the key (exit 2)."""

from __future__ import annotations

import ctypes.util
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from types import SimpleNamespace

import pytest
import yaml

from hooks import protocol
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.cli.doctor import checks as doctor
from nodemgr.cli.doctor.checks import (
    FAIL,
    PASS,
    WARN,
    HookEntry,
    Host,
    KubeProbe,
    Result,
    RuntimeHooks,
    SocketProbe,
)
from nodemgr.cli.install import steps as install
from nodemgr.config.loading import load_settings
from nodemgr.enforcement.hookserver import HookServer
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.inventory import Card, open_inventory
from nodemgr.kubernetes import adapter as kube
from nodemgr.kubernetes import client as kube_client
from nodemgr.status.server import DaemonFacts, LiveStatus, StatusServer
from tests.harness.apiserver_sim import ACCESS_REVIEWS, TestApiServer
from tests.harness.daemon_proc import MPS_STANDIN, _console_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHIPPED_HOOKS_D = os.path.join(REPO, "hooks", "oci-hooks.d")
SHIPPED_CONTAINERD_HOOKS = os.path.join(REPO, "hooks", "containerd", "gpushare-hooks.json")
HOOK_BIN = "/usr/local/bin/gpushare-hook"
T4 = Card(0, "GPU-0", "Tesla T4", 15360, compute_capability="7.5", mig_enabled=False)
NVML_NOT_FOUND = (  # what nodemgr.inventory.nvml raises on a machine without the driver
    "NVML library (libnvidia-ml.so.1) not found: is the NVIDIA driver installed and loaded "
    "(nvidia-smi works)? On a machine without GPUs, set gpus.backend: simulated"
)


def short_dir() -> str:
    """A directory for unix sockets: their paths must stay under 108 bytes."""
    return tempfile.mkdtemp(prefix="gsd-", dir="/tmp")


def listening(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    server.bind(path)
    server.listen(8)
    return server


def write(path: str, text: str, mode: int | None = None) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    if mode is not None:
        os.chmod(path, mode)
    return path


def fake_node(
    root: str, *, crio_hooks: bool = True, hook_bin: bool = True, cgroup: str = "v2", uid: int = 0
) -> Host:
    """A node tree: /proc/self/status, cgroups, the hook binary and (optionally) CRI-O hooks."""
    cap_eff = "000001ffffffffff" if uid == 0 else "0000000000000000"
    write(f"{root}/proc/self/status", f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    with open(f"{root}/proc/self/status", "a") as f:
        f.write(f"CapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n")
    if cgroup == "v2":
        write(f"{root}/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    elif cgroup == "hybrid":
        write(f"{root}/sys/fs/cgroup/unified/cgroup.controllers", "\n")
        write(f"{root}/sys/fs/cgroup/memory/cgroup.procs", "1\n")
    elif cgroup == "v1":
        write(f"{root}/sys/fs/cgroup/memory/cgroup.procs", "1\n")
        write(f"{root}/sys/fs/cgroup/pids/cgroup.procs", "1\n")
    if hook_bin:
        write(f"{root}{HOOK_BIN}", "#!/bin/sh\nexit 0\n", 0o755)
    if crio_hooks:
        os.makedirs(f"{root}/etc/containers/oci/hooks.d")
        for name in os.listdir(SHIPPED_HOOKS_D):
            shutil.copy(os.path.join(SHIPPED_HOOKS_D, name), f"{root}/etc/containers/oci/hooks.d")
    return Host(root=root, search_path="/nonexistent")


def entry(stage=doctor.CREATE, socket_path="/run/gpushare/hook.sock", **kw):
    values = dict(
        source="/etc/containers/oci/hooks.d/50-gpushare-create.json",
        stage=stage,
        path=HOOK_BIN,
        args=("gpushare-hook", "--socket", socket_path, stage),
        executable=True,
    )
    values.update(kw)
    return HookEntry(**values)


# --- pure verdicts -----------------------------------------------------------------------


def test_config_verdicts_point_at_the_installed_config():
    settings = SimpleNamespace(node_name="node-a", gpus=SimpleNamespace(backend="nvml"))
    given = doctor.config_result("/etc/g.yaml", settings, False)
    assert given == Result("config", PASS, "/etc/g.yaml: valid (node node-a, GPU backend nvml)")
    assert doctor.config_result(None, settings, False).status == PASS
    installed = doctor.config_result(None, settings, True)
    assert installed.status == WARN
    assert installed.fix == "nodemgr doctor --config /etc/gpushare/config.yaml"
    assert doctor.INSTALLED_CONFIG == install.CONFIG_PATH


def test_privileges_need_root_and_cap_net_admin():
    euid, caps = doctor.parse_proc_status("Uid:\t1000\t0\t0\t0\nCapEff:\t0000000000001000\n")
    assert (euid, caps) == (0, 1 << 12)  # the effective UID is the second field
    assert doctor.privileges_result(0, 1 << 12).status == PASS
    no_cap = doctor.privileges_result(0, 0)
    assert no_cap.status == WARN and "periodic scan" in no_cap.detail
    user = doctor.privileges_result(1000, 0)
    assert user.status == WARN and "uid 1000" in user.detail
    assert "sudo nodemgr doctor" in user.fix


def test_driver_version_from_proc():
    text = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert doctor.parse_driver_version(text) == "550.54.14"
    assert doctor.parse_driver_version("garbage\n") is None


def test_gpus_without_nvml_name_the_missing_piece_and_the_fix():
    no_module = doctor.gpus_result("nvml", None, NVML_NOT_FOUND, None)
    assert no_module.status == FAIL
    assert no_module.detail == (
        "NVML library (libnvidia-ml.so.1) not found; no NVIDIA kernel module loaded "
        "(/proc/driver/nvidia/version absent)"
    )
    assert "modprobe nvidia" in no_module.fix and "gpus.backend: simulated" in no_module.fix
    module_only = doctor.gpus_result("nvml", None, NVML_NOT_FOUND, "550.54.14")
    assert module_only.status == FAIL and "kernel module 550.54.14 is loaded" in module_only.detail
    assert "same version 550.54.14" in module_only.fix
    no_cards = doctor.gpus_result("nvml", (), None, "550.54.14")
    assert no_cards.status == FAIL and "nvidia-smi -L" in no_cards.fix


def test_gpus_found_and_simulated():
    found = doctor.gpus_result("nvml", (T4,), None, "550.54.14")
    assert found == Result("GPUs", PASS, "NVML: driver 550.54.14, 1 card: GPU0 Tesla T4 15360 MiB")
    simulated = doctor.gpus_result("simulated", (T4, T4), None, None)
    assert simulated.status == WARN
    assert simulated.detail.startswith("simulated: not a real GPU node (2 cards:")
    assert "gpus.backend: nvml" in simulated.fix


def test_card_compute_capability_for_mps():
    assert doctor.card_result(T4, mps_enabled=True) == Result(
        "GPU0", PASS, "Tesla T4, compute capability 7.5 (MPS needs >= 7.0), MIG off"
    )
    pascal = Card(1, "GPU-1", "Tesla P4", 7680, compute_capability="6.1")
    old = doctor.card_result(pascal, mps_enabled=True)
    assert old.check == "GPU1" and old.status == FAIL
    assert "6.1 < 7.0" in old.detail and "shared/reference/mps.md" in old.detail
    assert "mps.enabled: false" in old.fix
    # Without MPS the capability limits nothing.
    assert doctor.card_result(pascal, mps_enabled=False).status == PASS
    unknown = doctor.card_result(Card(2, "GPU-2", "X", 1024), mps_enabled=True)
    assert unknown.status == WARN and "compute_cap" in unknown.fix


def test_mig_cards_are_not_shared():
    mig = Card(0, "GPU-0", "A100", 40960, compute_capability="8.0", mig_enabled=True)
    result = doctor.card_result(mig, mps_enabled=True)
    assert result.status == WARN and "MIG mode is on" in result.detail
    assert "nvidia-smi -i 0 -mig 0" in result.fix
    both = doctor.card_result(
        Card(3, "GPU-3", "P", 1024, compute_capability="6.0", mig_enabled=True), mps_enabled=True
    )
    assert both.status == FAIL and "MIG" in both.detail and "6.0 < 7.0" in both.detail


def test_mps_binary_verdicts():
    off = doctor.mps_binary_result(False, "nvidia-cuda-mps-control", None, None, False, "nvml")
    assert off.status == PASS and "mps.enabled: false" in off.detail
    missing = doctor.mps_binary_result(
        True, "nvidia-cuda-mps-control", None, "is not in $PATH", False, "nvml"
    )
    assert missing.status == FAIL
    assert missing.detail.startswith("nvidia-cuda-mps-control is not in $PATH")
    assert "mps.control_binary" in missing.fix and "mps.enabled: false" in missing.fix
    found = doctor.mps_binary_result(True, "x", "/usr/bin/x", None, False, "nvml")
    assert found == Result("MPS control binary", PASS, "x → /usr/bin/x")
    # The stand-in is fine with simulated cards and suspicious on a real node.
    assert doctor.mps_binary_result(True, "/s", "/s", None, True, "simulated").status == PASS
    assert doctor.mps_binary_result(True, "/s", "/s", None, True, "nvml").status == WARN


@pytest.mark.parametrize(
    "state, status, found",
    [
        ("ok", PASS, "kubelet listens at /k/device-plugins/kubelet.sock"),
        ("no_dir", FAIL, "no directory /k/device-plugins"),
        ("missing", FAIL, "no socket at /k/device-plugins/kubelet.sock: kubelet is not running"),
        ("refused", FAIL, "stale socket (nobody listens)"),
        ("not_socket", FAIL, "exists but is not a socket"),
        ("timeout", FAIL, "accepts no connection"),
        ("denied", WARN, "permission denied"),
    ],
)
def test_kubelet_socket_verdicts(state, status, found):
    result = doctor.kubelet_socket_result(
        "kubelet socket", "/k/device-plugins/kubelet.sock", SocketProbe(state)
    )
    assert result.status == status and found in result.detail
    if status == FAIL:
        assert "stay Pending" in result.detail  # what it means for pods
        assert "kubelet" in result.fix
    if state in ("missing", "no_dir"):
        assert "--root-dir DIR, set kubelet.device_plugin_dir: DIR/device-plugins" in result.fix


def test_pod_resources_socket_verdict_names_its_key_and_consequence():
    result = doctor.kubelet_socket_result(
        "pod-resources socket", "/k/pod-resources/kubelet.sock", SocketProbe("missing")
    )
    assert result.status == FAIL and "never released" in result.detail
    assert "kubelet.pod_resources_socket: DIR/pod-resources/kubelet.sock" in result.fix


def test_cgroup_verdicts():
    assert doctor.cgroup_result("v2", []).status == PASS
    hybrid = doctor.cgroup_result("hybrid", ["memory"])
    assert hybrid.status == PASS and "support v1 and v2" in hybrid.detail
    assert doctor.cgroup_result("v1", ["memory", "pids"]).status == PASS
    none = doctor.cgroup_result("none", [])
    assert none.status == FAIL and "mount -t cgroup2" in none.fix


def test_no_hook_anywhere_fails_with_install_fix():
    result = doctor.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", False), RuntimeHooks("containerd", True)],
        "/run/gpushare/hook.sock",
    )
    assert result.status == FAIL
    assert result.detail.startswith("containers are not checked at creation")
    assert "nodemgr install" in result.fix and 'README "Enforcement"' in result.fix


def test_valid_hooks_pass_and_broken_ones_fail():
    sock = "/run/gpushare/hook.sock"
    good = RuntimeHooks("CRI-O/podman", True, [entry(), entry(doctor.POSTSTOP)])
    result = doctor.runtime_hook_result([good], sock)
    assert result == Result(
        "runtime hook",
        PASS,
        f"CRI-O/podman: {HOOK_BIN} (createRuntime, poststop; socket {sock})",
    )
    elsewhere = RuntimeHooks("CRI-O/podman", True, [entry(socket_path="/x.sock")])
    wrong = doctor.runtime_hook_result([elsewhere], sock)
    assert wrong.status == FAIL and f"calls /x.sock, but this config's daemon serves {sock}" in (
        wrong.detail
    )
    gone = doctor.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry(executable=False), entry(doctor.POSTSTOP)])],
        sock,
    )
    assert gone.status == FAIL and "is not an executable file" in gone.detail


def test_hook_warnings():
    sock = "/run/gpushare/hook.sock"
    no_poststop = doctor.runtime_hook_result([RuntimeHooks("CRI-O/podman", True, [entry()])], sock)
    assert no_poststop.status == WARN and "no poststop hook" in no_poststop.detail
    conditional = doctor.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry(always=False), entry(doctor.POSTSTOP)])], sock
    )
    assert conditional.status == WARN and "when.always is not true" in conditional.detail
    other = doctor.runtime_hook_result(
        [
            RuntimeHooks("CRI-O/podman", True, [entry(), entry(doctor.POSTSTOP)]),
            RuntimeHooks("containerd", True),
        ],
        sock,
    )
    assert other.status == WARN and "containerd is configured here without" in other.detail


def test_hook_entry_socket_defaults_to_the_hooks_default():
    assert entry(args=("gpushare-hook", "createRuntime")).socket == "/run/gpushare/hook.sock"


def test_oci_hook_file_parsing():
    with open(os.path.join(SHIPPED_HOOKS_D, "50-gpushare-create.json")) as f:
        shipped = json.load(f)
    [found] = doctor.oci_hook_entries("f.json", shipped, lambda path: True)
    assert (found.stage, found.path, found.socket, found.always) == (
        "createRuntime",
        HOOK_BIN,
        "/run/gpushare/hook.sock",
        True,
    )
    other = {"version": "1.0.0", "hook": {"path": "/usr/bin/nvidia-ctk"}, "stages": ["prestart"]}
    assert doctor.oci_hook_entries("o.json", other, lambda path: True) == []
    with pytest.raises(ValueError):
        doctor.oci_hook_entries("b.json", {"hook": {"path": HOOK_BIN}}, lambda path: True)


def test_containerd_runtimes_of_config_v2_and_v3():
    import tomllib

    v2 = tomllib.loads(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        'default_runtime_name = "runc"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        'base_runtime_spec = "/etc/containerd/gpushare-base-spec.json"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\n'
    )
    assert doctor.containerd_base_specs(v2) == [
        ("runc", "/etc/containerd/gpushare-base-spec.json", True),
        ("kata", None, False),
    ]
    v3 = tomllib.loads(
        'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]\n'
        'base_runtime_spec = "/s.json"\n'
    )
    assert doctor.containerd_base_specs(v3) == [("runc", "/s.json", True)]


def test_daemon_verdicts():
    hook, status = "/run/gpushare/hook.sock", "/run/gpushare/status.sock"
    ok, missing = SocketProbe("ok"), SocketProbe("missing")
    down = doctor.daemon_result(hook, missing, status, missing, None)
    assert down.status == FAIL and down.detail.startswith("not running: no hook socket")
    assert "fail closed" in down.detail and "systemctl enable --now gpushare-node" in down.fix
    stale = doctor.daemon_result(hook, SocketProbe("refused"), status, SocketProbe("refused"), None)
    assert stale.status == FAIL and "stale socket" in stale.detail
    odd = doctor.daemon_result(hook, SocketProbe("bad_answer", "not JSON"), status, ok, None)
    assert odd.status == FAIL and "not JSON" in odd.detail
    no_status = doctor.daemon_result(hook, ok, status, missing, None)
    assert no_status.status == WARN and "`nodemgr status` cannot reach it" in no_status.detail


def test_daemon_readiness_from_its_status_document():
    hook, status, ok = "/run/gpushare/hook.sock", "/run/gpushare/status.sock", SocketProbe("ok")
    daemon = {"pid": 42, "version": "0.4.0", "ready": True, "registered": True}
    ready = doctor.daemon_result(hook, ok, status, ok, {"daemon": daemon, "gpus": []})
    assert ready == Result(
        "gpushare-node",
        PASS,
        f"running (pid 42, version 0.4.0), ready: registered with kubelet, MPS healthy; "
        f"answers on {hook}",
    )
    sick = {"index": 1, "healthy": False, "problem": "MPS control daemon down"}
    document = {"daemon": dict(daemon, ready=False, registered=False), "gpus": [sick]}
    not_ready = doctor.daemon_result(hook, ok, status, ok, document)
    assert not_ready.status == WARN
    assert "not ready: not registered with kubelet; GPU1: MPS control daemon down" in (
        not_ready.detail
    )


def test_ledger_verdicts():
    none = doctor.ledger_result("/var/lib/gpushare", False, None, None)
    assert none.status == WARN and "no ledger yet" in none.detail
    assert "does not exist" in none.detail
    assert doctor.ledger_result("/s", True, (2, 1), None) == Result(
        "ledger",
        PASS,
        f"/s/{LEDGER_FILE} opens read-only: 2 allocation(s), 1 registered container(s)",
    )
    corrupt = doctor.ledger_result(
        "/s", True, None, "the ledger /s/ledger.sqlite is corrupt (x); to recover, stop it"
    )
    assert corrupt == Result(
        "ledger", FAIL, "the ledger /s/ledger.sqlite is corrupt (x)", "stop it"
    )


ALL_VERBS = tuple(
    (group, resource, verb) for group, resource, verbs in kube.API_PERMISSIONS for verb in verbs
)
SERVER = "https://10.0.0.1:6443"
CREDS = "kubernetes.kubeconfig (/etc/gpushare/kubeconfig)"


def test_kubernetes_disabled_warns_what_is_lost():
    result = doctor.kubernetes_disabled_result()
    assert result.status == WARN
    assert result.detail == (
        "disabled: no pod annotations, node labels or events; the gpushare scheduler extender "
        "and kubectl inspect gpushare won't see this node's allocations"
    )
    assert "kubernetes.enabled: true" in result.fix and "deploy/README.md" in result.fix


def test_kubernetes_credentials_verdict_keeps_the_fix_out_of_the_finding():
    fix = kube_client.CREDENTIALS_FIX
    problem = kube_client.credentials_problem(
        f"no Kubernetes credentials (tried kubernetes.kubeconfig: not set; $KUBECONFIG: not "
        f"set): {fix}"
    )
    assert doctor.kubernetes_credentials_result(problem, fix) == Result(
        "Kubernetes API",
        FAIL,
        "kubernetes.enabled, but no Kubernetes credentials (tried kubernetes.kubeconfig: not "
        "set; $KUBECONFIG: not set): gpushare-node would run as a plain device plugin (no pod "
        "annotations, node labels or events)",
        fix,
    )
    named = f"kubernetes.kubeconfig /k: no such file; create it or {fix}"
    assert kube_client.credentials_problem(named) == "kubernetes.kubeconfig /k: no such file"
    unusable = f"credentials from $KUBECONFIG (/k) are unusable: bad YAML; fix the file or {fix}"
    assert kube_client.credentials_problem(unusable) == (
        "credentials from $KUBECONFIG (/k) are unusable: bad YAML"
    )


def test_kubernetes_api_verdicts():
    probe = KubeProbe(CREDS, SERVER, "node-a")
    unreachable = doctor.kubernetes_result(
        KubeProbe(**{**probe.__dict__, "error": "get nodes/node-a: timed out", "unavailable": True})
    )
    assert unreachable.status == FAIL
    assert unreachable.detail == (
        f"API server {SERVER} (credentials from {CREDS}) unreachable: get nodes/node-a: timed out"
    )
    rejected = doctor.kubernetes_result(
        KubeProbe(**{**probe.__dict__, "error": "HTTP 401", "error_status": 401})
    )
    assert rejected.status == FAIL and "credentials rejected" in rejected.detail
    assert "python deploy/render.py kubeconfig" in rejected.fix

    allowed = KubeProbe(**{**probe.__dict__, "node": "found", "checked": ALL_VERBS})
    passed = doctor.kubernetes_result(allowed)
    assert passed == Result(
        "Kubernetes API",
        PASS,
        f"API server {SERVER} (credentials from {CREDS}): node node-a found; RBAC allows every "
        "request gpushare-node makes (get, list, watch, patch on pods; get, patch on nodes; "
        "patch on nodes/status; create, patch on events)",
    )
    no_node = doctor.kubernetes_result(KubeProbe(**{**allowed.__dict__, "node": "missing"}))
    assert no_node.status == WARN
    assert "node node-a does not exist there (node_name wrong? kubelet not registered" in (
        no_node.detail
    )
    assert "set node_name" in no_node.fix

    refused_get = KubeProbe(**{**allowed.__dict__, "node": None, "node_error": "HTTP 403 (x)"})
    other_authorizer = doctor.kubernetes_result(refused_get)
    assert other_authorizer.status == FAIL and other_authorizer.detail.endswith("yet HTTP 403 (x)")

    denied = (("", "pods", "watch"), ("", "nodes/status", "patch"))
    refused = doctor.kubernetes_result(KubeProbe(**{**allowed.__dict__, "denied": denied}))
    assert refused.status == FAIL
    assert refused.detail.endswith(
        "RBAC denies 2 of the 9 requests gpushare-node makes: watch on pods; patch on "
        "nodes/status missing"
    )
    assert "`python deploy/render.py rbac | kubectl apply -f -`" in refused.fix


def test_render_aligns_checks_and_appends_fix_and_summary():
    text = doctor.render(
        [Result("config", PASS, "ok"), Result("kubelet socket", FAIL, "gone", "start it")]
    )
    assert text.splitlines() == [
        "PASS  config          ok",
        "FAIL  kubelet socket  gone — fix: start it",
        "",
        "1 FAIL, 0 WARN, 1 PASS: gpushare-node cannot work on this node until every FAIL is fixed",
    ]


# --- probes against real files and sockets -----------------------------------------------


def test_probe_socket_states(tmp_path):
    directory = short_dir()
    try:
        path = os.path.join(directory, "k.sock")
        assert doctor.probe_socket(path, 1).state == "missing"
        assert doctor.probe_socket(os.path.join(directory, "no", "k.sock"), 1).state == "no_dir"
        server = listening(path)
        assert doctor.probe_socket(path, 1) == SocketProbe("ok")
        server.close()  # the file stays, nobody listens: what a dead kubelet leaves
        assert doctor.probe_socket(path, 1).state == "refused"
        plain = write(os.path.join(directory, "plain"), "")
        assert doctor.probe_socket(plain, 1).state == "not_socket"
    finally:
        shutil.rmtree(directory)


def test_hook_probe_is_answered_by_the_real_daemon_and_changes_nothing(tmp_path, caplog):
    from tests.harness.cards import simulated_settings

    settings = simulated_settings(str(tmp_path))
    ledger = Ledger(settings.state_dir)
    allocator = Allocator(settings, open_inventory(settings.gpus).cards(), ledger)
    registry = ContainerRegistry(ledger, allocator, None)
    directory = short_dir()
    server = HookServer(registry, os.path.join(directory, "hook.sock"))
    server.start()
    try:
        with caplog.at_level(logging.INFO):
            probe = doctor.probe_hook_socket(server.socket_path, 2)
        assert probe == SocketProbe("ok")
        assert registry.registrations() == [] and ledger.load_registrations() == []
        assert [r for r in caplog.records if r.name.startswith("nodemgr")] == []
    finally:
        server.stop()
        ledger.close()
        shutil.rmtree(directory)


def test_hook_probe_wants_the_protocols_answer():
    directory = short_dir()
    try:
        silent, refusing = (os.path.join(directory, n) for n in ("silent.sock", "refusing.sock"))
        # Something listening that never answers is not taken for the daemon...
        with listening(silent):
            assert doctor.probe_hook_socket(silent, 0.3).state == "timeout"
        # ...nor is one that refuses the no-op poststop (not gpushare-node's protocol).
        with listening(refusing) as server:
            answer = threading.Thread(target=refuse_one, args=(server,))
            answer.start()
            probe = doctor.probe_hook_socket(refusing, 2)
            answer.join()
        assert probe == SocketProbe("bad_answer", "unknown request")
    finally:
        shutil.rmtree(directory)


def refuse_one(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(2)
        protocol.read_message(conn)
        conn.sendall(protocol.encode({"allowed": False, "message": "unknown request"}))


def test_crio_hooks_found_in_a_fake_root(tmp_path):
    root = str(tmp_path)
    host = fake_node(root)
    settings = SimpleNamespace(hook_socket="/run/gpushare/hook.sock")
    result = doctor.check_runtime_hook(settings, host)
    assert result.status == PASS and "CRI-O/podman" in result.detail
    os.remove(f"{root}{HOOK_BIN}")
    gone = doctor.check_runtime_hook(settings, host)
    assert gone.status == FAIL and f"{HOOK_BIN} is not an executable file" in gone.detail
    write(f"{root}/etc/containers/oci/hooks.d/50-gpushare-create.json", '{"gpushare-hook": ')
    broken = doctor.check_runtime_hook(settings, host)
    assert broken.status == FAIL and "names gpushare-hook but is invalid" in broken.detail


def test_etc_hooks_d_replaces_the_same_file_in_usr_share(tmp_path):
    root = str(tmp_path)
    host = fake_node(root)
    # A stale copy in /usr/share with another socket is shadowed by /etc's file of that name.
    with open(os.path.join(SHIPPED_HOOKS_D, "50-gpushare-create.json")) as f:
        stale = f.read().replace("/run/gpushare/hook.sock", "/old/hook.sock")
    write(f"{root}/usr/share/containers/oci/hooks.d/50-gpushare-create.json", stale)
    settings = SimpleNamespace(hook_socket="/run/gpushare/hook.sock")
    assert doctor.check_runtime_hook(settings, host).status == PASS


def test_containerd_base_spec_in_a_fake_root(tmp_path):
    root = str(tmp_path)
    host = fake_node(root, crio_hooks=False)
    settings = SimpleNamespace(hook_socket="/run/gpushare/hook.sock")
    write(f"{root}/etc/containerd/config.toml", "version = 2\n")
    assert doctor.check_runtime_hook(settings, host).status == FAIL
    write(
        f"{root}/etc/containerd/config.toml",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        'base_runtime_spec = "/etc/containerd/gpushare-base-spec.json"\n',
    )
    missing = doctor.check_runtime_hook(settings, host)
    assert missing.status == FAIL and "gpushare-base-spec.json" in missing.detail
    with open(SHIPPED_CONTAINERD_HOOKS) as f:
        hooks = json.load(f)["hooks"]
    spec = {"ociVersion": "1.1.0", "process": {"args": ["sh"]}, "hooks": hooks}
    write(f"{root}/etc/containerd/gpushare-base-spec.json", json.dumps(spec))
    result = doctor.check_runtime_hook(settings, host)
    assert result.status == PASS and result.detail.startswith("containerd: " + HOOK_BIN)


def test_hooks_written_by_nodemgr_install_pass(tmp_path):
    root = str(tmp_path)
    done = subprocess.run(
        [*_console_script("nodemgr"), "install", "--root", root],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    settings = load_settings(f"{root}/etc/gpushare/config.yaml")
    host = fake_node(root, crio_hooks=False, hook_bin=False)
    with open(f"{root}/etc/containers/oci/hooks.d/50-gpushare-create.json") as f:
        hook_path = json.load(f)["hook"]["path"]
    # install points at the real gpushare-hook; under the fake root it is not there yet.
    missing = doctor.check_runtime_hook(settings, host)
    assert missing.status == FAIL and f"{hook_path} is not an executable file" in missing.detail
    write(f"{root}{hook_path}", "#!/bin/sh\n", 0o755)
    assert doctor.check_runtime_hook(settings, host).status == PASS


@pytest.mark.parametrize(
    "layout, status, found",
    [
        ("v2", PASS, "cgroup v2"),
        ("hybrid", PASS, "hybrid"),
        ("v1", PASS, "cgroup v1 (memory, pids hierarchies)"),
        ("none", FAIL, "no cgroup hierarchy"),
    ],
)
def test_cgroup_layout_of_a_fake_root(tmp_path, layout, status, found):
    result = doctor.check_cgroups(fake_node(str(tmp_path), cgroup=layout))
    assert result.status == status and found in result.detail


def test_privileges_read_from_proc_status(tmp_path):
    assert doctor.check_privileges(fake_node(str(tmp_path), uid=1000)).status == WARN
    assert doctor.check_privileges(fake_node(str(tmp_path / "r"), uid=0)).status == PASS


def test_ledger_probe(tmp_path):
    settings = SimpleNamespace(state_dir=str(tmp_path / "state"))
    assert doctor.check_ledger(settings).status == WARN
    Ledger(settings.state_dir).close()
    assert doctor.check_ledger(settings).status == PASS
    for suffix in ("-wal", "-shm"):
        if os.path.exists(os.path.join(settings.state_dir, LEDGER_FILE + suffix)):
            os.remove(os.path.join(settings.state_dir, LEDGER_FILE + suffix))
    write(os.path.join(settings.state_dir, LEDGER_FILE), "not a database at all " * 100)
    corrupt = doctor.check_ledger(settings)
    assert corrupt.status == FAIL and "move the file aside" in corrupt.fix


def test_mps_binary_probe(tmp_path):
    on = SimpleNamespace(enabled=True, control_binary="nvidia-cuda-mps-control")
    settings = SimpleNamespace(mps=on, gpus=SimpleNamespace(backend="simulated"))
    assert doctor.check_mps_binary(settings, Host(search_path=str(tmp_path))).status == FAIL
    shutil.copy(MPS_STANDIN, tmp_path / "nvidia-cuda-mps-control")
    found = doctor.check_mps_binary(settings, Host(search_path=str(tmp_path)))
    assert found.status == PASS and str(tmp_path) in found.detail
    plain = write(str(tmp_path / "plain"), "x", 0o644)
    settings.mps = SimpleNamespace(enabled=True, control_binary=plain)
    not_exec = doctor.check_mps_binary(settings, Host())
    assert not_exec.status == FAIL and "is not executable" in not_exec.detail


# --- the Kubernetes API, against the test API server -------------------------------------


@pytest.fixture
def api_server():
    server = TestApiServer()
    server.start()
    server.add_node("node-a")
    yield server
    server.stop()


def kube_settings(tmp_path, **kubernetes):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"node_name": "node-a", "kubernetes": kubernetes}))
    return load_settings(str(config))


def reviews(server) -> list:
    return [r for r in server.requests if r[:2] == ("POST", ACCESS_REVIEWS)]


def test_kubernetes_with_every_permission_passes(api_server, tmp_path):
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    result = doctor.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == PASS, result
    assert result.detail.startswith(
        f"API server {api_server.url} (credentials from kubernetes.kubeconfig ({kubeconfig})): "
        "node node-a found; RBAC allows every request gpushare-node makes"
    )
    assert api_server.requests[0][:2] == ("GET", "/api/v1/nodes/node-a")
    assert len(reviews(api_server)) == len(ALL_VERBS) == 9


def test_kubernetes_missing_verb_fails_naming_it(api_server, tmp_path):
    api_server.rbac_allowed = {
        (resource, verb)
        for _, resource, verb in ALL_VERBS
        if (resource, verb) != ("events", "patch")
    }
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    result = doctor.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.endswith(
        "RBAC denies 1 of the 9 requests gpushare-node makes: patch on events missing"
    )
    assert "python deploy/render.py rbac | kubectl apply -f -" in result.fix


def test_kubernetes_without_nodes_get_still_names_every_missing_verb(api_server, tmp_path):
    api_server.rbac_allowed = {("pods", "list"), ("pods", "watch")}
    api_server.fail_next("GET", r"/nodes/node-a$", 403)  # what RBAC makes of the GET
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    result = doctor.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.endswith(
        "RBAC denies 7 of the 9 requests gpushare-node makes: get, patch on pods; get, patch on "
        "nodes; patch on nodes/status; create, patch on events missing"
    )


def test_kubernetes_bad_token_fails(api_server, tmp_path):
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    text = (tmp_path / "kubeconfig").read_text().replace(api_server.token, "revoked")
    (tmp_path / "kubeconfig").write_text(text)
    result = doctor.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.startswith(f"API server {api_server.url}: credentials rejected (from ")
    assert "HTTP 401" in result.detail
    assert reviews(api_server) == []  # nothing asked after the rejection


def test_kubernetes_server_stopped_fails_with_its_url(api_server, tmp_path):
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    api_server.stop()
    result = doctor.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.startswith(f"API server {api_server.url} (credentials from ")
    assert " unreachable: get nodes/node-a: no answer from the API server" in result.detail
    assert "reaches it" in result.fix


def test_kubernetes_unknown_node_warns(api_server, tmp_path):
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"node_name": "gpu-7", "kubernetes": {"kubeconfig": kubeconfig}})
    )
    result = doctor.check_kubernetes(load_settings(str(config)), Host())
    assert result.status == WARN
    assert "node gpu-7 does not exist there (node_name wrong? kubelet not registered yet?)" in (
        result.detail
    )


def test_kubernetes_disabled_warns_without_a_request(api_server, tmp_path):
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    settings = kube_settings(tmp_path, enabled=False, kubeconfig=kubeconfig)
    assert doctor.check_kubernetes(settings, Host()) == doctor.kubernetes_disabled_result()
    assert api_server.requests == []


def test_kubernetes_without_credentials_fails_saying_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    result = doctor.check_kubernetes(kube_settings(tmp_path), Host(root=str(tmp_path)))
    assert result.status == FAIL
    assert result.detail == (
        "kubernetes.enabled, but no Kubernetes credentials (tried kubernetes.kubeconfig: not set; "
        "$KUBECONFIG: not set; in-cluster: $KUBERNETES_SERVICE_HOST not set; "
        f"{tmp_path}/home/.kube/config: no such file): gpushare-node would run as a plain device "
        "plugin (no pod annotations, node labels or events)"
    )
    assert "deploy/README.md" in result.fix and "kubernetes.enabled: false" in result.fix
    named = kube_settings(tmp_path, kubeconfig=str(tmp_path / "nowhere"))
    missing = doctor.check_kubernetes(named, Host(root=str(tmp_path)))
    assert missing.status == FAIL
    assert f"kubernetes.kubeconfig {tmp_path}/nowhere: no such file:" in missing.detail


# --- whole runs --------------------------------------------------------------------------


class SimulatedNode:
    """A simulated node with everything doctor can find working: a listening kubelet and
    pod-resources socket, the stand-in MPS binary, the shipped CRI-O hooks in a fake root,
    a daemon's real hook and status servers (allocator, registry, ledger) on its sockets,
    and a test API server that knows node-a and allows everything (its kubeconfig in the
    config)."""

    def __init__(self, tmp_path):
        self.api = TestApiServer()
        self.api.start()
        self.api.add_node("node-a")
        self.sockets = short_dir()
        self.hook_socket = f"{self.sockets}/run/hook.sock"
        self.config_path = str(tmp_path / "config.yaml")
        config = {
            "node_name": "node-a",
            "kubelet": {
                "device_plugin_dir": f"{self.sockets}/dp",
                "pod_resources_socket": f"{self.sockets}/pr/kubelet.sock",
            },
            "state_dir": str(tmp_path / "state"),
            "run_dir": f"{self.sockets}/run",
            "mps": {"control_binary": MPS_STANDIN},
            "kubernetes": {"kubeconfig": self.api.write_kubeconfig(tmp_path / "kubeconfig")},
            "gpus": {
                "backend": "simulated",
                "simulated": {
                    "devices": [{"uuid": "GPU-doc0", "name": "Tesla T4", "memory_mib": 15360}]
                },
            },
        }
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        # The shipped hook files call /run/gpushare/hook.sock, which a test must not take:
        # the fake root's copies call this node's socket (<run_dir>/hook.sock) instead.
        self.host = fake_node(str(tmp_path / "root"))
        hooks_d = tmp_path / "root" / "etc" / "containers" / "oci" / "hooks.d"
        for name in os.listdir(hooks_d):
            text = (hooks_d / name).read_text()
            (hooks_d / name).write_text(text.replace("/run/gpushare/hook.sock", self.hook_socket))
        self.servers = [
            listening(f"{self.sockets}/dp/kubelet.sock"),
            listening(f"{self.sockets}/pr/kubelet.sock"),
        ]
        settings = load_settings(self.config_path)
        self.ledger = Ledger(settings.state_dir)
        allocator = Allocator(settings, open_inventory(settings.gpus).cards(), self.ledger)
        registry = ContainerRegistry(self.ledger, allocator, None)
        self.hook_server = HookServer(registry, self.hook_socket)
        self.hook_server.start()
        facts = DaemonFacts(version="test", ready=True, registered=True)
        live = LiveStatus(
            "node-a", facts, allocator, self.ledger, registry, None, lambda: None, dict
        )
        self.status_server = StatusServer(live, settings.status_socket)
        self.status_server.start()

    def close(self):
        self.status_server.stop()
        self.hook_server.stop()
        self.ledger.close()
        for server in self.servers:
            server.close()
        shutil.rmtree(self.sockets, ignore_errors=True)
        self.api.stop()


def test_simulated_node_passes_what_can_pass(tmp_path, capsys):
    node = SimulatedNode(tmp_path)
    try:
        code = doctor.run(SimpleNamespace(config=node.config_path, json=True), node.host)
    finally:
        node.close()
    results = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
    assert {check: r["status"] for check, r in results.items()} == {
        "config": PASS,
        "privileges": PASS,
        "GPUs": WARN,  # simulated: not a real GPU node
        "MPS control binary": PASS,
        "kubelet socket": PASS,
        "pod-resources socket": PASS,
        "cgroups": PASS,
        "runtime hook": PASS,
        "gpushare-node": PASS,
        "ledger": PASS,
        "Kubernetes API": PASS,
    }
    assert code == 0
    assert all(r["fix"] for r in results.values() if r["status"] != PASS)
    assert results["GPUs"]["detail"].startswith("simulated: not a real GPU node")
    assert results["gpushare-node"]["detail"].startswith("running (pid")
    assert results["Kubernetes API"]["detail"].startswith(f"API server {node.api.url} ")


def test_node_without_kubelet_or_nvml_fails_through_the_real_command(tmp_path):
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("NVML is installed here: the NVML check may pass")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_name": "node-a",
                "kubelet": {
                    "device_plugin_dir": str(tmp_path / "dp"),
                    "pod_resources_socket": str(tmp_path / "pr" / "kubelet.sock"),
                },
                "state_dir": str(tmp_path / "state"),
                "run_dir": str(tmp_path / "run"),
            }
        )
    )
    done = subprocess.run(
        [*_console_script("nodemgr"), "doctor", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line[:4] in doctor._RANK}
    assert lines["GPUs"].startswith("FAIL  ")
    assert "NVML" in lines["GPUs"] and "— fix: install the NVIDIA driver" in lines["GPUs"]
    assert lines["kubelet"].startswith("FAIL  kubelet socket")
    assert f"no directory {tmp_path / 'dp'}" in lines["kubelet"]
    assert "set kubelet.device_plugin_dir: DIR/device-plugins" in lines["kubelet"]
    assert "FAIL, " in done.stdout.splitlines()[-1]


def test_this_machine_default_config_has_no_nvml():
    """The one test that looks at this machine: only what is certain here (no NVML)."""
    if ctypes.util.find_library("nvidia-ml") or os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver")
    done = subprocess.run(
        [*_console_script("nodemgr"), "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    [gpus] = [r for r in json.loads(done.stdout) if r["check"] == "GPUs"]
    assert gpus["status"] == FAIL and "gpus.backend: simulated" in gpus["fix"]


def test_bad_config_is_one_fail_line_naming_the_key(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("resources:\n  placement: roundrobin\n")
    code = doctor.run(SimpleNamespace(config=str(config), json=False), Host(root=str(tmp_path)))
    out = capsys.readouterr().out
    assert code == 2
    assert out.splitlines()[0] == (
        "FAIL  config  config error: resources.placement: must be one of binpack, spread "
        f'(got "roundrobin") — fix: correct resources.placement in {config} '
        f"(`nodemgr check-config --config {config}` rechecks it); nothing else was checked"
    )
