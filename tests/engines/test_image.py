"""The gpushare-scheduler container image that ``scripts/build-image`` writes (an OCI archive),
run by the real engines as the Deployment runs it.

The image is built once per test session (``scripts/build-image``: quick when nothing
changed); where it cannot be built the tests skip with the script's reason, except under
GPUSHARE_REQUIRE_REAL_PARTS=1 (CI), where they fail.

Pins: the image's entrypoint is the rendered Deployment's command, it runs as UID 65534
by default (the Deployment's runAsUser, and what kubelet reads from the CRI's
ImageStatus for runAsNonRoot), and the Deployment needs no shell (there is none); it
holds the extender and the libraries it imports (cryptography and cffi's backend
included: it signs placements), not the node daemon's (gRPC, NVML, psutil,
jinja2) nor the kubernetes client's parts it never imports (its asyncio client with
aiohttp, its generated API classes) nor cffi's C parser nor the project's stand-ins
(``standins``, in its wheel for the quick start and the tests); every shared object in it finds
its libraries in it (its own loader says so); the archive is reproducible (the same inputs give the
same digest). ``podman load`` and ``ctr -n k8s.io images import`` (a private
containerd) both take the archive under its name; in each engine ``gpushare-scheduler
--help`` runs, and the extender runs exactly as the rendered Deployment runs it: its
command and args (only the two listen addresses moved to free loopback ports), its TLS
and signing Secrets made by ``deploy/render.py tls`` / ``placement-keys`` and rendered
by ``scheduler-tls-secret`` / ``scheduler-signing-secret``, laid out as kubelet lays out
a Secret volume (readable by UID 65534 through fsGroup only) and mounted read-only where
the Deployment mounts them, in-cluster credentials (the API server behind TLS), on the
host network, as UID 65534 with a read-only root and no capabilities: under podman, and
through containerd's CRI as kubelet makes the pod (its security context too).
``/healthz`` answers on the plain port (which serves no verb); filter and bind answer
over mutual TLS only to the client kube-scheduler builds from the rendered
``gpushare-scheduler-config`` tlsConfig (no answer without its certificate, none to
plain HTTP); the bind leaves the pod bound with a placement that a node holding
``placement.pub`` believes (``nodemgr.kubernetes.podwatch``) and one holding another
key does not. docs/scheduler-extender.md's ways to a registry work: ``skopeo copy oci-archive:...
docker://...`` (the registry serves the archive's manifest digest) and ``podman load`` +
``podman push``, into a real registry (``scripts/setup-registry``: Debian's
docker-registry) from which containerd pulls and runs the image.
"""

from __future__ import annotations

import base64
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
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from nodemgr.config.schema import KubernetesSettings
from nodemgr.kubernetes.podwatch import placement_trust, pod_info
from standins.apiserver_sim import TestApiServer
from standins.cri import configs
from standins.cri.api import runtime_v1_pb2 as cri
from standins.cri.containerd import Containerd
from standins.extender_tls import (
    ClientTls,
    client_from_config,
    https_request,
    post_json,
    secret_volume,
)
from standins.paths import REPO
from standins.setup_script import run_setup
from tests.engines.conftest import PODMAN_RLIMITS, Podman, new_uid

pytestmark = pytest.mark.e2e

BUILD = os.path.join(REPO, "scripts", "build-image")
SETUP_REGISTRY = os.path.join(REPO, "scripts", "setup-registry")
BUILD_TIMEOUT_SECONDS = 900  # a cold build from nothing (Debian packages, wheels) included
NON_ROOT = 65534  # the Deployment's runAsUser: nobody
RENDER = os.path.join(REPO, "deploy", "render.py")
LOADER = "/lib64/ld-linux-x86-64.so.2"  # glibc's dynamic loader, the image's own
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
    "pycparser",  # cffi's C parser: cryptography's bindings are compiled already
    "standins",  # the project's stand-ins (test kubelet, ...): in its wheel, not for the extender
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
    "cryptography/hazmat/bindings/_rust.abi3.so",  # signs the placements (OpenSSL inside)
    "_cffi_backend.cpython-311-x86_64-linux-gnu.so",  # cryptography's OpenSSL bindings load it
)
LAYER_BUDGET_BYTES = 32 * 1024 * 1024  # compressed


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


def unpack(image: Image, directory: Path) -> None:
    """The image's layers, unpacked into ``directory`` as a runtime unpacks them."""
    with tarfile.open(image.archive) as outer:
        manifest = json.loads(outer.extractfile(f"blobs/sha256/{image.digest[7:]}").read())
        for layer in manifest["layers"]:
            blob = outer.extractfile(f"blobs/sha256/{layer['digest'][7:]}").read()
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as inner:
                inner.extractall(directory, filter="fully_trusted")  # this project's own


def test_every_shared_object_finds_its_libraries_in_the_image(image, tmp_path):
    """The image's own loader (``ld.so --list``, what ldd runs), chrooted into the unpacked
    image, loads every shared object of the venv (the wheels' native code: cryptography's
    Rust and OpenSSL, cffi's backend, PyYAML's and charset-normalizer's) and of the
    standard library's lib-dynload: nothing they link against is missing from the image."""
    chroot = shutil.which("chroot")
    if chroot is None:
        pytest.fail("chroot is needed to run the image's loader")
    tree = tmp_path / "tree"
    unpack(image, tree)
    objects = [
        path
        for path, entry in image.files.items()
        if entry.isfile()
        and (path.startswith("opt/gpushare/") or "/lib-dynload/" in path)
        and (path.endswith(".so") or ".so." in posixpath.basename(path))
    ]
    assert any("cryptography" in p for p in objects) and any("_cffi_backend" in p for p in objects)
    for path in objects:
        done = subprocess.run(
            [chroot, str(tree), LOADER, "--list", "/" + path],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert done.returncode == 0 and "not found" not in done.stdout, (path, done)


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


def post_plain(url: str, document: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_healthy(url: str, logs, timeout: float = 60.0) -> None:
    """Until ``url`` (the readiness probe's) answers 200, as kubelet's probe waits."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = get(url)
            if last[0] == 200:
                return
        except OSError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"no 200 from {url} ({last}); the container's log:\n{logs()}")


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
def front(api, tmp_path):
    """The test API server behind TLS."""
    directory = tmp_path / "apiserver"
    directory.mkdir()
    front = TlsFront(str(directory), int(api.url.rsplit(":", 1)[1]))
    yield front
    front.close()


@dataclass(frozen=True)
class Mount:
    """What configs.container_config takes for a mount (a device plugin Mount's fields)."""

    container_path: str
    host_path: str
    read_only: bool = True


def kubelet_secret_volume(directory: Path, data: dict[str, str], mode: int, fs_group: int) -> None:
    """A Secret's ``data`` laid out as kubelet lays out its volume: each key a file behind
    the atomic writer's ``..data`` link, of the volume's ``defaultMode``, owned by root and
    the pod's ``fsGroup`` (kubelet's volume ownership: the group set on every file and
    directory, directories setgid and group-searchable). The extender's UID reads the files
    through that group only: they are root's and not world-readable."""
    source = directory.with_name(directory.name + ".source")
    source.mkdir()
    for key, value in data.items():
        (source / key).write_bytes(base64.b64decode(value))
    secret_volume(str(directory), str(source))
    shutil.rmtree(source)
    os.chown(directory, 0, fs_group)
    os.chmod(directory, 0o2755)
    for root, directories, files in os.walk(directory):
        for name in directories + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            os.chown(path, 0, fs_group)
            os.chmod(path, 0o2755 if os.path.isdir(path) else mode)
            if not os.path.isdir(path):
                assert os.stat(path).st_mode & 0o044 == 0o040, (path, oct(mode))  # group only


def service_account(directory: Path, front: TlsFront, api: TestApiServer) -> str:
    """The service account's token and CA as kubelet's projected volume holds them."""
    account = directory / "serviceaccount"
    account.mkdir()
    shutil.copy(front.ca, account / "ca.crt")
    (account / "token").write_text(api.token)
    (account / "namespace").write_text("kube-system")
    for path in (account, *account.iterdir()):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return str(account)


@dataclass(frozen=True)
class Deployed:
    """The rendered Deployment's container, ready to run here as kubelet runs it."""

    pod: dict  # the pod template's spec
    container: dict  # its one container
    args: list[str]  # its args, the two listen addresses moved to free loopback ports
    health_url: str  # the plain port, where kubelet probes
    probe_url: str  # what its readinessProbe asks there
    mounts: list[Mount]  # its Secret volumes (as kubelet makes them) and the service account
    env: dict[str, str]  # what kubelet sets for in-cluster credentials
    scheduler: ClientTls  # kube-scheduler's client, from the rendered tlsConfig
    ca: str  # the extender's CA (ca.crt of render.py tls)
    public_key: str  # placement.pub, what every node holds
    other_public_key: str  # a key pair's public half that signed nothing here


def render(*args: str) -> str:
    """deploy/render.py run as an admin runs it: its stdout."""
    done = subprocess.run(
        [sys.executable, RENDER, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def deployment(image_name: str) -> dict:
    """The Deployment deploy/render.py renders for this image."""
    rendered = render("scheduler-deployment", "--image", image_name)
    [found] = [d for d in yaml.safe_load_all(rendered) if d["kind"] == "Deployment"]
    return found


def deploy(image: Image, api: TestApiServer, front: TlsFront, directory: Path) -> Deployed:
    """Everything the rendered manifests give the extender, made as deploy/README.md says:
    ``render.py tls`` and ``placement-keys``, their Secrets rendered and laid out as the
    Deployment's volumes, its args with only the addresses moved, and the client
    kube-scheduler builds from the rendered ``gpushare-scheduler-config``."""
    tls, keys, other = directory / "tls", directory / "keys", directory / "other-keys"
    render("tls", "--dir", str(tls))
    render("placement-keys", "--dir", str(keys))
    render("placement-keys", "--dir", str(other))
    secrets = {}
    for command, source in (("scheduler-tls-secret", tls), ("scheduler-signing-secret", keys)):
        secret = yaml.safe_load(render(command, "--dir", str(source)))
        secrets[secret["metadata"]["name"]] = secret

    pod = deployment(image.name)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == image.name
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (directory / "volumes").mkdir()
    mounts = []
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]]["secret"]
        assert set(secret) == {"secretName", "defaultMode"}, secret  # every key, required
        host = directory / "volumes" / mount["name"]
        data = secrets[secret["secretName"]]["data"]
        kubelet_secret_volume(host, data, secret["defaultMode"], pod["securityContext"]["fsGroup"])
        mounts.append(Mount(mount["mountPath"], str(host), mount.get("readOnly", False)))
    mounts.append(Mount(SERVICE_ACCOUNT_DIR, service_account(directory, front, api)))

    # kubelet probes the container port the readinessProbe names: the one --health-address
    # listens on (moved below with it).
    probe = container["readinessProbe"]["httpGet"]
    [probed] = [p["containerPort"] for p in container["ports"] if p["name"] == probe["port"]]
    assert f"--health-address=0.0.0.0:{probed}" in container["args"], (probed, container["args"])
    port, health_port = free_port(), free_port()
    moved = {"--address": f"127.0.0.1:{port}", "--health-address": f"127.0.0.1:{health_port}"}
    args = []
    for arg in container["args"]:
        flag, equals, _ = arg.partition("=")
        args.append(f"{flag}={moved.pop(flag)}" if equals and flag in moved else arg)
    assert not moved, f"the Deployment's args have no {', '.join(moved)}"

    prefix = next(a.split("=", 1)[1] for a in args if a.startswith("--url-prefix="))
    config = yaml.safe_load(
        render(
            "gpushare-scheduler-config",
            "--extender-url",
            f"https://127.0.0.1:{port}{prefix}",
            "--client-tls-dir",
            str(tls),
        )  # fmt: skip
    )
    return Deployed(
        pod=pod,
        container=container,
        args=args,
        health_url=f"http://127.0.0.1:{health_port}",
        probe_url=f"http://127.0.0.1:{health_port}{probe['path']}",
        mounts=mounts,
        env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(front.port)},
        scheduler=client_from_config(config, str(directory)),
        ca=str(tls / "ca.crt"),
        public_key=str(keys / "placement.pub"),
        other_public_key=str(other / "placement.pub"),
    )


def verb_path(client: ClientTls, verb: str) -> str:
    """Where kube-scheduler sends a verb: its urlPrefix's path, then the verb."""
    return f"{urlsplit(client.url).path}/{verb}"


def binding(api: TestApiServer, name: str) -> dict:
    """kube-scheduler's ExtenderBindingArgs for the pod on node-a."""
    uid = api.pod("default", name)["metadata"]["uid"]
    return {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": "node-a"}


def check_only_kube_scheduler_is_answered(api: TestApiServer, run: Deployed) -> None:
    """A bind of the small pod gets no answer on the verbs' port without kube-scheduler's
    client certificate (a TLS client trusting the extender's CA, plain HTTP), and a 4xx on
    the plain port: the pod stays unbound."""
    body = json.dumps(binding(api, "cuda")).encode()
    path = verb_path(run.scheduler, "bind")
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.load_verify_locations(cafile=run.ca)
    no_certificate = ClientTls(anonymous, run.scheduler.server_name, run.scheduler.url)
    try:
        status, answer = https_request(no_certificate, "POST", path, body)
    except OSError:  # ssl.SSLError, a reset or a closed connection: no HTTP answer
        pass
    else:
        raise AssertionError(f"answered {status} without a client certificate: {answer!r}")
    port = urlsplit(run.scheduler.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(b"POST %s HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                      % (path.encode(), len(body), body))  # fmt: skip
        assert plain.recv(100) == b""  # closed without an HTTP answer
    status, text = post_plain(run.health_url + path, json.loads(body))
    assert 400 <= status < 500, (status, text)  # 413: it takes no body at all
    assert not api.pod("default", "cuda")["spec"].get("nodeName")


def check_extender(api: TestApiServer, run: Deployed) -> None:
    """Over mutual TLS with the client kube-scheduler builds from the rendered tlsConfig:
    filters answered from what the extender listed (node-a's card has room for the small
    pod, not for the big one, with the reason), then the bind of the small pod: it is bound
    to node-a and carries a placement that a node holding placement.pub believes (card 0
    for its container), and a node holding another public key does not."""
    for name, fits in (("cuda", True), ("big", False)):
        args = {"Pod": api.pod("default", name), "Nodes": None, "NodeNames": ["node-a"]}
        status, result = post_json(run.scheduler, verb_path(run.scheduler, "filter"), args)
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

    status, result = post_json(
        run.scheduler, verb_path(run.scheduler, "bind"), binding(api, "cuda")
    )
    assert (status, result) == (200, {"Error": ""})
    bound = api.pod("default", "cuda")
    assert bound["spec"]["nodeName"] == "node-a"
    node = pod_info(bound, placement_trust(KubernetesSettings(placement_public_key=run.public_key)))
    assert node.choice is not None and node.choice.signed, node.choice_note
    assert dict(node.choice.cards) == {0: 0} and node.choice_note == ""
    other_key = KubernetesSettings(placement_public_key=run.other_public_key)
    other = pod_info(bound, placement_trust(other_key))
    assert other.choice is None and "signature" in other.choice_note, other.choice_note


def status_line(pid: int, key: str) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split()[1:]
    raise AssertionError(f"no {key} line for {pid}")


def check_process(pid: int, fs_group: int) -> None:
    """Every UID of the process is 65534, the pod's fsGroup is among its groups, it holds no
    capability, cannot gain privileges and runs under a seccomp filter."""
    assert status_line(pid, "Uid") == [str(NON_ROOT)] * 4
    assert str(fs_group) in status_line(pid, "Groups")
    assert int(status_line(pid, "CapEff")[0], 16) == 0
    assert status_line(pid, "NoNewPrivs") == ["1"]
    assert status_line(pid, "Seccomp") == ["2"]


@pytest.fixture
def podman(engines, tmp_path_factory):
    # A short directory: podman's runroot must stay under 50 characters.
    directory = tmp_path_factory.mktemp("pm", numbered=True)
    (directory / "hooks").mkdir()
    podman = Podman(str(directory / "s"), str(directory / "hooks"), engines.rootfs)
    yield podman
    podman.cleanup()


def test_podman_loads_the_archive_and_runs_the_extender(image, podman, api, front, tmp_path):
    """``podman load`` names the image; ``--help`` runs; the rendered Deployment's command
    and args (the addresses moved to free loopback ports) on the host network, its Secrets
    (render.py tls and placement-keys) mounted read-only where it mounts them, readable
    through fsGroup only, and in-cluster credentials: /healthz is 200 on the plain port,
    filter and bind are answered over mutual TLS to kube-scheduler's client only, the bind
    writes a placement a node verifies, as UID 65534 (the image's default, no --user) with
    a read-only root and no capabilities."""
    done = podman.podman("load", "-i", image.archive, timeout=300)
    assert done.returncode == 0, done.stderr
    done = podman.podman("images", "--format", "{{.Repository}}:{{.Tag}}")
    assert image.ref in done.stdout.split(), done.stdout

    flags = ["--network", "host", *PODMAN_RLIMITS, "--read-only", "--cap-drop", "all"]
    flags += ["--security-opt", "no-new-privileges"]
    done = podman.podman("run", "--rm", *flags, image.ref, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: gpushare-scheduler" in done.stdout

    run = deploy(image, api, front, tmp_path)
    fs_group = run.pod["securityContext"]["fsGroup"]
    flags += ["--group-add", str(fs_group)]  # kubelet adds fsGroup to the process's groups
    for mount in run.mounts:
        flags += ["--volume", f"{mount.host_path}:{mount.container_path}:ro"]
        assert mount.read_only, mount
    for key, value in run.env.items():
        flags += ["--env", f"{key}={value}"]
    done = podman.podman(
        "run", "-d", "--name", "extender", *flags,
        "--entrypoint", json.dumps(run.container["command"]),
        image.ref, *run.args,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr

    def logs() -> str:
        return podman.podman("logs", "extender").stderr

    wait_healthy(run.probe_url, logs)
    check_only_kube_scheduler_is_answered(api, run)
    check_extender(api, run)
    assert "credentials from in-cluster" in logs()
    check_process(podman.pid("extender"), fs_group)
    inspected = podman.inspect("extender")
    assert [inspected["Path"], *inspected["Args"]] == [*run.container["command"], *run.args]


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


def kubelet_security_context(security, pod: dict, container: dict | None = None) -> None:
    """Fill a CRI security context (the sandbox's, or a container's) from the pod's and the
    container's securityContext as kubelet does: runAsUser, fsGroup among the
    supplemental groups, the seccomp profile, and for a container its read-only root, no
    privilege escalation and the capabilities dropped."""
    wanted = pod["securityContext"]
    security.run_as_user.value = wanted["runAsUser"]
    security.supplemental_groups.append(wanted["fsGroup"])
    assert wanted["seccompProfile"] == {"type": "RuntimeDefault"}
    security.seccomp.SetInParent()
    security.seccomp.profile_type = cri.SecurityProfile.RuntimeDefault
    if container is not None:
        own = container["securityContext"]
        security.readonly_rootfs = own["readOnlyRootFilesystem"]
        security.no_new_privs = not own["allowPrivilegeEscalation"]
        security.capabilities.drop_capabilities.extend(own["capabilities"]["drop"])


def test_containerd_imports_the_archive_and_runs_the_deployments_container(
    image, containerd, api, front, tmp_path
):
    """``ctr -n k8s.io images import`` (the registry-less path) makes the image known
    under the Deployment's short name; the CRI reports UID 65534 for it (kubelet's
    runAsNonRoot check); ``ctr run`` runs ``--help``; through the CRI, a host-network pod
    as kubelet makes it from the rendered Deployment: its image, command, args (the
    addresses moved), security context (runAsUser, fsGroup, RuntimeDefault seccomp,
    read-only root, no capabilities), its two Secret volumes mounted read-only and the
    service account's token and CA with $KUBERNETES_SERVICE_HOST/PORT (the API server
    behind TLS): /healthz on the plain port, filter and bind over mutual TLS to
    kube-scheduler's client only, a signed placement a node verifies."""
    containerd.ctr("images", "import", image.archive)
    assert image.ref in containerd.ctr("images", "ls", "-q").split()
    run = deploy(image, api, front, tmp_path)
    status = containerd.images.ImageStatus(
        cri.ImageStatusRequest(image=cri.ImageSpec(image=run.container["image"])), timeout=30
    )
    assert status.image.id and status.image.uid.value == NON_ROOT

    helped = subprocess.run(
        ["ctr", "--address", containerd.socket, "-n", "k8s.io", "run", "--rm", image.ref,
         f"help-{new_uid()[:8]}", "gpushare-scheduler", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "usage: gpushare-scheduler" in helped.stdout

    name = run.container["name"]
    sandbox = configs.sandbox_config(
        "kube-system", "gpushare-scheduler", new_uid(), containerd.log_root
    )
    kubelet_security_context(sandbox.linux.security_context, run.pod)
    sandbox_id = containerd.run_pod_sandbox(sandbox)
    config = configs.container_config(
        sandbox, name, run.container["image"], run.container["command"], run.env, run.mounts
    )
    config.args.extend(run.args)
    kubelet_security_context(config.linux.security_context, run.pod, run.container)
    container_id = containerd.create_container(sandbox_id, sandbox, config)
    containerd.start_container(container_id)

    def logs() -> str:
        return container_log(sandbox, name)

    wait_healthy(run.probe_url, logs)
    check_only_kube_scheduler_is_answered(api, run)
    check_extender(api, run)
    assert "credentials from in-cluster" in logs()
    check_process(containerd.pid(container_id), run.pod["securityContext"]["fsGroup"])
    _, info = containerd.container_status(container_id)
    spec = info["runtimeSpec"]
    assert spec["process"]["args"] == [*run.container["command"], *run.args]
    mounted = {m["destination"]: m for m in spec["mounts"]}
    for mount in run.mounts:
        assert "ro" in mounted[mount.container_path]["options"], mounted[mount.container_path]


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
    """docs/scheduler-extender.md's two ways to a registry: ``skopeo copy oci-archive:...
    docker://...`` keeps the manifest as written (the registry serves the archive's
    digest), and ``podman load`` then ``podman push``; containerd pulls each (as kubelet
    would from a registry) and runs ``gpushare-scheduler --help`` from it."""
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
