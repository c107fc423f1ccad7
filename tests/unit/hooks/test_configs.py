"""The runtime configurations shipped in hooks/: valid JSON of the right shape, the CRI-O/podman
hooks.d files run exactly what the containerd snippet runs, the launcher they name, and that
launcher as nodemgr install renders it: Python in isolated mode without site, importing the hook
from the package directory it names and from nowhere else (not PYTHONPATH, not its own
directory), with no site-packages."""

import glob
import json
import os
import subprocess
import sys

import pytest

from nodemgr.cli.install import render

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HOOKS = os.path.join(REPO, "hooks")
SNIPPET = os.path.join(HOOKS, "containerd", "gpushare-hooks.json")
HOOKS_D = os.path.join(HOOKS, "oci-hooks.d")
SOCKET = "/run/gpushare/hook.sock"
# The daemon's own paths besides run_dir and the socket, by default: state_dir, its device
# plugin sockets (the status socket is in run_dir).
GUARDS = [
    "--guard", "/var/lib/gpushare",
    "--guard", "/var/lib/kubelet/device-plugins/gpushare-memory.sock",
    "--guard", "/var/lib/kubelet/device-plugins/gpushare-core.sock",
    "--guard", "/var/lib/kubelet/device-plugins/gpushare-whole.sock",
]  # fmt: skip


def load(path):
    with open(path) as f:
        return json.load(f)


def test_containerd_snippet_runs_the_launcher_at_create_and_poststop():
    """Both stages run the launcher with the default socket, the daemon's other own paths to
    guard, telling the hook it runs under containerd (it reads containerd's pod identity
    keys); the runtime's timeout is above the hook's own 2 s."""
    hooks = load(SNIPPET)["hooks"]
    assert set(hooks) == {"createRuntime", "poststop"}
    for stage, [hook] in hooks.items():
        assert hook["path"] == render.HOOK_LAUNCHER
        assert hook["args"] == [
            "gpushare-hook", "--socket", SOCKET, *GUARDS, "--runtime", "containerd", stage
        ]  # fmt: skip
        assert 0 < hook["timeout"] <= 10  # the hook itself gives up after 2 s


# What `ctr oci spec` of containerd 1.6 prints, with the default security settings the CRI
# plugin clears for a runtime without a base spec (here an AppArmor and a seccomp profile
# too, as other builds of the generator may set them).
CTR_OCI_SPEC = {
    "ociVersion": "1.0.2-dev",
    "process": {
        "user": {"uid": 0, "gid": 0},
        "cwd": "/",
        "capabilities": {"bounding": ["CAP_CHOWN"], "effective": ["CAP_CHOWN"]},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        "apparmorProfile": "docker-default",
        "noNewPrivileges": True,
    },
    "root": {"path": "rootfs"},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
    "linux": {
        "maskedPaths": ["/proc/kcore"],
        "readonlyPaths": ["/proc/sys"],
        "seccomp": {"defaultAction": "SCMP_ACT_ERRNO"},
        "namespaces": [{"type": "pid"}],
    },
}


def test_make_base_spec_is_the_cri_default_spec_plus_the_hooks(tmp_path):
    """make-base-spec prints `ctr oci spec` without what containerd's CRI clears from it for
    a runtime without a base spec (rlimits: RLIMIT_NOFILE 1024 would become every pod's
    `ulimit -n`; the AppArmor and seccomp profiles), plus the snippet's hooks; every other
    field as `ctr` printed it."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    ctr = fake_bin / "ctr"
    ctr.write_text(f"#!/bin/sh\ncat <<'END'\n{json.dumps(CTR_OCI_SPEC)}\nEND\n")
    ctr.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake_bin}:{os.environ['PATH']}")
    done = subprocess.run(
        [os.path.join(HOOKS, "containerd", "make-base-spec")],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    spec = json.loads(done.stdout)
    assert spec.pop("hooks") == load(SNIPPET)["hooks"]
    expected = json.loads(json.dumps(CTR_OCI_SPEC))
    del expected["process"]["rlimits"], expected["process"]["apparmorProfile"]
    del expected["linux"]["seccomp"]
    assert spec == expected


def cri_o_to_containerd(hook: dict) -> dict:
    """A CRI-O hook entry with its --runtime value as the containerd snippet's."""
    args = list(hook["args"])
    assert args[args.index("--runtime") + 1] == "cri-o"
    args[args.index("--runtime") + 1] = "containerd"
    return {**hook, "args": args}


def test_hooks_d_files_match_the_containerd_snippet():
    """CRI-O/podman run, always, exactly what containerd runs, but for --runtime cri-o
    (the hook reads CRI-O's pod identity keys there)."""
    snippet = load(SNIPPET)["hooks"]
    files = sorted(glob.glob(os.path.join(HOOKS_D, "*.json")))
    assert len(files) == 2
    stages = {}
    for path in files:
        config = load(path)
        assert config["version"] == "1.0.0"
        assert config["when"] == {"always": True}
        [stage] = config["stages"]
        stages[stage] = cri_o_to_containerd(config["hook"])
    assert stages == {stage: hook for stage, [hook] in snippet.items()}


def test_the_shipped_launcher_starts_python_isolated_without_site():
    """The launcher's #! line starts the shipped Python with -IS (one argument: the kernel
    passes one) and imports the hook from the shipped package directory."""
    with open(os.path.join(HOOKS, "gpushare-hook")) as f:
        text = f.read()
    assert text.startswith(f"#!{render.SHIPPED_PYTHON} -IS\n")
    assert f"sys.path.append({render.SHIPPED_PACKAGE_DIR!r})" in text
    assert os.access(os.path.join(HOOKS, "gpushare-hook"), os.X_OK)


@pytest.fixture
def launcher(tmp_path):
    """This environment's launcher, in a directory that also holds a decoy hooks package."""
    path = tmp_path / "gpushare-hook"
    path.write_text(render.hook_launcher(sys.executable, REPO))
    path.chmod(0o755)
    decoy = tmp_path / "hooks"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise SystemExit('decoy hooks package imported')\n")
    return str(path)


def test_the_launcher_runs_the_hook_isolated(launcher, tmp_path):
    """Run as the runtime runs it, with PYTHONPATH and PYTHONSTARTUP pointing at the decoy:
    the real hook answers (usage), so neither the environment nor the launcher's own
    directory is read, and Python ran isolated without site."""
    probe = "import sys; print(sys.flags.isolated, sys.flags.no_site, 'site' in sys.modules)"
    env = {"PYTHONPATH": str(tmp_path), "PYTHONSTARTUP": str(tmp_path / "hooks" / "__init__.py")}
    done = subprocess.run(
        [launcher, "--help"], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: gpushare-hook")
    with open(launcher) as f:
        interpreter, flags = f.readline()[2:].split()
    flagged = subprocess.run(
        [interpreter, flags, "-c", probe], capture_output=True, text=True, timeout=30
    )
    assert flagged.stdout.split() == ["1", "1", "False"]


@pytest.mark.parametrize("python", ["python3", "/opt/my python/bin/python3", "/" + "p" * 300])
def test_a_python_that_cannot_stand_in_a_shebang_is_refused(python):
    """A relative path, a space or an overlong path cannot be a #! interpreter: install
    refuses, saying why."""
    with pytest.raises(render.InstallError, match="cannot start the runtime hook from a #! line"):
        render.hook_launcher(python, REPO)
