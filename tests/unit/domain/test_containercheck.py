"""Pins nodemgr.domain.containercheck: which cgroup holds a container (v2 first, then v1 memory,
never "/", and only a cgroup a runtime made for that container ID: runc's default, kubelet's
cgroupfs and systemd drivers, docker, podman; never a host service, slice, pod or another
container's cgroup), and that a container's GPU env must name a live allocation and exactly
its cards, may lower but never raise or remove its quota env, may name only device 0, and must
use the MPS pipe directory when MPS is on; whole cards carry no quota; an allocation's pod
(namespace and name: any of its containers) is not shared with another pod."""

import pytest

from nodemgr.domain.containercheck import (
    CgroupError,
    check_container,
    container_cgroup,
    identity_conflict,
    parse_cgroups,
    quota_env_problem,
)
from nodemgr.domain.deviceids import ResourceKind, card_device_ids, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef, Registration
from nodemgr.domain.violations import index_registrations, registration_of
from standins.cards import GPU0, GPU1, MPS_PIPE, env_of

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
PIPE = MPS_PIPE
BY_INDEX = {"0": GPU0, "1": GPU1}
POD_A = ContainerRef("default", "a", "main")
POD_B = ContainerRef("default", "b", "main")


def shared(id_="ga-1", card=GPU0, units=4, percent=30, owner=None):
    devices = {
        MEM: tuple(memory_device_id(card, j) for j in range(units)),
        CORE: tuple(core_device_id(card, j) for j in range(percent)),
    }
    return Allocation(
        id=id_,
        devices={kind: ids for kind, ids in devices.items() if ids},
        memory_mib=units * 1024,
        created_at=100.0,
        owner=owner,
    )


def whole(id_="ga-w", cards=(GPU0, GPU1)):
    ids = tuple(d for card in cards for d in card_device_ids(WHOLE, card, 0))
    return Allocation(id=id_, devices={WHOLE: ids}, memory_mib=0, created_at=100.0)


def check(env, allocation, pipe=PIPE):
    return check_container(env, allocation, BY_INDEX, pipe)


# --- cgroups ---------------------------------------------------------------------------------

V1 = "12:pids:/kubepods/pod1/c1\n11:memory:/kubepods/pod1/c1\n1:name=systemd:/kubepods/pod1/c1\n"


def test_parse_cgroups_maps_controllers_to_paths():
    assert parse_cgroups(V1 + "0::/\n") == {
        "pids": "/kubepods/pod1/c1",
        "memory": "/kubepods/pod1/c1",
        "name=systemd": "/kubepods/pod1/c1",
        "": "/",
    }


def test_parse_cgroups_keeps_colons_in_the_path_and_skips_blank_lines():
    assert parse_cgroups("\n0::/a:b/c\n\n") == {"": "/a:b/c"}


@pytest.mark.parametrize("text", ["garbage\n", "0:/no-controllers\n", "0::relative/path\n"])
def test_malformed_cgroup_line_is_refused(text):
    with pytest.raises(CgroupError, match="not a /proc/PID/cgroup line"):
        parse_cgroups(text)
    with pytest.raises(CgroupError):
        container_cgroup(text, "c1")


def test_unified_hierarchy_is_preferred():
    text = "11:memory:/v1/c1\n0::/kubepods.slice/cri-containerd-c1.scope\n"
    assert container_cgroup(text, "c1") == CgroupKey("", "/kubepods.slice/cri-containerd-c1.scope")


def test_v1_memory_is_used_when_the_unified_path_is_root():
    assert container_cgroup(V1 + "0::/\n", "c1") == CgroupKey("memory", "/kubepods/pod1/c1")


def test_v1_pids_is_the_last_resort():
    assert container_cgroup("12:pids:/c1\n11:memory:/\n0::/\n", "c1") == CgroupKey("pids", "/c1")


def test_no_cgroup_of_its_own_is_refused():
    with pytest.raises(CgroupError, match="no cgroup of its own"):
        container_cgroup("12:pids:/\n11:memory:/\n0::/\n", "c1")
    with pytest.raises(CgroupError, match="no cgroup of its own"):
        container_cgroup("", "c1")


CONTAINER_ID = "4f2c9a0d5e6b"


@pytest.mark.parametrize(
    "path",
    [
        # runc's default (cgroupfs, no cgroupsPath): /<id>
        f"/{CONTAINER_ID}",
        # kubelet's cgroupfs driver: containerd /<pod>/<id>, CRI-O /<pod>/crio-<id>
        f"/kubepods/burstable/pod1234/{CONTAINER_ID}",
        f"/kubepods/besteffort/pod1234/crio-{CONTAINER_ID}",
        # kubelet's systemd driver
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/"
        f"cri-containerd-{CONTAINER_ID}.scope",
        f"/kubepods.slice/kubepods-pod1234.slice/crio-{CONTAINER_ID}.scope",
        # docker, podman (cgroupfs and systemd), runc --systemd-cgroup without a path
        f"/docker/{CONTAINER_ID}",
        f"/system.slice/docker-{CONTAINER_ID}.scope",
        f"/libpod_parent/libpod-{CONTAINER_ID}",
        f"/machine.slice/libpod-{CONTAINER_ID}.scope",
        f"/system.slice/runc-{CONTAINER_ID}.scope",
        # crun/runc's systemd sub-group (podman's run.oci.systemd.subgroup)
        f"/machine.slice/libpod-{CONTAINER_ID}.scope/container",
    ],
)
def test_container_cgroups_of_every_runtime_are_accepted(path):
    assert container_cgroup(f"0::{path}\n", CONTAINER_ID) == CgroupKey("", path)


@pytest.mark.parametrize(
    "path",
    [
        "/system.slice/containerd.service",
        "/system.slice/crio.service",
        "/user.slice/user-0.slice/session-1.scope",
        "/kubepods/burstable/pod1234",  # the pod's cgroup: every container of the pod
        "/kubepods.slice",
        "/init.scope",
        "/other-container",  # another container's
        f"/system.slice/docker-{CONTAINER_ID}x.scope",  # an id that only starts like it
        f"/x{CONTAINER_ID}",
        f"/{CONTAINER_ID}.scope",  # .scope without a runtime's prefix
        f"/{CONTAINER_ID}/container/container",
        "/container",
    ],
)
def test_a_cgroup_that_is_not_the_containers_own_is_refused(path):
    with pytest.raises(CgroupError, match="not a container cgroup") as refused:
        container_cgroup(f"0::{path}\n", CONTAINER_ID)
    assert path in str(refused.value) and CONTAINER_ID in str(refused.value)


@pytest.mark.parametrize("container_id", ["containerd.service", "system.slice", "..", ""])
def test_a_container_id_named_like_a_host_unit_does_not_make_its_cgroup_a_containers(
    container_id,
):
    with pytest.raises(CgroupError):
        container_cgroup(f"0::/system.slice/{container_id}\n", container_id)


def test_a_unified_path_left_in_the_runtimes_service_falls_back_to_v1_memory():
    """Hybrid hierarchy: the v2 path is inherited from the runtime's unit (a host cgroup);
    the v1 memory cgroup is the container's own: that one is used."""
    text = (
        f"11:memory:/kubepods/pod1/{CONTAINER_ID}\n"
        f"1:name=systemd:/kubepods/pod1/{CONTAINER_ID}\n"
        "0::/system.slice/containerd.service\n"
    )
    assert container_cgroup(text, CONTAINER_ID) == CgroupKey(
        "memory", f"/kubepods/pod1/{CONTAINER_ID}"
    )


# --- check_container: which allocation, which cards -------------------------------------------


def test_the_env_allocate_gave_passes():
    allocation = shared()
    assert check(env_of(allocation), allocation) is None


def test_gpus_without_an_allocation_id_are_refused():
    problem = check({"NVIDIA_VISIBLE_DEVICES": GPU0}, None)
    assert (
        f"NVIDIA_VISIBLE_DEVICES={GPU0}" in problem and "without a gpushare allocation" in problem
    )


def test_legacy_cuda_image_without_allocation_says_why_it_asks_for_gpus():
    problem = check({"CUDA_VERSION": "12.0"}, None)
    assert "legacy CUDA image" in problem and "without a gpushare allocation" in problem


def test_unknown_allocation_is_refused():
    problem = check({"NVIDIA_VISIBLE_DEVICES": GPU0, "GPUSHARE_ALLOCATION_ID": "ga-gone"}, None)
    assert "GPUSHARE_ALLOCATION_ID=ga-gone is not a live allocation" in problem


def test_allocation_without_gpu_request_is_harmless():
    allocation = shared()
    env = {"GPUSHARE_ALLOCATION_ID": allocation.id, "NVIDIA_VISIBLE_DEVICES": "void"}
    assert check(env, allocation) is None


@pytest.mark.parametrize("value", ["all", "ALL", f"{GPU0},all"])
def test_all_is_refused(value):
    allocation = shared()
    problem = check(env_of(allocation, NVIDIA_VISIBLE_DEVICES=value), allocation)
    assert "NVIDIA_VISIBLE_DEVICES=all" in problem and GPU0 in problem


def test_legacy_cuda_image_with_allocation_is_refused_as_all():
    allocation = shared()
    env = env_of(allocation, NVIDIA_VISIBLE_DEVICES=None, CUDA_VERSION="12.0")
    assert "NVIDIA_VISIBLE_DEVICES=all" in check(env, allocation)


def test_index_form_resolves_to_the_card():
    allocation = shared()
    assert check(env_of(allocation, NVIDIA_VISIBLE_DEVICES="0"), allocation) is None


def test_index_of_another_card_is_refused():
    allocation = shared()
    problem = check(env_of(allocation, NVIDIA_VISIBLE_DEVICES="1"), allocation)
    assert "NVIDIA_VISIBLE_DEVICES=1 differs from the cards of allocation ga-1" in problem


@pytest.mark.parametrize("value", [GPU1, f"{GPU0},{GPU1}", "GPU-unknown"])
def test_other_cards_are_refused(value):
    allocation = shared()
    problem = check(env_of(allocation, NVIDIA_VISIBLE_DEVICES=value), allocation)
    assert "differs from the cards of allocation" in problem


def test_whole_allocation_needs_exactly_its_cards():
    allocation = whole()
    env = {"NVIDIA_VISIBLE_DEVICES": f"{GPU1},{GPU0}", "GPUSHARE_ALLOCATION_ID": allocation.id}
    assert check(env, allocation) is None
    assert check({**env, "NVIDIA_VISIBLE_DEVICES": "0,1"}, allocation) is None
    assert "differs" in check({**env, "NVIDIA_VISIBLE_DEVICES": GPU0}, allocation)


def test_whole_allocation_ignores_quota_and_pipe_env():
    allocation = whole(cards=(GPU0,))
    env = {
        "NVIDIA_VISIBLE_DEVICES": GPU0,
        "GPUSHARE_ALLOCATION_ID": allocation.id,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999G",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "garbage",
        "CUDA_MPS_PIPE_DIRECTORY": "/elsewhere",
    }
    assert check(env, allocation) is None


# --- check_container: quota env ----------------------------------------------------------------


def test_lowered_memory_limit_is_allowed():
    allocation = shared()
    env = env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G")
    assert check(env, allocation) is None


def test_memory_limit_in_gib_equal_to_the_quota_is_allowed():
    allocation = shared()
    assert check(env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=4G"), allocation) is None


def test_raised_memory_limit_is_refused():
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=4097M"), allocation)
    assert "raises the quota of 4096 MiB" in problem


def test_removed_memory_limit_is_refused():
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=None), allocation)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT was removed (quota 4096 MiB)" in problem


def test_malformed_memory_limit_is_refused():
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="lots"), allocation)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in problem and "0=4096M" in problem


@pytest.mark.parametrize("value", ["1=1G", "0=1G,1=1G"])
def test_ordinal_other_than_0_is_refused(value):
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=value), allocation)
    assert "only device 0 is visible" in problem


def test_repeated_ordinal_in_memory_limit_is_refused():
    allocation = shared()
    env = env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=100G,0=1G")
    assert check(env, allocation) is not None


def test_memory_only_allocation_needs_no_thread_percentage():
    allocation = shared(percent=0)
    assert check(env_of(allocation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=None), allocation) is None


def test_share_only_allocation_needs_no_memory_limit():
    allocation = shared(units=0)
    env = env_of(allocation, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=None)
    assert check(env, allocation) is None


@pytest.mark.parametrize("value", ["30", "10", "29.5"])
def test_lowered_or_equal_thread_percentage_is_allowed(value):
    allocation = shared()
    assert check(env_of(allocation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=value), allocation) is None


@pytest.mark.parametrize("value", ["31", "100", "0"])
def test_thread_percentage_outside_the_share_is_refused(value):
    """A percentage in its exact form but above the share (or 0) is refused."""
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=value), allocation)
    assert "is outside the share of 30%" in problem


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "1e1", " 30", "٣٠", "３０"])
def test_thread_percentage_not_in_its_exact_form_is_refused(value):
    """Signs, nan, inf, exponents, spaces and non-ASCII digits are refused for their form,
    whatever number they might stand for."""
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=value), allocation)
    assert "is not a percentage in its exact form" in problem


def test_removed_thread_percentage_is_refused():
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=None), allocation)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE was removed (share 30%)" in problem


def test_non_numeric_thread_percentage_is_refused():
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="thirty"), allocation)
    assert "'thirty' is not a percentage in its exact form" in problem


# --- check_container: MPS pipe directory --------------------------------------------------------


@pytest.mark.parametrize("value", ["/elsewhere", None])
def test_other_or_missing_pipe_directory_is_refused_with_mps_on(value):
    allocation = shared()
    problem = check(env_of(allocation, CUDA_MPS_PIPE_DIRECTORY=value), allocation)
    shown = "(unset)" if value is None else value
    assert f"CUDA_MPS_PIPE_DIRECTORY={shown} differs from {PIPE}" in problem


@pytest.mark.parametrize("value", ["/elsewhere", None])
def test_pipe_directory_is_not_checked_with_mps_off(value):
    allocation = shared()
    assert check(env_of(allocation, CUDA_MPS_PIPE_DIRECTORY=value), allocation, pipe=None) is None


# --- quota_env_problem -------------------------------------------------------------------------


def test_quota_env_problem_reads_a_process_env():
    allocation = shared()
    quota = {
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
    }
    assert quota_env_problem(quota, allocation) is None
    assert "removed" in quota_env_problem({}, allocation)
    assert "raises" in quota_env_problem(
        {**quota, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=5G"}, allocation
    )


def test_quota_env_problem_of_an_allocation_without_quota_is_none():
    assert quota_env_problem({}, shared(units=0, percent=0)) is None


# --- identity_conflict -------------------------------------------------------------------------


def test_no_identity_is_never_a_conflict():
    """No identity is the caller's to refuse (podtie.NO_IDENTITY); nothing to compare here."""
    assert identity_conflict(None, shared(owner=POD_A), [POD_B]) is None


def test_owner_reported_by_kubelet_wins():
    """kubelet's owner binds the allocation to its pod, even over a registered other pod."""
    allocation = shared(owner=POD_A)
    assert identity_conflict(POD_A, allocation, []) is None
    assert identity_conflict(POD_B, allocation, []) == (
        "allocation ga-1 belongs to pod default/a, not to pod default/b"
    )
    # Even when another identity registered first.
    assert identity_conflict(POD_A, allocation, [POD_B]) is None


def test_without_owner_the_first_registered_container_binds_the_allocation():
    """Without an owner, the pod of a container already registered on it binds it."""
    allocation = shared()
    assert identity_conflict(POD_B, allocation, []) is None
    assert identity_conflict(POD_A, allocation, [POD_A]) is None
    assert "belongs to pod default/a, not to pod default/b" in identity_conflict(
        POD_B, allocation, [POD_A]
    )


@pytest.mark.parametrize("owner", [POD_A, None])
def test_any_container_of_the_owning_pod_may_use_the_allocation(owner):
    """Compared per pod (issue 14, item 4): an init container or sidecar of pod default/a
    uses the pod's allocation under its own container name; the same container name in
    another namespace is another pod."""
    allocation = shared(owner=owner)
    sidecar = ContainerRef("default", "a", "sidecar")
    assert identity_conflict(sidecar, allocation, [POD_A]) is None
    elsewhere = ContainerRef("other", "a", "main")
    assert "not to pod other/a" in identity_conflict(elsewhere, allocation, [POD_A])


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NVIDIA_VISIBLE_DEVICES", f"{GPU0},1\n2026-11-27 10:00:00,000 CRITICAL x"),
        ("GPUSHARE_ALLOCATION_ID", "ga-1\n2026-11-27 CRITICAL x"),
        ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/x\r\x1b[2Kforged"),
    ],
    ids=["cards", "allocation-id", "pipe-directory"],
)
def test_env_values_in_a_refusal_are_shown_escaped(name, value):
    """A value with a line break or terminal controls is shown as an escaped literal: the
    refusal (logged, passed to the pod's events) stays one line."""
    allocation = shared()
    env = {**env_of(allocation), name: value}
    problem = check_container(env, allocation if name != "GPUSHARE_ALLOCATION_ID" else None,
                              BY_INDEX, PIPE)  # fmt: skip
    assert problem is not None and problem.isprintable(), problem
    assert repr(value) in problem


def test_a_cgroup_path_in_a_refusal_is_shown_escaped():
    with pytest.raises(CgroupError) as raised:
        container_cgroup("0::/system.slice/x\r\x1b[2K.service\n", "c1")
    assert str(raised.value).isprintable()
    assert "'/system.slice/x\\r\\x1b[2K.service'" in str(raised.value)


def test_a_cgroup_name_with_a_carriage_return_is_one_path():
    """A cgroup named ``x<CR>0::`` with ``/kubepods/victim`` below it (cgroup v2, where a
    container may make cgroups below its own): one path, never a second line naming the
    victim's cgroup (the kernel ends lines at newline only), so the watchdog ties the
    process to its own container, not the victim's."""
    text = "0::/kubepods/mine/x\r0::/kubepods/victim\n"
    cgroups = parse_cgroups(text)
    assert cgroups == {"": "/kubepods/mine/x\r0::/kubepods/victim"}
    mine, victim = (
        Registration(name, "ga-1", CgroupKey("", f"/kubepods/{name}"), 1, 1, None, 0.0)
        for name in ("mine", "victim")
    )
    assert registration_of(index_registrations([victim, mine]), cgroups) is mine
