"""Pins doctor's runtime hook check: no hook anywhere FAILs with the install fix; valid hooks
pass; a hook calling another socket or not executable FAILs; a missing poststop, a
conditional hook or a runtime without the hook WARN; the shipped hooks.d files and
containerd base specs (config v2 and v3) parse; and, in a fake node tree, CRI-O hooks, /etc
shadowing /usr/share, containerd's base spec and the hooks nodemgr install writes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from nodemgr.cli.doctor import runtime_hook
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.cli.doctor.runtime_hook import HookEntry, RuntimeHooks
from nodemgr.config.loading import load_settings
from nodemgr.config.schema import Settings
from standins.daemon_proc import _console_script
from tests.unit.cli.doctor.support import (
    HOOK_BIN,
    SHIPPED_CONTAINERD_HOOKS,
    SHIPPED_HOOKS_D,
    fake_node,
    write,
)


def node_settings(backend="nvml"):
    """The defaults the shipped files are written for, on a node of this GPU backend."""
    defaults = Settings(node_name="n")
    return dataclasses.replace(defaults, gpus=dataclasses.replace(defaults.gpus, backend=backend))


def entry(stage=runtime_hook.CREATE, socket_path="/run/gpushare/hook.sock", **kw):
    values = dict(
        source="/etc/containers/oci/hooks.d/50-gpushare-create.json",
        stage=stage,
        path=HOOK_BIN,
        args=("gpushare-hook", "--socket", socket_path, "--runtime", "cri-o", stage),
        executable=True,
    )
    values.update(kw)
    return HookEntry(**values)


# --- verdicts ------------------------------------------------------------------------------


def test_no_hook_anywhere_fails_with_install_fix():
    """No gpushare-hook in any runtime's config FAILs: containers are not checked; the fix
    installs it."""
    result = runtime_hook.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", False), RuntimeHooks("containerd", True)],
        "/run/gpushare/hook.sock",
    )
    assert result.status == FAIL
    assert result.detail.startswith("containers are not checked at creation")
    assert "nodemgr install" in result.fix and "docs/enforcement.md" in result.fix


def test_valid_hooks_pass_and_broken_ones_fail():
    """createRuntime and poststop hooks on the daemon's socket pass; another socket or no binary
    FAILs."""
    sock = "/run/gpushare/hook.sock"
    good = RuntimeHooks("CRI-O/podman", True, [entry(), entry(runtime_hook.POSTSTOP)])
    result = runtime_hook.runtime_hook_result([good], sock)
    assert result == Result(
        "runtime hook",
        PASS,
        f"CRI-O/podman: {HOOK_BIN} (createRuntime, poststop; socket {sock})",
    )
    elsewhere = RuntimeHooks("CRI-O/podman", True, [entry(socket_path="/x.sock")])
    wrong = runtime_hook.runtime_hook_result([elsewhere], sock)
    assert wrong.status == FAIL and f"calls /x.sock, but this config's daemon serves {sock}" in (
        wrong.detail
    )
    gone = runtime_hook.runtime_hook_result(
        [
            RuntimeHooks(
                "CRI-O/podman", True, [entry(executable=False), entry(runtime_hook.POSTSTOP)]
            )
        ],
        sock,
    )
    assert gone.status == FAIL and "is not an executable file" in gone.detail


def test_hook_warnings():
    """A missing poststop, a conditional hook and a configured runtime without the hook each
    WARN."""
    sock = "/run/gpushare/hook.sock"
    no_poststop = runtime_hook.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry()])], sock
    )
    assert no_poststop.status == WARN and "no poststop hook" in no_poststop.detail
    conditional = runtime_hook.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry(always=False), entry(runtime_hook.POSTSTOP)])],
        sock,
    )
    assert conditional.status == WARN and "when.always is not true" in conditional.detail
    other = runtime_hook.runtime_hook_result(
        [
            RuntimeHooks("CRI-O/podman", True, [entry(), entry(runtime_hook.POSTSTOP)]),
            RuntimeHooks("containerd", True),
        ],
        sock,
    )
    assert other.status == WARN and "containerd is configured here without" in other.detail


def test_an_entry_without_runtime_warns_and_another_runtimes_fails():
    """A CRI-O hook without --runtime (an older install) WARNs to rerun nodemgr install; one
    with --runtime containerd FAILs (it would read keys a pod's annotations can write); the
    containerd base spec's entries must name containerd."""
    sock = "/run/gpushare/hook.sock"
    old = ("gpushare-hook", "--socket", sock, "createRuntime")
    older = runtime_hook.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry(args=old), entry(runtime_hook.POSTSTOP)])],
        sock,
    )
    assert older.status == WARN
    assert "the hook has no --runtime" in older.detail and "rerun `nodemgr install`" in older.detail
    swapped = ("gpushare-hook", "--socket", sock, "--runtime=containerd", "createRuntime")
    wrong = runtime_hook.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry(args=swapped), entry(runtime_hook.POSTSTOP)])],
        sock,
    )
    assert wrong.status == FAIL
    assert "runs with --runtime containerd, but this is cri-o's configuration" in wrong.detail
    ctrd = runtime_hook.runtime_hook_result(
        [RuntimeHooks("containerd", True, [entry(), entry(runtime_hook.POSTSTOP)])], sock
    )
    assert ctrd.status == FAIL and "make it --runtime containerd" in ctrd.detail


def test_an_entry_not_told_of_the_daemons_own_paths_warns():
    """The daemon's state_dir missing from the hook's --guard values: WARN naming it (a
    container mounting it would start unchecked); the entries nodemgr install writes carry
    them all."""
    sock = "/run/gpushare/hook.sock"
    guards = ("/var/lib/gpushare", "/srv/status.sock")
    told = ("gpushare-hook", "--socket", sock, "--guard=/srv/status.sock", "--runtime",
            "cri-o", "createRuntime")  # fmt: skip
    result = runtime_hook.runtime_hook_result(
        [RuntimeHooks("CRI-O/podman", True, [entry(args=told), entry(runtime_hook.POSTSTOP)])],
        sock,
        guards,
    )
    assert result.status == WARN
    assert "not told of the daemon's own /var/lib/gpushare (--guard)" in result.detail
    assert "/srv/status.sock" not in result.detail.split("not told of")[1].split("(")[0]
    assert entry(args=told).guards == ("/srv/status.sock",)


def test_hook_entry_socket_defaults_to_the_hooks_default():
    """A hook entry without --socket calls the hook's default socket."""
    assert entry(args=("gpushare-hook", "createRuntime")).socket == "/run/gpushare/hook.sock"


def test_oci_hook_file_parsing():
    """The shipped hooks.d file parses; another product's hook is ignored; an invalid one raises."""
    with open(os.path.join(SHIPPED_HOOKS_D, "50-gpushare-create.json")) as f:
        shipped = json.load(f)
    [found] = runtime_hook.oci_hook_entries("f.json", shipped, lambda path: True)
    assert (found.stage, found.path, found.socket, found.always) == (
        "createRuntime",
        HOOK_BIN,
        "/run/gpushare/hook.sock",
        True,
    )
    other = {"version": "1.0.0", "hook": {"path": "/usr/bin/nvidia-ctk"}, "stages": ["prestart"]}
    assert runtime_hook.oci_hook_entries("o.json", other, lambda path: True) == []
    with pytest.raises(ValueError, match="no stages list"):
        runtime_hook.oci_hook_entries("b.json", {"hook": {"path": HOOK_BIN}}, lambda path: True)


def test_containerd_runtimes_of_config_v2_and_v3():
    """Every CRI runtime's base_runtime_spec is found in containerd config version 2 and 3."""
    import tomllib

    v2 = tomllib.loads(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        'default_runtime_name = "runc"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        'base_runtime_spec = "/etc/containerd/gpushare-base-spec.json"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\n'
    )
    assert runtime_hook.containerd_base_specs(v2) == [
        ("runc", "/etc/containerd/gpushare-base-spec.json", True),
        ("kata", None, False),
    ]
    v3 = tomllib.loads(
        'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]\n'
        'base_runtime_spec = "/s.json"\n'
    )
    assert runtime_hook.containerd_base_specs(v3) == [("runc", "/s.json", True)]


# --- in a fake node tree -----------------------------------------------------------------


def test_crio_hooks_found_in_a_fake_root(tmp_path):
    """The shipped CRI-O hooks pass; a removed binary or a broken hook file FAILs."""
    root = str(tmp_path)
    host = fake_node(root)
    settings = Settings(node_name="n")  # the defaults the shipped files are written for
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == PASS and "CRI-O/podman" in result.detail
    os.remove(f"{root}{HOOK_BIN}")
    gone = runtime_hook.check_runtime_hook(settings, host)
    assert gone.status == FAIL and f"{HOOK_BIN} is not an executable file" in gone.detail
    write(f"{root}/etc/containers/oci/hooks.d/50-gpushare-create.json", '{"gpushare-hook": ')
    broken = runtime_hook.check_runtime_hook(settings, host)
    assert broken.status == FAIL and "names gpushare-hook but is invalid" in broken.detail


def test_no_hook_on_a_simulated_node_says_it_is_expected_there(tmp_path):
    """The quick start (simulated GPUs, no container runtime) has no hook: still a FAIL, as
    nothing is checked at creation, but the line says that is expected on such a node, so a
    newcomer following the quick start is not sent to install one."""
    host = fake_node(str(tmp_path), crio_hooks=False)
    real = runtime_hook.check_runtime_hook(node_settings("nvml"), host)
    simulated = runtime_hook.check_runtime_hook(node_settings("simulated"), host)
    assert real.status == simulated.status == FAIL
    assert "expected" not in real.detail
    assert simulated.detail == real.detail + (
        "; expected on a node with simulated GPUs and no container runtime (the quick start)"
    )


def test_etc_hooks_d_replaces_the_same_file_in_usr_share(tmp_path):
    """A file in /etc's hooks.d shadows a stale one of the same name in /usr/share's."""
    root = str(tmp_path)
    host = fake_node(root)
    # A stale copy in /usr/share with another socket is shadowed by /etc's file of that name.
    with open(os.path.join(SHIPPED_HOOKS_D, "50-gpushare-create.json")) as f:
        stale = f.read().replace("/run/gpushare/hook.sock", "/old/hook.sock")
    write(f"{root}/usr/share/containers/oci/hooks.d/50-gpushare-create.json", stale)
    settings = Settings(node_name="n")  # the defaults the shipped files are written for
    assert runtime_hook.check_runtime_hook(settings, host).status == PASS


def test_containerd_base_spec_in_a_fake_root(tmp_path):
    """containerd without a base spec FAILs, a missing spec file FAILs, the shipped hooks in it
    pass."""
    root = str(tmp_path)
    host = fake_node(root, crio_hooks=False)
    settings = Settings(node_name="n")  # the defaults the shipped files are written for
    write(f"{root}/etc/containerd/config.toml", "version = 2\n")
    assert runtime_hook.check_runtime_hook(settings, host).status == FAIL
    write(
        f"{root}/etc/containerd/config.toml",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        'base_runtime_spec = "/etc/containerd/gpushare-base-spec.json"\n',
    )
    missing = runtime_hook.check_runtime_hook(settings, host)
    assert missing.status == FAIL and "gpushare-base-spec.json" in missing.detail
    with open(SHIPPED_CONTAINERD_HOOKS) as f:
        hooks = json.load(f)["hooks"]
    spec = {"ociVersion": "1.1.0", "process": {"args": ["sh"]}, "hooks": hooks}
    write(f"{root}/etc/containerd/gpushare-base-spec.json", json.dumps(spec))
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == PASS and result.detail.startswith(
        "containerd (/etc/containerd/config.toml, default path, no containerd process found): "
        + HOOK_BIN
    )


def test_hooks_written_by_nodemgr_install_pass(tmp_path):
    """The hook files nodemgr install writes pass once the gpushare-hook they name exists."""
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
    # install writes the launcher the hook files run; without it they fail.
    assert runtime_hook.check_runtime_hook(settings, host).status == PASS
    os.rename(f"{root}{hook_path}", f"{root}{hook_path}.away")
    missing = runtime_hook.check_runtime_hook(settings, host)
    assert missing.status == FAIL and f"{hook_path} is not an executable file" in missing.detail


# --- which containerd config -------------------------------------------------------------


def fake_process(root: str, pid: int, exe: str, argv: list[str], uid: int = 0, cwd: str = "/"):
    """/proc/<pid> of a process in the fake tree: exe and cwd links, cmdline, status."""
    os.makedirs(f"{root}/proc/{pid}")
    os.symlink(exe, f"{root}/proc/{pid}/exe")
    os.symlink(cwd, f"{root}/proc/{pid}/cwd")
    write(f"{root}/proc/{pid}/cmdline", "\0".join(argv) + "\0")
    write(f"{root}/proc/{pid}/status", f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def hooked_containerd_config(root: str, config: str) -> None:
    """A containerd config at ``config`` whose runc runtime has the shipped hooks."""
    spec_path = os.path.join(os.path.dirname(config), "gpushare-base-spec.json")
    write(
        f"{root}{config}",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        f'base_runtime_spec = "{spec_path}"\n',
    )
    with open(SHIPPED_CONTAINERD_HOOKS) as f:
        hooks = json.load(f)["hooks"]
    write(f"{root}{spec_path}", json.dumps({"ociVersion": "1.1.0", "hooks": hooks}))


@pytest.mark.parametrize(
    ("argv", "cwd"),
    [
        (["containerd", "--config", "/opt/k8s/containerd.toml"], "/"),
        (["/usr/bin/containerd", "--log-level", "info", "-c=/opt/k8s/containerd.toml"], "/"),
        (["containerd", "-config=/opt/k8s/containerd.toml"], "/"),
        (["containerd", "--c", "containerd.toml"], "/opt/k8s"),
    ],
)
def test_containerd_config_comes_from_the_running_process(tmp_path, argv, cwd):
    """containerd run with its config elsewhere (--config/-c in any form Go's flag package
    takes, relative to its cwd): doctor reads that file, not /etc/containerd/config.toml, and
    says which file it checked and how it found it."""
    root = str(tmp_path)
    host = fake_node(root, crio_hooks=False)
    settings = node_settings()
    write(f"{root}/etc/containerd/config.toml", "version = 2\n")  # not the one running
    hooked_containerd_config(root, "/opt/k8s/containerd.toml")
    fake_process(root, 4242, "/usr/bin/containerd", argv, cwd=cwd)
    fake_process(root, 4243, "/usr/bin/containerd-shim-runc-v2", ["shim", "-c", "/x.toml"])
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == PASS, result.detail
    assert result.detail.startswith(
        f"containerd (/opt/k8s/containerd.toml, --config of pid 4242): {HOOK_BIN}"
    )


def test_containerd_config_without_a_running_containerd_is_the_default_path(tmp_path):
    """No containerd process: the default /etc/containerd/config.toml is read, and the
    result says so; a containerd without --config reads the default path too."""
    root = str(tmp_path)
    host = fake_node(root, crio_hooks=False)
    settings = node_settings()
    hooked_containerd_config(root, "/etc/containerd/config.toml")
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == PASS and result.detail.startswith(
        "containerd (/etc/containerd/config.toml, default path, no containerd process found):"
    )
    fake_process(root, 77, "/usr/bin/containerd", ["containerd"])
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == PASS and result.detail.startswith(
        "containerd (/etc/containerd/config.toml, default path of pid 77):"
    )


def test_a_containerd_not_run_by_root_is_not_believed(tmp_path):
    """A local user's process named containerd pointing at a config with the hooks does not
    make the check pass: only root's containerd says where the node's config is."""
    root = str(tmp_path)
    host = fake_node(root, crio_hooks=False)
    settings = node_settings()
    write(f"{root}/etc/containerd/config.toml", "version = 2\n")
    hooked_containerd_config(root, "/home/eve/containerd.toml")
    fake_process(
        root,
        500,
        "/home/eve/containerd",
        ["containerd", "-c", "/home/eve/containerd.toml"],
        uid=1000,
    )
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == FAIL
    assert "/home/eve" not in result.detail
    assert "/etc/containerd/config.toml" in result.detail


def test_no_hook_names_the_containerd_config_checked(tmp_path):
    """Without the hook anywhere, the FAIL names the containerd config it read (the running
    containerd's), and the fix names that file."""
    root = str(tmp_path)
    host = fake_node(root, crio_hooks=False)
    settings = node_settings()
    write(f"{root}/opt/k8s/containerd.toml", "version = 2\n")
    fake_process(
        root, 9, "/usr/bin/containerd", ["containerd", "--config", "/opt/k8s/containerd.toml"]
    )
    result = runtime_hook.check_runtime_hook(settings, host)
    assert result.status == FAIL
    assert "a base_runtime_spec in /opt/k8s/containerd.toml (--config of pid 9)" in result.detail
    assert "/opt/k8s/containerd.toml" in result.fix
