"""Pins hooks.gpuenv: only GPU env names are read from an OCI env list, a name set twice to
different values is refused, which envs ask for GPUs (including the legacy CUDA image rule of
the NVIDIA toolkit), and how CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE are read: ASCII digits and spaces only, exact forms, and a
GPU container whose quota value is not in that form is refused by the hook."""

import pytest

from hooks.gpuenv import (
    EnvError,
    env_from_list,
    needs_daemon,
    parse_pinned_limit,
    requested_gpus,
)

# --- env_from_list -------------------------------------------------------------------------


def test_env_from_list_keeps_only_gpu_names():
    env = env_from_list(
        [
            "PATH=/usr/bin",
            "NVIDIA_VISIBLE_DEVICES=GPU-a",
            "HOME=/root",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M",
            "GPUSHARE_ALLOCATION_ID=ga-1",
        ]
    )
    assert env == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "GPUSHARE_ALLOCATION_ID": "ga-1",
    }


def test_env_from_list_keeps_everything_after_the_first_equals_sign():
    assert env_from_list(["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G"]) == {
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G"
    }


def test_same_name_twice_with_different_values_is_refused_naming_it():
    with pytest.raises(EnvError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set twice"):
        env_from_list(
            ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100"]
        )


def test_same_name_twice_with_the_same_value_is_fine():
    env = env_from_list(["NVIDIA_VISIBLE_DEVICES=GPU-a", "NVIDIA_VISIBLE_DEVICES=GPU-a"])
    assert env == {"NVIDIA_VISIBLE_DEVICES": "GPU-a"}


def test_non_gpu_names_twice_with_different_values_are_ignored():
    assert env_from_list(["PATH=/a", "PATH=/b"]) == {}


def test_non_string_entry_is_refused():
    with pytest.raises(EnvError, match="non-string"):
        env_from_list(["NVIDIA_VISIBLE_DEVICES=all", 7])


# --- requested_gpus / needs_daemon -----------------------------------------------------------


@pytest.mark.parametrize("value", ["", "void", "none", "NONE", " Void "])
def test_no_gpu_values_request_nothing(value):
    assert requested_gpus({"NVIDIA_VISIBLE_DEVICES": value}) is None


def test_unset_requests_nothing():
    assert requested_gpus({}) is None


def test_all_and_lists():
    assert requested_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}) == ["all"]
    assert requested_gpus({"NVIDIA_VISIBLE_DEVICES": "GPU-a, GPU-b,"}) == ["GPU-a", "GPU-b"]
    assert requested_gpus({"NVIDIA_VISIBLE_DEVICES": "0,1"}) == ["0", "1"]


def test_only_commas_request_nothing():
    assert requested_gpus({"NVIDIA_VISIBLE_DEVICES": " , "}) is None


def test_legacy_cuda_image_gets_every_gpu():
    assert requested_gpus({"CUDA_VERSION": "11.8.0"}) == ["all"]


def test_cuda_image_with_require_cuda_gets_none():
    assert requested_gpus({"CUDA_VERSION": "11.8.0", "NVIDIA_REQUIRE_CUDA": "cuda>=11.8"}) is None


def test_visible_devices_beats_the_legacy_rule():
    assert requested_gpus({"CUDA_VERSION": "11.8.0", "NVIDIA_VISIBLE_DEVICES": "void"}) is None


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, False),
        ({"CUDA_VERSION": "12.0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0"}, False),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-a"}, True),
        ({"CUDA_VERSION": "12.0"}, True),
        # Claims an allocation without asking for a GPU: the daemon must still check it.
        ({"GPUSHARE_ALLOCATION_ID": "ga-1", "NVIDIA_VISIBLE_DEVICES": "none"}, True),
    ],
)
def test_needs_daemon(env, expected):
    assert needs_daemon(env) is expected


# --- parse_pinned_limit ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0=4096M", {"0": 4096}),
        ("0=4G", {"0": 4096}),
        ("0=4g", {"0": 4096}),
        ("0=1024M,1=2G", {"0": 1024, "1": 2048}),
        (" 0 = 512M , 1=1M ", {"0": 512, "1": 1}),
    ],
)
def test_parse_pinned_limit(value, expected):
    assert parse_pinned_limit(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", "4096M", "0=", "0=M", "0=4096", "0=4096K", "x=4G", "0=-1M", "0=1.5G", "0=4G,", "=4G"],
)
def test_malformed_pinned_limit_is_refused_naming_the_variable(value):
    with pytest.raises(EnvError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        parse_pinned_limit(value)


@pytest.mark.parametrize("value", ["0=²M", "0=" + "9" * 5000 + "M", "0=٤G"])
def test_non_ascii_or_overlong_amount_is_an_env_error(value):
    with pytest.raises(EnvError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        parse_pinned_limit(value)


# --- exact ASCII forms (issue 14, item 8) ------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "0=\u00a04096M",  # NBSP: Python's \s and str.strip() take it for a space
        "0\u00a0=4096M",
        "\u00a00=4096M",
        "0=4096M\u2003",
        "0=4096M,\u30001=1G",
        "٠=4096M",
        "0=４０９６M",
    ],
)
def test_pinned_limit_takes_only_ascii_digits_and_spaces(value):
    with pytest.raises(EnvError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        parse_pinned_limit(value)


@pytest.mark.parametrize(
    ("value", "expected"), [("30", 30.0), ("100", 100.0), ("0", 0.0), ("29.5", 29.5), ("07", 7.0)]
)
def test_parse_thread_percentage(value, expected):
    from hooks.gpuenv import parse_thread_percentage

    assert parse_thread_percentage(value) == expected


@pytest.mark.parametrize(
    "value",
    ["٣٠", "３０", "30\u00a0", " 30", "30 ", "3_0", "+30", "-5", "3e1", "nan", "inf", "", "30.",
     ".5", "1" * 20, "30%", "²"],
)  # fmt: skip
def test_thread_percentage_takes_only_ascii_digits(value):
    from hooks.gpuenv import parse_thread_percentage

    with pytest.raises(EnvError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.*ASCII digits"):
        parse_thread_percentage(value)


@pytest.mark.parametrize(
    "entry",
    [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=٣٠",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=３０",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=\u00a04096M",
    ],
)
def test_the_hook_refuses_a_gpu_container_whose_quota_env_is_not_ascii(entry):
    """env_from_list is what the runtime hook reads the OCI env with: a GPU container with
    a quota value that is not in its exact ASCII form is refused there (fail closed)."""
    name = entry.partition("=")[0]
    with pytest.raises(EnvError, match=name):
        env_from_list(["NVIDIA_VISIBLE_DEVICES=GPU-a", "GPUSHARE_ALLOCATION_ID=ga-1", entry])


def test_a_container_without_gpus_is_not_refused_for_its_quota_env():
    """The hook lets non-GPU containers through without asking the daemon: their quota env
    means nothing (no GPU to share), so it is not judged."""
    assert env_from_list(["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=٣٠"]) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "٣٠"
    }
