"""``nodemgr status --cluster`` (nodemgr/cli/cluster_status.py, reached through
``status.run``): the cluster-wide view from the nodes' gpushare annotation.

Against the test API server (standins/apiserver_sim.py: the real REST protocol, the
official client end to end), with node annotations made by what the daemon publishes
(nodemgr.kubernetes.publish.node_annotation of a status document from
nodemgr.domain.statusdoc.build_status,
so the format cannot drift): two GPU nodes (one with a multi-container pod across its
cards, one with a container not yet matched to its pod and a card given out whole) and a
node without gpushare-node. Pins the summary in the shape of ``kubectl inspect gpushare``
(GiB, InternalIP, "-" for a card a node lacks, the node without the annotation named
below), ``-d`` (pods per card, Allocated and Total per node) and ``--json`` (the
annotation's cards as published), through the real ``nodemgr`` command too; annotations
that cannot be read are named, not fatal; and the errors: no credentials, a missing
--kubeconfig, the API server down or answering 503, a rejected token, RBAC without
``nodes list`` (exit 1, each naming the fix), ``kubernetes.enabled: false`` (exit 2), -d
without --cluster.
"""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import yaml

from nodemgr.cli import cluster_status
from nodemgr.cli import status as status_cli
from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.statusdoc import build_status
from nodemgr.inventory import Card
from nodemgr.kubernetes.publish import node_annotation
from standins.apiserver_sim import TestApiServer
from standins.daemon_proc import _console_script

KEY = "gpushare.aliyun.com/gpus"
T4 = [Card(0, "GPU-a0", "Tesla T4", 15360), Card(1, "GPU-a1", "Tesla T4", 15360)]
A100 = [
    Card(0, "GPU-b0", "NVIDIA A100-SXM4-40GB", 40960),
    Card(1, "GPU-b1", "NVIDIA A100-SXM4-40GB", 40960),
]


def shared(aid, card, gib, core, owner):
    """A shared allocation of ``gib`` GiB and ``core`` core shares of one card."""
    devices = {ResourceKind.MEMORY: tuple(memory_device_id(card, j) for j in range(gib))}
    if core:
        devices[ResourceKind.CORE] = tuple(core_device_id(card, j) for j in range(core))
    return Allocation(aid, devices, gib * 1024, created_at=1.0, owner=owner)


def annotation(node, cards, allocations, unhealthy=()):
    """The gpushare annotation a node's daemon publishes for these cards and allocations."""
    status = build_status(
        node,
        cards,
        allocations,
        source="daemon",
        card_problems={uuid: "XID 79" for uuid in unhealthy},
        mps={},
        usage=None,
        containers={},
        violations={},
        enforcement=None,
        daemon=None,
    )
    return node_annotation(status)


NODE_A = annotation(
    "node-a",
    T4,
    [
        shared("a1", "GPU-a0", 4, 30, ContainerRef("default", "train-1", "main")),
        shared("a2", "GPU-a0", 2, 20, ContainerRef("ml", "infer-2", "server")),
        shared("a3", "GPU-a1", 1, 10, ContainerRef("ml", "infer-2", "sidecar")),
    ],
)
NODE_B = annotation(
    "node-b",
    A100,
    [
        shared("b1", "GPU-b0", 10, 0, ContainerRef("ml", "bert", "main")),
        shared("b2", "GPU-b0", 2, 0, None),  # kubelet has not said whose yet
        Allocation("b3", {ResourceKind.WHOLE: ("GPU-b1",)}, 0, 1.0, ContainerRef("ml", "big", "m")),
    ],
    unhealthy=("GPU-b1",),
)

SUMMARY = """\
NAME    IPADDRESS     GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(GiB)
node-a  192.168.0.71  6/15                   1/15                   7/30
node-b  192.168.0.72  12/40                  40/40                  52/80
-----------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
59/110 (53%)

Not shown: 1 node without the gpushare.aliyun.com/gpus annotation (no gpushare-node there, \
or it has not published yet): node-c
Unhealthy cards (see nodemgr status on the node): node-b GPU1"""

DETAILS = """
NAME:       node-a
IPADDRESS:  192.168.0.71

NAME         NAMESPACE  GPU0(Allocated)  GPU1(Allocated)
train-1      default    4                0
infer-2      ml         2                1
Allocated :  7 (23%)
Total :      30
--------------------------------------------------------

NAME:       node-b
IPADDRESS:  192.168.0.72

NAME             NAMESPACE  GPU0(Allocated)  GPU1(Allocated)
bert             ml         10               0
(not yet known)  -          2                0
big              ml         0                40
Allocated :      52 (65%)
Total :          80
------------------------------------------------------------

Allocated/Total GPU Memory In Cluster:  59/110 (53%)

Not shown: 1 node without the gpushare.aliyun.com/gpus annotation (no gpushare-node there, \
or it has not published yet): node-c
Unhealthy cards (see nodemgr status on the node): node-b GPU1"""


@pytest.fixture
def api():
    """The test API server with node-a and node-b (GPU nodes) and node-c (no gpushare-node)."""
    server = TestApiServer()
    server.start()
    server.add_node("node-a", annotations={KEY: NODE_A}, address="192.168.0.71")
    server.add_node("node-b", annotations={KEY: NODE_B}, address="192.168.0.72")
    server.add_node("node-c", address="192.168.0.73")  # a CPU node: no gpushare-node
    yield server
    server.stop()


def config(tmp_path, **kubernetes) -> str:
    """A config for node-a with these kubernetes settings; its path."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"node_name": "node-a", "kubernetes": kubernetes}))
    return str(path)


def args(config_path, kubeconfig=None, details=False, as_json=False, cluster=True):
    """The argparse namespace ``nodemgr status`` gets."""
    return SimpleNamespace(
        config=config_path, json=as_json, cluster=cluster, details=details, kubeconfig=kubeconfig
    )


def test_summary_in_the_shape_of_kubectl_inspect_gpushare(api, tmp_path, capsys):
    """The summary is kubectl inspect gpushare's table, from one LIST of the nodes."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    assert status_cli.run(args(config(tmp_path), kubeconfig)) == 0
    assert capsys.readouterr().out == SUMMARY + "\n"
    assert [(m, p) for m, p, _ in api.requests] == [("GET", "/api/v1/nodes")]  # one request


def test_details(api, tmp_path, capsys):
    """-d shows per node the pods' memory per card, allocated and total."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    assert status_cli.run(args(config(tmp_path), kubeconfig, details=True)) == 0
    assert capsys.readouterr().out == DETAILS + "\n"


def test_json_gives_the_cards_as_published(api, tmp_path, capsys):
    """--json gives each node's cards as its annotation published them, and the skipped nodes."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    assert status_cli.run(args(config(tmp_path), kubeconfig, as_json=True)) == 0
    view = json.loads(capsys.readouterr().out)
    assert [(n["name"], n["address"]) for n in view["nodes"]] == [
        ("node-a", "192.168.0.71"),
        ("node-b", "192.168.0.72"),
    ]
    assert view["nodes"][0]["gpus"] == json.loads(NODE_A)["gpus"]
    assert view["nodes"][1]["gpus"] == json.loads(NODE_B)["gpus"]
    assert view["nodes"][0]["gpus"][0]["allocations"] == [
        ["default", "train-1", "main", 4096, 30],
        ["ml", "infer-2", "server", 2048, 20],
    ]
    assert view["skipped"] == [{"name": "node-c", "reason": "no annotation"}]
    assert view["annotation"] == KEY


def test_credentials_come_from_the_config_and_the_label_prefix_too(api, tmp_path, capsys):
    """Without --kubeconfig the config's kubeconfig is used, and its label_prefix names the
    annotation."""
    api.add_node("node-d", annotations={"example.com/gpus": NODE_A}, address="10.1.0.4")
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    path = config(tmp_path, kubeconfig=kubeconfig, label_prefix="example.com/")
    assert status_cli.run(args(path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["node-d", "10.1.0.4", "6/15", "1/15", "7/30"]
    assert "3 nodes without the example.com/gpus annotation" in lines[-1]


def test_unreadable_annotations_are_named_not_fatal():
    """An annotation of a newer format or not JSON skips its node with the reason; no IP shows
    unknown."""
    view = cluster_status.cluster_view(
        [
            ("node-a", None, {KEY: NODE_A}),
            ("node-n", "10.0.0.9", {KEY: '{"v":2,"gpus":[]}'}),
            ("node-x", "10.0.0.8", {KEY: "{broken"}),
        ],
        KEY,
    )
    assert [n["name"] for n in view["nodes"]] == ["node-a"]
    assert view["skipped"][0]["name"] == "node-n"
    assert (
        "format v2, this nodemgr reads v1 (a newer gpushare-node wrote it"
        in (view["skipped"][0]["reason"])
    )
    assert view["skipped"][1]["reason"].startswith(f"unreadable {KEY} annotation: not JSON")
    text = cluster_status.render_cluster(view)
    assert text.splitlines()[1].split() == ["node-a", "unknown", "6/15", "1/15", "7/30"]  # no IP
    assert f"Not shown: node-x: unreadable {KEY} annotation: not JSON" in text


def test_through_the_real_command(api, tmp_path):
    """The real nodemgr command prints the summary; -d without --cluster exits 2 saying so."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    done = subprocess.run(
        [*_console_script("nodemgr"), "status", "--cluster", "--kubeconfig", kubeconfig,
         "--config", config(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    print(done.stdout, done.stderr)
    assert (done.returncode, done.stdout, done.stderr) == (0, SUMMARY + "\n", "")
    done = subprocess.run(
        [*_console_script("nodemgr"), "status", "-d", "--config", config(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "nodemgr: --details and --kubeconfig go with --cluster\n"


# --- errors ------------------------------------------------------------------------------


def test_no_credentials(tmp_path, capsys, monkeypatch):
    """Without credentials, or with a missing --kubeconfig, it exits 1 naming what was tried and
    the fix."""
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert status_cli.run(args(config(tmp_path))) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "nodemgr: no Kubernetes credentials (tried kubernetes.kubeconfig: not set; $KUBECONFIG: "
        "not set; in-cluster: $KUBERNETES_SERVICE_HOST not set; "
        f"{tmp_path}/home/.kube/config: no such file); give --kubeconfig FILE: a kubeconfig "
        "allowed to list nodes"
    )
    assert status_cli.run(args(config(tmp_path), str(tmp_path / "nowhere"))) == 1
    assert capsys.readouterr().err.startswith(
        f"nodemgr: --kubeconfig {tmp_path}/nowhere: no such file; give --kubeconfig FILE"
    )


def test_api_server_down(api, tmp_path, capsys):
    """An API server that does not answer or answers 503 exits 1 naming the server and what to
    do."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    api.stop()
    assert status_cli.run(args(config(tmp_path), kubeconfig)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        f"nodemgr: the API server {api.url} does not answer (list nodes: no answer from the API "
        "server: "
    )
    assert f"the server address in --kubeconfig ({kubeconfig})" in captured.err
    api.start()
    api.fail_next("GET", r"^/api/v1/nodes$", 503)
    assert status_cli.run(args(config(tmp_path), kubeconfig)) == 1
    assert capsys.readouterr().err == (
        f"nodemgr: the API server {api.url} is unavailable (list nodes: HTTP 503 (injected "
        "failure: HTTP 503)): try again later\n"
    )


def test_rejected_token_and_no_nodes_list(api, tmp_path, capsys):
    """A rejected token and RBAC without nodes list each exit 1 with their own explanation."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    text = (tmp_path / "admin.kubeconfig").read_text().replace(api.token, "revoked")
    (tmp_path / "admin.kubeconfig").write_text(text)
    assert status_cli.run(args(config(tmp_path), kubeconfig)) == 1
    assert "rejected the credentials from --kubeconfig" in capsys.readouterr().err

    daemons = api.write_kubeconfig(tmp_path / "kubeconfig")
    api.fail_next("GET", r"^/api/v1/nodes$", 403)  # what RBAC answers gpushare-node's own
    assert status_cli.run(args(config(tmp_path, kubeconfig=daemons))) == 1
    assert capsys.readouterr().err == (
        f"nodemgr: the credentials from kubernetes.kubeconfig ({daemons}) may not list nodes "
        f"(HTTP 403 from {api.url}): `nodemgr status --cluster` needs RBAC nodes list, which "
        "gpushare-node's own ClusterRole does not grant; run it with an admin's kubeconfig: "
        "--kubeconfig FILE\n"
    )


def test_kubernetes_disabled(api, tmp_path, capsys):
    """With kubernetes.enabled: false --cluster exits 2 without a request."""
    kubeconfig = api.write_kubeconfig(tmp_path / "admin.kubeconfig")
    assert status_cli.run(args(config(tmp_path, enabled=False), kubeconfig)) == 2
    assert capsys.readouterr().err.startswith(
        "nodemgr: --cluster needs the Kubernetes integration (kubernetes.enabled)"
    )
    assert api.requests == []
