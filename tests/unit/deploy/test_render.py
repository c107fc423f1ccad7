"""deploy/: what a cluster admin applies is valid, and grants and asks what it says.

Pins:
- every template in deploy/templates renders with deploy/render.py, with the
  defaults and with other values, and the renderer refuses bad values;
- every Kubernetes object (rendered RBAC, every example) deserializes into the
  ``kubernetes`` client's model with no field dropped or changed, so a typo
  (``replica:``), a wrong type or a missing required field fails;
- the ClusterRole grants exactly ``DAEMON_API_VERBS``, the API requests the
  daemon makes, bound to the daemon's ServiceAccount, with its token Secret;
- the KubeSchedulerConfiguration matches the v1 schema written down below
  (the client has no model for it) and configures the gpushare extender;
- the examples ask for the resources their docs state, in limits;
- the rendered kubeconfig is one the ``kubernetes`` client loads;
- the DRA template's ClusterRole grants exactly what the daemon's DRA side requests
  (``DRA_API_PERMISSIONS``), its DeviceClasses select the driver, and the DRA examples
  ask what their comments say through claim templates.

Why this module is longer than 400 lines: it pins every template the operator applies
(RBAC verbs against what the code requests, kubeconfigs, the scheduler configurations
against the v1 schema, examples), each a public interface.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from kubernetes import config as kube_config
from kubernetes.client import ApiClient, Configuration
from kubernetes.utils import parse_quantity

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
EXAMPLES = DEPLOY / "examples"


def _load_renderer():
    # deploy/ is for cluster admins, not a package: load the script by path.
    spec = importlib.util.spec_from_file_location("gpushare_deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer()

# The API requests gpushare-node makes: (API group, resource) -> verbs. The
# ClusterRole must grant exactly these (least privilege); the Kubernetes
# adapter's own declaration of what it calls is to be compared with this.
#   pods: one watch of the pods on its node (list + watch, field selector
#     spec.nodeName), get of one pod, patch of the gpushare annotations;
#   nodes: get and patch of its own node (labels, the allocation annotation);
#   nodes/status: patch (aliyun.com/gpu-count capacity and allocatable);
#   events: create, and patch to count a repeated event.
DAEMON_API_VERBS: dict[tuple[str, str], frozenset[str]] = {
    ("", "pods"): frozenset({"get", "list", "watch", "patch"}),
    ("", "nodes"): frozenset({"get", "patch"}),
    ("", "nodes/status"): frozenset({"patch"}),
    ("", "events"): frozenset({"create", "patch"}),
}

# The kinds deploy/ may hold, and the client model each must deserialize into.
MODELS: dict[tuple[str, str], str] = {
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Service"): "V1Service",
    ("v1", "Pod"): "V1Pod",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("batch/v1", "Job"): "V1Job",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("resource.k8s.io/v1", "DeviceClass"): "V1DeviceClass",
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): "V1ResourceClaimTemplate",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): (
        "V1ValidatingAdmissionPolicy"
    ),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): (
        "V1ValidatingAdmissionPolicyBinding"
    ),
}

MODELS_WITH_PODS = {"Pod", "StatefulSet", "Job"}  # the kinds whose pods ask for GPUs

# Rendering values: the defaults, and others that exercise quoting (a path
# with a blank) and the https extender.
VALUE_SETS: dict[str, dict[str, str]] = {
    "defaults": {},
    "custom": {
        "namespace": "gpu-system",
        "service_account": "gpushare-agent",
        "extender_url": "https://gpushare-schd.example.internal:8443/gpushare-scheduler",
        "scheduler_kubeconfig": "/etc/kubernetes/scheduler config/scheduler.conf",
        "cluster_name": "prod-east",
    },
}

# A real self-signed CA certificate (EC P-256, test data only): the kubeconfig
# test checks that the TLS stack accepts what comes back out of the kubeconfig.
TEST_CA_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBjjCCATOgAwIBAgIURQXqhChb+XHYTU8/u7ocDPQ82WMwCgYIKoZIzj0EAwIw
GzEZMBcGA1UEAwwQZ3B1c2hhcmUtdGVzdC1jYTAgFw0yNjExMjIxOTE3MzVaGA8y
MTI2MTAyOTE5MTczNVowGzEZMBcGA1UEAwwQZ3B1c2hhcmUtdGVzdC1jYTBZMBMG
ByqGSM49AgEGCCqGSM49AwEHA0IABNm/8AfF6gkEwPVn0kcV2zN4gmpoFz3H8K7b
Zg5sdN2omY0KNFiVj3raeDQMaTno+RvTbASTGx2G8y7Txqb4bUijUzBRMB0GA1Ud
DgQWBBQm6LIRZo11w92lOZBGuqDPK2yqeTAfBgNVHSMEGDAWgBQm6LIRZo11w92l
OZBGuqDPK2yqeTAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0kAMEYCIQCV
orXff4TNuS4Heg6hlWXwOVNDpgdtAyhXiB9p4N3iEwIhAO7wRLtt6gy7CwqoA2oz
DQWeAFr4LWZcaGYyI5oyuEWT
-----END CERTIFICATE-----
"""
TEST_TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2lnbmF0dXJl"
TEST_SERVER = "https://10.0.0.1:6443"

_API = ApiClient()


class InvalidManifest(AssertionError):
    """A document that is not a valid object of its kind."""


# ---------------------------------------------------------------- helpers


def _documents(text: str) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    for doc in docs:
        assert isinstance(doc, dict), f"a YAML document is not a mapping: {doc!r}"
    return docs


def _rendered(template: str, values: dict[str, str]) -> list[dict[str, Any]]:
    return _documents(render.render(template, values))


def _example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def _example(name: str) -> list[dict[str, Any]]:
    return _documents((EXAMPLES / name).read_text(encoding="utf-8"))


def _quantities_as_strings(node: Any) -> Any:
    """``resources.limits``/``requests`` numbers as strings.

    The API server's resource.Quantity accepts a JSON number (the gpushare
    docs write ``aliyun.com/gpu-mem: 3``); the client's model types it as a
    string only. Nothing else is converted, so other type errors still fail.
    """
    if isinstance(node, list):
        return [_quantities_as_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "resources" and isinstance(value, dict):
            value = {
                part: (
                    {
                        name: str(amount) if isinstance(amount, int | float) else amount
                        for name, amount in quantities.items()
                    }
                    if part in ("limits", "requests") and isinstance(quantities, dict)
                    else quantities
                )
                for part, quantities in value.items()
            }
        out[key] = _quantities_as_strings(value)
    return out


def _differences(sent: Any, back: Any, path: str = "") -> Iterator[str]:
    if isinstance(sent, dict) and isinstance(back, dict):
        for key in sent.keys() - back.keys():
            yield f"{path}.{key}: dropped (not a field of the model: a typo?)"
        for key in back.keys() - sent.keys():
            yield f"{path}.{key}: added by the model"
        for key in sent.keys() & back.keys():
            yield from _differences(sent[key], back[key], f"{path}.{key}")
    elif isinstance(sent, list) and isinstance(back, list) and len(sent) == len(back):
        for index, (one, other) in enumerate(zip(sent, back, strict=True)):
            yield from _differences(one, other, f"{path}[{index}]")
    elif sent != back or type(sent) is not type(back):
        yield f"{path}: {sent!r} came back as {back!r}"


def to_model(doc: dict[str, Any]) -> Any:
    """Deserialize ``doc`` into its client model; fail if anything is dropped or changed."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    name = doc.get("metadata", {}).get("name")
    if key not in MODELS:
        raise InvalidManifest(f"{name}: unexpected kind {key} (known: {sorted(MODELS)})")
    sent = _quantities_as_strings(doc)
    try:
        # The client's own response path: JSON text -> model, validated (types,
        # required fields) by the generated pydantic models.
        obj = _API.deserialize(json.dumps(sent), MODELS[key], "application/json")
    except Exception as exc:  # pydantic's ValidationError, or a bad shape
        raise InvalidManifest(f"{key[1]} {name}: {exc}") from exc
    # Unknown keys are ignored by the models, not refused: the round trip finds them.
    problems = list(_differences(sent, _API.sanitize_for_serialization(obj)))
    if problems:
        raise InvalidManifest(f"{key[1]} {name}:\n  " + "\n  ".join(problems))
    return obj


def _pod_spec(obj: Any) -> Any:
    return obj.spec if obj.kind == "Pod" else obj.spec.template.spec


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


# ------------------------------------------- the KubeSchedulerConfiguration schema


class Required:
    """A key that must be present (``json:"name"`` without omitempty)."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema


# Written down from kubescheduler.config.k8s.io/v1, the Go types in
# k8s.io/kube-scheduler/config/v1/types.go (KubeSchedulerConfiguration,
# Extender, ExtenderManagedResource, ExtenderTLSConfig) and
# k8s.io/component-base/config/v1alpha1 (ClientConnectionConfiguration),
# keys as in their json tags; also the reference page
# kubernetes.io/docs/reference/config-api/kube-scheduler-config.v1/.
# ``dict`` alone: a mapping whose content is not checked here (not written by
# deploy/). kube-scheduler decodes strictly: an unknown key is an error there.
_TLS_CONFIG = {
    "insecure": bool,
    "serverName": str,
    "certFile": str,
    "keyFile": str,
    "caFile": str,
    "certData": str,  # []byte: base64 in JSON/YAML
    "keyData": str,
    "caData": str,
}
_EXTENDER = {
    "urlPrefix": Required(str),
    "filterVerb": str,
    "preemptVerb": str,
    "prioritizeVerb": str,
    "weight": int,
    "bindVerb": str,
    "enableHTTPS": bool,
    "tlsConfig": _TLS_CONFIG,
    "httpTimeout": str,  # metav1.Duration, e.g. "30s"
    "nodeCacheCapable": bool,
    "managedResources": [{"name": Required(str), "ignoredByScheduler": bool}],
    "ignorable": bool,
}
SCHEDULER_CONFIG_SCHEMA = {
    "apiVersion": Required(str),
    "kind": Required(str),
    "parallelism": int,
    "leaderElection": dict,
    "clientConnection": {
        "kubeconfig": str,
        "acceptContentTypes": str,
        "contentType": str,
        "qps": float,
        "burst": int,
    },
    "enableProfiling": bool,  # DebuggingConfiguration, inlined
    "enableContentionProfiling": bool,
    "percentageOfNodesToScore": int,
    "podInitialBackoffSeconds": int,
    "podMaxBackoffSeconds": int,
    "profiles": [dict],
    "extenders": [_EXTENDER],
    "delayCacheUntilActive": bool,
}


def schema_errors(value: Any, schema: Any, path: str = "") -> list[str]:
    """Where ``value`` breaks ``schema`` (a type, a dict of keys, or a one-item list)."""
    if isinstance(schema, Required):
        schema = schema.schema
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: a list expected, got {value!r}"]
        return [
            e
            for i, item in enumerate(value)
            for e in schema_errors(item, schema[0], f"{path}[{i}]")
        ]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path}: a mapping expected, got {value!r}"]
        errors = [f"{path}.{key}: unknown field" for key in value if key not in schema]
        for key, sub in schema.items():
            if key in value:
                errors += schema_errors(value[key], sub, f"{path}.{key}")
            elif isinstance(sub, Required):
                errors.append(f"{path}.{key}: required")
        return errors
    if schema is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)
    return [] if ok else [f"{path}: {schema.__name__} expected, got {value!r}"]


# ---------------------------------------------------------------- the files


def test_every_file_in_deploy_is_checked():
    """A new template or manifest cannot slip past these tests."""
    templates = {path.name for path in (DEPLOY / "templates").iterdir()}
    assert templates == set(render.TEMPLATES.values())
    assert set(render.VALUES) == set(render.TEMPLATES)
    manifests = {
        path
        for pattern in ("*.yaml", "*.yml", "*.json")
        for path in DEPLOY.rglob(pattern)
        if "grafana" not in path.relative_to(DEPLOY).parts  # tested by the metrics tests
    }
    assert manifests == set(_example_files())
    assert {path.name for path in _example_files()} == {
        "binpack-statefulset.yaml",
        "dra-job-mem-core.yaml",
        "dra-whole-card-pod.yaml",
        "job-mem-core.yaml",
        "multi-container-pod.yaml",
        "whole-card-pod.yaml",
    }


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_rbac_is_valid_kubernetes_objects(values):
    docs = _rendered("rbac", values)
    assert [doc["kind"] for doc in docs] == [
        "ServiceAccount",
        "Secret",
        "ClusterRole",
        "ClusterRoleBinding",
    ]
    for doc in docs:
        to_model(doc)


@pytest.mark.parametrize("path", _example_files(), ids=lambda path: path.name)
def test_example_is_valid_kubernetes_objects(path):
    docs = _documents(path.read_text(encoding="utf-8"))
    assert docs
    for doc in docs:
        to_model(doc)


def test_the_model_check_fails_on_a_typo_a_wrong_type_and_a_missing_field():
    (service, statefulset) = _example("binpack-statefulset.yaml")
    to_model(statefulset)

    def broken(change) -> dict[str, Any]:
        doc = json.loads(json.dumps(statefulset))
        change(doc)
        return doc

    container = ("spec", "template", "spec", "containers")
    cases = {
        "replica": broken(lambda d: d["spec"].update(replica=d["spec"].pop("replicas"))),
        "imag": broken(lambda d: _dig(d, container)[0].update(imag="x")),
        "limit": broken(lambda d: _dig(d, container)[0]["resources"].update(limit={"a": "1"})),
        "replicas: '3'": broken(lambda d: d["spec"].update(replicas="3")),
        "no container name": broken(lambda d: _dig(d, container)[0].pop("name")),
        "ClusterRole rule verb": {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "x"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verb": ["get"]}],
        },
        "unknown kind": {**service, "apiVersion": "v2"},
    }
    for case, doc in cases.items():
        try:
            to_model(doc)
        except InvalidManifest:
            continue
        pytest.fail(f"{case}: accepted")


def _dig(doc: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        doc = doc[key]
    return doc


# ---------------------------------------------------------------- RBAC


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rbac_grants_exactly_the_daemon_verbs_to_its_service_account(values):
    namespace = values.get("namespace", render.DEFAULTS["namespace"])
    account = values.get("service_account", render.DEFAULTS["service_account"])
    kinds = _by_kind(_rendered("rbac", values))
    (service_account,) = (to_model(doc) for doc in kinds["ServiceAccount"])
    (secret,) = (to_model(doc) for doc in kinds["Secret"])
    (role,) = (to_model(doc) for doc in kinds["ClusterRole"])
    (binding,) = (to_model(doc) for doc in kinds["ClusterRoleBinding"])

    assert (service_account.metadata.namespace, service_account.metadata.name) == (
        namespace,
        account,
    )
    assert service_account.automount_service_account_token is False

    # The long-lived token the nodes' kubeconfig is made from (deploy/README.md).
    assert secret.type == "kubernetes.io/service-account-token"
    assert (secret.metadata.namespace, secret.metadata.name) == (namespace, f"{account}-token")
    assert secret.metadata.annotations == {"kubernetes.io/service-account.name": account}
    assert secret.data is None and secret.string_data is None  # the token controller fills it

    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role.rules:
        assert not rule.resource_names and not rule.non_resource_urls
        for group in rule.api_groups:
            for resource in rule.resources:
                granted.setdefault((group, resource), set()).update(rule.verbs)
    assert granted == {key: set(verbs) for key, verbs in DAEMON_API_VERBS.items()}

    assert (binding.role_ref.api_group, binding.role_ref.kind, binding.role_ref.name) == (
        "rbac.authorization.k8s.io",
        "ClusterRole",
        role.metadata.name,
    )
    assert [(s.kind, s.namespace, s.name) for s in binding.subjects] == [
        ("ServiceAccount", namespace, account)
    ]


def test_the_verb_contract_is_least_privilege():
    """What the daemon must never be able to do, whatever the contract grows into."""
    verbs = set().union(*DAEMON_API_VERBS.values())
    assert not verbs & {
        "delete",
        "deletecollection",
        "update",
        "*",
        "escalate",
        "bind",
        "impersonate",
    }
    assert {group for group, _ in DAEMON_API_VERBS} == {""}
    assert not {resource for _, resource in DAEMON_API_VERBS} & {"secrets", "configmaps", "*"}


# ---------------------------------------------------------------- scheduler


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_scheduler_config_is_a_v1_kube_scheduler_configuration_with_the_extender(values):
    url = values.get("extender_url", render.DEFAULTS["extender_url"])
    kubeconfig = values.get("scheduler_kubeconfig", render.DEFAULTS["scheduler_kubeconfig"])
    (config,) = _rendered("scheduler-config", values)

    assert schema_errors(config, SCHEDULER_CONFIG_SCHEMA) == []
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["clientConnection"] == {"kubeconfig": kubeconfig}
    assert config["extenders"] == [
        {
            "urlPrefix": url,
            "filterVerb": "filter",
            "bindVerb": "bind",
            "enableHTTPS": url.startswith("https://"),
            "nodeCacheCapable": True,
            "managedResources": [{"name": "aliyun.com/gpu-mem", "ignoredByScheduler": False}],
            "ignorable": False,
        }
    ]
    assert set(config) == {"apiVersion", "kind", "clientConnection", "extenders"}


def test_the_schema_check_fails_on_a_typo_and_a_wrong_type():
    (config,) = _rendered("scheduler-config", {})
    extender = config["extenders"][0]
    cases = {
        "filterverb": {**config, "extenders": [{**extender, "filterverb": "filter"}]},
        "enableHttps (Policy spelling)": {
            **config,
            "extenders": [{**extender, "enableHttps": False}],
        },
        "weight '1'": {**config, "extenders": [{**extender, "weight": "1"}]},
        "nodeCacheCapable 'true'": {
            **config,
            "extenders": [{**extender, "nodeCacheCapable": "true"}],
        },
        "no urlPrefix": {
            **config,
            "extenders": [{k: v for k, v in extender.items() if k != "urlPrefix"}],
        },
        "managed resource nam": {
            **config,
            "extenders": [{**extender, "managedResources": [{"nam": "aliyun.com/gpu-mem"}]}],
        },
        "extenders as a mapping": {**config, "extenders": extender},
        "clientConnection.kubeConfig": {**config, "clientConnection": {"kubeConfig": "/x"}},
        "policy at top level": {**config, "policy": {}},
    }
    for case, broken in cases.items():
        assert schema_errors(broken, SCHEDULER_CONFIG_SCHEMA), f"{case}: accepted"


# ---------------------------------------------------------------- examples


def _gpu_limits(container: Any) -> dict[str, str]:
    limits = (container.resources.limits if container.resources else None) or {}
    return {name: value for name, value in limits.items() if "/" in name}


def test_binpack_statefulset_asks_3_gib_in_3_replicas_as_the_gpushare_docs():
    kinds = _by_kind(_example("binpack-statefulset.yaml"))
    (service,) = (to_model(doc) for doc in kinds["Service"])
    (statefulset,) = (to_model(doc) for doc in kinds["StatefulSet"])
    spec = statefulset.spec
    assert spec.replicas == 3 and spec.pod_management_policy == "Parallel"
    # The governing Service exists, is headless and selects these pods.
    assert spec.service_name == service.metadata.name and service.spec.cluster_ip == "None"
    labels = spec.template.metadata.labels
    assert spec.selector.match_labels.items() <= labels.items()
    assert service.spec.selector.items() <= labels.items()
    (container,) = spec.template.spec.containers
    assert _gpu_limits(container) == {"aliyun.com/gpu-mem": "3"}


def test_job_asks_2_gib_and_30_percent_of_one_card():
    (job,) = (to_model(doc) for doc in _example("job-mem-core.yaml"))
    assert job.kind == "Job"
    pod = job.spec.template.spec
    assert pod.restart_policy in ("Never", "OnFailure")  # what a Job allows
    (container,) = pod.containers
    assert _gpu_limits(container) == {
        "aliyun.com/gpu-mem": "2",
        "aliyun.com/gpu-core.percentage": "30",
    }


def test_multi_container_pod_gives_each_container_its_own_memory():
    (pod,) = (to_model(doc) for doc in _example("multi-container-pod.yaml"))
    assert pod.kind == "Pod" and len(pod.spec.containers) >= 2
    for container in pod.spec.containers:
        assert set(_gpu_limits(container)) == {"aliyun.com/gpu-mem"}, container.name


def test_whole_card_pod_asks_one_card_and_nothing_shared():
    (pod,) = (to_model(doc) for doc in _example("whole-card-pod.yaml"))
    (container,) = pod.spec.containers
    assert _gpu_limits(container) == {"nvidia.com/gpu": "1"}


@pytest.mark.parametrize("path", _example_files(), ids=lambda path: path.name)
def test_example_gpu_resources_are_whole_units_in_limits(path):
    """Device-plugin resources: positive integers, in limits; requests, if any, equal."""
    workloads = [
        to_model(doc) for doc in _documents(path.read_text()) if doc["kind"] in MODELS_WITH_PODS
    ]
    assert workloads
    for workload in workloads:
        spec = _pod_spec(workload)
        for container in (spec.init_containers or []) + spec.containers:
            resources = container.resources
            requests = (resources.requests if resources else None) or {}
            limits = _gpu_limits(container)
            for name, value in requests.items():
                if "/" in name:
                    assert limits.get(name) == value, f"{container.name}: {name} not in limits"
            for name, value in limits.items():
                amount = parse_quantity(value)
                assert amount > 0 and amount == int(amount), f"{container.name}: {name}={value}"


# ---------------------------------------------------------------- DRA


DRA_VALUE_SETS = {**VALUE_SETS, "driver": {"driver": "gpu.example.com"}}


@pytest.mark.parametrize("values", DRA_VALUE_SETS.values(), ids=DRA_VALUE_SETS.keys())
def test_the_dra_template_is_valid_objects_granting_exactly_the_dra_verbs(values):
    """DeviceClasses, ClusterRole and binding, ResourceSlice policy and its binding: valid
    objects; the role grants exactly what the daemon's DRA side declares it requests
    (the 1.36 claim-status check for its own driver's name only), to its account."""
    from nodemgr.kubernetes.dra import DRA_API_PERMISSIONS

    namespace = values.get("namespace", render.DEFAULTS["namespace"])
    account = values.get("service_account", render.DEFAULTS["service_account"])
    driver = values.get("driver", render.DEFAULTS["driver"])
    docs = _rendered("dra", values)
    kinds = _by_kind(docs)
    for doc in docs:
        to_model(doc)
    (role,) = (to_model(doc) for doc in kinds["ClusterRole"])
    (binding,) = (to_model(doc) for doc in kinds["ClusterRoleBinding"])
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role.rules:
        assert rule.resource_names in (None, [driver]), rule
        assert rule.resource_names is None or rule.resources == ["resourceclaims/driver"]
        for group in rule.api_groups:
            for resource in rule.resources:
                granted.setdefault((group, resource), set()).update(rule.verbs)
    assert granted == {(g, r): set(verbs) for g, r, verbs in DRA_API_PERMISSIONS}
    assert binding.role_ref.name == role.metadata.name
    assert [(s.kind, s.namespace, s.name) for s in binding.subjects] == [
        ("ServiceAccount", namespace, account)
    ]
    classes = {doc["metadata"]["name"]: doc for doc in kinds["DeviceClass"]}
    assert set(classes) == {f"gpu.{driver}", f"whole-gpu.{driver}"}
    shared = classes[f"gpu.{driver}"]["spec"]["selectors"][0]["cel"]["expression"]
    assert shared == f'device.driver == "{driver}"'
    whole = classes[f"whole-gpu.{driver}"]["spec"]["selectors"][0]["cel"]["expression"]
    assert f'!device.attributes["{driver}"].devicePluginInUse' in whole
    (policy,) = kinds["ValidatingAdmissionPolicy"]
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert f"system:serviceaccount:{namespace}:{account}" in condition
    assert f'variables.slice.spec.driver == "{driver}"' in [
        v["expression"] for v in policy["spec"]["validations"]
    ]
    (policy_binding,) = kinds["ValidatingAdmissionPolicyBinding"]
    assert policy_binding["spec"]["policyName"] == policy["metadata"]["name"]


def test_the_dra_job_asks_4_gib_and_30_percent_through_its_claim_template():
    """The DRA twin of the extended-resource Job: the template asks memory 4Gi and cores
    30 of the shared class; the container names the pod's claim; no extended resource."""
    kinds = _by_kind(_example("dra-job-mem-core.yaml"))
    (template,) = (to_model(doc) for doc in kinds["ResourceClaimTemplate"])
    (job,) = (to_model(doc) for doc in kinds["Job"])
    (request,) = template.spec.spec.devices.requests
    assert request.exactly.device_class_name == "gpu.gpushare.aliyun.com"
    assert request.exactly.capacity.requests == {"memory": "4Gi", "cores": "30"}
    pod = job.spec.template.spec
    (claim,) = pod.resource_claims
    assert claim.resource_claim_template_name == template.metadata.name
    (container,) = pod.containers
    assert [c.name for c in container.resources.claims] == [claim.name]
    assert _gpu_limits(container) == {}


def test_the_dra_whole_card_pod_asks_no_capacity_of_the_whole_class():
    kinds = _by_kind(_example("dra-whole-card-pod.yaml"))
    (template,) = (to_model(doc) for doc in kinds["ResourceClaimTemplate"])
    (request,) = template.spec.spec.devices.requests
    assert request.exactly.device_class_name == "whole-gpu.gpushare.aliyun.com"
    assert request.exactly.capacity is None


# ---------------------------------------------------------------- kubeconfig


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_kubeconfig_loads_with_the_kubernetes_client(values, tmp_path):
    text = render.render(
        "kubeconfig", {**values, "server": TEST_SERVER, "ca_pem": TEST_CA_PEM, "token": TEST_TOKEN}
    )
    path = tmp_path / "kubeconfig"
    path.write_text(text, encoding="utf-8")
    (doc,) = _documents(text)
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "Config")

    configuration = Configuration()
    kube_config.load_kube_config(config_file=str(path), client_configuration=configuration)
    assert configuration.host == TEST_SERVER
    assert configuration.api_key == {"BearerToken": f"Bearer {TEST_TOKEN}"}
    assert configuration.verify_ssl is True
    assert Path(configuration.ssl_ca_cert).read_text(encoding="ascii") == TEST_CA_PEM
    ssl.create_default_context(cafile=configuration.ssl_ca_cert)  # a CA the TLS stack takes

    _, active = kube_config.list_kube_config_contexts(config_file=str(path))
    assert active["context"]["namespace"] == values.get("namespace", "kube-system")
    assert active["context"]["user"] == values.get("service_account", "gpushare-node")


def test_kubeconfig_takes_the_token_decoded_and_stripped():
    text = render.render(
        "kubeconfig", {"server": TEST_SERVER, "ca_pem": TEST_CA_PEM, "token": TEST_TOKEN + "\n"}
    )
    (doc,) = _documents(text)
    assert doc["users"][0]["user"] == {"token": TEST_TOKEN}
    ca_data = doc["clusters"][0]["cluster"]["certificate-authority-data"]
    assert base64.b64decode(ca_data).decode("ascii") == TEST_CA_PEM


# ---------------------------------------------------------------- the renderer


@pytest.mark.parametrize(
    ("template", "values", "message"),
    [
        ("rbac", {"namespace": "Kube-System"}, "DNS-1123"),
        ("rbac", {"service_account": "gpushare_node"}, "DNS-1123"),
        ("rbac", {"namespace": "a" * 64}, "DNS-1123"),
        ("scheduler-config", {"extender_url": "127.0.0.1:32766/gpushare-scheduler"}, "URL"),
        ("scheduler-config", {"extender_url": "ftp://h/gpushare-scheduler"}, "URL"),
        ("scheduler-config", {"scheduler_kubeconfig": "scheduler.conf"}, "absolute"),
        ("kubeconfig", {"ca_pem": TEST_CA_PEM, "token": TEST_TOKEN}, "server is required"),
        ("kubeconfig", {"server": "http://10.0.0.1:6443"}, "https URL"),
        ("kubeconfig", {"ca_pem": "not a certificate"}, "PEM"),
        ("kubeconfig", {"token": "two words"}, "token"),
        ("kubeconfig", {"token": "  \n"}, "token"),
        ("kubeconfig", {"token": base64.b64encode(TEST_TOKEN.encode()).decode()}, "base64 -d"),
        ("dra", {"driver": "Gpushare_Aliyun"}, "DRA driver name"),
        ("dra", {"driver": "1gpu.example.com"}, "DRA driver name"),
        ("nope", {}, "unknown template"),
    ],
)
def test_renderer_refuses_bad_values(template, values, message):
    good = {"server": TEST_SERVER, "ca_pem": TEST_CA_PEM, "token": TEST_TOKEN}
    if message == "server is required":
        good.pop("server")
    with pytest.raises(render.RenderError, match=message):
        render.render(template, {**good, **values} if template == "kubeconfig" else values)


def test_renderer_templates_use_only_declared_values():
    """StrictUndefined: a template variable nobody passes fails instead of rendering empty."""
    with pytest.raises(jinja2.UndefinedError):
        render._environment().from_string("namespace: {{ namespace }}\n").render()
    with pytest.raises(jinja2.UndefinedError):
        render._environment().get_template("rbac.yaml.j2").render(namespace="kube-system")


def _run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEPLOY / "render.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_renders_to_stdout_and_writes_the_kubeconfig_0600(tmp_path):
    rbac = _run_cli("rbac", "--namespace", "gpu-system")
    assert rbac.returncode == 0, rbac.stderr
    assert {doc["metadata"].get("namespace") for doc in _documents(rbac.stdout)} == {
        "gpu-system",
        None,  # the ClusterRole and its binding are cluster-scoped
    }

    ca = tmp_path / "ca.crt"
    ca.write_text(TEST_CA_PEM, encoding="ascii")
    out = tmp_path / "kubeconfig"
    out.write_text("old, world-readable\n")
    os.chmod(out, 0o644)
    made = _run_cli(
        "kubeconfig",
        "--server",
        TEST_SERVER,
        "--ca-file",
        str(ca),
        "--token-file",
        "-",
        "-o",
        str(out),
        stdin=TEST_TOKEN + "\n",
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout == ""
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    (doc,) = _documents(out.read_text())
    assert doc["users"][0]["user"]["token"] == TEST_TOKEN


def test_cli_refuses_without_changing_anything(tmp_path):
    missing = _run_cli("kubeconfig", "--ca-file", "x", "--token-file", "y")
    assert missing.returncode == 2 and "--server" in missing.stderr
    out = tmp_path / "kubeconfig"
    bad = _run_cli(
        "kubeconfig",
        "--server",
        TEST_SERVER,
        "--ca-file",
        str(tmp_path / "absent.crt"),
        "--token-file",
        "-",
        "-o",
        str(out),
        stdin=TEST_TOKEN,
    )
    assert bad.returncode == 2 and "absent.crt" in bad.stderr
    assert not out.exists()


def test_the_verb_contract_is_what_the_adapter_declares_it_uses():
    from nodemgr.kubernetes.adapter import API_PERMISSIONS

    declared = {(group, resource): frozenset(verbs) for group, resource, verbs in API_PERMISSIONS}
    assert declared == DAEMON_API_VERBS
