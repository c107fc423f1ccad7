"""nodemgr.extender.tls and the TLS listener: only kube-scheduler's client gets an answer.

A real TLS handshake, with the client kube-scheduler builds from exactly the
``tlsConfig`` deploy/render.py writes into its KubeSchedulerConfiguration (the files by
path, or embedded as certData/keyData/caData), against the server in this process. Pins:
that client gets its answers; a client with no certificate, one from another CA, an
expired one, a server certificate presented as a client's, and plain HTTP get none (the
connection is closed, nothing is bound); ``--tls-client-name`` narrows it to a name;
rotated files (a Secret volume's atomic ``..data`` swap) are used from the next
connection without a restart, the old CA's clients refused from then on, and files that
do not load leave the last good ones in place.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl

import pytest

from nodemgr.extender.tls import TlsError, TlsFiles, peer_names, server_context
from standins.extender_tls import (
    TlsMaterial,
    client_with,
    https_request,
    other_certificate,
    secret_volume,
)
from tests.unit.extender.support import MEMORY, annotation, cache_with, node, pod
from tests.unit.extender.test_server import Served

JOB = pod("job", ("main", {MEMORY: 6}), uid="u-job")
BIND = json.dumps(
    {"PodName": "job", "PodNamespace": "default", "PodUID": "u-job", "Node": "b"}
).encode()


@pytest.fixture
def served():
    s = Served(cache_with([node("b", annotation((0, 0)))], [JOB]))
    yield s
    s.close()


def refused(client, method="POST", path="/gpushare-scheduler/bind", body=BIND) -> str:
    """How the request failed (it must not get an HTTP answer)."""
    try:
        status, answer = https_request(client, method, path, body, timeout=10)
    except (ssl.SSLError, ConnectionError, OSError) as e:
        return type(e).__name__
    raise AssertionError(f"answered {status}: {answer[:200]!r}")


@pytest.mark.parametrize("embed", [False, True], ids=["files", "embedded"])
def test_the_rendered_scheduler_configuration_gets_its_answers(served, embed):
    """kube-scheduler's tlsConfig as rendered (verify the server by serverName against the
    extender's CA, present the client certificate): filter and bind answer."""
    client = served.tls.client(served.url + "/gpushare-scheduler", embed=embed)
    tls_config = served.tls.scheduler_config(served.url, embed)["extenders"][0]["tlsConfig"]
    assert tls_config["insecure"] is False
    assert tls_config["serverName"] == "gpushare-scheduler.kube-system.svc"
    assert ("certData" in tls_config) == embed and ("certFile" in tls_config) != embed
    filtered = {"Pod": JOB, "NodeNames": ["b"]}
    status, body = https_request(
        client, "POST", "/gpushare-scheduler/filter", json.dumps(filtered).encode()
    )
    assert status == 200 and json.loads(body)["NodeNames"] == ["b"]
    status, body = https_request(client, "POST", "/gpushare-scheduler/bind", BIND)
    assert (status, json.loads(body)) == (200, {"Error": ""})


def test_every_other_client_is_refused_and_binds_nothing(served, tmp_path):
    """No certificate, another CA's, an expired one, the server's own kind of certificate
    (serverAuth), plain HTTP: no answer, and the bind of the victim's pod never happens."""
    served.post("filter", {"Pod": JOB, "NodeNames": ["b"]})
    url = served.url + "/gpushare-scheduler"
    material = served.tls
    clients = {
        "no certificate": client_with(material, url, None, None),
        "another CA": client_with(material, url, *other_certificate(str(tmp_path), "rogue")),
        "expired": client_with(
            material,
            url,
            *other_certificate(str(tmp_path), "old", ca_dir=material.dir, expired=True),
        ),
        "a server certificate": client_with(
            material,
            url,
            *other_certificate(str(tmp_path), "srv", ca_dir=material.dir, server=True),
        ),
    }
    for why, client in clients.items():
        assert refused(client), why
    port = served.server.address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(b"POST /gpushare-scheduler/bind HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
                      % len(BIND) + BIND)  # fmt: skip
        assert plain.recv(100) == b""  # closed: plain HTTP gets nothing back
    assert served.binder.calls == []
    counts = served.server.serving.call(lambda: dict(served.server.stats.counts))
    assert counts[("https", "handshake_failed")] >= 5


def test_an_insecure_client_still_needs_a_certificate(served):
    """tlsConfig insecure: true skips the client's check of the server, not the server's
    check of the client."""
    config = served.tls.scheduler_config(served.url + "/gpushare-scheduler")
    del config["extenders"][0]["tlsConfig"]["certFile"]
    del config["extenders"][0]["tlsConfig"]["keyFile"]
    config["extenders"][0]["tlsConfig"]["insecure"] = True
    from standins.extender_tls import client_from_config

    assert refused(client_from_config(config, served.tls.dir))


def test_client_names_narrow_the_accepted_certificates(tmp_path):
    """With --tls-client-name kube-scheduler, a certificate of the right CA naming another
    client is refused after the handshake; one naming kube-scheduler is answered."""
    other = TlsMaterial(str(tmp_path / "other"), client_name="other-client")
    cache = cache_with([node("b", annotation((0, 0)))], [JOB])
    served = Served(
        cache, tls_files=TlsFiles.in_directory(other.dir), client_names=("kube-scheduler",)
    )
    try:
        url = served.url + "/gpushare-scheduler"
        assert refused(other.client(url), "GET", "/healthz", None)
        named = other_certificate(str(tmp_path), "named", ca_dir=other.dir)  # CN kube-scheduler
        assert https_request(client_with(other, url, *named), "GET", "/healthz")[0] == 200
    finally:
        served.close()
    assert peer_names(
        {"subject": ((("commonName", "a"),),), "subjectAltName": (("DNS", "b"), ("IP", "c"))}
    ) == {"a", "b"}


def test_rotated_files_are_used_without_a_restart(tmp_path):
    """A new CA and certificates swapped into the Secret volume: the next connection uses
    them (the old CA's client refused, the new one's answered), the server never stops;
    files that do not load (a key of another certificate) keep the last good ones."""
    old = TlsMaterial(str(tmp_path / "old"))
    new = TlsMaterial(str(tmp_path / "new"))
    volume = str(tmp_path / "volume")
    secret_volume(volume, old.dir)
    cache = cache_with([node("b", annotation((0, 0)))], [JOB])
    served = Served(cache, tls_files=TlsFiles.in_directory(volume), tls_check_seconds=0.0)
    try:
        url = served.url + "/gpushare-scheduler"
        healthz = ("GET", "/gpushare-scheduler/healthz")
        assert https_request(old.client(url), *healthz)[0] == 200
        secret_volume(volume, new.dir)
        assert https_request(new.client(url), *healthz)[0] == 200
        assert refused(old.client(url), *healthz, None)
        assert served.server_tls.reloads == 1
        broken = str(tmp_path / "broken")
        shutil.copytree(new.dir, broken)
        shutil.copy(os.path.join(old.dir, "tls.key"), os.path.join(broken, "tls.key"))
        secret_volume(volume, broken)
        assert https_request(new.client(url), *healthz)[0] == 200  # still the good ones
        assert served.server_tls.reloads == 1
    finally:
        served.close()


def test_files_that_do_not_make_a_server_context_say_why(tmp_path):
    material = TlsMaterial(str(tmp_path / "tls"))
    files = TlsFiles.in_directory(material.dir)
    assert isinstance(server_context(files), ssl.SSLContext)
    with pytest.raises(TlsError, match="do not load"):
        server_context(
            TlsFiles(files.cert, os.path.join(material.dir, "client.key"), files.client_ca)
        )
    with pytest.raises(TlsError, match="the client CA .* does not load"):
        server_context(TlsFiles(files.cert, files.key, str(tmp_path / "absent.crt")))
    empty = tmp_path / "empty.crt"
    empty.write_text("")
    with pytest.raises(TlsError, match="does not load"):
        server_context(TlsFiles(files.cert, files.key, str(empty)))
