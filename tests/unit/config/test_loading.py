"""Pins nodemgr.config (schema, loading; reload has test_reload.py): what a valid file loads to, the
documented defaults (the hook socket defaults to <run_dir>/hook.sock), the node name
fallback, and that every invalid or useless setting is refused with a ConfigError naming
the dotted key and saying what was wrong.

Why this module is longer than 400 lines: it pins every key of the config file, valid
and invalid, one parametrised table per section.
"""

import dataclasses
import textwrap

import pytest

from nodemgr.config import loading, reload, schema
from nodemgr.config.loading import config_error_line, load_settings, settings_from_mapping
from nodemgr.config.schema import (
    DraSettings,
    GpuSettings,
    KubeletSettings,
    ResourceSettings,
    Settings,
    SimulatedDevice,
    SimulatedSettings,
)
from nodemgr.domain.extenderchoice import TRUST_MODES
from nodemgr.errors import ConfigError

ENV = {"NODE_NAME": "node-a"}
UUID = "GPU-6a7c0d3e-1111-2222-3333-444455556666"

FULL_EXAMPLE = """\
node_name: node-a
kubelet:
  device_plugin_dir: /var/lib/kubelet/device-plugins
  pod_resources_socket: /var/lib/kubelet/pod-resources/kubelet.sock
  reconcile_interval_seconds: 10
  allocation_grace_seconds: 60
state_dir: /var/lib/gpushare
run_dir: /run/gpushare
gpus:
  backend: simulated
  simulated:
    devices:
      - {uuid: GPU-6a7c0d3e-1111-2222-3333-444455556666, name: Tesla T4, memory_mib: 15360}
    usage_file: /tmp/usage.json
resources:
  memory: aliyun.com/gpu-mem
  memory_unit_mib: 1024
  core: aliyun.com/gpu-core.percentage
  whole: nvidia.com/gpu
  placement: binpack
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "gpushare.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(data: object) -> Settings:
    return settings_from_mapping(data, environ=ENV)


def simulated(*devices: dict, **extra: object) -> dict:
    return {"gpus": {"backend": "simulated", "simulated": {"devices": list(devices), **extra}}}


def device(uuid: str = UUID, name: str = "Tesla T4", memory_mib: object = 15360) -> dict:
    return {"uuid": uuid, "name": name, "memory_mib": memory_mib}


def refused(data: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(data)
    return info.value


# --- what loads --------------------------------------------------------------------------


def test_full_example_loads_exactly(tmp_path):
    settings = load_settings(write(tmp_path, FULL_EXAMPLE), environ={})
    assert settings == Settings(
        node_name="node-a",
        kubelet=KubeletSettings(
            device_plugin_dir="/var/lib/kubelet/device-plugins",
            pod_resources_socket="/var/lib/kubelet/pod-resources/kubelet.sock",
            reconcile_interval_seconds=10.0,
            allocation_grace_seconds=60.0,
        ),
        state_dir="/var/lib/gpushare",
        run_dir="/run/gpushare",
        gpus=GpuSettings(
            backend="simulated",
            simulated=SimulatedSettings(
                devices=(SimulatedDevice(uuid=UUID, name="Tesla T4", memory_mib=15360),),
                usage_file="/tmp/usage.json",
            ),
        ),
        resources=ResourceSettings(
            memory="aliyun.com/gpu-mem",
            memory_unit_mib=1024,
            core="aliyun.com/gpu-core.percentage",
            whole="nvidia.com/gpu",
            placement="binpack",
        ),
    )
    assert isinstance(settings.kubelet.reconcile_interval_seconds, float)
    assert isinstance(settings.gpus.simulated.devices, tuple)


DOCUMENTED_DEFAULTS = Settings(
    node_name="node-a",
    kubelet=KubeletSettings(
        device_plugin_dir="/var/lib/kubelet/device-plugins",
        pod_resources_socket="/var/lib/kubelet/pod-resources/kubelet.sock",
        reconcile_interval_seconds=10.0,
        allocation_grace_seconds=60.0,
    ),
    state_dir="/var/lib/gpushare",
    run_dir="/run/gpushare",
    gpus=GpuSettings(backend="nvml", simulated=SimulatedSettings(devices=(), usage_file="")),
    resources=ResourceSettings(
        memory="aliyun.com/gpu-mem",
        memory_unit_mib=1024,
        core="aliyun.com/gpu-core.percentage",
        whole="nvidia.com/gpu",
        placement="binpack",
    ),
)


def test_no_path_gives_documented_defaults():
    assert load_settings(None, environ=ENV) == DOCUMENTED_DEFAULTS


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_empty_file_gives_documented_defaults(tmp_path, text):
    assert load_settings(write(tmp_path, text), environ=ENV) == DOCUMENTED_DEFAULTS


@pytest.mark.parametrize("data", [None, {}, {"kubelet": None}, {"resources": {}}])
def test_empty_mapping_or_section_gives_defaults(data):
    assert load(data) == DOCUMENTED_DEFAULTS


def test_public_names():
    """The package's public names, one module each: the schema, loading and reload."""
    assert set(schema.__all__) == {
        "DraSettings",
        "EnforcementSettings",
        "GpuSettings",
        "KubeletSettings",
        "KubernetesSettings",
        "MetricsSettings",
        "NUMBER_RANGES",
        "NumberRange",
        "PLACEMENT_TRUST_MODES",
        "MpsSettings",
        "ResourceSettings",
        "Settings",
        "SimulatedDevice",
        "SimulatedSettings",
        "StatusSettings",
    }
    assert set(loading.__all__) == {
        "CONFIG_HELP",
        "config_error_line",
        "load_settings",
        "settings_from_mapping",
    }
    assert set(reload.__all__) == {"RELOADABLE_KEYS", "reload_settings"}


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DOCUMENTED_DEFAULTS.state_dir = "/elsewhere"  # type: ignore[misc]


def test_optional_values_accepted():
    settings = load(
        {
            "kubelet": {"reconcile_interval_seconds": 0.5, "allocation_grace_seconds": 0},
            "resources": {"whole": "", "placement": "spread"},
            **simulated(device(uuid="A" * 52), device(uuid="b", memory_mib=1), usage_file=""),
        }
    )
    assert settings.kubelet.reconcile_interval_seconds == 0.5
    assert settings.kubelet.allocation_grace_seconds == 0.0
    assert settings.resources.whole == ""
    assert settings.resources.placement == "spread"
    assert [d.uuid for d in settings.gpus.simulated.devices] == ["A" * 52, "b"]
    assert settings.gpus.simulated.usage_file == ""


# --- node name ---------------------------------------------------------------------------


def test_node_name_from_environment():
    assert settings_from_mapping({}, environ={"NODE_NAME": "gpu-7.example"}).node_name == (
        "gpu-7.example"
    )


@pytest.mark.parametrize("environ", [{}, {"NODE_NAME": ""}])
def test_node_name_falls_back_to_lowercased_hostname(monkeypatch, environ):
    monkeypatch.setattr(loading.socket, "gethostname", lambda: "Worker-3\n")
    assert settings_from_mapping({}, environ=environ).node_name == "worker-3"


def test_node_name_in_file_beats_environment():
    assert settings_from_mapping({"node_name": "node-b"}, environ=ENV).node_name == "node-b"


def test_environ_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "from-os-environ")
    assert settings_from_mapping({}).node_name == "from-os-environ"


@pytest.mark.parametrize("name", ["Node-A", "node_a", "", "-node", "a" * 254, 42])
def test_invalid_node_name_in_file_refused(name):
    err = refused({"node_name": name})
    assert err.key == "node_name"
    assert "got" in err.problem


def test_invalid_node_name_from_environment_says_where_it_came_from(monkeypatch):
    with pytest.raises(ConfigError) as info:
        settings_from_mapping({}, environ={"NODE_NAME": "Bad_Name"})
    assert info.value.key == "node_name"
    assert "$NODE_NAME" in info.value.problem and '"Bad_Name"' in info.value.problem

    monkeypatch.setattr(loading.socket, "gethostname", lambda: "under_score")
    with pytest.raises(ConfigError) as info:
        settings_from_mapping({}, environ={})
    assert "hostname" in info.value.problem


# --- the file ----------------------------------------------------------------------------


def test_missing_file_names_the_file(tmp_path):
    path = str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ=ENV)
    assert info.value.key == path
    assert "cannot read" in info.value.problem


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "node_name: node-a\nkubelet: [unclosed\nstate_dir: /x\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ=ENV)
    assert info.value.key == path
    assert "not valid YAML at line" in info.value.problem


def test_duplicate_yaml_key_refused(tmp_path):
    path = write(tmp_path, "run_dir: /a\nstate_dir: /b\nrun_dir: /c\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ=ENV)
    assert info.value.key == path
    assert "line 3" in info.value.problem and '"run_dir" twice' in info.value.problem


def test_top_level_not_a_mapping_refused(tmp_path):
    path = write(tmp_path, "- node_name: node-a\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ=ENV)
    assert info.value.key == path
    assert "must be a YAML mapping" in info.value.problem
    assert "must be a YAML mapping" in refused(["node_name"]).problem


# --- unknown keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"nodename": "x"}, "nodename"),
        ({"kubelet": {"foo": 1}}, "kubelet.foo"),
        ({"resources": {"memory_unit": 1}}, "resources.memory_unit"),
        (
            {
                "gpus": {
                    "simulated": {"devices": [{**device(), "cores": 1}]},
                    "backend": "simulated",
                }
            },
            "gpus.simulated.devices[0].cores",
        ),
    ],
)
def test_unknown_key_refused_with_known_keys(data, key):
    err = refused(data)
    assert err.key == key
    assert err.problem.startswith("unknown key; known keys: ")


def test_unknown_nested_key_lists_the_section_keys():
    assert "device_plugin_dir, pod_resources_socket" in refused({"kubelet": {"foo": 1}}).problem


def test_kubernetes_section_defaults_and_values():
    kube = load({}).kubernetes
    assert (kube.enabled, kube.kubeconfig, kube.label_prefix) == (True, "", "gpushare.aliyun.com/")
    kube = load(
        {"kubernetes": {"enabled": False, "kubeconfig": "/etc/gpushare/kubeconfig",
                        "label_prefix": "gpu.example.com/", "request_timeout_seconds": 3}}
    ).kubernetes  # fmt: skip
    assert (kube.enabled, kube.kubeconfig, kube.label_prefix, kube.request_timeout_seconds) == (
        False,
        "/etc/gpushare/kubeconfig",
        "gpu.example.com/",
        3.0,
    )


def test_placement_trust_and_public_key():
    """Default: only signed placements, no key (so none is believed); the old extender's
    annotations are believed only when asked for; the key is an absolute path; the modes
    are the domain's."""
    kube = load({}).kubernetes
    assert (kube.placement_trust, kube.placement_public_key) == ("signed", "")
    kube = load(
        {"kubernetes": {"placement_trust": "annotations",
                        "placement_public_key": "/etc/gpushare/placement.pub"}}
    ).kubernetes  # fmt: skip
    assert (kube.placement_trust, kube.placement_public_key) == (
        "annotations",
        "/etc/gpushare/placement.pub",
    )
    err = refused({"kubernetes": {"placement_trust": "owners"}})
    assert err.key == "kubernetes.placement_trust" and "signed, annotations" in err.problem
    err = refused({"kubernetes": {"placement_public_key": "placement.pub"}})
    assert err.key == "kubernetes.placement_public_key"
    assert schema.PLACEMENT_TRUST_MODES == TRUST_MODES


@pytest.mark.parametrize(
    "prefix", ["gpushare.aliyun.com", "gpushare.aliyun.com/x", "Upper.example/", "kubernetes.io/",
               "node.k8s.io/", "/"]
)  # fmt: skip
def test_kubernetes_label_prefix_refused(prefix):
    err = refused({"kubernetes": {"label_prefix": prefix}})
    assert err.key == "kubernetes.label_prefix"


def test_dra_section_defaults_and_values():
    """The DRA plugin is off by default; its driver, kubelet's plugin directories and the
    CDI directory load, and the sockets are where kubelet looks for them."""
    assert load({}).dra == DraSettings()
    assert DraSettings().enabled is False and DraSettings().driver == "gpushare.aliyun.com"
    dra = load({"dra": {"enabled": True, "driver": "gpu.example.com",
                        "plugins_registry_dir": "/k/plugins_registry",
                        "plugins_dir": "/k/plugins", "cdi_dir": "/etc/cdi"}}).dra  # fmt: skip
    assert dra.registration_socket == "/k/plugins_registry/gpu.example.com-reg.sock"
    assert dra.service_socket == "/k/plugins/gpu.example.com/dra.sock"
    assert dra.cdi_dir == "/etc/cdi"


@pytest.mark.parametrize(
    ("dra", "key", "problem"),
    [
        ({"enabled": "yes"}, "dra.enabled", "true or false"),
        ({"driver": "Gpu_Share"}, "dra.driver", "DNS subdomain"),
        ({"driver": "1gpu.example.com"}, "dra.driver", "starting with a letter"),
        ({"driver": "a" * 64}, "dra.driver", "at most 63"),
        ({"plugins_dir": "plugins"}, "dra.plugins_dir", "absolute"),
        ({"cdi_dir": ""}, "dra.cdi_dir", "empty"),
        ({"plugins_dir": "/p" * 50}, "dra.plugins_dir", "at most 107"),
        ({"plugins_registry_dir": "/r" * 50}, "dra.plugins_registry_dir", "at most 107"),
        ({"socket": "/x"}, "dra.socket", "unknown key"),
    ],
)
def test_bad_dra_values_name_the_key(dra, key, problem):
    """Each bad DRA value is refused naming its key."""
    err = refused({"dra": dra})
    assert err.key == key and problem in err.problem


def test_dra_needs_the_kubernetes_api():
    """Prepare reads claims from the API server: dra.enabled without it is refused."""
    err = refused({"dra": {"enabled": True}, "kubernetes": {"enabled": False}})
    assert err.key == "dra.enabled" and "kubernetes.enabled" in err.problem


def test_kubernetes_kubeconfig_must_be_absolute():
    assert refused({"kubernetes": {"kubeconfig": "kubeconfig"}}).key == "kubernetes.kubeconfig"


# --- values ------------------------------------------------------------------------------

INVALID = [
    # (data, key, fragment of the problem)
    ({"kubelet": []}, "kubelet", "must be a mapping"),
    ({"kubelet": {"device_plugin_dir": "var/lib"}}, "kubelet.device_plugin_dir", "absolute"),
    ({"kubelet": {"device_plugin_dir": ""}}, "kubelet.device_plugin_dir", "empty"),
    ({"kubelet": {"pod_resources_socket": 5}}, "kubelet.pod_resources_socket", "string"),
    ({"kubelet": {"reconcile_interval_seconds": 0}}, "kubelet.reconcile_interval_seconds", "> 0"),
    (
        {"kubelet": {"reconcile_interval_seconds": -1.5}},
        "kubelet.reconcile_interval_seconds",
        "> 0",
    ),
    (
        {"kubelet": {"reconcile_interval_seconds": "10"}},
        "kubelet.reconcile_interval_seconds",
        'must be a finite number (got "10")',
    ),
    (
        {"kubelet": {"reconcile_interval_seconds": True}},
        "kubelet.reconcile_interval_seconds",
        "must be a finite number (got true)",
    ),
    (
        {"kubelet": {"reconcile_interval_seconds": float("inf")}},
        "kubelet.reconcile_interval_seconds",
        "must be a finite number",
    ),
    (
        {"kubelet": {"reconcile_interval_seconds": float("nan")}},
        "kubelet.reconcile_interval_seconds",
        "must be a finite number",
    ),
    (
        {"kubelet": {"allocation_grace_seconds": 10**400}},
        "kubelet.allocation_grace_seconds",
        "must be a finite number",
    ),
    ({"kubelet": {"allocation_grace_seconds": -1}}, "kubelet.allocation_grace_seconds", ">= 0"),
    (
        {"kubelet": {"allocation_grace_seconds": False}},
        "kubelet.allocation_grace_seconds",
        "number",
    ),
    ({"state_dir": "gpushare"}, "state_dir", 'absolute path (got "gpushare")'),
    ({"run_dir": ""}, "run_dir", "empty"),
    ({"run_dir": None}, "run_dir", "must be a string (got null)"),
    ({"gpus": {"backend": "cuda"}}, "gpus.backend", 'one of nvml, simulated (got "cuda")'),
    (
        {"resources": {"placement": "bestfit"}},
        "resources.placement",
        'must be one of binpack, spread (got "bestfit")',
    ),
    ({"resources": {"memory_unit_mib": 0}}, "resources.memory_unit_mib", "> 0"),
    ({"resources": {"memory_unit_mib": 1.5}}, "resources.memory_unit_mib", "integer"),
    (
        {"resources": {"memory_unit_mib": True}},
        "resources.memory_unit_mib",
        "must be an integer (got true)",
    ),
    ({"resources": {"memory": ""}}, "resources.memory", "empty"),
    ({"resources": {"core": ""}}, "resources.core", "empty"),
    ({"resources": {"memory": "gpu-mem"}}, "resources.memory", "'/'"),
    ({"resources": {"memory": "a.com/b/c"}}, "resources.memory", "'/'"),
    ({"resources": {"memory": "kubernetes.io/gpu-mem"}}, "resources.memory", "reserved"),
    ({"resources": {"core": "gpu.kubernetes.io/core"}}, "resources.core", "reserved"),
    ({"resources": {"memory": "Aliyun.com/gpu-mem"}}, "resources.memory", "domain"),
    ({"resources": {"memory": "aliyun.com/" + "m" * 64}}, "resources.memory", "63"),
    ({"resources": {"memory": "aliyun.com/-mem"}}, "resources.memory", "63"),
    ({"resources": {"whole": "nvidia.com/"}}, "resources.whole", "63"),
    (
        {"resources": {"core": "aliyun.com/gpu-mem"}},
        "resources.core",
        "must differ from resources.memory",
    ),
    (
        {"resources": {"whole": "aliyun.com/gpu-core.percentage"}},
        "resources.whole",
        "must differ from resources.core",
    ),
    (
        {"gpus": {"simulated": {"devices": [device()]}}},
        "gpus.simulated",
        "only allowed with backend: simulated",
    ),
    (
        {"gpus": {"backend": "nvml", "simulated": {}}},
        "gpus.simulated",
        "only allowed with backend: simulated",
    ),
    ({"gpus": {"backend": "simulated"}}, "gpus.simulated.devices", "at least one device"),
    (simulated(), "gpus.simulated.devices", "at least one device"),
    (
        {"gpus": {"backend": "simulated", "simulated": {"devices": {"a": 1}}}},
        "gpus.simulated.devices",
        "must be a list",
    ),
    (simulated(device(), "GPU-x"), "gpus.simulated.devices[1]", "must be a mapping"),
    (simulated({"name": "T4", "memory_mib": 1}), "gpus.simulated.devices[0].uuid", "required"),
    (simulated({"uuid": "a", "memory_mib": 1}), "gpus.simulated.devices[0].name", "required"),
    (simulated({"uuid": "a", "name": "T4"}), "gpus.simulated.devices[0].memory_mib", "required"),
    (simulated(device(uuid="GPU_1")), "gpus.simulated.devices[0].uuid", "52 letters"),
    (simulated(device(uuid="-GPU")), "gpus.simulated.devices[0].uuid", "52 letters"),
    (simulated(device(uuid="A" * 53)), "gpus.simulated.devices[0].uuid", "52 letters"),
    (simulated(device(uuid=12)), "gpus.simulated.devices[0].uuid", "string"),
    (
        simulated(device(uuid="a"), device(uuid="b"), device(uuid="a")),
        "gpus.simulated.devices[2].uuid",
        "already used by gpus.simulated.devices[0]",
    ),
    (simulated(device(name="")), "gpus.simulated.devices[0].name", "empty"),
    (simulated(device(memory_mib=0)), "gpus.simulated.devices[0].memory_mib", "> 0"),
    (simulated(device(memory_mib=True)), "gpus.simulated.devices[0].memory_mib", "integer"),
    (simulated(device(memory_mib="16G")), "gpus.simulated.devices[0].memory_mib", "integer"),
    (simulated(device(), usage_file="usage.json"), "gpus.simulated.usage_file", "absolute"),
]


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    INVALID,
    ids=[f"{key}-{i}" for i, (_, key, _) in enumerate(INVALID)],
)
def test_invalid_value_refused(data, key, fragment):
    err = refused(data)
    assert err.key == key
    assert fragment in err.problem


# --- the error line ----------------------------------------------------------------------


def test_config_error_line_format():
    err = refused({"resources": {"placement": "bestfit"}})
    assert config_error_line(err) == (
        "gpushare-node: config error: resources.placement: "
        'must be one of binpack, spread (got "bestfit")'
    )


def test_config_error_line_is_one_line(tmp_path):
    err = ConfigError("kubelet", "first line\n  second line\r\n")
    assert config_error_line(err) == "gpushare-node: config error: kubelet: first line second line"
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "a: b: c\n"), environ=ENV)
    assert "\n" not in config_error_line(info.value)


def test_mps_section_loads_with_defaults_and_values():
    assert load({}).mps == schema.MpsSettings()
    mps = load(
        {
            "mps": {
                "enabled": False,
                "control_binary": "/opt/mps/nvidia-cuda-mps-control",
                "supervisor": "process",
                "shm_size_mib": 4096,
                "health_check_interval_seconds": 1,
                "command_timeout_seconds": 2.5,
            }
        }
    ).mps
    assert (mps.enabled, mps.control_binary, mps.shm_size_mib) == (
        False,
        "/opt/mps/nvidia-cuda-mps-control",
        4096,
    )
    assert mps.health_check_interval_seconds == 1.0 and mps.command_timeout_seconds == 2.5


@pytest.mark.parametrize(
    ("mps", "key", "problem"),
    [
        ({"enabled": "yes"}, "mps.enabled", "must be true or false"),
        ({"control_binary": "bin/mps"}, "mps.control_binary", "absolute path"),
        ({"control_binary": ""}, "mps.control_binary", "must not be empty"),
        ({"supervisor": "systemd"}, "mps.supervisor", "systemd is not supported"),
        ({"supervisor": "runit"}, "mps.supervisor", "must be one of process"),
        ({"shm_size_mib": -1}, "mps.shm_size_mib", ">= 0"),
        ({"command_timeout_seconds": 0}, "mps.command_timeout_seconds", "> 0"),
        ({"pipe": "/x"}, "mps.pipe", "unknown key"),
    ],
)
def test_bad_mps_values_name_the_key(mps, key, problem):
    err = refused({"mps": mps})
    assert err.key == key and problem in err.problem


# --- enforcement -------------------------------------------------------------------------


def test_enforcement_defaults():
    settings = load({"run_dir": "/run/gs"})
    assert settings.enforcement == schema.EnforcementSettings(
        action="kill", interval_seconds=0.25, grace_mib=128, hook_socket=""
    )
    assert settings.hook_socket == "/run/gs/hook.sock"
    assert load({}).hook_socket == "/run/gpushare/hook.sock"
    assert load({"enforcement": None}).enforcement == schema.EnforcementSettings()


def test_enforcement_values_load():
    settings = load(
        {
            "enforcement": {
                "action": "log",
                "interval_seconds": 0.25,
                "grace_mib": 0,
                "hook_socket": "/var/run/gs.sock",
            }
        }
    )
    enforcement = settings.enforcement
    assert (enforcement.action, enforcement.interval_seconds, enforcement.grace_mib) == (
        "log",
        0.25,
        0,
    )
    assert settings.hook_socket == "/var/run/gs.sock"
    assert load({"enforcement": {"interval_seconds": 2}}).enforcement.interval_seconds == 2.0
    assert isinstance(
        load({"enforcement": {"interval_seconds": 2}}).enforcement.interval_seconds, float
    )
    assert load({"enforcement": {"grace_mib": 512}}).enforcement.grace_mib == 512


@pytest.mark.parametrize(
    ("enforcement", "key", "problem"),
    [
        ({"action": "stop"}, "enforcement.action", 'must be one of kill, log (got "stop")'),
        ({"action": True}, "enforcement.action", "must be one of kill, log"),
        ({"interval_seconds": 0}, "enforcement.interval_seconds", "must be > 0 (got 0)"),
        ({"interval_seconds": "1s"}, "enforcement.interval_seconds", "must be a finite number"),
        ({"interval_seconds": float("inf")}, "enforcement.interval_seconds", "finite number"),
        ({"grace_mib": -1}, "enforcement.grace_mib", "must be >= 0 (got -1)"),
        ({"grace_mib": 1.5}, "enforcement.grace_mib", "must be an integer (got 1.5)"),
        ({"grace_mib": True}, "enforcement.grace_mib", "must be an integer"),
        ({"hook_socket": "run/hook.sock"}, "enforcement.hook_socket", "must be an absolute path"),
        ({"hook_socket": 5}, "enforcement.hook_socket", "must be a string"),
        ({"kill_signal": "TERM"}, "enforcement.kill_signal", "unknown key; known keys: action"),
    ],
)
def test_bad_enforcement_values_name_the_key(enforcement, key, problem):
    err = refused({"enforcement": enforcement})
    assert err.key == key and problem in err.problem


def test_enforcement_section_must_be_a_mapping():
    err = refused({"enforcement": ["kill"]})
    assert err.key == "enforcement" and "must be a mapping" in err.problem


def test_enforcement_section_loads_from_a_file(tmp_path):
    path = write(
        tmp_path,
        """\
        run_dir: /run/x
        enforcement:
          action: log
          grace_mib: 64
        """,
    )
    settings = load_settings(path, environ=ENV)
    assert settings.enforcement.action == "log" and settings.enforcement.grace_mib == 64
    assert settings.hook_socket == "/run/x/hook.sock"


# --- status and metrics ------------------------------------------------------------------


def test_status_socket_defaults_under_run_dir():
    settings = settings_from_mapping({"node_name": "n", "run_dir": "/run/gs"})
    assert settings.status_socket == "/run/gs/status.sock"
    moved = settings_from_mapping({"node_name": "n", "status": {"socket": "/tmp/s.sock"}})
    assert moved.status_socket == "/tmp/s.sock"


def test_metrics_defaults_to_loopback():
    metrics = settings_from_mapping({"node_name": "n"}).metrics
    assert metrics.enabled is True
    assert metrics.address == "127.0.0.1:9445"


@pytest.mark.parametrize("address", ["0.0.0.0:9100", "[::1]:0", "node-a.example:65535"])
def test_metrics_address_accepted(address):
    assert settings_from_mapping({"node_name": "n", "metrics": {"address": address}})


@pytest.mark.parametrize("address", ["9445", ":9445", "host:", "host:65536", "::1:9445", "h:x"])
def test_metrics_address_refused(address):
    err = refused({"metrics": {"address": address}})
    assert err.key == "metrics.address"
    assert "host:port" in err.problem or "brackets" in err.problem


def test_status_socket_must_be_absolute():
    assert refused({"status": {"socket": "run/s.sock"}}).key == "status.socket"


@pytest.mark.parametrize(
    ("section", "name", "value"),
    [
        ("mps", "health_check_interval_seconds", 1e300),
        ("mps", "command_timeout_seconds", 1e300),
        ("enforcement", "interval_seconds", 1e-300),
        ("enforcement", "interval_seconds", 1e300),
        ("kubelet", "reconcile_interval_seconds", 1e-9),
        ("kubernetes", "request_timeout_seconds", 86400 * 365),
        ("resources", "memory_unit_mib", 2**40),
    ],
)
def test_numbers_that_parse_but_would_break_the_daemon_are_refused_with_their_range(
    section, name, value
):
    """A value that validates as a number but makes a worker spin, never wake or never start
    (1e300 s, 1e-300 s) is refused naming the key and the documented range."""
    key = f"{section}.{name}"
    with pytest.raises(ConfigError) as refused:
        load({section: {name: value}})
    allowed = schema.NUMBER_RANGES[key]
    assert refused.value.key == key
    assert "must be between" in refused.value.problem and allowed.unit in refused.value.problem


def test_every_number_of_the_file_has_a_documented_range():
    """No numeric setting escapes the range table: a new one must be given its range."""
    import dataclasses

    def numeric_keys(cls, prefix):
        for field in dataclasses.fields(cls):
            key = f"{prefix}{field.name}"
            if dataclasses.is_dataclass(field.type if isinstance(field.type, type) else None):
                yield from numeric_keys(field.type, f"{key}.")
            elif field.type in ("int", "float", int, float):
                yield key

    found = set(numeric_keys(schema.Settings, ""))
    found |= {f"gpus.simulated.devices[].{k}" for k in numeric_keys(schema.SimulatedDevice, "")}
    for section in ("kubelet", "gpus", "resources", "mps", "enforcement", "status", "metrics",
                    "kubernetes"):  # fmt: skip
        cls = type(getattr(schema.Settings(node_name="n"), section))
        found |= set(numeric_keys(cls, f"{section}."))
    assert found == set(schema.NUMBER_RANGES)


def test_configuration_page_lists_every_range_as_the_schema_has_it():
    """The range table of docs/configuration.md is the documentation operators read: it must
    match the schema."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_.\[\]]+)` \| ([0-9.]+ to [0-9.]+) ", page, re.M))
    assert set(rows) == set(schema.NUMBER_RANGES)
    for key, allowed in schema.NUMBER_RANGES.items():
        low, high = (float(x) for x in rows[key].split(" to "))
        assert (low, high) == (allowed.minimum, allowed.maximum), key
