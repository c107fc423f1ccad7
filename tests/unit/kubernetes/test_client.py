"""Pins nodemgr.kubernetes.client, the adapter's one edge with the kubernetes client: where
credentials come from (and one error naming everything tried), ApiClients that leave the
client's global configuration alone, the mapping of every client failure to a KubeApiError
class (a Status inside a watch stream too), ApiSession's connected state and its log lines
(a loss and a recovery once each, an RBAC refusal once per message), and CommandClient's
requests for ``nodemgr doctor`` and ``nodemgr status --cluster`` against the test API
server."""

import logging

import pytest
import urllib3
from kubernetes.client import Configuration
from kubernetes.client.exceptions import ApiException

from nodemgr.errors import (
    KubeApiError,
    KubeConflict,
    KubeCredentialsError,
    KubeExpired,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
)
from nodemgr.kubernetes import client as client_module
from nodemgr.kubernetes.client import (
    CREDENTIALS_FIX,
    ApiSession,
    CommandClient,
    credentials_problem,
    find_credentials,
    map_error,
    new_api_client,
    rfc3339,
    status_error,
)
from tests.unit.kubernetes.support import NODE, FakeClock


def test_rfc3339():
    """The API timestamp: UTC, whole seconds, a Z."""
    assert rfc3339(1704164645.7) == "2024-01-02T03:04:05Z"


# --- credentials ---------------------------------------------------------------


KUBECONFIG_TEXT = """\
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "http://127.0.0.1:1"}
users:
- name: u
  user: {token: secret-token}
contexts:
- name: ctx
  context: {cluster: c, user: u}
current-context: ctx
"""


@pytest.fixture
def kubeconfig(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG_TEXT)
    return str(path)


def test_credentials_named_file(kubeconfig, tmp_path):
    """kubernetes.kubeconfig set and present: used, and said to come from that key."""
    creds = find_credentials(kubeconfig, environ={}, home=str(tmp_path))
    assert (creds.kind, creds.path, creds.source) == (
        "kubeconfig",
        kubeconfig,
        "kubernetes.kubeconfig",
    )


def test_credentials_named_file_missing_has_no_fallback(kubeconfig, tmp_path):
    """A named kubeconfig that is missing is an error, never a silent fallback to $KUBECONFIG."""
    with pytest.raises(KubeCredentialsError) as caught:
        find_credentials(
            str(tmp_path / "nope"), environ={"KUBECONFIG": kubeconfig}, home=str(tmp_path)
        )
    assert "kubernetes.kubeconfig" in str(caught.value) and "no such file" in str(caught.value)


def test_credentials_from_env_list(kubeconfig, tmp_path):
    """$KUBECONFIG may list several files, the missing ones ignored (as kubectl)."""
    value = f"{tmp_path}/missing:{kubeconfig}"
    creds = find_credentials("", environ={"KUBECONFIG": value}, home=str(tmp_path))
    assert (creds.kind, creds.path, creds.source) == ("kubeconfig", value, "$KUBECONFIG")


def test_credentials_in_cluster_then_home(kubeconfig, tmp_path):
    """Without a usable $KUBECONFIG: the in-cluster service account, else ~/.kube/config."""
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    environ = {"KUBECONFIG": str(tmp_path / "missing"), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    creds = find_credentials("", environ, home=str(tmp_path), service_account_dir=str(sa))
    assert (creds.kind, creds.path) == ("in-cluster", str(sa))

    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(KUBECONFIG_TEXT)
    creds = find_credentials("", {}, home=str(home), service_account_dir=str(sa))
    assert (creds.source, creds.path) == ("~/.kube/config", str(home / ".kube" / "config"))


def test_no_credentials_names_everything_tried(tmp_path):
    """No credentials anywhere: one error naming every place tried and the fix."""
    with pytest.raises(KubeCredentialsError) as caught:
        find_credentials(
            "",
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
            home=str(tmp_path),
            service_account_dir=str(tmp_path / "sa"),
        )
    text = str(caught.value)
    for part in (
        "kubernetes.kubeconfig: not set",
        "$KUBECONFIG: not set",
        f"{tmp_path}/sa/token: no such file",
        f"{tmp_path}/.kube/config: no such file",
        "set kubernetes.kubeconfig",
        "kubernetes.enabled: false",
    ):
        assert part in text


def test_api_client_is_private(kubeconfig, tmp_path):
    """The ApiClient has its own Configuration (host, token, no urllib3 retries); the
    client's global default is left alone."""
    before = Configuration.get_default_copy().host
    creds = find_credentials(kubeconfig, environ={}, home=str(tmp_path))
    client = new_api_client(creds)
    assert client.configuration.host == "http://127.0.0.1:1"
    assert client.configuration.api_key["BearerToken"].endswith("secret-token")
    assert client.configuration.retries is False
    assert Configuration.get_default_copy().host == before  # the global default untouched
    client.close()


def test_in_cluster_api_client(tmp_path):
    """In-cluster: the service host and port, the token and CA of the service account."""
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    creds = find_credentials("", environ, home=str(tmp_path), service_account_dir=str(sa))
    client = new_api_client(creds, environ)
    assert client.configuration.host == "https://10.96.0.1:443"
    assert client.configuration.api_key["BearerToken"] == "bearer sa-token"
    assert client.configuration.ssl_ca_cert == str(sa / "ca.crt")
    client.close()


def test_unusable_kubeconfig(tmp_path):
    """A kubeconfig without a usable context: KubeCredentialsError naming the file, chained."""
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    creds = find_credentials(str(path), environ={}, home=str(tmp_path))
    with pytest.raises(KubeCredentialsError) as caught:
        new_api_client(creds)
    assert str(path) in str(caught.value)
    assert caught.value.__cause__ is not None


# --- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (401, KubeForbidden),
        (403, KubeForbidden),
        (404, KubeNotFound),
        (409, KubeConflict),
        (410, KubeExpired),
        (429, KubeUnavailable),
        (500, KubeUnavailable),
        (503, KubeUnavailable),
        (0, KubeUnavailable),
        (422, KubeApiError),
    ],
)
def test_map_api_exception(status, cls):
    """Each HTTP status maps to its KubeApiError class, naming the verb and resource."""
    error = map_error(ApiException(status=status, reason="R"), "patch", "pods/ml/train-0")
    assert type(error) is cls
    assert "patch pods/ml/train-0" in str(error)


def test_forbidden_names_verb_resource_and_deploy():
    """A 403 names the verb and RBAC resource, points at deploy/ and quotes the server."""
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = '{"kind":"Status","message":"nodes \\"n\\" is forbidden: cannot patch"}'
    error = map_error(exc, "patch", "nodes/status/node-a")
    assert "may not patch nodes/status" in str(error)
    assert "deploy/" in str(error)
    assert 'nodes "n" is forbidden' in str(error)  # the server's own message


@pytest.mark.parametrize(
    "exc",
    [
        urllib3.exceptions.NewConnectionError(None, "Connection refused"),
        urllib3.exceptions.ReadTimeoutError(None, "/api", "read timed out"),
        urllib3.exceptions.ProtocolError("connection broken"),
        ConnectionResetError(104, "reset"),
    ],
)
def test_transport_errors_are_unavailable(exc):
    """Connection refused, read timeouts, broken connections: KubeUnavailable (retry)."""
    assert type(map_error(exc, "list", "pods")) is KubeUnavailable


def test_a_status_in_a_watch_stream_maps_like_an_http_answer():
    """An ERROR event's Status object maps as its code would over HTTP, quoting its message."""
    expired = status_error(
        {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"},
        "watch",
        "pods",
    )
    assert type(expired) is KubeExpired and expired.status == 410
    assert "watch pods" in str(expired) and "too old resource version" in str(expired)
    assert type(status_error({"message": "no code"}, "watch", "pods")) is KubeUnavailable


def test_credentials_problem_strips_only_the_daemons_fix():
    """The message without CREDENTIALS_FIX (for doctor and status --cluster, which say
    their own fix); a message without it is left as it is."""
    message = f"kubernetes.kubeconfig /etc/k: no such file; create it or {CREDENTIALS_FIX}"
    assert credentials_problem(message) == "kubernetes.kubeconfig /etc/k: no such file"
    assert credentials_problem("something else") == "something else"


# --- ApiSession -------------------------------------------------------------------------


@pytest.fixture
def session(api, tmp_path):
    creds = find_credentials(api.write_kubeconfig(tmp_path / "kubeconfig"), environ={})
    reconnects = []
    session = ApiSession(
        new_api_client(creds), 1.0, FakeClock(5000.0), lambda: reconnects.append(1)
    )
    session.reconnects = reconnects
    yield session
    session.close()


def test_a_call_returns_decoded_json_and_marks_connected(api, session):
    """A request that is answered: its JSON as dicts (not client models), connected, and
    the reconnect callback runs once (the writer's backoffs end)."""
    node = session.call("get", f"nodes/{NODE}", session.core.read_node, NODE)
    assert node["metadata"]["name"] == NODE and isinstance(node, dict)
    session.call("get", f"nodes/{NODE}", session.core.read_node, NODE)
    assert session.connected is True
    assert session.reconnects == [1]
    assert session.host == api.url


def test_a_refused_connection_is_a_loss_logged_once(api, session, caplog):
    """The API server going away: KubeUnavailable, connected False, last error kept with
    the session's clock; one warning for the loss, one info line for the recovery."""
    session.call("get", f"nodes/{NODE}", session.core.read_node, NODE)
    api.stop()
    with caplog.at_level(logging.INFO, logger=client_module.log.name):
        for _ in range(3):
            with pytest.raises(KubeUnavailable):
                session.call("get", f"nodes/{NODE}", session.core.read_node, NODE)
        assert session.connected is False
        assert "no answer from the API server" in session.last_error
        assert session.last_error_at == 5000.0
        api.start()
        session.call("get", f"nodes/{NODE}", session.core.read_node, NODE)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unavailable, retrying with backoff" in m for m in messages) == 1
    assert sum("answers again" in m for m in messages) == 1
    assert session.connected and session.reconnects == [1, 1]


def test_routine_answers_are_no_error_to_report(api, session):
    """404 and 410 are answers (connected stays True) and do not become last_error."""
    with pytest.raises(KubeNotFound):
        session.call("get", "nodes/gone", session.core.read_node, "gone")
    assert session.connected is True
    assert session.last_error is None


def test_an_rbac_refusal_is_logged_once_per_message(api, session, caplog):
    """A 403 is an answer (still connected), logged at ERROR once however often it comes."""
    api.fail_next("GET", f"/nodes/{NODE}$", 403, count=3)
    with caplog.at_level(logging.ERROR, logger=client_module.log.name):
        for _ in range(3):
            with pytest.raises(KubeForbidden):
                session.call("get", f"nodes/{NODE}", session.core.read_node, NODE)
    assert session.connected is True
    [record] = caplog.records
    assert "may not get nodes" in record.getMessage()


# --- CommandClient ------------------------------------------------------------------------


@pytest.fixture
def command_client(api, tmp_path):
    creds = find_credentials(api.write_kubeconfig(tmp_path / "kubeconfig"), environ={})
    with CommandClient(creds, timeout_seconds=2.0) as command:
        yield command


def test_command_client_reads_a_node(api, command_client):
    """read_node returns the Node as JSON; a missing one is KubeNotFound."""
    assert command_client.server == api.url
    assert command_client.read_node(NODE)["metadata"]["labels"]["team"] == "vision"
    with pytest.raises(KubeNotFound):
        command_client.read_node("node-z")


def test_command_client_lists_nodes_with_their_address_and_annotations(api, command_client):
    """list_nodes: every node with its InternalIP and annotations."""
    api.add_node("node-b", annotations={"x": "1"}, address="10.0.0.2")
    nodes = {n.name: n for n in command_client.list_nodes()}
    assert set(nodes) == {NODE, "node-b"}
    assert nodes["node-b"].internal_ip == "10.0.0.2"
    assert nodes["node-b"].annotations["x"] == "1"
    assert nodes[NODE].internal_ip == "10.0.0.11"  # the simulator's default


def test_command_client_asks_can_i_as_kubectl_does(api, command_client):
    """can_i is a SelfSubjectAccessReview: allowed or not, per resource and subresource."""
    api.rbac_allowed = {("nodes/status", "patch")}
    assert command_client.can_i("patch", "", "nodes/status")[0] is True
    assert command_client.can_i("patch", "", "nodes")[0] is False


def test_command_client_refused_credentials(api, tmp_path):
    """A wrong token: each request raises KubeForbidden (HTTP 401) naming the token."""
    path = api.write_kubeconfig(tmp_path / "kubeconfig")
    text = open(path).read().replace(api.token, "wrong-token")
    with open(path, "w") as f:
        f.write(text)
    with CommandClient(find_credentials(path, environ={}), timeout_seconds=2.0) as command:
        with pytest.raises(KubeForbidden, match="HTTP 401"):
            command.read_node(NODE)
