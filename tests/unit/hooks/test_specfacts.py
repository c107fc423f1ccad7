"""Pins hooks.specfacts, how the hook and the daemon read a config.json as runc does: which
mounts show host paths (bind sources, relative ones in the bundle; overlay dirs; devtmpfs;
absolute sources) and land where, lexically normal; which linux.devices nodes and which
resources.devices rules may be NVIDIA's (Go's zero values, runc's wildcards); keys that differ
from runc's field names only in case (as Go matches them) and values of the wrong type are
refused; and touches_gpu, the hook's cheap test of whether the daemon must see a container."""

import pytest

from hooks import specfacts
from hooks.specfacts import SpecError, nvidia_majors, read_facts, touches_gpu

BUNDLE = "/run/containerd/bundles/c1"
MPS = "/run/gpushare/mps"


def config(mounts=(), devices=(), rules=(), **extra):
    linux = {"devices": list(devices), "resources": {"devices": list(rules)}}
    return {"mounts": list(mounts), "linux": linux, **extra}


def bind(destination, source, **extra):
    return {"destination": destination, "source": source, "type": "bind",
            "options": ["rbind", "ro"], **extra}  # fmt: skip


# --- mounts ----------------------------------------------------------------------------------


def test_runc_default_mounts_show_no_host_paths():
    """proc, tmpfs /dev, devpts, shm, mqueue, sysfs and cgroup mounts (runc spec) are left out."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs"},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
    ]
    assert read_facts(config(mounts), BUNDLE)["mounts"] == []


@pytest.mark.parametrize(
    ("mount", "sources"),
    [
        (bind("/tmp/nvidia-mps", f"{MPS}//GPU-b/./pipe/"), [f"{MPS}/GPU-b/pipe"]),
        (bind("/x", "//run/../run/gpushare"), ["/run/gpushare"]),
        (bind("/x", "rel/dir"), [f"{BUNDLE}/rel/dir"]),
        (bind("/x", "../../../../run/gpushare/mps"), [MPS]),
        ({"destination": "/x", "source": "/dev/nvidia1", "options": ["bind"]}, ["/dev/nvidia1"]),
        ({"destination": "/x", "source": "rel", "type": "none", "options": ["rbind"]},
         [f"{BUNDLE}/rel"]),
        ({"destination": "/x", "source": "/srv", "type": "ext4"}, ["/srv"]),
        ({"destination": "/x", "source": "overlay", "type": "overlay",
          "options": [f"lowerdir={MPS}:/a", "upperdir=/u", "workdir=w"]},
         [MPS, "/a", "/u", f"{BUNDLE}/w"]),
        ({"destination": "/x", "source": "devtmpfs", "type": "devtmpfs"}, ["/dev"]),
    ],
)  # fmt: skip
def test_host_paths_of_a_mount(mount, sources):
    """Each mount's host paths as runc would use them, lexically normal (relative bind sources
    and overlay dirs in the bundle, devtmpfs as /dev), with the destination normal too."""
    [fact] = read_facts(config([mount]), BUNDLE)["mounts"]
    destination = "/x" if mount["destination"] == "/x" else "/tmp/nvidia-mps"
    assert fact == {"destination": destination, "sources": sources, "nodes": []}


def test_a_mount_in_the_device_list_is_kept_without_host_paths():
    """A tmpfs mounted at /var/run/nvidia-container-devices/GPU-b makes an entry named GPU-b:
    kept, though it shows no host path."""
    mount = {"destination": "/var/run/nvidia-container-devices/GPU-b/", "type": "tmpfs",
             "source": "tmpfs"}  # fmt: skip
    [fact] = read_facts(config([mount]), BUNDLE)["mounts"]
    assert fact["destination"] == "/var/run/nvidia-container-devices/GPU-b"
    assert fact["sources"] == []


# --- devices and rules -----------------------------------------------------------------------


def test_only_devices_that_may_be_nvidias_are_kept():
    """c/u 195:*, /dev/nvidia* of any type and numbers runc would truncate are kept (missing
    numbers are Go's 0); /dev/null and block devices are not."""
    devices = [
        {"path": "/dev/null", "type": "c", "major": 1, "minor": 3},
        {"path": "/dev/sda", "type": "b", "major": 195, "minor": 1},
        {"path": "/dev/x", "type": "c", "major": 195, "minor": 1},
        {"path": "/dev/y", "type": "u", "major": 195},
        {"path": "/dev/nvidia-uvm", "type": "c", "major": 510, "minor": 0},
        {"path": "/dev/z", "type": "c", "major": 4291, "minor": 1},
        {"path": "//dev//nvidia0/", "type": "b", "major": 8, "minor": 0},
    ]
    kept = read_facts(config(devices=devices), BUNDLE)["devices"]
    assert kept == [
        {"path": "/dev/x", "type": "c", "major": 195, "minor": 1},
        {"path": "/dev/y", "type": "u", "major": 195, "minor": 0},
        {"path": "/dev/nvidia-uvm", "type": "c", "major": 510, "minor": 0},
        {"path": "/dev/z", "type": "c", "major": 4291, "minor": 1},
        {"path": "/dev/nvidia0", "type": "b", "major": 8, "minor": 0},
    ]


def test_only_rules_that_may_allow_using_an_nvidia_node_are_kept():
    """Allow rules for reading or writing c 195, any major (missing, null or negative), any
    type (missing is "a") or a truncated number are kept; deny, mknod-only, block and other
    majors are not."""
    rules = [
        {"allow": False, "access": "rwm"},
        {"allow": True, "type": "c", "access": "m"},
        {"allow": True, "type": "b", "access": "rwm"},
        {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"},
        {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
        {"allow": True, "access": "rwm"},
        {"allow": True, "type": "c", "major": -1, "minor": None, "access": "r"},
        {"allow": True, "type": "c", "major": 4291, "minor": 0},
    ]
    kept = read_facts(config(rules=rules), BUNDLE)["rules"]
    assert kept == [
        {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
        {"allow": True, "type": "a", "major": None, "minor": None, "access": "rwm"},
        {"allow": True, "type": "c", "major": None, "minor": None, "access": "r"},
        {"allow": True, "type": "c", "major": 4291, "minor": 0, "access": ""},
    ]


# --- read as runc reads it -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"Mounts": [bind("/x", MPS)]}, "config.json has the key 'Mounts'"),
        ({"LINUX": {}}, "config.json has the key 'LINUX'"),
        ({"process": {"Env": ["NVIDIA_VISIBLE_DEVICES=all"]}}, "process has the key 'Env'"),
        ({"mounts": [{"Source": MPS, "destination": "/x"}]}, "mounts[0] has the key 'Source'"),
        ({"linux": {"Devices": []}}, "linux has the key 'Devices'"),
        ({"linux": {"resources": {"deviceſ": []}}}, "linux.resources has the key 'deviceſ'"),
        ({"linux": {"devices": [{"path": "/dev/x", "majoR": 195}]}}, "has the key 'majoR'"),
        ({"linux": {"resources": {"devices": [{"allow": True, "Major": 195}]}}},
         "has the key 'Major'"),
        ({"mounts": [{"\u017fource": MPS, "destination": "/x"}]}, "has the key 'ſource'"),
    ],
)  # fmt: skip
def test_keys_differing_from_runcs_fields_only_in_case_are_refused(document, fragment):
    """Go matches field names without regard to case (ſ is s, the Kelvin sign k): such a key
    would be read by runc and missed by Python, so it is refused, naming it."""

    def read(document):
        specfacts.process_env(document)
        return read_facts(document, BUNDLE)

    with pytest.raises(SpecError) as raised:
        read(document)
    assert fragment in str(raised.value) and "write it" in str(raised.value)


def test_keys_folding_to_no_field_read_here_are_ignored():
    """Other keys (runc's other fields, a Kelvin-sign "kind") are not the hook's business."""
    mount = {"destination": "/x", "source": "tmpfs", "type": "tmpfs", "\u212aind": 1,
             "uidMappings": []}  # fmt: skip
    assert read_facts({"mounts": [mount], "hooks": {}}, BUNDLE)["mounts"] == []


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"mounts": {"destination": "/x"}}, "mounts is not a list"),
        ({"mounts": ["/x"]}, "mounts[0] is not an object"),
        ({"mounts": [{"destination": 7}]}, "mounts[0].destination is not a string"),
        ({"mounts": [{"destination": "/x", "options": [1]}]}, "options holds a non-string"),
        ({"linux": {"devices": [{"path": "/dev/x", "major": 195.0}]}}, "major is not an integer"),
        ({"linux": {"devices": [{"path": "/dev/x", "minor": True}]}}, "minor is not an integer"),
        ({"linux": {"resources": {"devices": [{"allow": "yes"}]}}}, "allow is not true or false"),
        ({"linux": []}, "linux is not an object"),
    ],
)
def test_values_of_the_wrong_type_are_refused(document, fragment):
    """A value runc could not read either is refused, naming the field."""
    with pytest.raises(SpecError) as raised:
        read_facts(document, BUNDLE)
    assert fragment in str(raised.value)


def test_null_lists_and_objects_read_as_empty():
    """null mounts, linux, devices and options are Go's empty values, not errors."""
    document = {"mounts": [{"destination": "/x", "source": "/srv", "options": None}],
                "linux": {"devices": None, "resources": None}}  # fmt: skip
    facts = read_facts(document, BUNDLE)
    assert facts == {"mounts": [{"destination": "/x", "sources": ["/srv"], "nodes": []}],
                     "devices": [], "rules": []}  # fmt: skip
    assert read_facts({"linux": None, "mounts": None}, BUNDLE)["mounts"] == []


def test_too_many_entries_are_refused():
    """More GPU-relevant entries than the hook sends are refused, naming the count."""
    mounts = [bind(f"/m{i}", f"/srv/{i}") for i in range(specfacts.MAX_ENTRIES + 1)]
    with pytest.raises(SpecError, match=f"{specfacts.MAX_ENTRIES + 1} mounts"):
        read_facts(config(mounts), BUNDLE)


def test_process_env_is_read_as_runc_reads_it():
    """process.env as a list (null: empty); a process or env of the wrong type is refused."""
    assert specfacts.process_env({"process": {"env": ["A=1"]}}) == ["A=1"]
    assert specfacts.process_env({"process": None}) == []
    with pytest.raises(SpecError, match="process.env is not a list"):
        specfacts.process_env({"process": {"env": "A=1"}})


# --- touches_gpu -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mount",
    [
        bind("/tmp/nvidia-mps", f"{MPS}/GPU-b/pipe"),
        bind("/x", MPS),
        bind("/x", "/run"),
        bind("/x", "/"),
        bind("/x", "/dev"),
        bind("/x", "/dev/nvidia1"),
        bind("/x", "/dev/nvidia-caps"),
        bind("/x", "/var/run/nvidia-container-devices/GPU-b"),
        bind("/var/run/nvidia-container-devices/all", "/dev/null"),
        bind("/run/nvidia-container-devices/0", "/dev/null"),
        {"destination": "/x", "source": "devtmpfs", "type": "devtmpfs"},
    ],
)
def test_mounts_that_touch_a_gpu(mount):
    """The MPS root, anything in or above it, NVIDIA nodes, /dev, / and the device lists
    (as source or destination) touch a GPU."""
    assert touches_gpu(read_facts(config([mount]), BUNDLE), MPS) is not None


@pytest.mark.parametrize(
    "mount",
    [
        bind("/etc/hosts", "/var/lib/kubelet/pods/p/etc-hosts"),
        bind("/dev/shm", "/run/containerd/io.containerd.grpc.v1.cri/sandboxes/s/shm"),
        bind("/dev/shm", "/dev/shm"),
        bind("/var/run/docker.sock", "/run/docker.sock"),
        bind("/x", "/run/gpushare/hook.sock"),
        bind("/x", "/run/gpushare/mpsX"),
        bind("/x", "/dev/nvme0n1"),
    ],
)
def test_mounts_that_do_not_touch_a_gpu(mount):
    """Ordinary mounts, a sibling of the MPS root with a longer name and /dev/nvme* do not."""
    assert touches_gpu(read_facts(config([mount]), BUNDLE), MPS) is None


def test_a_bind_mounted_device_node_touches_by_its_numbers():
    """A mount whose source the hook found to be c 195:N (or a number out of range) touches."""
    facts = read_facts(config([bind("/x", "/tmp/innocent")]), BUNDLE)
    assert touches_gpu(facts, MPS) is None
    facts["mounts"][0]["nodes"] = [[195, 1]]
    assert touches_gpu(facts, MPS) == "mount of device 195:1 at /x"


def test_kept_devices_and_rules_touch():
    """Any device or rule read_facts keeps touches a GPU; a spec without them does not."""
    assert touches_gpu(read_facts(config(), BUNDLE), MPS) is None
    device = {"path": "/dev/x", "type": "c", "major": 195, "minor": 1}
    assert touches_gpu(read_facts(config(devices=[device]), BUNDLE), MPS) == "device /dev/x"
    rule = {"allow": True, "access": "rwm"}
    assert touches_gpu(read_facts(config(rules=[rule]), BUNDLE), MPS) == "device rule a None:None"


def test_nvidias_other_majors_are_kept_when_the_host_names_them():
    """nvidia-uvm's major (510 here) from /proc/devices: a node or an allow rule of it is
    kept whatever its name, a bind-mounted node of it touches a GPU; without the host
    naming it, neither is."""
    document = config(
        devices=[{"path": "/dev/x", "type": "c", "major": 510, "minor": 1}],
        rules=[{"allow": True, "type": "c", "major": 510, "access": "rw"}],
    )
    majors = frozenset({510})
    facts = read_facts(document, BUNDLE, majors)
    assert [d["major"] for d in facts["devices"]] == [510]
    assert [r["major"] for r in facts["rules"]] == [510]
    assert read_facts(document, BUNDLE) == {"mounts": [], "devices": [], "rules": []}
    mounted = {"mounts": [{"destination": "/dev/u", "sources": ["/srv/u"], "nodes": [[510, 0]]}],
               "devices": [], "rules": []}  # fmt: skip
    assert touches_gpu(mounted, MPS, (), majors) == "mount of device 510:0 at /dev/u"
    assert touches_gpu(mounted, MPS) is None


def test_nvidia_majors_come_from_the_character_devices_only():
    text = "Character devices:\n195 nvidia\n510 nvidia-uvm\n 10 misc\n\nBlock devices:\n"
    assert nvidia_majors(text + "259 nvidia-fake-block\n") == {510}


class CountingMajors(specfacts.HostMajors):
    reads = 0

    def read(self):
        self.reads += 1
        return frozenset({510})


def test_the_hosts_majors_are_read_only_for_numbers_from_the_dynamic_range():
    """An ordinary spec's rules (c 1:3, 5:*, 136:*, 10:200) never make the hook read
    /proc/devices; a number from the kernel's dynamic range does, once."""
    majors = CountingMajors()
    ordinary = config(
        rules=[{"allow": True, "type": "c", "major": m, "access": "rwm"} for m in (1, 5, 136, 10)]
    )
    assert read_facts(ordinary, BUNDLE, majors)["rules"] == []
    assert majors.reads == 0
    assert 510 in majors and 511 not in majors and 240 not in majors
    assert majors.reads == 1
