"""Pins mps.namespace with real mount namespaces (root): a card's namespace is the host's
with the card's tmpfs at /dev/shm, kept by a bind of its namespace file in a private
directory (which works where the run directory is a shared mount, as under systemd);
a new one replaces the last; a plain file is no namespace; what fails says why; a caller
in a namespace whose id is above the helper's (ids are handed out per CPU) still binds. And
mps.CardDaemon started with one: the stand-in control daemon runs there, with the card's
tmpfs as /dev/shm, and is verified in it; one run in another namespace is not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from mps import CardDaemon, MpsLayout, MpsUnavailable, mounts, namespace, proc, shm
from standins.daemon_proc import MPS_STANDIN, unmount_under

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
CARD = "GPU-ns000000-0000-4000-8000-000000000000"


@pytest.fixture
def layout():
    """A run directory on a tmpfs of its own, made a shared mount (systemd makes / shared)."""
    root = tempfile.mkdtemp(prefix="nst-", dir="/tmp")
    mounts.run(["mount", "-t", "tmpfs", "tmpfs", root])
    mounts.run(["mount", "--make-shared", root])
    layout = MpsLayout(os.path.join(root, "run"))
    namespace.prepare_directory(layout.namespace_dir)
    shm.mount(layout.shm_dir(CARD), 16)
    yield layout
    for pid in proc.pids():
        environ = proc.read_file(f"/proc/{pid}/environ", 1 << 20) or b""
        if f"CUDA_MPS_PIPE_DIRECTORY={layout.root}".encode() in environ:
            os.kill(pid, 9)
    unmount_under(root)
    mounts.run(["umount", "--lazy", root])
    shutil.rmtree(root, ignore_errors=True)


def card_namespace(layout: MpsLayout) -> namespace.CardNamespace:
    return namespace.CardNamespace(layout.namespace_file(CARD), layout.shm_dir(CARD), 5)


def in_namespace(ns: namespace.CardNamespace, *argv: str) -> str:
    done = subprocess.run(ns.command(list(argv)), capture_output=True, text=True, check=True)
    return done.stdout


def test_the_namespace_has_the_cards_tmpfs_as_dev_shm(layout):
    """A file written in the card's tmpfs on the host is in /dev/shm there, and the
    host's /dev/shm is untouched; the namespace directory is a private mount."""
    ns = card_namespace(layout)
    made = ns.create()
    assert ns.bound() == made
    with open(os.path.join(layout.shm_dir(CARD), "from-host"), "w") as f:
        f.write("x")
    assert in_namespace(ns, "ls", "/dev/shm").split() == ["from-host"]
    assert not os.path.exists("/dev/shm/from-host")
    top = mounts.top_mount(layout.namespace_dir)
    assert top is not None and not any(p.startswith("shared") for p in top.propagation)


def test_a_new_namespace_replaces_the_last(layout):
    """Each create binds a new namespace at the same file, unbinding the one before (held
    open here, so that its number is not given to the new one)."""
    ns = card_namespace(layout)
    first = ns.create()
    held = os.open(ns.path, os.O_RDONLY)
    try:
        second = ns.create()
    finally:
        os.close(held)
    assert first != second and ns.bound() == second
    stacked = [
        e for e in mounts.parse_mountinfo(open("/proc/self/mountinfo", "rb").read())
        if e.mount_point == ns.path
    ]  # fmt: skip
    assert len(stacked) == 1
    assert ns.remove() is True and ns.bound() is None and ns.remove() is False


def test_a_plain_file_is_no_namespace(layout):
    """A regular file at the path (nothing bound) is not taken for a namespace."""
    ns = card_namespace(layout)
    with open(ns.path, "w") as f:
        f.write("x")
    assert ns.bound() is None


def test_a_missing_tmpfs_directory_fails_with_the_reason(layout):
    """The helper cannot bind what is not there: MpsUnavailable naming the namespace."""
    ns = namespace.CardNamespace(layout.namespace_file(CARD), "/nonexistent/shm", 5)
    with pytest.raises(MpsUnavailable, match="cannot make the mount namespace") as e:
        ns.create()
    assert "/nonexistent/shm" in str(e.value)


def test_a_daemon_started_in_it_is_on_the_cards_tmpfs_and_verified(layout):
    """CardDaemon with a namespace: its daemon's mount namespace is the card's, its
    /dev/shm is the card's tmpfs (its mountinfo says so too), and it is verified."""
    daemon = CardDaemon(
        CARD,
        MPS_STANDIN,
        layout.pipe_dir(CARD),
        layout.log_dir(CARD),
        5,
        layout.client_dir(CARD),
        card_namespace(layout),
    )
    daemon.start()
    identity = daemon.identify()
    assert identity is not None
    assert proc.mount_ns(identity.pid) == daemon.namespace.bound()
    assert proc.mount_ns(identity.pid) != proc.mount_ns("self")
    assert daemon.on_card_shm(identity) is True
    with open(f"/proc/{identity.pid}/mountinfo", "rb") as f:
        shown = [e for e in mounts.parse_mountinfo(f.read()) if e.mount_point == "/dev/shm"]
    assert shown[-1].fstype == "tmpfs" and "size=16384k" in shown[-1].options
    daemon.stop()


def test_a_daemon_in_a_namespace_not_bound_for_the_card_is_not_verified(layout):
    """The same daemon started in a namespace of its own that the card's file does not
    hold (as a container's): not the card's daemon."""
    ns = card_namespace(layout)
    ns.create()
    daemon = CardDaemon(CARD, MPS_STANDIN, layout.pipe_dir(CARD), layout.log_dir(CARD), 5)
    os.makedirs(daemon.pipe_dir, exist_ok=True)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": CARD,
        "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
        "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir,
    }
    subprocess.run(
        ["unshare", "--mount", "--propagation", "slave", MPS_STANDIN, "-d"], env=env, check=True
    )
    assert daemon.probe().ok
    assert daemon.identify() is None
    with_ns = CardDaemon(CARD, MPS_STANDIN, daemon.pipe_dir, daemon.log_dir, 5, namespace=ns)
    assert with_ns.identify() is None
    daemon.client.quit()


def test_a_daemon_in_the_hosts_namespace_is_verified_but_not_on_the_cards_tmpfs(layout):
    """A daemon started without the namespace (an earlier gpushare-node's): still the card's
    daemon, and on_card_shm says it is not on the card's tmpfs."""
    plain = CardDaemon(CARD, MPS_STANDIN, layout.pipe_dir(CARD), layout.log_dir(CARD), 5)
    plain.start()
    with_ns = CardDaemon(
        CARD, MPS_STANDIN, layout.pipe_dir(CARD), layout.log_dir(CARD), 5,
        namespace=card_namespace(layout),
    )  # fmt: skip
    identity = with_ns.identify()
    assert identity is not None
    assert with_ns.on_card_shm(identity) is False
    assert plain.on_card_shm(identity) is None  # no namespace: nothing to compare
    plain.stop()


# --- namespace ids handed out per CPU --------------------------------------------------------

NS_GET_MNTNS_ID = 0x8008B705  # _IOR(0xb7, 5, __u64), Linux 6.8 on

# Run in a mount namespace of its own made on one CPU, pinned to another: makes the card's
# namespace there and prints the file identity of the namespace it bound.
IN_A_NAMESPACE_OF_ITS_OWN = """
import sys
from mps import namespace
ns = namespace.CardNamespace(sys.argv[1], sys.argv[2], 5)
print(ns.create())
"""


def mount_ns_id_made_on(cpu: int) -> int:
    """The id the kernel gives a mount namespace made on ``cpu`` now."""
    script = (
        "import fcntl, os, struct; fd = os.open('/proc/self/ns/mnt', os.O_RDONLY); "
        f"print(struct.unpack('Q', fcntl.ioctl(fd, {NS_GET_MNTNS_ID}, bytes(8)))[0])"
    )
    done = subprocess.run(
        ["taskset", "--cpu-list", str(cpu), "unshare", "--mount", sys.executable, "-c", script],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout)


def test_a_caller_whose_namespace_id_is_above_the_next_cpus_still_binds(layout):
    """Since Linux 6.18 a namespace's id comes from a batch held by the CPU that made it, so
    ids are not in the order namespaces were made; and the kernel binds a mount namespace's
    file only from a namespace with a lower id. gpushare-node run in a namespace made on the
    CPU whose batch is highest (a container's, a sandboxed unit's), its helper made on
    another CPU: the card's namespace is still made and bound (tried on each CPU in turn)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: namespace ids are in order")
    try:
        ids = {cpu: mount_ns_id_made_on(cpu) for cpu in cpus}
    except subprocess.CalledProcessError as e:
        pytest.skip(f"no mount namespace ids here (NS_GET_MNTNS_ID, Linux 6.8): {e.stderr}")
    high, low = max(ids, key=ids.get), min(ids, key=ids.get)
    if ids[high] - ids[low] < len(cpus):  # one after the other: no batches per CPU
        pytest.skip(f"namespace ids are handed out in order here: {ids}")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(namespace.__file__))}
    done = subprocess.run(
        ["taskset", "--cpu-list", str(high), "unshare", "--mount", "--propagation", "private",
         "taskset", "--cpu-list", str(low), sys.executable, "-c", IN_A_NAMESPACE_OF_ITS_OWN,
         layout.namespace_file(CARD), layout.shm_dir(CARD)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "FileId" in done.stdout
