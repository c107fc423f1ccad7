"""Pins gpushare-hook as the runtime runs it (a subprocess, OCI state on stdin, started as
``nodemgr install`` writes it: python -I -S on the hook's file, argv[0] the console script):
containers that ask for no GPU and whose spec touches none start without the daemon; GPU
containers, and containers whose mounts, device nodes or device rules touch a GPU, are refused
when the daemon is down or silent (fail closed, one line naming the socket and how to check the
daemon) or when it says no; unreadable input exits 2; the request carries only GPU env names,
the pod identity from the containerd or CRI-O annotations, the init process's cgroup text and
the spec's GPU facts (mount paths also through symlinks, bind-mounted device nodes by number);
poststop always exits 0. The bundle's config.json is read with a size cap: one over it (or not
a regular file) is refused at once, without being read whole; a /proc/PID/cgroup that is not
UTF-8 is refused with a clear message. Started that way it imports no site-packages, no
argparse, and socket only to call the daemon."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from hooks import gpushare_hook, podidentity, protocol
from mps.layout import MpsLayout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "gpushare-hook")
# As the runtime runs the hook nodemgr install configures: the interpreter, argv[0] the
# console script (ps shows it; Python finds its environment from it), -I -S, the file.
HOOK = [CONSOLE_SCRIPT, "-I", "-S", os.path.join(REPO, "hooks", "gpushare_hook.py")]
NO_SPEC = {"mounts": [], "devices": [], "rules": []}
GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_ENV = [
    "PATH=/usr/bin:/bin",
    f"NVIDIA_VISIBLE_DEVICES={GPU0}",
    "GPUSHARE_ALLOCATION_ID=ga-1",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
    "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
    "HOME=/root",
    "API_TOKEN=secret",
]
CONTAINERD = {
    "io.kubernetes.cri.sandbox-namespace": "team-a",
    "io.kubernetes.cri.sandbox-name": "trainer-0",
    "io.kubernetes.cri.container-name": "main",
}
CRIO = {
    "io.kubernetes.pod.namespace": "team-b",
    "io.kubernetes.pod.name": "infer-1",
    "io.kubernetes.container.name": "server",
}


_short_dirs = []


def short_dir():
    """Unix socket paths must stay under 108 bytes; pytest's tmp_path may not."""
    path = tempfile.mkdtemp(dir="/tmp", prefix="gsh-")
    _short_dirs.append(path)
    return path


@pytest.fixture(autouse=True)
def _remove_short_dirs():
    yield
    while _short_dirs:
        shutil.rmtree(_short_dirs.pop(), ignore_errors=True)


class FakeDaemon:
    """Reads one request per connection; answers ``answer``, or never when it is None."""

    def __init__(self, answer):
        self.answer = answer
        self.path = os.path.join(short_dir(), "hook.sock")
        self.requests = []
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen()
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                self.requests.append(protocol.read_message(conn))
                if self.answer is None:
                    self._stop.wait(10)  # silent until the test ends
                else:
                    conn.sendall(protocol.encode(self.answer))

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@pytest.fixture
def daemon():
    started = []

    def start(answer):
        fake = FakeDaemon(answer)
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.close()


def bundle(env, annotations=None, **spec):
    """A bundle whose config.json has this env, annotations and top-level ``spec`` fields."""
    path = short_dir()
    config = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": env}, **spec}
    if annotations is not None:
        config["annotations"] = annotations
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def state(bundle_dir, annotations=None, pid=None, id_="c1"):
    return {
        "ociVersion": "1.0.2",
        "id": id_,
        "status": "creating",
        "pid": os.getpid() if pid is None else pid,
        "bundle": bundle_dir,
        "annotations": annotations or {},
    }


def run_hook(socket_path, stage, stdin, *options, python_options=()):
    data = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    argv = [HOOK[0], *python_options, *HOOK[1:], "--socket", socket_path, *options, stage]
    return subprocess.run(
        argv, executable=sys.executable, input=data, capture_output=True, timeout=20
    )


def missing_socket():
    return os.path.join(short_dir(), "absent.sock")


# --- without the daemon ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        ["PATH=/usr/bin:/bin", "HOME=/root"],
        ["NVIDIA_VISIBLE_DEVICES=void"],
        ["CUDA_VERSION=12.0", "NVIDIA_REQUIRE_CUDA=cuda>=12.0"],
        [],
    ],
)
def test_container_without_gpus_starts_without_the_daemon(env):
    result = run_hook(missing_socket(), "createRuntime", state(bundle(env)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""


def test_config_without_process_env_starts_without_the_daemon():
    path = short_dir()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"ociVersion": "1.0.2"}, f)
    assert run_hook(missing_socket(), "createRuntime", state(path)).returncode == 0


@pytest.mark.parametrize(
    "env", [["NVIDIA_VISIBLE_DEVICES=all"], ["CUDA_VERSION=12.0"], ["GPUSHARE_ALLOCATION_ID=ga-1"]]
)
def test_gpu_container_is_refused_when_the_daemon_is_down(env):
    socket_path = missing_socket()
    result = run_hook(socket_path, "createRuntime", state(bundle(env)))
    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert stderr.count("\n") == 1 and stderr.endswith("\n")
    assert stderr.startswith("gpushare-hook: refused container c1")
    assert socket_path in stderr and "systemctl status gpushare-node" in stderr


@pytest.mark.parametrize(
    ("stdin", "fragment"),
    [
        (b"{not json", "the OCI state on stdin is not JSON"),
        (b"", "the OCI state on stdin is not JSON"),
        (b"\xff\xfe", "the OCI state on stdin is not JSON"),
        (b"[1, 2]", "the OCI state on stdin is not a JSON object"),
        (b'{"id": "", "bundle": "/tmp"}', "has no container id"),
        (b'{"bundle": "/tmp"}', "has no container id"),
        (b'{"id": "c1"}', "the OCI state of container c1 has no bundle"),
    ],
)
def test_unreadable_state_exits_2_with_a_clear_message(stdin, fragment):
    result = run_hook(missing_socket(), "createRuntime", stdin)
    assert result.returncode == 2
    assert fragment in result.stderr.decode()
    assert result.stderr.decode().count("\n") == 1


def test_oversized_state_exits_2():
    result = run_hook(missing_socket(), "createRuntime", b" " * (1024 * 1024))
    assert result.returncode == 2 and "bytes" in result.stderr.decode()


@pytest.mark.parametrize(
    "args",
    [[], ["createRuntime", "poststop"], ["prestart"], ["--verbose", "createRuntime"]],
)
def test_bad_invocation_exits_2_with_usage(args):
    result = subprocess.run(
        [*HOOK, *args], executable=sys.executable, input=b"{}", capture_output=True, timeout=20
    )
    assert result.returncode == 2
    assert "usage: gpushare-hook" in result.stderr.decode()


def test_socket_option_with_equals_sign(daemon):
    fake = daemon({"allowed": True, "message": "registered"})
    stdin = json.dumps(state(bundle(GPU_ENV))).encode()
    result = subprocess.run(
        [*HOOK, f"--socket={fake.path}", "createRuntime"],
        executable=sys.executable,
        input=stdin,
        capture_output=True,
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    assert len(fake.requests) == 1


def test_missing_bundle_config_exits_2():
    empty = short_dir()
    result = run_hook(missing_socket(), "createRuntime", state(empty))
    assert result.returncode == 2
    assert f"cannot read the container's {empty}/config.json" in result.stderr.decode()


def test_bundle_config_not_json_exits_2():
    path = short_dir()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{truncated")
    result = run_hook(missing_socket(), "createRuntime", state(path))
    assert result.returncode == 2 and "config.json" in result.stderr.decode()


def test_config_just_over_the_cap_is_refused():
    """A valid config.json one byte over the cap (a container asking for no GPU, which
    would otherwise start): refused, exit 2, naming the cap."""
    from hooks import gpushare_hook

    path = short_dir()
    cap = gpushare_hook.MAX_CONFIG_BYTES
    head = json.dumps({"process": {"env": ["HOME=/root"]}, "pad": ""})[:-2]
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(head + "x" * (cap + 1 - len(head) - 2) + '"}')
    assert os.path.getsize(os.path.join(path, "config.json")) == cap + 1
    result = run_hook(missing_socket(), "createRuntime", state(path))
    assert result.returncode == 2, result.stderr
    assert f"over {cap} bytes" in result.stderr.decode()


def test_a_300_mb_config_is_refused_without_reading_it_whole():
    """A 300 MB config.json (sparse: it costs no disk): refused at once; reading and
    parsing it whole would take the hook's time and memory at every container creation."""
    path = short_dir()
    config = os.path.join(path, "config.json")
    with open(config, "wb") as f:
        f.write(b'{"process": {"env": []}, "pad": "')
        f.truncate(300 * 1024 * 1024)
    started = time.monotonic()
    result = run_hook(missing_socket(), "createRuntime", state(path))
    took = time.monotonic() - started
    assert result.returncode == 2
    assert "over" in result.stderr.decode() and "bytes" in result.stderr.decode()
    assert took < 2.0, took


def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking():
    """config.json a FIFO nobody writes: opening it for reading would block forever."""
    path = short_dir()
    os.mkfifo(os.path.join(path, "config.json"))
    result = run_hook(missing_socket(), "createRuntime", state(path))
    assert result.returncode == 2
    assert "not a regular file" in result.stderr.decode()


@pytest.fixture
def child_in_a_0xff_cgroup():
    """A process in a cgroup whose name has byte 0xff (root and a writable cgroup v1 pids
    or v2 hierarchy needed)."""
    roots = [b"/sys/fs/cgroup/pids", b"/sys/fs/cgroup"]
    root = next((r for r in roots if os.access(r + b"/cgroup.procs", os.W_OK)), None)
    if os.geteuid() != 0 or root is None:
        pytest.skip("needs root and a writable cgroup hierarchy")
    path = root + b"/gs-hook-\xff-" + str(os.getpid()).encode()
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here: {e}")
    child = subprocess.Popen(["sleep", "60"])
    try:
        with open(path + b"/cgroup.procs", "w") as f:
            f.write(str(child.pid))
        yield child.pid
    finally:
        child.kill()
        child.wait()
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.05)


def test_a_cgroup_that_is_not_utf8_is_refused_with_a_clear_message(daemon, child_in_a_0xff_cgroup):
    """/proc/PID/cgroup naming a cgroup with byte 0xff: refused (exit 2) saying so, not a
    traceback; the daemon is not asked."""
    fake = daemon({"allowed": True, "message": "ok"})
    result = run_hook(
        fake.path, "createRuntime", state(bundle(GPU_ENV), pid=child_in_a_0xff_cgroup)
    )
    assert result.returncode == 2, result.stderr
    assert "is not UTF-8" in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()
    assert fake.requests == []


def test_gpu_container_without_pid_exits_2(daemon):
    fake = daemon({"allowed": True, "message": "ok"})
    stdin = state(bundle(GPU_ENV))
    del stdin["pid"]
    result = run_hook(fake.path, "createRuntime", stdin)
    assert result.returncode == 2 and "has no pid" in result.stderr.decode()
    assert fake.requests == []


def test_duplicate_env_name_with_different_values_is_refused():
    env = ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=15G"]
    result = run_hook(missing_socket(), "createRuntime", state(bundle(env)))
    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert "container c1" in stderr and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is set twice" in stderr


# --- against a daemon ----------------------------------------------------------------------------


def test_request_carries_gpu_env_containerd_identity_and_cgroup(daemon):
    fake = daemon({"allowed": True, "message": "registered"})
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV), CONTAINERD))
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    [request] = fake.requests
    with open(f"/proc/{os.getpid()}/cgroup") as f:
        cgroup = f.read()
    assert request == {
        "stage": "createRuntime",
        "container_id": "c1",
        "pid": os.getpid(),
        "env": {
            "NVIDIA_VISIBLE_DEVICES": GPU0,
            "GPUSHARE_ALLOCATION_ID": "ga-1",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
            "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        },
        "identity": {"namespace": "team-a", "pod": "trainer-0", "container": "main"},
        "identity_annotations": CONTAINERD,
        "runtime": None,
        "cgroup": cgroup,
        "spec": NO_SPEC,
    }


def test_identity_from_crio_annotations_in_the_bundle_config(daemon):
    fake = daemon({"allowed": True, "message": "registered"})
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV, annotations=CRIO)))
    assert result.returncode == 0, result.stderr
    assert fake.requests[0]["identity"] == {
        "namespace": "team-b",
        "pod": "infer-1",
        "container": "server",
    }


FORGED = {**CRIO, **CONTAINERD}  # CRI-O's keys, and containerd's from the pod's annotations


@pytest.mark.parametrize(
    ("runtime", "annotations", "identity"),
    [
        ("cri-o", FORGED, {}),
        ("containerd", FORGED, {}),
        (None, FORGED, {}),
        ("cri-o", CONTAINERD, {}),
        ("containerd", CRIO, {}),
        ("cri-o", CRIO, {"namespace": "team-b", "pod": "infer-1", "container": "server"}),
        ("containerd", CONTAINERD, {"namespace": "team-a", "pod": "trainer-0",
                                    "container": "main"}),
    ],
    ids=[
        "crio-two-pods", "containerd-two-pods", "older-config-two-pods",
        "crio-only-containerd-keys", "containerd-only-crio-keys", "crio", "containerd",
    ],
)  # fmt: skip
def test_runtime_reads_only_its_own_keys_and_sends_them_all(daemon, runtime, annotations, identity):
    """--runtime names the runtime whose keys give the identity: annotations naming two pods
    give none (the daemon refuses them, naming both), and neither do only the other
    runtime's keys; the request carries every identity key found and the runtime, so the
    daemon reads them again."""
    fake = daemon({"allowed": False, "message": "judged"})
    options = ("--runtime", runtime) if runtime else ()
    run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV, annotations)), *options)
    [request] = fake.requests
    assert request["identity"] == identity
    assert request["identity_annotations"] == annotations
    assert request["runtime"] == runtime


def test_an_unknown_runtime_is_a_bad_invocation():
    """--runtime docker: exit 2 naming the values, before anything is read."""
    result = run_hook(missing_socket(), "createRuntime", b"", "--runtime", "docker")
    assert result.returncode == 2
    assert "--runtime must be containerd or cri-o (got 'docker')" in result.stderr.decode()


def test_state_annotations_override_the_bundle_config(daemon):
    fake = daemon({"allowed": True, "message": "registered"})
    in_config = {**CONTAINERD, "io.kubernetes.cri.sandbox-name": "from-config"}
    in_state = {"io.kubernetes.cri.sandbox-name": "from-state"}
    run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV, in_config), in_state))
    assert fake.requests[0]["identity"]["pod"] == "from-state"


def test_without_annotations_the_identity_is_empty(daemon):
    fake = daemon({"allowed": True, "message": "registered"})
    run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV)))
    assert fake.requests[0]["identity"] == {}


def test_refusal_from_the_daemon_exits_1_with_its_message(daemon):
    message = "gpushare-node refused container c1: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT was removed"
    fake = daemon({"allowed": False, "message": message})
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV)))
    assert result.returncode == 1
    assert result.stderr.decode() == f"gpushare-hook: {message}\n"


def test_answer_without_allowed_is_a_refusal(daemon):
    fake = daemon({"message": "no verdict"})
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV)))
    assert result.returncode == 1
    assert "did not answer" in result.stderr.decode()


def test_silent_daemon_is_a_refusal_within_the_timeout(daemon):
    fake = daemon(None)
    started = time.monotonic()
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV)))
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "did not answer" in result.stderr.decode()
    assert len(fake.requests) == 1
    assert elapsed < 6  # the hook's own 2 s timeout, plus interpreter start-up


# --- poststop ------------------------------------------------------------------------------------


def test_poststop_exits_0_without_a_daemon():
    result = run_hook(missing_socket(), "poststop", state(bundle(GPU_ENV)))
    assert result.returncode == 0 and result.stderr == b""


@pytest.mark.parametrize("allowed", [True, False])
def test_poststop_tells_the_daemon_and_exits_0_whatever_it_answers(daemon, allowed):
    fake = daemon({"allowed": allowed, "message": "whatever"})
    result = run_hook(fake.path, "poststop", state(bundle(GPU_ENV), id_="c9"))
    assert result.returncode == 0 and result.stderr == b""
    assert fake.requests == [{"stage": "poststop", "container_id": "c9"}]


def test_poststop_does_not_need_the_bundle(daemon):
    fake = daemon({"allowed": True, "message": "unregistered"})
    gone = os.path.join(short_dir(), "deleted-bundle")
    result = run_hook(fake.path, "poststop", state(gone))
    assert result.returncode == 0
    assert fake.requests == [{"stage": "poststop", "container_id": "c1"}]


# --- the spec's GPU facts ----------------------------------------------------------------------


def mps_root_of(socket_path):
    """The MPS root the hook assumes without --run-dir: <socket's directory>/mps."""
    return MpsLayout(os.path.dirname(socket_path)).root


def test_the_hooks_mps_directory_is_the_daemons():
    """The hook's <run_dir>/mps is mps.layout's MPS root (the hook cannot import it)."""
    assert MpsLayout("/run/gs").root == os.path.join("/run/gs", gpushare_hook.MPS_SUBDIR)


def touching_specs(socket_path):
    """Specs of containers without GPU env that touch a GPU all the same."""
    pipe = os.path.join(mps_root_of(socket_path), "GPU-b", "pipe")
    return {
        "device": {"linux": {"devices": [{"path": "/dev/nvidia1", "type": "c", "major": 195,
                                          "minor": 1}]}},
        "rule": {"linux": {"resources": {"devices": [{"allow": True, "access": "rwm"}]}}},
        "pipe": {"mounts": [{"destination": "/tmp/nvidia-mps", "source": pipe, "type": "bind",
                             "options": ["rbind"]}]},
        "list": {"mounts": [{"destination": "/var/run/nvidia-container-devices/GPU-b",
                             "source": "/dev/null", "type": "bind", "options": ["bind"]}]},
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["device", "rule", "pipe", "list"])
def test_a_container_without_gpu_env_whose_spec_touches_a_gpu_asks_the_daemon(daemon, kind):
    """No GPU env, but an NVIDIA node, a rule allowing every device, a mount of the MPS
    directory or of the device list: the daemon is asked, with the spec facts, and its
    refusal is the hook's."""
    message = "gpushare-node refused container c1: it touches a GPU"
    fake = daemon({"allowed": False, "message": message})
    spec = touching_specs(fake.path)[kind]
    result = run_hook(fake.path, "createRuntime", state(bundle(["HOME=/"], **spec)))
    assert result.returncode == 1
    assert result.stderr.decode() == f"gpushare-hook: {message}\n"
    [request] = fake.requests
    assert request["env"] == {}
    assert request["spec"] != NO_SPEC
    assert request["spec"]["mounts"] or request["spec"]["devices"] or request["spec"]["rules"]


@pytest.mark.parametrize("kind", ["device", "rule", "pipe", "list"])
def test_a_spec_touching_a_gpu_is_refused_when_the_daemon_is_down(kind):
    """Fail closed: without the daemon, such a container is refused like a GPU container."""
    socket_path = missing_socket()
    spec = touching_specs(socket_path)[kind]
    result = run_hook(socket_path, "createRuntime", state(bundle(["HOME=/"], **spec)))
    assert result.returncode == 1
    assert "or its spec touches them" in result.stderr.decode()


def test_ordinary_mounts_devices_and_rules_start_without_the_daemon():
    """containerd's usual mounts, /dev/null and rules (c 1:3, c *:* m) need no daemon."""
    spec = {
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/etc/hosts", "type": "bind", "source": "/etc/hosts",
             "options": ["rbind", "ro"]},
        ],
        "linux": {
            "devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
            "resources": {"devices": [{"allow": False, "access": "rwm"},
                                      {"allow": True, "type": "c", "access": "m"},
                                      {"allow": True, "type": "c", "major": 1, "minor": 3,
                                       "access": "rwm"}]},
        },
    }  # fmt: skip
    result = run_hook(missing_socket(), "createRuntime", state(bundle(["HOME=/"], **spec)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""


def requires_root():
    if os.geteuid() != 0:
        if os.environ.get("GPUSHARE_REQUIRE_RUNC") == "1":
            pytest.fail("GPUSHARE_REQUIRE_RUNC=1 but making device nodes needs root")
        pytest.skip("making device nodes needs root")


def test_symlinks_and_device_nodes_are_resolved(daemon):
    """A symlink to the MPS directory and a c 195:1 node under an innocent name, bind-mounted:
    the daemon gets their real path and the node's numbers (and the hook asks it at all)."""
    requires_root()
    fake = daemon({"allowed": False, "message": "no"})
    pipe = os.path.join(mps_root_of(fake.path), "GPU-b", "pipe")
    os.makedirs(pipe)
    scratch = short_dir()
    os.symlink(pipe, os.path.join(scratch, "link"))
    os.mknod(os.path.join(scratch, "node"), 0o600 | 0o020000, os.makedev(195, 1))
    link = {"destination": "/a", "source": f"{scratch}/link", "type": "bind", "options": ["rbind"]}
    node = {"destination": "/b", "source": f"{scratch}//node", "type": "bind", "options": ["bind"]}
    expected = [
        (
            link,
            {
                "destination": "/a",
                "sources": [f"{scratch}/link", pipe],
                "nodes": [],
            },
        ),
        (
            node,
            {
                "destination": "/b",
                "sources": [f"{scratch}/node"],
                "nodes": [[195, 1]],
            },
        ),
    ]
    for mount, fact in expected:
        fake.requests.clear()
        config = bundle(["HOME=/"], mounts=[mount])
        assert run_hook(fake.path, "createRuntime", state(config)).returncode == 1
        [request] = fake.requests
        assert request["spec"]["mounts"] == [fact]


def test_run_dir_option_names_the_mps_directory(daemon):
    """--run-dir DIR makes DIR/mps the MPS root (a socket outside the run_dir); without it,
    the socket's directory is the run_dir."""
    fake = daemon({"allowed": False, "message": "no"})
    mount = {"destination": "/x", "source": "/srv/gs/mps/GPU-b/pipe", "type": "bind",
             "options": ["rbind"]}  # fmt: skip
    stdin = state(bundle(["HOME=/"], mounts=[mount]))
    assert run_hook(fake.path, "createRuntime", stdin).returncode == 0
    assert run_hook(fake.path, "createRuntime", stdin, "--run-dir", "/srv/gs").returncode == 1
    assert run_hook(fake.path, "createRuntime", stdin, "--run-dir=/srv/gs/").returncode == 1
    assert len(fake.requests) == 2
    relative = run_hook(fake.path, "createRuntime", stdin, "--run-dir", "srv")
    assert (
        relative.returncode == 2
        and "--run-dir must be an absolute path" in relative.stderr.decode()
    )


def test_a_key_runc_reads_in_another_case_is_refused():
    """config.json with "Mounts" (runc reads it as mounts, Python would not): refused, so a
    mount cannot hide from the hook in a key Go folds."""
    mount = {"destination": "/x", "source": "/dev/nvidia1", "type": "bind", "options": ["bind"]}
    result = run_hook(missing_socket(), "createRuntime", state(bundle(["HOME=/"], Mounts=[mount])))
    assert result.returncode == 1
    assert (
        "config.json has the key 'Mounts', which runc reads as 'mounts'" in result.stderr.decode()
    )


def test_a_config_with_a_key_twice_is_refused():
    """Two "linux" objects (Go merges them, Python keeps the last): refused, exit 2."""
    path = short_dir()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"process": {"env": []}, "linux": {"devices": []}, "linux": {}}')
    result = run_hook(missing_socket(), "createRuntime", state(path))
    assert result.returncode == 2
    assert "the key 'linux' appears twice" in result.stderr.decode()


@pytest.mark.parametrize("where", ["state", "config"])
def test_json_nested_past_the_recursion_limit_is_refused_with_exit_2(where):
    """An OCI state or config.json nested deeper than Python can read (100,000 arrays) is a
    bad input (exit 2, one line naming it), not a crash of the hook."""
    deep = "[" * 100_000 + "]" * 100_000
    path = short_dir()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(deep if where == "config" else '{"process": {"env": []}}')
    stdin = ('{"id": "c1", "bundle": ' + json.dumps(path) + ', "x": ' + deep + "}").encode()
    result = run_hook(missing_socket(), "createRuntime", stdin if where == "state" else state(path))
    assert result.returncode == 2, result.stderr
    assert "nested too deeply" in result.stderr.decode()
    assert result.stderr.decode().count("\n") == 1


def test_a_request_over_the_protocol_limit_is_refused_unsent(daemon):
    """Spec facts too big for the daemon to read (many long mount paths): refused by the hook
    itself, naming the size; nothing is sent."""
    fake = daemon({"allowed": True, "message": "ok"})
    long = "/srv/" + "d" * 4000
    mounts = [{"destination": f"/m{i}", "source": f"{long}{i}", "type": "bind",
               "options": ["bind"]} for i in range(300)]  # fmt: skip
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV, mounts=mounts)))
    assert result.returncode == 1
    assert f"over the {protocol.MAX_MESSAGE_BYTES} the daemon reads" in result.stderr.decode()
    assert fake.requests == []


# --- start-up ------------------------------------------------------------------------------------


def imported(result) -> set[str]:
    """Module names from -X importtime output."""
    names = set()
    for line in result.stderr.decode().splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("gpu", [False, True])
def test_the_installed_hook_imports_no_slow_module(daemon, gpu):
    """Run as installed (python -I -S), for a container without GPUs and for one the daemon
    registers, the hook imports neither argparse, __future__ nor site-packages, and socket
    only for the container it sends to the daemon (each costs milliseconds at every
    container creation)."""
    fake = daemon({"allowed": True, "message": "registered"})
    env = GPU_ENV if gpu else ["HOME=/"]
    result = run_hook(
        fake.path, "createRuntime", state(bundle(env)), python_options=("-X", "importtime")
    )
    assert result.returncode == 0, result.stderr
    assert len(fake.requests) == int(gpu)
    names = imported(result)
    assert "hooks.gpuenv" in names and ("hooks.protocol" in names) == gpu
    assert ("socket" in names) == gpu
    assert names & {"argparse", "site", "__future__"} == set()


def test_a_container_mounting_a_guarded_path_is_sent_to_the_daemon(daemon):
    """A container without GPU env mounting a --guard path (the daemon's state_dir), a path
    in it, a directory above it, the hook socket or anything in the run_dir is sent to the
    daemon; one mounting something else is not."""
    fake = daemon({"allowed": False, "message": "judged"})
    run_dir = os.path.dirname(fake.path)
    guard = ("--guard", "/srv/gs-state")
    for source in ("/srv/gs-state/ledger.sqlite", "/srv", fake.path, f"{run_dir}/status.sock"):
        mounts = [{"destination": "/mnt", "source": source, "type": "bind"}]
        stdin = state(bundle(["HOME=/"], mounts=mounts))
        assert run_hook(fake.path, "createRuntime", stdin, *guard).returncode == 1, source
    mounts = [{"destination": "/mnt", "source": "/srv-other", "type": "bind"}]
    stdin = state(bundle(["HOME=/"], mounts=mounts))
    assert run_hook(fake.path, "createRuntime", stdin, *guard).returncode == 0
    assert len(fake.requests) == 4


def test_a_relative_guard_is_a_bad_invocation():
    result = run_hook(missing_socket(), "createRuntime", b"", "--guard=srv/state")
    assert result.returncode == 2
    assert "--guard takes absolute paths (got ['srv/state'])" in result.stderr.decode()


def test_what_the_hook_writes_is_one_line_whatever_the_message_holds(daemon):
    """A refusal holding a line break or terminal escapes (an older daemon's, or a value the
    hook shows itself): stderr is one line, those written as escapes (the runtime passes it
    into the pod's events)."""
    fake = daemon({"allowed": False, "message": "refused: x\n2026-11-27 CRITICAL forged\x1b[2K"})
    result = run_hook(fake.path, "createRuntime", state(bundle(GPU_ENV)))
    assert result.returncode == 1
    assert result.stderr.decode() == (
        "gpushare-hook: refused: x\\n2026-11-27 CRITICAL forged\\x1b[2K\n"
    )


def test_the_hooks_runtimes_are_podidentitys():
    """The hook checks --runtime without importing hooks.podidentity (only containers sent to
    the daemon pay for it): the two lists are the same."""
    assert gpushare_hook.RUNTIMES == podidentity.RUNTIMES
