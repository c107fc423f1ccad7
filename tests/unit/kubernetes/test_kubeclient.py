"""Pins nodemgr.kubernetes.kubeclient, the official kubernetes client used through its
public API: every request kind of the adapter, the one-shot commands and the extender works
through the installed client without loading a generated API class or model; the package
is imported as it publishes itself, and only when a client is made; the dependency admits
newer releases; bodies go out as given and names as one quoted path segment; credentials
are read from the Configuration at each request (so exec plugins and rotated tokens work,
an exec plugin end to end); and the generated methods' convention is kept where it is
safe, refused where it is not (no models to deserialize into, no argument silently
dropped)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nodemgr.kubernetes.client import CommandClient, find_credentials, new_api_client
from nodemgr.kubernetes.kubeclient import (
    CREDENTIALS_SECONDS,
    JSON,
    CoreV1,
    KubeClient,
    ResourceV1,
    api_exception,
    new_configuration,
)
from standins.clock import Clock
from standins.paths import REPO
from tests.unit.kubernetes.support import NODE

# The generated API classes and models: a module named so, or under it, must not be loaded
# (the models package itself is: the ApiClient imports it, and it loads its models lazily).
LEFT_OUT = ("kubernetes.client.api", "kubernetes.client.models.", "kubernetes.aio")

# Every request kind of the daemon's adapter, nodemgr doctor / status --cluster and the
# extender, in a fresh process; prints the modules of LEFT_OUT that got loaded.
EVERY_REQUEST = """
import json, sys, threading, time
from nodemgr.config.schema import KubernetesSettings
from nodemgr.kubernetes import client, scheduling
from nodemgr.kubernetes.adapter import KubeAdapter
from nodemgr.kubernetes.listwatch import ListWatch
from standins.apiserver_sim import TestApiServer

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
    if any(m.startswith(name) if name.endswith(".") else m == name or m.startswith(name + ".")
           for name in sys.argv[2:])
)
print(json.dumps(left_out))
stop.set()
nodes.abort()
adapter.stop()
api.stop()
"""


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with {} (201) and keeps (method, path, Content-Type, body),
    and each request's header names."""

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.headers.append({name.lower() for name in self.headers})  # type: ignore[attr-defined]
        self.server.requests.append(  # type: ignore[attr-defined]
            (self.command, self.path, self.headers.get("Content-Type"), body)
        )
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _record

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recorder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.requests = []  # type: ignore[attr-defined]
    server.headers = []  # type: ignore[attr-defined]
    server.url = f"http://127.0.0.1:{server.server_port}"  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def write_kubeconfig(path, server: str, user: dict) -> str:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return str(path)


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


def test_every_request_kind_works_without_the_generated_classes(tmp_path):
    """The daemon's adapter (LIST+WATCH, every write, events created and patched), the
    commands' client (node, access review, node list) and the extender's requests (patch,
    binding, node watch) all work through the installed client in a fresh process that
    never loads a generated API class or model (~25 MiB, and bodies checked against
    models: see the module)."""
    out = run_python(EVERY_REQUEST, str(tmp_path / "kubeconfig"), *LEFT_OUT)
    assert json.loads(out.splitlines()[-1]) == []


def test_the_client_is_the_whole_package_imported_as_published(tmp_path):
    """Once kubeclient made a client, the process holds the kubernetes package as its own
    __init__ makes it (every subpackage, the real ApiClient and config loaders), so any
    other user of the client in the process gets what the library documents."""
    code = """
    import sys
    from nodemgr.kubernetes import client
    with client.CommandClient(client.find_credentials(sys.argv[1], environ={}), 1.0):
        pass
    import kubernetes
    from kubernetes.client.api_client import ApiClient
    from kubernetes.config import kube_config
    assert kubernetes.__dict__.get("__project__") == "kubernetes", "kubernetes/__init__ not run"
    assert kubernetes.__version__ == sys.argv[2], kubernetes.__version__
    assert kubernetes.client.ApiClient is ApiClient and kube_config.ApiClient is ApiClient
    for name in ("config", "dynamic", "watch", "stream", "utils", "leaderelection", "informer"):
        assert f"kubernetes.{name}" in sys.modules, name
    assert isinstance(kube_config.new_client_from_config(config_file=sys.argv[1]), ApiClient)
    print("ok")
    """
    from importlib.metadata import version

    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1", {"token": "t"})
    assert run_python(code, kubeconfig, version("kubernetes")).strip() == "ok"


def test_importing_the_kubernetes_edge_loads_no_part_of_the_client():
    """The modules of nodemgr.kubernetes import the kubernetes package only when a client
    is built, credentials are loaded or a quantity parsed: importing them (as the
    extender's cache and the daemon's wiring do) loads none of it."""
    code = """
    import sys
    import nodemgr.kubernetes.adapter, nodemgr.kubernetes.client, nodemgr.kubernetes.dra
    import nodemgr.kubernetes.kubeclient, nodemgr.kubernetes.listwatch
    import nodemgr.kubernetes.podwatch, nodemgr.kubernetes.scheduling
    print(sorted(m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")))
    """
    assert run_python(code).strip() == "[]"


def test_the_dependency_admits_every_release_from_37_on():
    """pyproject.toml asks for the kubernetes client from 37 (the first with the request
    methods used) and caps no newer release; the installed one is admitted."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    with open(f"{REPO}/pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    [requirement] = [Requirement(d) for d in dependencies if Requirement(d).name == "kubernetes"]
    specifier = requirement.specifier
    assert not specifier.contains("36.0.3")
    for release in ("37.0.0", version("kubernetes"), "38.0.0", "41.2.0"):
        assert specifier.contains(release), (release, str(specifier))


def test_bodies_go_out_as_given(recorder):
    """A body is sent as the JSON of what the caller gave: a field no model of this client
    knows and a time in the server's own format reach the API server unchanged (the
    generated classes would refuse the first and rewrite the second)."""
    configuration = new_configuration()
    configuration.host = recorder.url
    client = KubeClient(configuration)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ml", "resourceVersion": "7"},
        "status": {
            "allocation": {"devices": {"results": []}},
            "aFieldFromANewerServer": {"x": 1},
            "devices": [
                {
                    "driver": "gpushare.aliyun.com",
                    "pool": "node-a",
                    "device": "gpu-0",
                    "conditions": [
                        {"type": "Ready", "status": "True",
                         "lastTransitionTime": "2026-01-02T03:04:05Z"}
                    ],
                }
            ],
        },
    }  # fmt: skip
    ResourceV1(client).replace_namespaced_resource_claim_status(
        "c", "ml", claim, _preload_content=False
    ).release_conn()
    event = {"metadata": {"name": "e"}, "eventTime": "2026-01-02T03:04:05.123456Z"}
    CoreV1(client).create_namespaced_event("ml", event, _preload_content=False).release_conn()
    client.close()
    [(put, put_path, put_type, put_body), (post, post_path, post_type, post_body)] = (
        recorder.requests
    )
    assert (put, put_path, put_type) == (
        "PUT",
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c/status",
        "application/json",
    )
    assert json.loads(put_body) == claim
    assert (post, post_path, post_type) == ("POST", "/api/v1/namespaces/ml/events", JSON)
    assert json.loads(post_body) == event


def test_names_are_quoted_as_one_path_segment(recorder):
    """A name or namespace with characters a URL path gives meaning to ("/", "?", "%",
    "..") reaches the server as one quoted segment, never as another path."""
    configuration = new_configuration()
    configuration.host = recorder.url
    client = KubeClient(configuration)
    core = CoreV1(client)
    core.read_node("a/../b?c=%", _preload_content=False).release_conn()
    core.patch_namespaced_pod("p", "../x", {}, _preload_content=False).release_conn()
    client.close()
    assert [path for _, path, _, _ in recorder.requests] == [
        "/api/v1/nodes/a%2F..%2Fb%3Fc%3D%25",
        "/api/v1/namespaces/..%2Fx/pods/p",
    ]


def test_a_refused_token_is_asked_for_again_at_the_next_request(api):
    """A token renewed between two requests (what exec plugins and the in-cluster loader do
    through refresh_api_key_hook) is the one the next request sends once the API server
    refused the old one: the first request with a wrong one is refused (401), the next
    one, within the same second, asks the hook again and is answered."""
    configuration = new_configuration()
    configuration.host = api.url
    configuration.api_key = {"BearerToken": "wrong"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    client = KubeClient(configuration)
    core = CoreV1(client)
    with pytest.raises(api_exception()) as refused:
        core.read_node(NODE)
    assert refused.value.status == 401
    configuration.refresh_api_key_hook = lambda c: c.api_key.update(BearerToken=api.token)
    response = core.read_node(NODE)
    assert json.loads(response.data)["metadata"]["name"] == NODE
    client.close()


def test_the_credentials_hook_is_asked_at_most_once_a_second(api):
    """The refresh hook (the kubeconfig loader's sets the whole configuration again at each
    call: tens of microseconds a request) is asked at the first request and then once per
    CREDENTIALS_SECONDS, not at every request: ten requests within one second ask it once;
    the first one after that asks again and sends what it renewed."""
    clock = Clock()
    calls = []

    def hook(c):
        calls.append(clock())
        c.api_key["BearerToken"] = api.token if len(calls) == 1 else "renewed"

    configuration = new_configuration()
    configuration.host = api.url
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
    with pytest.raises(api_exception()) as refused:  # the renewed token is sent at once
        core.read_node(NODE)
    assert refused.value.status == 401 and len(calls) == 2
    client.close()


def test_a_configuration_without_a_token_sends_none(recorder):
    """Client certificates only (no BearerToken in the Configuration): no Authorization
    header is sent."""
    configuration = new_configuration()
    configuration.host = recorder.url
    client = KubeClient(configuration)
    CoreV1(client).read_node(NODE).release_conn()
    assert client.credentials() is None
    assert recorder.headers and all("authorization" not in h for h in recorder.headers)
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
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(plugin)],
        }
    }
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url, user)
    with CommandClient(find_credentials(kubeconfig, environ={}), 2.0) as command:
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
