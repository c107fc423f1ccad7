"""``kubectl inspect gpushare`` (nodemgr.cli.inspect, the executable kubectl-inspect-gpushare).

Against the test API server with the nodes of tests/unit/cli/test_cluster_status.py.
Pins: the same renderer as ``nodemgr status --cluster`` (with --no-share the output is
byte for byte the same), plus the allocated share per card (summary and -d); real
kubectl finds the plugin on $PATH and passes -d and $KUBECONFIG on; no credentials
exit 1 with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from nodemgr.cli import inspect
from standins.apiserver_sim import TestApiServer
from tests.unit.cli.test_cluster_status import DETAILS, KEY, NODE_A, NODE_B, SUMMARY

_HEADER = (
    "NAME    IPADDRESS     GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(GiB)  "
    "GPU0(Core)  GPU1(Core)"
)
SUMMARY_WITH_SHARE = "\n".join(
    [
        _HEADER,
        "node-a  192.168.0.71  6/15                   1/15                   7/30             "
        "50%         10%",
        "node-b  192.168.0.72  12/40                  40/40                  52/80            "
        "0%          100%",
        "-" * len(_HEADER),
        "Allocated/Total GPU Memory In Cluster:",
        "59/110 (53%)",
        "Allocated/Total GPU Core In Cluster:",
        "160/400% (40%)",
        *SUMMARY.splitlines()[-3:],
    ]
)


@pytest.fixture
def api():
    server = TestApiServer()
    server.start()
    server.add_node("node-a", annotations={KEY: NODE_A}, address="192.168.0.71")
    server.add_node("node-b", annotations={KEY: NODE_B}, address="192.168.0.72")
    server.add_node("node-c", address="192.168.0.73")
    yield server
    server.stop()


def test_summary_with_the_share_and_without(api, tmp_path, capsys):
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    assert inspect.main(["--kubeconfig", kubeconfig]) == 0
    assert capsys.readouterr().out == SUMMARY_WITH_SHARE + "\n"
    assert inspect.main(["--kubeconfig", kubeconfig, "--no-share"]) == 0
    assert capsys.readouterr().out == SUMMARY + "\n"  # nodemgr status --cluster's, exactly
    assert inspect.main(["--kubeconfig", kubeconfig, "-d", "--no-share"]) == 0
    assert capsys.readouterr().out == DETAILS + "\n"


def test_details_with_the_share(api, tmp_path, capsys):
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    assert inspect.main(["--kubeconfig", kubeconfig, "-d"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["train-1"] == ["train-1", "default", "4", "0", "30%", "0%"]
    assert rows["infer-2"] == ["infer-2", "ml", "2", "1", "20%", "10%"]
    assert rows["big"] == ["big", "ml", "0", "40", "0%", "100%"]
    assert "Allocated Core :  60/200% (30%)" in out


def test_through_real_kubectl(api, tmp_path):
    # $GPUSHARE_KUBECTL: a kubectl that is not the first in $PATH (Debian's kubernetes-client
    # next to another one, e.g. unpacked with apt-get download + dpkg-deb -x).
    kubectl = os.environ.get("GPUSHARE_KUBECTL") or shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (apt-get install kubernetes-client)")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["KUBECONFIG"] = api.write_kubeconfig(tmp_path / "kubeconfig")
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [kubectl, "inspect", "gpushare"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, SUMMARY_WITH_SHARE + "\n", "")
    done = subprocess.run(
        [kubectl, "inspect", "gpushare", "-d", "--no-share"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, DETAILS + "\n")
    plugins = subprocess.run(
        [kubectl, "plugin", "list"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (
        os.path.join(os.path.dirname(sys.executable), "kubectl-inspect-gpushare") in plugins.stdout
    )


def test_no_credentials(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert inspect.main([]) == 1
    assert capsys.readouterr().err.startswith(
        "kubectl-inspect-gpushare: no Kubernetes credentials (tried kubernetes.kubeconfig: not set"
    )
