"""Pins gpushare-hook as the runtime runs it (a subprocess, OCI state on stdin): containers that
ask for no GPU start without the daemon; GPU containers are refused when the daemon is down or
silent (fail closed, one line naming the socket and how to check the daemon) or when it says no;
unreadable input exits 2; the request carries only GPU env names, the pod identity from the
containerd or CRI-O annotations and the init process's cgroup text; poststop always exits 0.
The bundle's config.json is read with a size cap: one over it (or not a regular file) is
refused at once, without being read whole; a /proc/PID/cgroup that is not UTF-8 is refused
with a clear message."""

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

from hooks import protocol

HOOK = os.path.join(os.path.dirname(sys.executable), "gpushare-hook")
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


def bundle(env, annotations=None):
    path = short_dir()
    config = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": env}}
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


def run_hook(socket_path, stage, stdin):
    data = stdin if isinstance(stdin, bytes) else json.dumps(stdin).encode()
    return subprocess.run(
        [HOOK, "--socket", socket_path, stage],
        input=data,
        capture_output=True,
        timeout=20,
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
    result = subprocess.run([HOOK, *args], input=b"{}", capture_output=True, timeout=20)
    assert result.returncode == 2
    assert "usage: gpushare-hook" in result.stderr.decode()


def test_socket_option_with_equals_sign(daemon):
    fake = daemon({"allowed": True, "message": "registered"})
    stdin = json.dumps(state(bundle(GPU_ENV))).encode()
    result = subprocess.run(
        [HOOK, f"--socket={fake.path}", "createRuntime"],
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
        "cgroup": cgroup,
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
