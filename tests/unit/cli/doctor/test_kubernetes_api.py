"""Pins doctor's Kubernetes API check: the verdicts as pure functions, and the check against
the test API server (standins/apiserver_sim.py, the real client end to end): all of
nodemgr.kubernetes.adapter.API_PERMISSIONS allowed passes, a missing verb FAILs naming it and
the RBAC fix, a rejected token, a stopped server and missing credentials FAIL, an unknown node
WARNs, ``kubernetes.enabled: false`` WARNs without a request."""

from __future__ import annotations

import pytest
import yaml

from nodemgr.cli.doctor import kubernetes_api
from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.kubernetes_api import KubeProbe
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.config.loading import load_settings
from nodemgr.kubernetes import adapter as kube
from nodemgr.kubernetes import client as kube_client
from standins.apiserver_sim import ACCESS_REVIEWS, TestApiServer

ALL_VERBS = tuple(
    (group, resource, verb) for group, resource, verbs in kube.API_PERMISSIONS for verb in verbs
)

SERVER = "https://10.0.0.1:6443"

CREDS = "kubernetes.kubeconfig (/etc/gpushare/kubeconfig)"

# --- verdicts ------------------------------------------------------------------------------


def test_kubernetes_disabled_warns_what_is_lost():
    """kubernetes.enabled: false WARNs naming what is lost and how to enable it."""
    result = kubernetes_api.kubernetes_disabled_result()
    assert result.status == WARN
    assert result.detail == (
        "disabled: no pod annotations, node labels or events; the gpushare scheduler extender "
        "and kubectl inspect gpushare won't see this node's allocations"
    )
    assert "kubernetes.enabled: true" in result.fix and "deploy/README.md" in result.fix


def test_kubernetes_credentials_verdict_keeps_the_fix_out_of_the_finding():
    """Missing credentials FAIL with what was tried as the finding and the fix kept apart."""
    fix = kube_client.CREDENTIALS_FIX
    problem = kube_client.credentials_problem(
        f"no Kubernetes credentials (tried kubernetes.kubeconfig: not set; $KUBECONFIG: not "
        f"set): {fix}"
    )
    assert kubernetes_api.kubernetes_credentials_result(problem, fix) == Result(
        "Kubernetes API",
        FAIL,
        "kubernetes.enabled, but no Kubernetes credentials (tried kubernetes.kubeconfig: not "
        "set; $KUBECONFIG: not set): gpushare-node would run as a plain device plugin (no pod "
        "annotations, node labels or events)",
        fix,
    )
    named = f"kubernetes.kubeconfig /k: no such file; create it or {fix}"
    assert kube_client.credentials_problem(named) == "kubernetes.kubeconfig /k: no such file"
    unusable = f"credentials from $KUBECONFIG (/k) are unusable: bad YAML; fix the file or {fix}"
    assert kube_client.credentials_problem(unusable) == (
        "credentials from $KUBECONFIG (/k) are unusable: bad YAML"
    )


def test_kubernetes_api_verdicts():
    """Unreachable, rejected, all allowed, unknown node, another authorizer and RBAC denials each
    get their verdict."""
    probe = KubeProbe(CREDS, SERVER, "node-a")
    unreachable = kubernetes_api.kubernetes_result(
        KubeProbe(**{**probe.__dict__, "error": "get nodes/node-a: timed out", "unavailable": True})
    )
    assert unreachable.status == FAIL
    assert unreachable.detail == (
        f"API server {SERVER} (credentials from {CREDS}) unreachable: get nodes/node-a: timed out"
    )
    rejected = kubernetes_api.kubernetes_result(
        KubeProbe(**{**probe.__dict__, "error": "HTTP 401", "error_status": 401})
    )
    assert rejected.status == FAIL and "credentials rejected" in rejected.detail
    assert "python deploy/render.py kubeconfig" in rejected.fix

    allowed = KubeProbe(**{**probe.__dict__, "node": "found", "checked": ALL_VERBS})
    passed = kubernetes_api.kubernetes_result(allowed)
    assert passed == Result(
        "Kubernetes API",
        PASS,
        f"API server {SERVER} (credentials from {CREDS}): node node-a found; RBAC allows every "
        "request gpushare-node makes (get, list, watch, patch on pods; get, patch on nodes; "
        "patch on nodes/status; create, patch on events)",
    )
    no_node = kubernetes_api.kubernetes_result(KubeProbe(**{**allowed.__dict__, "node": "missing"}))
    assert no_node.status == WARN
    assert "node node-a does not exist there (node_name wrong? kubelet not registered" in (
        no_node.detail
    )
    assert "set node_name" in no_node.fix

    refused_get = KubeProbe(**{**allowed.__dict__, "node": None, "node_error": "HTTP 403 (x)"})
    other_authorizer = kubernetes_api.kubernetes_result(refused_get)
    assert other_authorizer.status == FAIL and other_authorizer.detail.endswith("yet HTTP 403 (x)")

    denied = (("", "pods", "watch"), ("", "nodes/status", "patch"))
    refused = kubernetes_api.kubernetes_result(KubeProbe(**{**allowed.__dict__, "denied": denied}))
    assert refused.status == FAIL
    assert refused.detail.endswith(
        "RBAC denies 2 of the 9 requests gpushare-node makes: watch on pods; patch on "
        "nodes/status missing"
    )
    assert "`python deploy/render.py rbac | kubectl apply -f -`" in refused.fix


# --- against the test API server ---------------------------------------------------------


@pytest.fixture
def api_server():
    server = TestApiServer()
    server.start()
    server.add_node("node-a")
    yield server
    server.stop()


def kube_settings(tmp_path, **kubernetes):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"node_name": "node-a", "kubernetes": kubernetes}))
    return load_settings(str(config))


def reviews(server) -> list:
    return [r for r in server.requests if r[:2] == ("POST", ACCESS_REVIEWS)]


def test_kubernetes_with_every_permission_passes(api_server, tmp_path):
    """With every permission granted the check passes after one GET and one review per verb."""
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    result = kubernetes_api.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == PASS, result
    assert result.detail.startswith(
        f"API server {api_server.url} (credentials from kubernetes.kubeconfig ({kubeconfig})): "
        "node node-a found; RBAC allows every request gpushare-node makes"
    )
    assert api_server.requests[0][:2] == ("GET", "/api/v1/nodes/node-a")
    assert len(reviews(api_server)) == len(ALL_VERBS) == 9


def test_kubernetes_missing_verb_fails_naming_it(api_server, tmp_path):
    """One verb RBAC denies FAILs naming it, with the command that applies the RBAC."""
    api_server.rbac_allowed = {
        (resource, verb)
        for _, resource, verb in ALL_VERBS
        if (resource, verb) != ("events", "patch")
    }
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    result = kubernetes_api.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.endswith(
        "RBAC denies 1 of the 9 requests gpushare-node makes: patch on events missing"
    )
    assert "python deploy/render.py rbac | kubectl apply -f -" in result.fix


def test_kubernetes_without_nodes_get_still_names_every_missing_verb(api_server, tmp_path):
    """A 403 on the node GET does not stop the reviews: every missing verb is named."""
    api_server.rbac_allowed = {("pods", "list"), ("pods", "watch")}
    api_server.fail_next("GET", r"/nodes/node-a$", 403)  # what RBAC makes of the GET
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    result = kubernetes_api.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.endswith(
        "RBAC denies 7 of the 9 requests gpushare-node makes: get, patch on pods; get, patch on "
        "nodes; patch on nodes/status; create, patch on events missing"
    )


def test_kubernetes_bad_token_fails(api_server, tmp_path):
    """A rejected token FAILs as credentials rejected, and nothing more is asked."""
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    text = (tmp_path / "kubeconfig").read_text().replace(api_server.token, "revoked")
    (tmp_path / "kubeconfig").write_text(text)
    result = kubernetes_api.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.startswith(f"API server {api_server.url}: credentials rejected (from ")
    assert "HTTP 401" in result.detail
    assert reviews(api_server) == []  # nothing asked after the rejection


def test_kubernetes_server_stopped_fails_with_its_url(api_server, tmp_path):
    """A stopped API server FAILs as unreachable, naming its URL."""
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    api_server.stop()
    result = kubernetes_api.check_kubernetes(kube_settings(tmp_path, kubeconfig=kubeconfig), Host())
    assert result.status == FAIL
    assert result.detail.startswith(f"API server {api_server.url} (credentials from ")
    assert " unreachable: get nodes/node-a: no answer from the API server" in result.detail
    assert "reaches it" in result.fix


def test_kubernetes_unknown_node_warns(api_server, tmp_path):
    """A node_name the API server does not know WARNs."""
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"node_name": "gpu-7", "kubernetes": {"kubeconfig": kubeconfig}})
    )
    result = kubernetes_api.check_kubernetes(load_settings(str(config)), Host())
    assert result.status == WARN
    assert "node gpu-7 does not exist there (node_name wrong? kubelet not registered yet?)" in (
        result.detail
    )


def test_kubernetes_disabled_warns_without_a_request(api_server, tmp_path):
    """With kubernetes.enabled: false the check WARNs without sending a request."""
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    settings = kube_settings(tmp_path, enabled=False, kubeconfig=kubeconfig)
    assert (
        kubernetes_api.check_kubernetes(settings, Host())
        == kubernetes_api.kubernetes_disabled_result()
    )
    assert api_server.requests == []


def test_kubernetes_without_credentials_fails_saying_what_was_tried(tmp_path, monkeypatch):
    """Without credentials the check FAILs listing every place tried, or the named kubeconfig
    missing."""
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    result = kubernetes_api.check_kubernetes(kube_settings(tmp_path), Host(root=str(tmp_path)))
    assert result.status == FAIL
    assert result.detail == (
        "kubernetes.enabled, but no Kubernetes credentials (tried kubernetes.kubeconfig: not set; "
        "$KUBECONFIG: not set; in-cluster: $KUBERNETES_SERVICE_HOST not set; "
        f"{tmp_path}/home/.kube/config: no such file): gpushare-node would run as a plain device "
        "plugin (no pod annotations, node labels or events)"
    )
    assert "deploy/README.md" in result.fix and "kubernetes.enabled: false" in result.fix
    named = kube_settings(tmp_path, kubeconfig=str(tmp_path / "nowhere"))
    missing = kubernetes_api.check_kubernetes(named, Host(root=str(tmp_path)))
    assert missing.status == FAIL
    assert f"kubernetes.kubeconfig {tmp_path}/nowhere: no such file:" in missing.detail
