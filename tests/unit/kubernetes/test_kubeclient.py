"""Pins nodemgr.kubernetes.kubeclient, the official kubernetes client imported slim: a
process running the adapter, the one-shot commands' client and the extender's requests
loads no generated API class, no model and no pydantic, and another importer in that
process still gets the whole client; the installed client still has every name and
signature kubeclient relies on (this fails loudly after an upgrade that changes them);
credentials are read from the Configuration at most a second apart and at once after a
401 (so exec plugins and rotated tokens work, an exec plugin end to end); and the
generated methods' convention is kept where it is safe, refused where it is not (no
models to deserialize into, no argument silently dropped)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import subprocess
import sys
import textwrap

import pytest

from nodemgr.kubernetes.client import CommandClient, find_credentials, new_api_client
from nodemgr.kubernetes.kubeclient import (
    CREDENTIALS_SECONDS,
    SUBPACKAGES,
    ApiException,
    Configuration,
    CoreV1,
    InClusterConfigLoader,
    KubeClient,
    RESTClientObject,
    load_kube_config,
)
from tests.harness.clock import Clock
from tests.harness.paths import REPO
from tests.unit.kubernetes.support import NODE

# What the slim import leaves out; a module named so, or under it, must not be loaded.
LEFT_OUT = (
    "pydantic",
    "kubernetes.client.api_client",
    "kubernetes.client.api",
    "kubernetes.client.models",
    "kubernetes.dynamic",
    "kubernetes.watch",
    "kubernetes.stream",
    "kubernetes.leaderelection",
    "kubernetes.informer",
    "websocket",
)

# Every request kind of the daemon's adapter, nodemgr doctor / status --cluster and the
# extender, in a fresh process; prints the modules of LEFT_OUT that got loaded.
EVERY_REQUEST = """
import json, sys, threading, time
from nodemgr.config.schema import KubernetesSettings
from nodemgr.kubernetes import client, scheduling
from nodemgr.kubernetes.adapter import KubeAdapter
from nodemgr.kubernetes.listwatch import ListWatch
from tests.harness.apiserver_sim import TestApiServer

def wait(predicate, what):
    deadline = time.monotonic() + 10
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)

api = TestApiServer()
api.start()
api.add_node("node-a")
api.add_pod("ml", "train", node_name="node-a")
queued = api.add_pod("ml", "queued")
kubeconfig = api.write_kubeconfig(sys.argv[1])
settings = KubernetesSettings(kubeconfig=kubeconfig, request_timeout_seconds=2.0)
adapter = KubeAdapter(settings, "node-a", event_interval_seconds=0.0)  # no fold: a patch
adapter.start()
wait(lambda: adapter.synced and adapter.state()["watching"], "the pod watch")
adapter.patch_pod_annotations("ml", "train", {"a": "1"})
adapter.set_node_labels({"gpus": "2"})
adapter.set_node_extended_resources({"aliyun.com/gpu-count": 2})
adapter.record_event("ml", "train", "Test", "once")
wait(lambda: api.pod("ml", "train")["metadata"].get("annotations") == {"a": "1"}, "annotation")
wait(lambda: "aliyun.com/gpu-count" in api.node("node-a")["status"]["capacity"], "capacity")
wait(lambda: len(api.events()) == 1, "event")
adapter.record_event("ml", "train", "Test", "twice")  # a repeat patches the event
with client.CommandClient(client.find_credentials(kubeconfig), 2.0) as command:
    command.read_node("node-a")
    command.can_i("patch", "", "nodes/status")
    command.list_nodes()
session = scheduling.open_session(kubeconfig, 2.0)
scheduling.patch_pod_annotations(session, "ml", "queued", {"b": "2"})
scheduling.create_binding(session, "ml", "queued", queued["metadata"]["uid"], "node-a")

class Handler:
    def replace(self, items):
        list(items)
    def apply(self, kind, obj):
        pass

stop = threading.Event()
nodes = ListWatch(session, "nodes", Handler(), stop)
nodes.start()
wait(lambda: nodes.synced and nodes.watching, "the node watch")
wait(lambda: api.events()[0].get("count") == 2, "the event patch")
left_out = sorted(
    m for m in sys.modules
    if any(m == name or m.startswith(name + ".") for name in sys.argv[2:])
)
print(json.dumps(left_out))
stop.set()
nodes.abort()
adapter.stop()
api.stop()
"""


def run_python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_request_kind_loads_no_generated_class_model_or_pydantic(tmp_path):
    """The daemon's adapter (LIST+WATCH, every write, events created and patched), the
    commands' client (node, access review, node list) and the extender's requests (patch,
    binding, node watch) all work in a fresh process that never loads the generated API
    classes or models, pydantic, or the subpackages kubernetes/__init__ would import."""
    out = run_python(EVERY_REQUEST, str(tmp_path / "kubeconfig"), *LEFT_OUT)
    assert json.loads(out.splitlines()[-1]) == []


def test_another_importer_in_the_process_gets_the_whole_client(tmp_path):
    """After the slim import, code that wants the official client still finds all of it:
    the package's version and subpackages, the real ApiClient and the generated classes,
    and kube_config's own ApiClient (new_client_from_config) builds a real one."""
    code = """
    import sys
    import nodemgr.kubernetes.kubeclient
    import kubernetes
    from kubernetes.client import CoreV1Api, V1Pod
    from kubernetes.client.api_client import ApiClient
    from kubernetes.config import kube_config
    assert kubernetes.__version__ == sys.argv[2], kubernetes.__version__
    assert kubernetes.client.ApiClient is ApiClient
    assert kubernetes.watch.Watch and kubernetes.stream.stream and kubernetes.utils
    assert V1Pod.from_dict({"metadata": {"name": "p"}}).metadata.name == "p"
    assert isinstance(kube_config.new_client_from_config(config_file=sys.argv[1]), ApiClient)
    assert CoreV1Api
    print("ok")
    """
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    from importlib.metadata import version

    assert run_python(code, str(kubeconfig), version("kubernetes")).strip() == "ok"


def test_the_installed_client_has_what_kubeclient_relies_on():
    """The names and signatures kubeclient uses in place of the generated ApiClient and
    API classes, as the installed kubernetes package has them; a release that changes
    one fails here, not in production."""
    spec = importlib.util.find_spec("kubernetes")
    assert spec is not None and spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        package_init = f.read()
    # The lazy top package offers exactly what the real __init__ imports, and its version.
    assert tuple(re.findall(r"^from \. import (\w+)$", package_init, re.MULTILINE)) == SUBPACKAGES
    assert re.search(r'^__version__ = "[^"]+"$', package_init, re.MULTILINE)
    request = inspect.signature(RESTClientObject.request).parameters
    assert list(request) == [
        "self",
        "method",
        "url",
        "headers",
        "body",
        "post_params",
        "_request_timeout",
    ]
    from_response = inspect.signature(ApiException.from_response).parameters
    assert {n: p.kind for n, p in from_response.items()} == {
        "http_resp": inspect.Parameter.KEYWORD_ONLY,
        "body": inspect.Parameter.KEYWORD_ONLY,
        "data": inspect.Parameter.KEYWORD_ONLY,
    }
    assert {"config_file", "client_configuration", "persist_config"} <= set(
        inspect.signature(load_kube_config).parameters
    )
    assert {"token_filename", "cert_filename", "environ"} <= set(
        inspect.signature(InClusterConfigLoader).parameters
    )
    assert callable(InClusterConfigLoader.load_and_set)
    # The credentials: one header, asked of the refresh hook at each call.
    configuration = Configuration(host="http://127.0.0.1:1")
    configuration.api_key = {"BearerToken": "old"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    configuration.refresh_api_key_hook = lambda c: c.api_key.update(BearerToken="new")
    assert configuration.auth_settings() == {
        "BearerToken": {
            "type": "api_key",
            "in": "header",
            "key": "authorization",
            "value": "Bearer new",
        }
    }


def test_a_refused_token_is_asked_for_again_at_the_next_request(api):
    """A token renewed between two requests (what exec plugins and the in-cluster loader do
    through refresh_api_key_hook) is the one the next request sends once the API server
    refused the old one: the first request with a wrong one is refused (401), the next
    one, within the same second, asks the hook again and is answered."""
    configuration = Configuration(host=api.url)
    configuration.api_key = {"BearerToken": "wrong"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    client = KubeClient(configuration)
    core = CoreV1(client)
    with pytest.raises(ApiException) as refused:
        core.read_node(NODE)
    assert refused.value.status == 401
    configuration.refresh_api_key_hook = lambda c: c.api_key.update(BearerToken=api.token)
    response = core.read_node(NODE)
    assert json.loads(response.data)["metadata"]["name"] == NODE
    client.close()


def test_the_credentials_hook_is_asked_at_most_once_a_second(api):
    """The refresh hook (the kubeconfig loader's sets the whole configuration again at
    each call, host and proxy included: tens of microseconds a request) is asked at the
    first request and then once per CREDENTIALS_SECONDS, not at every request: ten
    requests in one second ask it once, the first one after it asks again and sends what
    it renewed."""
    clock = Clock()
    calls = []

    def hook(c):
        calls.append(clock())
        c.api_key["BearerToken"] = api.token if len(calls) == 1 else "renewed"

    configuration = Configuration(host=api.url)
    configuration.api_key = {"BearerToken": "unset"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    configuration.refresh_api_key_hook = hook
    client = KubeClient(configuration, clock=clock)
    core = CoreV1(client)
    for _ in range(10):
        core.read_node(NODE).release_conn()
        clock.now += CREDENTIALS_SECONDS / 20
    assert calls == [1000.0]
    clock.now = 1000.0 + CREDENTIALS_SECONDS
    with pytest.raises(ApiException) as refused:  # the renewed token is sent at once
        core.read_node(NODE)
    assert refused.value.status == 401 and len(calls) == 2
    client.close()


def test_an_exec_plugin_supplies_the_token(api, tmp_path):
    """A kubeconfig whose user is an exec plugin (as EKS, GKE and OIDC logins are): the
    plugin runs and its token opens the API server."""
    plugin = tmp_path / "plugin.py"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": api.token},
    }
    plugin.write_text(f"print({json.dumps(json.dumps(credential))})\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                "users": [
                    {
                        "name": "u",
                        "user": {
                            "exec": {
                                "apiVersion": "client.authentication.k8s.io/v1beta1",
                                "command": sys.executable,
                                "args": [str(plugin)],
                            }
                        },
                    }
                ],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    with CommandClient(find_credentials(str(kubeconfig), environ={}), 2.0) as command:
        assert command.read_node(NODE)["metadata"]["name"] == NODE


def test_the_generated_convention_is_kept_where_safe_and_refused_where_not(api, tmp_path):
    """Booleans go out as the API spells them (watch=true); a PATCH without a content type
    is what the official client sends (a list: JSON patch); asking for models, or passing an
    argument these methods do not send, is a TypeError naming it, never silently dropped."""
    client = new_api_client(find_credentials(api.write_kubeconfig(tmp_path / "kc"), environ={}))
    core = CoreV1(client)
    core.list_node(watch=True, timeout_seconds=1, _request_timeout=(2, 5)).close()
    [(_, _, query)] = [r for r in api.requests if r[1] == "/api/v1/nodes"]
    assert query.get("watch") == "true" and query.get("timeoutSeconds") == "1"
    patch = [{"op": "add", "path": "/metadata/labels/x", "value": "1"}]
    assert core.patch_node(NODE, patch, _preload_content=False).status == 200
    assert api.node(NODE)["metadata"]["labels"]["x"] == "1"
    with pytest.raises(TypeError, match="_preload_content=False"):
        core.read_node(NODE, _preload_content=True)
    with pytest.raises(TypeError, match="pretty"):
        core.list_node(pretty="true")
    with pytest.raises(TypeError, match="dry_run"):
        core.patch_node(NODE, {}, dry_run="All")
    assert isinstance(client, KubeClient) and client.user_agent == "gpushare-node"
    client.close()
