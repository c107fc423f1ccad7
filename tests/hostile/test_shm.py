"""Hostile tenants against /dev/shm: what one tenant reaches of another's shared memory.

PyTorch's data loaders pass tensors through files in /dev/shm, so what a container finds
there is other tenants' data. gpushare-node mounts nothing at /dev/shm: each container
keeps the tmpfs its runtime gives it (runc's own here), whichever card it shares, and a
card's tmpfs (``<run_dir>/mps/<uuid>/shm``) is its MPS control daemon's and server's
alone.

Each test makes its attack as a tenant would, from inside a real runc container made from
a real Allocate response (with its pod's CRI identity), against the real gpushare-node
with NVIDIA's real MPS control binary and the test kubelet, and records one row of the
table "Shared memory (/dev/shm)" of docs/attacks.md from what it observed; the last test
compares the table with that file (``scripts/update-tables`` rewrites it). An attack that
still gets something stays in the table with what it got, and its test is a strict xfail
naming why.

Pods land on a card by size: the node has two 15 GiB cards and places by binpack, so a
first pod asking 12 GiB takes GPU0 and a 4 GiB pod after it can only fit GPU1.
"""

from __future__ import annotations

import os

import pytest

from mps.layout import MpsLayout
from standins.daemon_proc import GPU0, GPU1
from standins.outcome_table import OutcomeTable
from tests.hostile import tenant
from tests.hostile.tenant import refusal

pytestmark = [pytest.mark.e2e, pytest.mark.outcome_table]

READ = "read `/dev/shm/torch_1_secret` that a tenant of another card wrote"
OVERWRITE = "overwrite and delete that file"
FILL = "fill /dev/shm until the write fails"
LEFT_BEHIND = "files left in /dev/shm by a pod that is gone"
OTHER_CARD = "another card's /dev/shm tmpfs mounted at /dev/shm (its host path)"
NODE_WIDE = "the node-wide MPS /dev/shm of earlier versions (`<run_dir>/mps/shm`) mounted"
SAME_CARD = "read, overwrite and delete a file of a tenant on the same card"
SAME_CARD_FILL = "fill /dev/shm so that a tenant of the same card cannot write"
OWN_CARD = "its own card's tmpfs (the MPS server's /dev/shm) mounted at /dev/shm"

TABLE = OutcomeTable(
    "hostile-shm",
    "tests/hostile/test_shm.py",
    "docs/attacks.md",
    ("attack", "result", "what the tenant got"),
    (
        READ,
        OVERWRITE,
        FILL,
        LEFT_BEHIND,
        OTHER_CARD,
        NODE_WIDE,
        SAME_CARD,
        SAME_CARD_FILL,
        OWN_CARD,
    ),
)

SECRET = "secret-of-a"
FILE = "/dev/shm/torch_1_secret"
NOTHING_STARTED = "nothing: the container did not start"
BIG_GIB = 12  # a first pod this big takes GPU0; a QUOTA_GIB pod after it only fits GPU1


class AttackSucceeded(AssertionError):
    """The attack got what it wanted: recorded in the table, failing its strict xfail."""


def start_on(site: tenant.Site, name: str, memory_gib: int) -> str:
    """A container of its own pod asking ``memory_gib``; the card it got."""
    env, mounts = site.admit(name, memory_gib=memory_gib)
    done = site.cluster.start_in_pod(name, name, env, mounts)
    assert done.returncode == 0, done.stdout
    return env["NVIDIA_VISIBLE_DEVICES"]


def two_cards(site: tenant.Site) -> None:
    """Container "a" on GPU0 with SECRET in FILE, container "b" on GPU1."""
    assert start_on(site, "a", BIG_GIB) == GPU0
    assert start_on(site, "b", tenant.QUOTA_GIB) == GPU1
    sh(site, "a", f"echo {SECRET} > {FILE}")


def sh(site: tenant.Site, container: str, script: str, ok: bool = True):
    """``script`` run in the container (busybox: ``busybox <applet>`` for what is not
    linked); asserts it succeeded unless ``ok`` is False."""
    done = site.cluster.run_in(container, script)
    if ok:
        assert done.returncode == 0, (container, script, done.stdout, done.stderr)
    return done


def shm_dir(site: tenant.Site, card: str) -> str:
    return MpsLayout(os.path.join(site.cluster.node.root, "run")).shm_dir(card)


def without_shm(mounts: list) -> list:
    """Allocate's mounts less any at /dev/shm (a test adds its own there)."""
    return [(d, s) for d, s in mounts if d != "/dev/shm"]


def shm_size_mib(site: tenant.Site, container: str) -> int:
    """The size of the container's /dev/shm tmpfs, from its /proc/mounts."""
    for line in sh(site, container, "cat /proc/mounts").stdout.splitlines():
        fields = line.split()
        if fields[1] == "/dev/shm" and fields[2] == "tmpfs":
            options = dict(o.partition("=")[::2] for o in fields[3].split(","))
            return int(options["size"].removesuffix("k")) // 1024
    raise AssertionError("no tmpfs at /dev/shm in " + container)


def own_shm_device(site: tenant.Site, container: str) -> int:
    """The device of the container's /dev/shm, as the host sees it."""
    return os.stat(f"/proc/{site.cluster.runtime.pid(container)}/root/dev/shm").st_dev


def test_a_tenant_of_another_card_cannot_read_a_shm_file(site):
    """b, on the other card, finds no trace of a's file in its /dev/shm."""
    two_cards(site)
    read = sh(site, "b", f"cat {FILE}", ok=False)
    if read.returncode == 0:
        TABLE.record(READ, f"read: “{read.stdout.strip()}”", "the other tenant's data")
        raise AttackSucceeded(f"b read {read.stdout!r}")
    assert "No such file or directory" in read.stderr, read.stderr
    listed = sh(site, "b", "busybox ls -A /dev/shm").stdout.split()
    assert listed == [], listed
    cards_tmpfs = {os.stat(shm_dir(site, card)).st_dev for card in (GPU0, GPU1)}
    assert own_shm_device(site, "b") not in cards_tmpfs | {own_shm_device(site, "a")}
    TABLE.record(
        READ,
        "not there: “No such file or directory”; its /dev/shm is its own (its runtime's "
        "tmpfs), empty",
        "nothing",
    )


def test_a_tenant_of_another_card_cannot_overwrite_or_delete_a_shm_file(site):
    """b writes and removes a file of the same name: that happens in its own card's tmpfs,
    and a's file reads as a wrote it."""
    two_cards(site)
    sh(site, "b", f"echo forged > {FILE} && busybox rm {FILE}")
    kept = sh(site, "a", f"cat {FILE}").stdout.strip()
    if kept != SECRET:
        TABLE.record(OVERWRITE, f"a's file now reads “{kept}”", "the other tenant's file")
        raise AttackSucceeded(f"a's file reads {kept!r}")
    TABLE.record(
        OVERWRITE,
        f"written and removed in its own /dev/shm; a's file still reads “{SECRET}”",
        "nothing of the other tenant's",
    )


def test_filling_shm_stops_at_its_own_tmpfs(site):
    """b fills its /dev/shm: the write fails at the size its runtime gave that tmpfs (not
    mps.shm_size_mib, which sizes the card's tmpfs), and a tenant of the other card still
    writes."""
    two_cards(site)
    size_mib = shm_size_mib(site, "b")
    fill = sh(site, "b", "busybox dd if=/dev/zero of=/dev/shm/fill bs=1M count=100000", ok=False)
    assert fill.returncode != 0 and "No space left on device" in fill.stderr, fill.stderr
    used_mib = int(sh(site, "b", "busybox du -m /dev/shm/fill").stdout.split()[0])
    assert used_mib <= size_mib, used_mib
    other = sh(site, "a", "busybox dd if=/dev/zero of=/dev/shm/mine bs=1M count=8", ok=False)
    if other.returncode != 0:
        said = other.stderr.strip().splitlines()[0]
        TABLE.record(FILL, f"a tenant of the other card: “{said}”", "a denial")
        raise AttackSucceeded(f"a cannot write: {other.stderr}")
    TABLE.record(
        FILL,
        f"“No space left on device” at {used_mib} MiB (its own /dev/shm, {size_mib} MiB as "
        "its runtime made it); a tenant of the other card still writes",
        "its own /dev/shm full, nobody else's",
    )


def test_files_of_a_gone_pod_do_not_outlive_it(site):
    """a leaves files in /dev/shm and its pod goes: they were in its own /dev/shm, none in
    its card's tmpfs, and the card's next tenant finds /dev/shm empty."""
    cluster = site.cluster
    assert start_on(site, "a", BIG_GIB) == GPU0
    sh(site, "a", f"echo {SECRET} > {FILE} && busybox mkdir -p /dev/shm/d/e")
    sh(site, "a", "echo x > /dev/shm/d/e/f && busybox ln -s / /dev/shm/d/root")
    host_dir = shm_dir(site, GPU0)
    assert os.listdir(host_dir) == []
    cluster.runtime.delete("a")
    cluster.kubelet.remove_pod("default", "a")
    cluster.node.wait_for(lambda: not cluster.node.allocations(), 30, "a's allocation released")
    assert start_on(site, "c", BIG_GIB) == GPU0
    left = sh(site, "c", "busybox ls -A /dev/shm").stdout.split()
    if left:
        TABLE.record(LEFT_BEHIND, f"the card's next tenant finds {left}", "a gone pod's files")
        raise AttackSucceeded(f"c found {left}")
    TABLE.record(
        LEFT_BEHIND,
        "they were in the pod's own /dev/shm, none in the card's tmpfs; the next pod on the "
        "card finds /dev/shm empty",
        "nothing: the files went with the pod",
    )


def test_another_cards_shm_mounted_is_refused(site):
    """A container admitted on GPU1 whose spec mounts GPU0's tmpfs at /dev/shm."""
    cluster = site.cluster
    assert start_on(site, "a", BIG_GIB) == GPU0
    env, mounts = site.admit("thief")
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU1
    mounts = [*without_shm(mounts), ("/dev/shm", shm_dir(site, GPU0))]
    reason = refusal(cluster.start_in_pod("thief", "thief", env, mounts), "thief")
    tenant.not_started(cluster, "thief")
    TABLE.record(OTHER_CARD, reason, NOTHING_STARTED)


def test_the_node_wide_shm_of_earlier_versions_is_refused(site):
    """A container whose spec mounts ``<run_dir>/mps/shm`` (what earlier versions gave every
    shared container): refused, and the daemon no longer mounts anything there."""
    cluster = site.cluster
    layout = MpsLayout(os.path.join(cluster.node.root, "run"))
    assert not os.path.exists(layout.retired_shm_dir)
    env, mounts = site.admit("old")
    mounts = [*without_shm(mounts), ("/dev/shm", layout.retired_shm_dir)]
    gone = cluster.start_in_pod("old", "old", env, mounts)
    assert gone.returncode != 0 and "no such file or directory" in gone.stdout, gone.stdout
    tenant.not_started(cluster, "old")
    os.makedirs(layout.retired_shm_dir)  # a directory left there
    try:
        reason = refusal(cluster.start_in_pod("old2", "old", env, mounts), "old2")
    finally:
        os.rmdir(layout.retired_shm_dir)
    tenant.not_started(cluster, "old2")
    TABLE.record(
        NODE_WIDE,
        "not mounted, its directory removed at start (runc: “no such file or directory”); "
        f"with a directory left there: {reason}",
        NOTHING_STARTED,
    )


def test_a_tenant_of_the_same_card_reaches_nothing_of_its_neighbours_shm(site):
    """Two tenants of GPU0: b finds no file of a's in its /dev/shm, and writing and
    removing a file of that name leaves a's file as a wrote it."""
    assert start_on(site, "a", tenant.QUOTA_GIB) == GPU0
    assert start_on(site, "b", tenant.QUOTA_GIB) == GPU0
    sh(site, "a", f"echo {SECRET} > {FILE}")
    read = sh(site, "b", f"cat {FILE}", ok=False)
    if read.returncode == 0:
        sh(site, "b", f"echo forged > {FILE}")
        forged = sh(site, "a", f"cat {FILE}").stdout.strip()
        sh(site, "b", f"busybox rm {FILE}")
        gone = sh(site, "a", f"cat {FILE}", ok=False).returncode != 0
        TABLE.record(
            SAME_CARD,
            f"read “{read.stdout.strip()}”; overwritten (a then reads “{forged}”); "
            f"{'deleted' if gone else 'not deleted'}",
            "the neighbour's /dev/shm files: a card's tenants share its tmpfs",
        )
        raise AttackSucceeded(f"b read {read.stdout!r} of a tenant on its card")
    assert "No such file or directory" in read.stderr, read.stderr
    assert sh(site, "b", "busybox ls -A /dev/shm").stdout.split() == []
    sh(site, "b", f"echo forged > {FILE} && busybox rm {FILE}")
    kept = sh(site, "a", f"cat {FILE}").stdout.strip()
    if kept != SECRET:
        TABLE.record(SAME_CARD, f"a's file now reads “{kept}”", "the neighbour's file")
        raise AttackSucceeded(f"a's file reads {kept!r}")
    assert own_shm_device(site, "a") != own_shm_device(site, "b")
    TABLE.record(
        SAME_CARD,
        "not there: “No such file or directory”; its /dev/shm is its own (its runtime's "
        f"tmpfs), empty; written and removed there, a's file still reads “{SECRET}”",
        "nothing",
    )


def test_filling_shm_leaves_a_tenant_of_the_same_card_room(site):
    """b fills its /dev/shm: the write fails at the size of its own tmpfs, and a, on the
    same card, still writes to its own."""
    assert start_on(site, "a", tenant.QUOTA_GIB) == GPU0
    assert start_on(site, "b", tenant.QUOTA_GIB) == GPU0
    fill = sh(site, "b", "busybox dd if=/dev/zero of=/dev/shm/fill bs=1M count=100000", ok=False)
    assert fill.returncode != 0 and "No space left on device" in fill.stderr, fill.stderr
    used_mib = int(sh(site, "b", "busybox du -m /dev/shm/fill").stdout.split()[0])
    other = sh(site, "a", "busybox dd if=/dev/zero of=/dev/shm/mine bs=1M count=8", ok=False)
    if other.returncode != 0:
        said = other.stderr.strip().splitlines()[0]
        TABLE.record(
            SAME_CARD_FILL,
            f"b full at {used_mib} MiB; a, on the same card: “{said}”",
            "a denial of its neighbour's /dev/shm",
        )
        raise AttackSucceeded(f"a cannot write: {other.stderr}")
    TABLE.record(
        SAME_CARD_FILL,
        f"“No space left on device” at {used_mib} MiB, in its own /dev/shm; a, on the "
        "same card, still writes",
        "its own /dev/shm full, nobody else's",
    )


def test_its_own_cards_shm_mounted_is_refused(site):
    """A container admitted on GPU0 whose spec mounts GPU0's tmpfs (the /dev/shm of the
    card's MPS control daemon and server) at /dev/shm."""
    cluster = site.cluster
    env, mounts = site.admit("borrower")
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU0
    mounts = [*without_shm(mounts), ("/dev/shm", shm_dir(site, GPU0))]
    done = cluster.start_in_pod("borrower", "borrower", env, mounts)
    if done.returncode == 0:
        TABLE.record(OWN_CARD, "started, /dev/shm the card's tmpfs", "the MPS server's /dev/shm")
        raise AttackSucceeded("a container started with its card's tmpfs as /dev/shm")
    reason = refusal(done, "borrower")
    tenant.not_started(cluster, "borrower")
    TABLE.record(OWN_CARD, reason, NOTHING_STARTED)


def test_docs_table_says_what_was_observed():
    """After a complete run, the table in docs/attacks.md is what this module observed."""
    if not TABLE.complete:
        missing = [c for c in TABLE.expected_cases if c not in TABLE.rows]
        pytest.skip(f"partial run, the docs table is not judged (no row for {missing})")
    problem = TABLE.check_or_update()
    assert problem is None, problem
