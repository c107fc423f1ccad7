"""Pins nodemgr.domain.cdi, the CDI spec a DRA claim gets: one device per allocated
result named ``<claim UID>-<device>[-<share ID>]`` under kind ``<driver>/gpu``, with the
env and mounts the device plugin gives, fully qualified ids, the lowest cdiVersion the
fields need, CDI's name rules, and a validation that agrees with the CDI schema
(tests/unit/domain/data/cdi-spec.schema.json, checked with jsonschema)."""

from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import pytest

from nodemgr.domain import cdi
from nodemgr.domain.model import Mount
from nodemgr.errors import CdiError

SCHEMA = json.loads((pathlib.Path(__file__).parent / "data" / "cdi-spec.schema.json").read_text())
CLAIM = "0b7c1e5a-7d2f-4c1e-9a8b-1c2d3e4f5a6b"
SHARE = "5f0e9d8c-1b2a-4c3d-8e7f-6a5b4c3d2e1f"
ENV = {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
MOUNTS = (Mount("/tmp/nvidia-mps", "/run/gpushare/mps/GPU-1", read_only=True),)


def schema_errors(spec) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    return sorted(e.message for e in validator.iter_errors(spec))


def one_device(**kwargs) -> cdi.ClaimDevice:
    values = {"device": "gpu-0", "share_id": SHARE, "env": ENV, "mounts": MOUNTS} | kwargs
    return cdi.ClaimDevice(**values)


def test_claim_spec_shape():
    """A claim's spec: kind <driver>/gpu, one device per result named claim-device-share,
    env as K=V in the given order, mounts bind-mounted (read-only ones ro), nothing else."""
    spec = cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device()])
    assert spec == {
        "cdiVersion": "0.5.0",
        "kind": "gpushare.aliyun.com/gpu",
        "devices": [
            {
                "name": f"{CLAIM}-gpu-0-{SHARE}",
                "containerEdits": {
                    "env": [
                        "NVIDIA_VISIBLE_DEVICES=GPU-1",
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                    ],
                    "mounts": [
                        {
                            "hostPath": "/run/gpushare/mps/GPU-1",
                            "containerPath": "/tmp/nvidia-mps",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        }
                    ],
                },
            }
        ],
    }
    assert schema_errors(spec) == []
    assert cdi.spec_problems(spec) == []


def test_qualified_ids_follow_the_devices():
    """The ids kubelet gets back: <kind>=<name>, one per device, in order; a device
    without a share ID (a card given whole) is named without one."""
    devices = [one_device(), one_device(device="gpu-1", share_id=None, mounts=())]
    spec = cdi.claim_spec("gpu.example.com", CLAIM, devices)
    assert cdi.qualified_ids(spec) == [
        f"gpu.example.com/gpu={CLAIM}-gpu-0-{SHARE}",
        f"gpu.example.com/gpu={CLAIM}-gpu-1",
    ]
    assert spec["devices"][1]["containerEdits"] == {"env": list(f"{k}={v}" for k, v in ENV.items())}
    assert cdi.device_name(CLAIM, "gpu-1", None) == f"{CLAIM}-gpu-1"
    assert cdi.qualified_id("v.io/gpu", "x") == "v.io/gpu=x"


def test_cdi_version_is_the_lowest_the_fields_need():
    """0.5.0 when a device name starts with a digit (claim UIDs often do; 0.3.0 to 0.4.0
    libraries refuse such names), else 0.3.0: podman 4.3 knows nothing newer than 0.5.0.
    The rules of later versions: a mount type 0.4.0, a device node hostPath 0.5.0,
    annotations or a dot in the class 0.6.0, additionalGids or intelRdt 0.7.0, netDevices
    1.1.0."""
    digit = cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device()])
    letter = cdi.claim_spec(cdi.DEFAULT_DRIVER, "a" + CLAIM[1:], [one_device()])
    assert (digit["cdiVersion"], letter["cdiVersion"]) == ("0.5.0", "0.3.0")

    base = {
        "cdiVersion": "0.3.0",
        "kind": "v.io/c",
        "devices": [{"name": "d", "containerEdits": {}}],
    }

    def edited(edits=None, **top):
        spec = copy.deepcopy(base) | top
        spec["devices"][0]["containerEdits"] = edits or {}
        return spec

    assert cdi.required_version(base) == "0.3.0"
    mount = {"hostPath": "/a", "containerPath": "/b"}
    assert cdi.required_version(edited({"mounts": [mount]})) == "0.3.0"
    assert cdi.required_version(edited({"mounts": [mount | {"type": "bind"}]})) == "0.4.0"
    node = {"path": "/dev/x", "hostPath": "/dev/y"}
    assert cdi.required_version(edited({"deviceNodes": [node]})) == "0.5.0"
    assert cdi.required_version(edited(annotations={"a": "b"})) == "0.6.0"
    assert cdi.required_version(edited(kind="v.io/c.d")) == "0.6.0"
    assert cdi.required_version(edited({"additionalGids": [5]})) == "0.7.0"
    assert cdi.required_version(edited({"intelRdt": {"closID": "x"}})) == "0.7.0"
    net = {"hostInterfaceName": "eth1", "name": "net1"}
    assert cdi.required_version(edited({"netDevices": [net]})) == "1.1.0"
    spec_level = edited(containerEdits={"mounts": [mount | {"type": "bind"}]})
    assert cdi.required_version(spec_level) == "0.4.0"


def test_spec_file_name_is_unique_per_claim():
    """One file per claim, named after driver, class and claim UID (never reused)."""
    assert cdi.spec_file_name(cdi.DEFAULT_DRIVER, CLAIM) == f"gpushare.aliyun.com-gpu_{CLAIM}.json"


def test_render_is_json_that_reads_back():
    """The file's text: JSON of the spec, ending in a newline."""
    spec = cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device()])
    text = cdi.render(spec)
    assert text.endswith("\n") and json.loads(text) == spec


@pytest.mark.parametrize(
    ("driver", "claim_uid", "device", "share_id", "why"),
    [
        ("", CLAIM, "gpu-0", None, "vendor"),
        ("-bad.io", CLAIM, "gpu-0", None, "vendor"),
        ("bad.io-", CLAIM, "gpu-0", None, "vendor"),
        ("b@d.io", CLAIM, "gpu-0", None, "vendor"),
        ("ok.io", "", "gpu-0", None, "claim UID"),
        ("ok.io", "x/y", "gpu-0", None, "claim UID"),
        ("ok.io", CLAIM, "", None, "device"),
        ("ok.io", CLAIM, "gpu 0", None, "device"),
        ("ok.io", CLAIM, "gpu-0", "a=b", "share ID"),
        ("ok.io", CLAIM, "gpu-0", "", "share ID"),
    ],
)
def test_names_cdi_refuses_are_refused(driver, claim_uid, device, share_id, why):
    """A driver, claim UID, device or share ID that would make a name CDI refuses raises
    CdiError naming the part and the value, before anything is written."""
    with pytest.raises(CdiError) as raised:
        cdi.claim_spec(driver, claim_uid, [one_device(device=device, share_id=share_id)])
    assert why in str(raised.value)


def test_bad_env_and_mounts_are_refused():
    """An env name that is empty or holds '=' or NUL, a NUL in a value, a relative or
    empty path: CdiError, not a spec CDI would refuse at container start."""
    for env in ({"": "x"}, {"A=B": "x"}, {"A\0": "x"}, {"A": "x\0y"}):
        with pytest.raises(CdiError, match="env"):
            cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device(env=env)])
    for mount in (Mount("", "/h"), Mount("/c", "h"), Mount("c", "/h")):
        with pytest.raises(CdiError, match="mount"):
            cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device(mounts=(mount,))])


def test_a_claim_needs_devices_with_distinct_names():
    """No devices, or two results that would get one name: CdiError."""
    with pytest.raises(CdiError, match="no device"):
        cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [])
    with pytest.raises(CdiError, match="twice"):
        cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device(), one_device()])


def good_spec() -> dict:
    return cdi.claim_spec(cdi.DEFAULT_DRIVER, CLAIM, [one_device()])


def broken(change) -> dict:
    spec = good_spec()
    change(spec)
    return spec


BROKEN_SPECS = {
    "no cdiVersion": broken(lambda s: s.pop("cdiVersion")),
    "unknown cdiVersion": broken(lambda s: s.update(cdiVersion="0.9.0")),
    "no kind": broken(lambda s: s.pop("kind")),
    "kind without class": broken(lambda s: s.update(kind="gpushare.aliyun.com")),
    "kind starting with a digit": broken(lambda s: s.update(kind="1v.io/gpu")),
    "no devices": broken(lambda s: s.update(devices=[])),
    "unknown top-level field": broken(lambda s: s.update(extra=1)),
    "device without name": broken(lambda s: s["devices"][0].pop("name")),
    "device name with a slash": broken(lambda s: s["devices"][0].update(name="a/b")),
    "device name ending in a dash": broken(lambda s: s["devices"][0].update(name="ab-")),
    "device without containerEdits": broken(lambda s: s["devices"][0].pop("containerEdits")),
    "unknown device field": broken(lambda s: s["devices"][0].update(bogus=1)),
    "unknown edit": broken(lambda s: s["devices"][0]["containerEdits"].update(bogus=1)),
    "env without =": broken(lambda s: s["devices"][0]["containerEdits"].update(env=["A"])),
    "env not a string": broken(lambda s: s["devices"][0]["containerEdits"].update(env=[1])),
    "mount without hostPath": broken(
        lambda s: s["devices"][0]["containerEdits"]["mounts"][0].pop("hostPath")
    ),
    "mount with unknown field": broken(
        lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(readOnly=True)
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN_SPECS))
def test_spec_problems_agrees_with_the_schema(name):
    """Each broken spec is refused both by the schema (jsonschema) and by
    cdi.spec_problems, which the daemon runs on what it writes."""
    spec = BROKEN_SPECS[name]
    assert schema_errors(spec), f"the schema accepts {name}"
    assert cdi.spec_problems(spec), f"spec_problems accepts {name}"


def test_spec_problems_checks_the_version_against_the_fields():
    """A known cdiVersion below what the fields need (a digit-leading name in 0.3.0)
    is a problem the schema alone cannot see."""
    spec = broken(lambda s: s.update(cdiVersion="0.3.0"))
    assert schema_errors(spec) == []
    assert cdi.spec_problems(spec) == ["cdiVersion 0.3.0 is below 0.5.0, which the fields need"]


def test_duplicate_device_names_are_a_problem():
    """Two devices of one name in a spec: CDI drops both, so it is refused."""
    spec = broken(lambda s: s["devices"].append(copy.deepcopy(s["devices"][0])))
    assert any("twice" in p for p in cdi.spec_problems(spec))
