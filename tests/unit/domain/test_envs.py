"""Pins nodemgr.domain.envs, the env Allocate gives a container: a shared container gets
its card, its allocation ID, the MPS memory limit and share only for what it holds, the
gpushare compatibility names, the MPS pipe when MPS is on, and the pod total only when
the pod is known; a whole-card container gets its cards and allocation ID, nothing else;
and the values agree with what the runtime hook reads (hooks.gpuenv)."""

from hooks import gpuenv
from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.envs import shared_envs, whole_envs
from nodemgr.domain.model import Allocation

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
GPU = "GPU-6a7c0d3e-1111-2222-3333-444455556666"


def allocation(units=4, percent=30, unit_mib=1024):
    devices = {}
    if units:
        devices[MEM] = tuple(memory_device_id(GPU, j) for j in range(units))
    if percent:
        devices[CORE] = tuple(core_device_id(GPU, j) for j in range(percent))
    return Allocation("ga-1", devices, units * unit_mib, 1000.0)


def test_a_container_with_memory_and_share():
    """Both resources: the card, the ID, the MPS limits and the gpushare names."""
    assert shared_envs(allocation(), GPU, 1, 15, "/run/mps") == {
        "NVIDIA_VISIBLE_DEVICES": GPU,
        "GPUSHARE_ALLOCATION_ID": "ga-1",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/mps",
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_DEV": "15",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "4",
    }


def test_memory_only_sets_no_share():
    """A container holding memory only: no thread percentage (MPS's default: all SMs)."""
    envs = shared_envs(allocation(percent=0), GPU, 0, 15)
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in envs


def test_share_only_sets_no_memory_limit():
    """A container holding share only: no memory limit and no memory count, never a
    placeholder (kubelet keeps the first value it sees for a name)."""
    envs = shared_envs(allocation(units=0), GPU, 0, 15)
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in envs
    assert "ALIYUN_COM_GPU_MEM_CONTAINER" not in envs


def test_the_memory_limit_is_in_mib_of_the_allocation():
    """The limit is the allocation's MiB (units times the unit at allocation time)."""
    envs = shared_envs(allocation(units=3, unit_mib=512), GPU, 0, 30)
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1536M"
    assert envs["ALIYUN_COM_GPU_MEM_CONTAINER"] == "3"


def test_without_mps_no_pipe_directory():
    """MPS off: the container is not pointed at an MPS pipe."""
    assert "CUDA_MPS_PIPE_DIRECTORY" not in shared_envs(allocation(), GPU, 0, 15, None)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in shared_envs(allocation(), GPU, 0, 15, "")


def test_the_pod_total_only_when_the_pod_is_known():
    """ALIYUN_COM_GPU_MEM_POD is left out unless the pod (from the API) is known; a known
    total of zero is still said."""
    assert "ALIYUN_COM_GPU_MEM_POD" not in shared_envs(allocation(), GPU, 0, 15)
    assert (
        shared_envs(allocation(), GPU, 0, 15, pod_memory_units=10)["ALIYUN_COM_GPU_MEM_POD"] == "10"
    )
    assert (
        shared_envs(allocation(), GPU, 0, 15, pod_memory_units=0)["ALIYUN_COM_GPU_MEM_POD"] == "0"
    )


def test_whole_cards_get_the_cards_and_nothing_else():
    """A whole-card container: its cards, comma-separated, and its ID; no MPS, no quota."""
    whole = Allocation("ga-w", {WHOLE: ("GPU-a", "GPU-b")}, 0, 1000.0)
    assert whole_envs(whole, ["GPU-a", "GPU-b"]) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "GPUSHARE_ALLOCATION_ID": "ga-w",
    }


def test_the_hook_reads_back_what_allocate_wrote():
    """The runtime hook's parser finds the card and limits the daemon wrote."""
    envs = shared_envs(allocation(), GPU, 0, 15, "/run/mps")
    assert gpuenv.needs_daemon(envs)
    assert gpuenv.requested_gpus(envs) == [GPU]
    assert envs[gpuenv.ALLOCATION_ID] == "ga-1"
    assert gpuenv.parse_pinned_limit(envs[gpuenv.PINNED_MEM_LIMIT]) == {"0": 4096}
