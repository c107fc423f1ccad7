"""deploy/ for gpushare-scheduler: RBAC, Deployment + Service, KubeSchedulerConfiguration.

Pins: every object deserializes into the kubernetes client's model with nothing dropped
(a typo fails); the ClusterRole grants exactly the requests the extender makes
(``EXTENDER_API_VERBS``, compared with what it really requests of the test API server
in test_main/test_kube_edge: nodes list+watch, pods list+watch+patch, pods/binding
create, events create); the Deployment runs one replica (the assume cache is per process) as the
account, with its Service's NodePort where the scheduler config points; the
KubeSchedulerConfiguration matches the v1 schema and has filter, prioritize and bind,
nodeCacheCapable true (names only: the extender has its own node cache), all three
resources managed and not ignored, ignorable false;
the renderer refuses a missing image and bad ports or resource names.
"""

from __future__ import annotations

import json

import pytest

import tests.unit.deploy.test_render as base
from nodemgr.kubernetes.listwatch import RESOURCES as WATCHED

render = base.render

# What gpushare-scheduler requests: (API group, resource) -> verbs.
#   nodes: one LIST+WATCH (nodemgr.kubernetes.listwatch);
#   pods: one LIST+WATCH, a merge patch of the bound pod's annotations (scheduling);
#   pods/binding: create (scheduling.create_binding);
#   events: create (scheduling.create_event: a placement annotation it ignored).
EXTENDER_API_VERBS = {
    ("", "nodes"): {"list", "watch"},
    ("", "pods"): {"list", "watch", "patch"},
    ("", "pods/binding"): {"create"},
    ("", "events"): {"create"},
}
MODELS = {**base.MODELS, ("apps/v1", "Deployment"): "V1Deployment"}


def to_model(doc):
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in MODELS, key
    sent = base._quantities_as_strings(doc)
    obj = base._API.deserialize(json.dumps(sent), MODELS[key], "application/json")
    problems = list(base._differences(sent, base._API.sanitize_for_serialization(obj)))
    assert not problems, problems
    return obj


def rendered(template, values=None):
    return base._documents(render.render(template, values or {}))


def test_rbac_grants_exactly_what_the_extender_requests():
    docs = rendered("scheduler-rbac", {"namespace": "gpu-system"})
    assert [d["kind"] for d in docs] == [
        "ServiceAccount",
        "Secret",
        "ClusterRole",
        "ClusterRoleBinding",
    ]
    account, secret, role, binding = (to_model(d) for d in docs)
    assert (account.metadata.namespace, account.metadata.name) == (
        "gpu-system",
        "gpushare-scheduler",
    )
    assert secret.type == "kubernetes.io/service-account-token"
    assert secret.metadata.annotations == {
        "kubernetes.io/service-account.name": "gpushare-scheduler"
    }
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role.rules:
        assert not rule.resource_names
        for group in rule.api_groups:
            for resource in rule.resources:
                granted.setdefault((group, resource), set()).update(rule.verbs)
    assert granted == EXTENDER_API_VERBS
    assert set(WATCHED) == {r for (_, r), verbs in EXTENDER_API_VERBS.items() if "watch" in verbs}
    assert [(s.kind, s.namespace, s.name) for s in binding.subjects] == [
        ("ServiceAccount", "gpu-system", "gpushare-scheduler")
    ]
    assert binding.role_ref.name == role.metadata.name


def test_deployment_and_service():
    docs = rendered("scheduler-deployment", {"image": "registry.example/gpushare-node:0.1.0"})
    deployment, service = (to_model(d) for d in docs)
    assert deployment.spec.replicas == 1 and deployment.spec.strategy.type == "Recreate"
    pod = deployment.spec.template.spec
    assert pod.service_account_name == "gpushare-scheduler"
    (container,) = pod.containers
    assert container.image == "registry.example/gpushare-node:0.1.0"
    assert container.command[0] == "gpushare-scheduler"
    assert "--address=0.0.0.0:32766" in container.command
    assert "--url-prefix=/gpushare-scheduler" in container.command
    assert container.readiness_probe.http_get.path == "/healthz"
    assert container.security_context.read_only_root_filesystem is True
    assert service.spec.type == "NodePort"
    (port,) = service.spec.ports
    assert (port.node_port, port.port, port.target_port) == (32766, 32766, "http")
    assert service.spec.selector == deployment.spec.selector.match_labels
    assert render.DEFAULTS["extender_url"] == "http://127.0.0.1:32766/gpushare-scheduler"


@pytest.mark.parametrize("values", base.VALUE_SETS.values(), ids=base.VALUE_SETS.keys())
def test_scheduler_config_sends_all_three_resources_to_gpushare_scheduler(values):
    values = {k: v for k, v in values.items() if k in ("extender_url", "scheduler_kubeconfig")}
    (config,) = rendered("gpushare-scheduler-config", values)
    assert base.schema_errors(config, base.SCHEDULER_CONFIG_SCHEMA) == []
    assert (config["apiVersion"], config["kind"]) == (
        "kubescheduler.config.k8s.io/v1",
        "KubeSchedulerConfiguration",
    )
    url = values.get("extender_url", render.DEFAULTS["extender_url"])
    (extender,) = config["extenders"]
    assert extender == {
        "urlPrefix": url,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": 5,
        "bindVerb": "bind",
        "enableHTTPS": url.startswith("https://"),
        "nodeCacheCapable": True,
        "httpTimeout": "10s",
        "managedResources": [
            {"name": "aliyun.com/gpu-mem", "ignoredByScheduler": False},
            {"name": "aliyun.com/gpu-core.percentage", "ignoredByScheduler": False},
            {"name": "nvidia.com/gpu", "ignoredByScheduler": False},
        ],
        "ignorable": False,
    }


@pytest.mark.parametrize(
    ("template", "values", "message"),
    [
        ("scheduler-deployment", {}, "image is required"),
        ("scheduler-deployment", {"image": "a b"}, "one image reference"),
        ("scheduler-deployment", {"image": "x", "node_port": "80"}, r"\[30000, 32767\]"),
        ("gpushare-scheduler-config", {"memory_resource": "gpu-mem"}, "extended resource name"),
        ("scheduler-rbac", {"scheduler_account": "Bad_Name"}, "DNS-1123"),
    ],
)
def test_renderer_refuses_bad_values(template, values, message):
    with pytest.raises(render.RenderError, match=message):
        render.render(template, values)


def test_cli_renders_the_deployment():
    done = base._run_cli("scheduler-deployment", "--image", "r/g:1", "--namespace", "gpu")
    assert done.returncode == 0, done.stderr
    assert {d["metadata"]["namespace"] for d in base._documents(done.stdout)} == {"gpu"}
    assert base._run_cli("scheduler-deployment").returncode == 2  # --image is required
