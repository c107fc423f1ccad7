"""The gpushare-scheduler container image that ``scripts/build-image`` writes (an OCI archive),
run by the real engines as the Deployment runs it.

The image is built once per test session (``scripts/build-image``: quick when nothing
changed); where it cannot be built the tests skip with the script's reason, except under
GPUSHARE_REQUIRE_REAL_PARTS=1 (CI), where they fail.

Pins: the image's entrypoint is the rendered Deployment's command, it runs as UID 65534
by default (the Deployment's runAsUser, and what kubelet reads from the CRI's
ImageStatus for runAsNonRoot), and the Deployment needs no shell (there is none); it
holds the extender and the libraries it imports, not the node daemon's (gRPC, NVML,
psutil, jinja2) nor the kubernetes client's parts it never imports
(its asyncio client with aiohttp, its generated API classes); the archive is
reproducible (the same inputs give the same digest). ``podman load`` and ``ctr -n k8s.io
images import`` (a private containerd) both take the archive under its name; in each
engine ``gpushare-scheduler --help`` runs, and the extender in the container, on the
host network against the test API server, answers ``/healthz`` and a filter, as UID
65534 with a read-only root file system and no capabilities: under podman with a
kubeconfig; under containerd through the CRI as kubelet runs the rendered Deployment
(its image name, command, args but the address, security context) with in-cluster
credentials (a service account token and CA, the API server behind TLS). README's ways
to a registry work: ``skopeo copy oci-archive:... docker://...`` (the registry serves
the archive's manifest digest) and ``podman load`` + ``podman push``, into a real
registry (``scripts/setup-registry``: Debian's docker-registry) from which containerd
pulls and runs the image.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
import posixpath
import shutil
import socket
import ssl
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import yaml

from tests.engines.conftest import PODMAN_RLIMITS, Podman, new_uid
from tests.harness.apiserver_sim import TestApiServer
from tests.harness.cri import configs
from tests.harness.cri.api import runtime_v1_pb2 as cri
from tests.harness.cri.containerd import Containerd
from tests.harness.paths import REPO
from tests.harness.setup_script import run_setup

pytestmark = pytest.mark.e2e

BUILD = os.path.join(REPO, "scripts", "build-image")
SETUP_REGISTRY = os.path.join(REPO, "scripts", "setup-registry")
BUILD_TIMEOUT_SECONDS = 900  # a cold build from nothing (Debian packages, wheels) included
NON_ROOT = 65534  # the Deployment's runAsUser: nobody
KUBECONFIG_IN_CONTAINER = "/etc/gpushare/kubeconfig"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Distributions the extender never imports: none of their files may be in the image.
LEFT_OUT = (
    "grpc",  # grpcio: the kubelet edge
    "google",  # protobuf, google-auth
    "pynvml.py",  # nvidia-ml-py
    "psutil",
    "jinja2",
    "aiohttp",  # the kubernetes client's asyncio client
    "pip",  # installs the wheels at build time only
)
# Parts of the kubernetes client the extender never imports.
UNUSABLE = ("kubernetes/aio", "kubernetes/client/api")
# What the extender imports: these must be there.
NEEDED = (
    "nodemgr/extender/main.py",
    "prometheus_client",
    "kubernetes/client/api_client.py",
    "kubernetes/watch",
    "pydantic",
    "dateutil",
    "websocket",
    "yaml",
    "urllib3",
    "requests",
)
LAYER_BUDGET_BYTES = 32 * 1024 * 1024  # compressed; about 18 MiB when written


@dataclass(frozen=True)
class Image:
    archive: str  # the OCI archive
    ref: str  # the full name the engines import it under
    digest: str  # the manifest's, as build-image printed it
    index: dict  # index.json
    config: dict  # the OCI image config
    layers: list[int]  # compressed sizes
    files: dict[str, tarfile.TarInfo]  # path in the image (no leading /) -> its entry
    contents: dict[str, bytes]  # path -> content, of the regular files

    @property
    def name(self) -> str:
        """The name a Deployment gives (kubelet and the runtimes add docker.io/library/)."""
        return self.ref.removeprefix("docker.io/library/")


@functools.cache
def build() -> Image | str:
    """The image, or why it cannot be had here (one line)."""
    if os.geteuid() != 0:
        return "building and running the image needs root (chroot, real engines)"
    values = run_setup(BUILD, BUILD_TIMEOUT_SECONDS)
    if isinstance(values, str):
        return values
    try:
        return read_archive(
            values["GPUSHARE_IMAGE_ARCHIVE"],
            values["GPUSHARE_IMAGE_REF"],
            values["GPUSHARE_IMAGE_DIGEST"],
        )
    except KeyError as e:
        return f"scripts/build-image printed no {e.args[0]}"


def read_archive(archive: str, ref: str, digest: str) -> Image:
    """Read an OCI archive with one manifest: its config, layers and every file of them."""
    with tarfile.open(archive) as outer:

        def blob(descriptor: dict) -> bytes:
            algorithm, hexdigest = descriptor["digest"].split(":")
            return outer.extractfile(f"blobs/{algorithm}/{hexdigest}").read()

        index = json.loads(outer.extractfile("index.json").read())
        [descriptor] = index["manifests"]
        manifest = json.loads(blob(descriptor))
        config = json.loads(blob(manifest["config"]))
        files: dict[str, tarfile.TarInfo] = {}
        contents: dict[str, bytes] = {}
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(layer)))) as inner:
                for member in inner:
                    path = member.name.removeprefix("./").rstrip("/")
                    files[path] = member
                    if member.isfile():
                        contents[path] = inner.extractfile(member).read()
    layers = [layer["size"] for layer in manifest["layers"]]
    return Image(archive, ref, digest, index, config, layers, files, contents)


def require(found, reason: str):
    """``found``, or skip with why not (fail under GPUSHARE_REQUIRE_REAL_PARTS=1)."""
    if not isinstance(found, str):
        return found
    reason = f"{reason}: {found}"
    if os.environ.get("GPUSHARE_REQUIRE_REAL_PARTS") == "1":
        pytest.fail(f"GPUSHARE_REQUIRE_REAL_PARTS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def image() -> Image:
    return require(build(), "the gpushare-scheduler image cannot be built here")


def deployment(image_name: str) -> dict:
    """The Deployment deploy/render.py renders for this image."""
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "deploy", "render.py"), "scheduler-deployment",
         "--image", image_name],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    [found] = [d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "Deployment"]
    return found


def resolve(image: Image, path: str) -> str:
    """Follow symbolic links inside the image; the path (no leading /) they end at."""
    path = path.lstrip("/")
    for _ in range(40):
        entry = image.files.get(path)
        if entry is None or not entry.issym():
            return path
        base = "/" if entry.linkname.startswith("/") else posixpath.dirname(path)
        path = posixpath.normpath(posixpath.join(base, entry.linkname)).lstrip("/")
    raise AssertionError(f"symbolic link loop at {path}")


def executable(image: Image, path: str) -> bool:
    entry = image.files.get(resolve(image, path))
    return entry is not None and entry.isfile() and bool(entry.mode & 0o111)


def test_entrypoint_user_and_shell_agree_with_the_deployment(image):
    """The Deployment's command is the image's entrypoint, found on the image's PATH, a
    script whose interpreter is in the image; the image runs as UID 65534 by default, the
    Deployment's runAsUser; the image has no shell and the Deployment needs none (no exec
    probes or hooks)."""
    config = image.config["config"]
    assert config["User"] == f"{NON_ROOT}:{NON_ROOT}"
    pod = deployment(image.name)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == config["Entrypoint"] == ["gpushare-scheduler"]
    assert pod["securityContext"]["runAsUser"] == NON_ROOT
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    path = dict(e.split("=", 1) for e in config["Env"])["PATH"]
    found = [
        resolve(image, posixpath.join(d, container["command"][0]))
        for d in path.split(":")
        if executable(image, posixpath.join(d, container["command"][0]))
    ]
    assert found, f"{container['command'][0]} is not on the image's PATH {path}"
    first = image.contents[found[0]].split(b"\n", 1)[0]
    assert first.startswith(b"#!"), first
    interpreter = first[2:].decode().split()[0]
    assert executable(image, interpreter), interpreter

    for shell in ("bin/sh", "usr/bin/sh", "bin/bash", "usr/bin/bash", "bin/busybox"):
        assert resolve(image, shell) not in image.files, shell
    for key in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert "exec" not in container.get(key, {}), key
    assert "lifecycle" not in container


def test_image_holds_the_extender_and_only_what_it_imports(image):
    """The extender and the libraries it imports are in the image; the node daemon's
    libraries, pip and the kubernetes client's parts that need left-out libraries are not;
    the compressed size stays under its budget (reported)."""
    [site] = [p for p in image.files if p.endswith("/site-packages")]
    for name in NEEDED:
        assert f"{site}/{name}" in image.files, name
    for name in LEFT_OUT + UNUSABLE:
        path = f"{site}/{name}"
        assert not any(p == path or p.startswith(path + "/") for p in image.files), name
    size = sum(image.layers)
    unpacked = sum(e.size for e in image.files.values() if e.isfile())
    print(f"image {image.ref}: {size / 2**20:.1f} MiB compressed, {unpacked / 2**20:.1f} MiB")
    assert size < LAYER_BUDGET_BYTES, size


def test_the_archive_is_reproducible_and_named_for_both_engines(image):
    """Built again from the same inputs (--rebuild), the archive has the same digest; its
    index names the image for containerd and podman (io.containerd.image.name) and gives
    the tag for skopeo's oci-archive:FILE:TAG."""
    [descriptor] = image.index["manifests"]
    assert descriptor["digest"] == image.digest
    annotations = descriptor["annotations"]
    assert annotations["io.containerd.image.name"] == image.ref
    assert annotations["org.opencontainers.image.ref.name"] == image.ref.rsplit(":", 1)[1]
    done = subprocess.run(
        [BUILD, "--rebuild"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS
    )
    assert done.returncode == 0, done.stderr
    assert f"GPUSHARE_IMAGE_DIGEST={image.digest}" in done.stdout.splitlines()


# ---------------------------------------------------------------------------- running it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, document: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status, json.loads(answer.read())


def wait_healthy(url: str, logs, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = get(url + "/healthz")
            if last[0] == 200:
                return
        except OSError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"no 200 from {url}/healthz ({last}); the container's log:\n{logs()}")


GPUS = {
    "v": 1,
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-0",
            "model": "Tesla T4",
            "mode": "idle",
            "healthy": True,
            "memory_mib": 15360,
            "memory_allocated_mib": 0,
            "core_allocated_percent": 0,
            "allocations": [],
        }
    ],
}


@pytest.fixture
def api():
    """The test API server with one GPU node (one idle 15 GiB card) and two pending pods:
    one asking 4 GiB + 30 %, one asking 20 GiB."""
    api = TestApiServer()
    api.start()
    api.add_node("node-a", annotations={"gpushare.aliyun.com/gpus": json.dumps(GPUS)})
    requests = {"aliyun.com/gpu-mem": "4", "aliyun.com/gpu-core.percentage": "30"}
    api.add_pod("default", "cuda", containers=[{"name": "main", "requests": requests}])
    requests = {"aliyun.com/gpu-mem": "20"}
    api.add_pod("default", "big", containers=[{"name": "main", "requests": requests}])
    yield api
    api.stop()


def check_extender(api: TestApiServer, url: str) -> None:
    """Filters answered from inside the container from what it listed: node-a's card has
    room for the small pod, not for the big one (with the reason)."""
    for name, fits in (("cuda", True), ("big", False)):
        args = {"Pod": api.pod("default", name), "Nodes": None, "NodeNames": ["node-a"]}
        status, result = post(url + "/gpushare-scheduler/filter", args)
        assert status == 200 and not result["Error"], result
        if fits:
            assert result["NodeNames"] == ["node-a"], result
        else:
            assert not result["NodeNames"], result
            failed = {
                **(result["FailedNodes"] or {}),
                **(result["FailedAndUnresolvableNodes"] or {}),
            }
            assert "20 GiB" in failed["node-a"], failed


def status_line(pid: int, key: str) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split()[1:]
    raise AssertionError(f"no {key} line for {pid}")


def check_process(pid: int) -> None:
    """Every UID of the process is 65534 and it holds no capability."""
    assert status_line(pid, "Uid") == [str(NON_ROOT)] * 4
    assert int(status_line(pid, "CapEff")[0], 16) == 0


@pytest.fixture
def podman(engines, tmp_path_factory):
    # A short directory: podman's runroot must stay under 50 characters.
    directory = tmp_path_factory.mktemp("pm", numbered=True)
    (directory / "hooks").mkdir()
    podman = Podman(str(directory / "s"), str(directory / "hooks"), engines.rootfs)
    yield podman
    podman.cleanup()


def test_podman_loads_the_archive_and_runs_the_extender(image, podman, api, tmp_path):
    """``podman load`` names the image; ``--help`` runs; on the host network, with a
    kubeconfig only UID 65534 can read, the extender in the container lists the test API
    server and answers /healthz and a filter, as UID 65534 (the image's default, no
    --user) with a read-only root and no capabilities."""
    done = podman.podman("load", "-i", image.archive, timeout=300)
    assert done.returncode == 0, done.stderr
    done = podman.podman("images", "--format", "{{.Repository}}:{{.Tag}}")
    assert image.ref in done.stdout.split(), done.stdout

    flags = ["--network", "host", *PODMAN_RLIMITS, "--read-only", "--cap-drop", "all"]
    flags += ["--security-opt", "no-new-privileges"]
    done = podman.podman("run", "--rm", *flags, image.ref, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: gpushare-scheduler" in done.stdout

    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    os.chown(kubeconfig, NON_ROOT, NON_ROOT)
    os.chmod(kubeconfig, 0o600)
    port = free_port()
    done = podman.podman(
        "run", "-d", "--name", "extender", *flags,
        "--volume", f"{kubeconfig}:{KUBECONFIG_IN_CONTAINER}:ro",
        image.ref,
        "--kubeconfig", KUBECONFIG_IN_CONTAINER, f"--address=127.0.0.1:{port}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, lambda: podman.podman("logs", "extender").stderr)
    check_extender(api, url)
    check_process(podman.pid("extender"))


class TlsFront:
    """The test API server behind TLS on 127.0.0.1 (a certificate for that IP, made with
    openssl), as in-cluster credentials reach the real one: each connection is forwarded
    to the plain-HTTP server."""

    def __init__(self, directory: str, backend_port: int):
        if shutil.which("openssl") is None:
            pytest.fail("openssl is needed to make the test API server's certificate")
        self.ca = os.path.join(directory, "ca.crt")
        key = os.path.join(directory, "tls.key")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", "/CN=kube-apiserver", "-keyout", key, "-out", self.ca,
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.ca, key)
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(client, server_side=True)
            backend = socket.create_connection(("127.0.0.1", self.backend_port))
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pump, args=(backend, tls), daemon=True).start()
        self._pump(tls, backend)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@pytest.fixture
def containerd(engines, image, tmp_path_factory):
    # Its config's paths and the socket (under 108 bytes) live here.
    directory = str(tmp_path_factory.mktemp("ctrd", numbered=True))
    # No base runtime spec: containerd's default (no gpushare hook; the extender asks no GPU).
    containerd = Containerd(directory, "", [engines.pause_archive], engines.pause_image)
    try:
        containerd.start()
        yield containerd
    finally:
        containerd.cleanup()


@dataclass(frozen=True)
class Mount:
    """What configs.container_config takes for a mount (a device plugin Mount's fields)."""

    container_path: str
    host_path: str
    read_only: bool = True


def test_containerd_imports_the_archive_and_runs_the_deployments_container(
    image, containerd, api, tmp_path
):
    """``ctr -n k8s.io images import`` (the registry-less path) makes the image known
    under the Deployment's short name; the CRI reports UID 65534 for it (kubelet's
    runAsNonRoot check); ``ctr run`` runs ``--help``; through the CRI, a host-network pod
    with the rendered Deployment's image, command, args (but the address) and security
    context, and in-cluster credentials as kubelet gives them (the service account's
    token and CA, $KUBERNETES_SERVICE_HOST/PORT, the API server behind TLS), lists the
    test API server and answers /healthz and a filter, as UID 65534."""
    containerd.ctr("images", "import", image.archive)
    assert image.ref in containerd.ctr("images", "ls", "-q").split()
    wanted_pod = deployment(image.name)["spec"]["template"]["spec"]
    [wanted] = wanted_pod["containers"]
    assert wanted["image"] == image.name
    status = containerd.images.ImageStatus(
        cri.ImageStatusRequest(image=cri.ImageSpec(image=wanted["image"])), timeout=30
    )
    assert status.image.id and status.image.uid.value == NON_ROOT

    helped = subprocess.run(
        ["ctr", "--address", containerd.socket, "-n", "k8s.io", "run", "--rm", image.ref,
         f"help-{new_uid()[:8]}", "gpushare-scheduler", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "usage: gpushare-scheduler" in helped.stdout

    front = TlsFront(str(tmp_path), int(api.url.rsplit(":", 1)[1]))
    try:
        account = tmp_path / "serviceaccount"
        account.mkdir()
        shutil.copy(front.ca, account / "ca.crt")
        (account / "token").write_text(api.token)
        (account / "namespace").write_text("kube-system")
        for path in (account, *account.iterdir()):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)  # as kubelet's projected volume

        port = free_port()
        args = [a for a in wanted["args"] if not a.startswith("--address=")]
        args.append(f"--address=127.0.0.1:{port}")
        sandbox = configs.sandbox_config(
            "kube-system", "gpushare-scheduler", new_uid(), containerd.log_root
        )
        sandbox_id = containerd.run_pod_sandbox(sandbox)
        config = configs.container_config(
            sandbox,
            wanted["name"],
            wanted["image"],
            wanted["command"],
            envs={
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(front.port),
            },
            mounts=[Mount(SERVICE_ACCOUNT_DIR, str(account))],
        )
        config.args.extend(args)
        security = config.linux.security_context
        wanted_security = wanted["securityContext"]
        security.readonly_rootfs = wanted_security["readOnlyRootFilesystem"]
        security.no_new_privs = not wanted_security["allowPrivilegeEscalation"]
        security.capabilities.drop_capabilities.extend(wanted_security["capabilities"]["drop"])
        container_id = containerd.create_container(sandbox_id, sandbox, config)
        containerd.start_container(container_id)

        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, lambda: container_log(sandbox, wanted["name"]))
        check_extender(api, url)
        assert "credentials from in-cluster" in container_log(sandbox, wanted["name"])
        check_process(containerd.pid(container_id))  # no runAsUser given: the image's user
        _, info = containerd.container_status(container_id)
        assert info["runtimeSpec"]["process"]["args"] == [*wanted["command"], *args]
    finally:
        front.close()


def container_log(sandbox: cri.PodSandboxConfig, name: str) -> str:
    try:
        with open(os.path.join(sandbox.log_directory, f"{name}/0.log")) as f:
            return f.read()
    except OSError as e:
        return f"(no log: {e})"


# ---------------------------------------------------------------------------- a registry


@dataclass(frozen=True)
class RegistryTools:
    skopeo: str
    registry: str  # Debian's docker-registry (CNCF Distribution)


@functools.cache
def registry_tools() -> RegistryTools | str:
    if os.geteuid() != 0:
        return "installing skopeo needs root"
    values = run_setup(SETUP_REGISTRY, BUILD_TIMEOUT_SECONDS)
    if isinstance(values, str):
        return values
    return RegistryTools(values["GPUSHARE_SKOPEO"], values["GPUSHARE_REGISTRY"])


@pytest.fixture
def registry(tmp_path):
    """A real registry on a loopback port (plain HTTP), its storage under tmp_path; its
    host:port."""
    tools = require(registry_tools(), "skopeo and a registry cannot be had here")
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
        f"http:\n  addr: {address}\n"
    )
    with open(tmp_path / "registry.log", "w") as log:
        process = subprocess.Popen(
            [tools.registry, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if get(f"http://{address}/v2/")[0] == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, (tmp_path / "registry.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "registry.log").read_text()
            time.sleep(0.1)
        yield address, tools.skopeo
    finally:
        process.terminate()
        process.wait(10)


def test_pushed_to_a_registry_as_the_readme_says_and_pulled_by_containerd(
    image, registry, podman, containerd
):
    """README's two ways to a registry: ``skopeo copy oci-archive:... docker://...`` keeps
    the manifest as written (the registry serves the archive's digest), and ``podman load``
    then ``podman push``; containerd pulls each (as kubelet would from a registry) and
    runs ``gpushare-scheduler --help`` from it."""
    address, skopeo = registry
    tag = image.ref.rsplit(":", 1)[1]
    copied = f"{address}/gpushare-scheduler:{tag}"
    done = subprocess.run(
        [skopeo, "copy", "--dest-tls-verify=false", f"oci-archive:{image.archive}",
         f"docker://{copied}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    request = urllib.request.Request(
        f"http://{address}/v2/gpushare-scheduler/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.headers["Docker-Content-Digest"] == image.digest

    pushed = f"{address}/gpushare-scheduler:pushed"
    assert podman.podman("load", "-i", image.archive, timeout=300).returncode == 0
    done = podman.podman("push", "--tls-verify=false", image.ref, pushed, timeout=300)
    assert done.returncode == 0, done.stderr

    for ref in (copied, pushed):
        containerd.ctr("images", "pull", "--plain-http", ref)
        helped = subprocess.run(
            ["ctr", "--address", containerd.socket, "-n", "k8s.io", "run", "--rm", ref,
             f"help-{new_uid()[:8]}", "gpushare-scheduler", "--help"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert helped.returncode == 0, (ref, helped.stderr)
        assert "usage: gpushare-scheduler" in helped.stdout
