"""podman 4.3 (Debian) consumes the CDI specs nodemgr.domain.cdi writes for a DRA claim.

podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi (it has no
--cdi-spec-dir flag and no cdi_spec_dirs setting), so each test writes its spec there
under a name of its own, with a vendor of its own, and removes it afterwards.

Pins: ``podman run --device <fully qualified id>`` of a claim's spec gives the
container the device's env and its mounts (read-only with nosuid and nodev where the
spec says so); the cdiVersion the module picks is one podman 4.3 loads, both for a
claim UID starting with a digit (0.5.0) and with a letter (0.3.0); a spec of
cdiVersion 0.6.0 is refused by podman 4.3 ("unresolvable CDI devices"), which is why
the module writes the lowest version the fields need; an id no spec names is refused.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import uuid

import pytest

from mps.layout import MpsLayout
from nodemgr.domain import cdi
from nodemgr.domain.model import Mount
from tests.engines.conftest import PODMAN_RLIMITS, Podman

pytestmark = pytest.mark.e2e

CDI_DIR = "/var/run/cdi"
SHARE = "5f0e9d8c-1b2a-4c3d-8e7f-6a5b4c3d2e1f"


@pytest.fixture
def workdir():
    # podman's runroot must stay within 50 characters: a short directory of our own.
    path = tempfile.mkdtemp(prefix="cdi-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def podman(engines, workdir):
    hooks = os.path.join(workdir, "hooks")  # no OCI hooks: only CDI edits the container
    os.makedirs(hooks)
    podman = Podman(os.path.join(workdir, "pm"), hooks, engines.rootfs)
    yield podman
    podman.cleanup()


@pytest.fixture
def spec_dir():
    """/var/run/cdi, created if missing (and removed again if it is left empty); yields a
    function writing a spec file there, and removes every file it wrote."""
    created = not os.path.isdir(CDI_DIR)
    os.makedirs(CDI_DIR, exist_ok=True)
    written = []

    def write(name: str, text: str) -> str:
        path = os.path.join(CDI_DIR, name)
        with open(path, "x") as f:
            f.write(text)
        written.append(path)
        return path

    yield write
    for path in written:
        os.unlink(path)
    if created:
        try:
            os.rmdir(CDI_DIR)
        except OSError:
            pass  # something else wrote there meanwhile: leave it


def driver() -> str:
    """A vendor no other spec on this host uses (CDI drops ids two specs both define)."""
    return f"gpushare-test-{secrets.token_hex(4)}.example.com"


def run(podman: Podman, device: str, script: str):
    return podman.podman(
        "run", "--rm", "--network", "none", *PODMAN_RLIMITS, "--device", device,
        "--rootfs", podman.rootfs, "sh", "-c", script,
    )  # fmt: skip


def host_dir(workdir: str, text: str) -> str:
    path = os.path.join(workdir, "host-" + secrets.token_hex(3))
    os.makedirs(path)
    with open(os.path.join(path, "hello.txt"), "w") as f:
        f.write(text)
    return path


def test_podman_applies_a_claims_env_and_mounts(podman, spec_dir, workdir):
    """The claim's CDI device gives the container its env and both mounts: the
    read-only one (ro, nosuid, nodev: writing there fails) and the writable one."""
    claim = str(uuid.uuid4())
    ro_dir, rw_dir = host_dir(workdir, "from-host"), host_dir(workdir, "rw")
    device = cdi.ClaimDevice(
        "gpu-0",
        SHARE,
        {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"},
        (Mount("/gpushare/ro", ro_dir, read_only=True), Mount("/gpushare/rw", rw_dir)),
    )
    name = driver()
    spec = cdi.claim_spec(name, claim, [device])
    spec_dir(cdi.spec_file_name(name, claim), cdi.render(spec))
    [device_id] = cdi.qualified_ids(spec)

    done = run(
        podman,
        device_id,
        "echo env=$NVIDIA_VISIBLE_DEVICES,$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE;"
        " cat /gpushare/ro/hello.txt; echo;"
        " grep ' /gpushare/ro ' /proc/mounts;"
        " touch /gpushare/ro/x 2>/dev/null && echo ro-writable;"
        " echo written > /gpushare/rw/out.txt",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "env=GPU-1,30"
    assert lines[1] == "from-host"
    options = lines[2].split()[3].split(",")
    assert {"ro", "nosuid", "nodev"} <= set(options), lines[2]
    assert "ro-writable" not in done.stdout
    with open(os.path.join(rw_dir, "out.txt")) as f:
        assert f.read() == "written\n"


@pytest.mark.parametrize(
    "first", ["0", "a"], ids=["uid-starts-with-digit", "uid-starts-with-letter"]
)
def test_the_version_the_module_picks_is_one_podman_loads(podman, spec_dir, first):
    """A claim UID starting with a digit gets cdiVersion 0.5.0, one with a letter 0.3.0;
    podman 4.3 loads both."""
    claim = first + str(uuid.uuid4())[1:]
    name = driver()
    spec = cdi.claim_spec(name, claim, [cdi.ClaimDevice("gpu-0", SHARE, {"X": "1"})])
    assert spec["cdiVersion"] == ("0.5.0" if first == "0" else "0.3.0")
    spec_dir(cdi.spec_file_name(name, claim), cdi.render(spec))
    done = run(podman, cdi.qualified_ids(spec)[0], "echo X=$X")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "X=1"


def test_podman_4_3_refuses_cdi_version_0_6_0(podman, spec_dir):
    """The same spec marked cdiVersion 0.6.0 (valid CDI, newer than podman 4.3's
    library) does not load: the device is unresolvable and the container never starts.
    The one marked 0.5.0 next to it (another file) still loads."""
    claim = str(uuid.uuid4())
    old, new = driver(), driver()
    for name, version in ((old, "0.5.0"), (new, "0.6.0")):
        spec = cdi.claim_spec(name, claim, [cdi.ClaimDevice("gpu-0", None, {"X": version})])
        spec["cdiVersion"] = version
        assert cdi.spec_problems(spec) == []
        spec_dir(cdi.spec_file_name(name, claim), cdi.render(spec))
    refused = run(podman, f"{new}/gpu={claim}-gpu-0", "echo X=$X")
    assert refused.returncode != 0
    assert "unresolvable CDI devices" in refused.stderr, refused.stderr
    loaded = run(podman, f"{old}/gpu={claim}-gpu-0", "echo X=$X")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "X=0.5.0"


def test_an_id_no_spec_names_is_refused(podman):
    """An id of a vendor that wrote no spec: podman refuses the container."""
    done = run(podman, f"{driver()}/gpu=nothing", "true")
    assert done.returncode != 0
    assert "unresolvable CDI devices" in done.stderr, done.stderr


def test_podman_runs_a_container_from_the_spec_the_daemon_wrote_for_a_claim(podman):
    """The real gpushare-node prepares a claim (4Gi + 30 %) with dra.cdi_dir
    /var/run/cdi; podman, given the CDI id kubelet got back, starts the container with
    the claim's env (quota, allocation id, MPS pipe directory) and its MPS mount: the
    card's client directory read-only; its /dev/shm is podman's own (a file written there
    does not reach the card's tmpfs); the spec is removed at unprepare."""
    from standins.dra_node import DraCluster

    cluster = DraCluster(driver=driver(), cdi_dir=CDI_DIR)
    try:
        cluster.start()
        pod = cluster.claimed_pod("p1", "c1", {"memory": "4Gi", "cores": "30"})
        assert cluster.dra.prepare_pod(pod).ok
        [device] = cluster.dra.claims()[("ns", "c1")].drivers[cluster.driver]
        [cdi_id] = device.cdi_ids
        [allocation] = cluster.node.allocations()
        done = run(
            podman,
            cdi_id,
            "echo $GPUSHARE_ALLOCATION_ID,$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,"
            "$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,$CUDA_MPS_PIPE_DIRECTORY;"
            " grep -E ' (/tmp/nvidia-mps|/dev/shm) ' /proc/mounts;"
            " echo probe > /dev/shm/probe",
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == f"{allocation['id']},0=4096M,30,/tmp/nvidia-mps"
        mounts = {line.split()[1]: line.split()[3].split(",") for line in lines[1:]}
        assert "ro" in mounts["/tmp/nvidia-mps"] and "rw" in mounts["/dev/shm"]
        [card] = allocation["cards"]
        card_shm = MpsLayout(os.path.join(cluster.node.root, "run")).shm_dir(card)
        assert os.listdir(card_shm) == []
        spec = os.path.join(CDI_DIR, f"{cluster.driver}-gpu_{pod_claim_uid(cluster)}.json")
        assert os.path.exists(spec)
        assert cluster.dra.unprepare_pod(pod).ok
        assert not os.path.exists(spec)
    finally:
        cluster.close()
        for name in os.listdir(CDI_DIR):  # a failure above may have left the claim's spec
            if name.startswith(f"{cluster.driver}-"):
                os.unlink(os.path.join(CDI_DIR, name))


def pod_claim_uid(cluster) -> str:
    return cluster.claim("c1")["metadata"]["uid"]
