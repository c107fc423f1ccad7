"""kube-scheduler's side of the extender's mutual TLS, from exactly what it is given.

``render`` is deploy/render.py itself (loaded from its file, as an admin runs it).
``TlsMaterial`` makes the extender's CA, server and client certificates with its
``tls`` command and renders the KubeSchedulerConfiguration kube-scheduler reads
(``gpushare-scheduler-config``, its files by path or embedded). ``client_from_config``
builds the client kube-scheduler builds from that configuration's extender
``tlsConfig`` (k8s.io/kube-scheduler/config/v1 ExtenderTLSConfig, handed to client-go's
TLS transport): ``caData`` over ``caFile`` (else the system roots), ``certData``/
``keyData`` over ``certFile``/``keyFile``, ``serverName`` (else the URL's host) for SNI
and the certificate check, ``insecure`` to skip it; TLS 1.2 or later. The test client
uses those fields and nothing else.

``https_request`` sends one request over such a context, as kube-scheduler's HTTP client
does (a fresh connection per call here). ``other_certificate`` makes certificates the
extender must refuse: from another CA, expired, or for a server.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import os
import shutil
import socket
import ssl
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from standins.paths import REPO


def _load_render():
    spec = importlib.util.spec_from_file_location(
        "gpushare_deploy_render", os.path.join(REPO, "deploy", "render.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


@dataclass
class ClientTls:
    """What kube-scheduler's extender client is: a context and the name it checks."""

    context: ssl.SSLContext
    server_name: str | None  # SNI and the certificate check; None: the URL's host
    url: str


def client_from_config(config: dict, workdir: str) -> ClientTls:
    """The client of the configuration's first extender, from its tlsConfig fields."""
    (extender,) = config["extenders"]
    assert extender.get("enableHTTPS") is True, extender
    tls = extender.get("tlsConfig") or {}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.get("insecure"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if tls.get("caData"):
        context.load_verify_locations(cadata=base64.b64decode(tls["caData"]).decode("ascii"))
    elif tls.get("caFile"):
        context.load_verify_locations(cafile=tls["caFile"])
    else:
        context.load_default_certs()
    cert, key = tls.get("certFile"), tls.get("keyFile")
    if tls.get("certData") or tls.get("keyData"):
        # client-go takes the bytes; Python's ssl reads a file: written as given, 0600.
        cert = _private_file(workdir, "cert-data.pem", base64.b64decode(tls["certData"]))
        key = _private_file(workdir, "key-data.pem", base64.b64decode(tls["keyData"]))
    if cert or key:
        context.load_cert_chain(cert, key)
    return ClientTls(context, tls.get("serverName") or None, extender["urlPrefix"])


def _private_file(directory: str, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


class TlsMaterial:
    """render.py tls in ``directory`` (made when None) and the scheduler configuration."""

    def __init__(self, directory: str | None = None, **tls_options: Any):
        self.dir = directory or tempfile.mkdtemp(prefix="gpushare-tls-", dir="/tmp")
        if not os.path.exists(os.path.join(self.dir, "tls.crt")):
            render.make_tls(self.dir, **tls_options)

    def scheduler_config(self, url: str, embed: bool = False) -> dict:
        """The KubeSchedulerConfiguration as render.py writes it for kube-scheduler."""
        values = {"extender_url": url}
        if embed:
            for name, file in (
                ("client_cert_pem", "client.crt"),
                ("client_key_pem", "client.key"),
                ("client_ca_pem", "ca.crt"),
            ):
                values[name] = Path(self.dir, file).read_text()
        else:
            values["client_tls_dir"] = self.dir
        return yaml.safe_load(render.render("gpushare-scheduler-config", values))

    def client(self, url: str, embed: bool = False) -> ClientTls:
        return client_from_config(self.scheduler_config(url, embed), self.dir)


def https_request(
    client: ClientTls,
    method: str,
    path: str,
    body: bytes | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    """One request to the client's URL host and port (the path replaces the URL's)."""
    parts = urlsplit(client.url)
    raw = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    try:
        sock = client.context.wrap_socket(raw, server_hostname=client.server_name or parts.hostname)
    except BaseException:
        raw.close()
        raise
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    connection.sock = sock
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def post_json(client: ClientTls, path: str, document: Any) -> tuple[int, Any]:
    data = document if isinstance(document, bytes) else json.dumps(document).encode()
    status, body = https_request(client, "POST", path, data)
    return status, json.loads(body or b"null") if body.startswith((b"{", b"[")) else body


def other_certificate(
    directory: str,
    name: str,
    *,
    ca_dir: str | None = None,
    expired: bool = False,
    server: bool = False,
) -> tuple[str, str]:
    """A client (or ``server``) certificate and key in ``directory``/``name``.*, signed by
    the CA of ``ca_dir`` (None: a CA of its own, which the extender does not trust);
    ``expired``: valid from 40 days ago to 39 days ago."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if ca_dir is None:
        ca_dir = os.path.join(directory, f"{name}-ca")
        render.make_tls(ca_dir)
    ca_key = serialization.load_pem_private_key(Path(ca_dir, "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(Path(ca_dir, "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    start = datetime.now(UTC) - timedelta(days=40 if expired else 0, minutes=5)
    end = start + timedelta(days=1 if expired else 30)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-scheduler")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    cert_path = os.path.join(directory, f"{name}.crt")
    key_path = os.path.join(directory, f"{name}.key")
    Path(cert_path).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _private_file(
        directory,
        f"{name}.key",
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return cert_path, key_path


def client_with(material: TlsMaterial, url: str, cert: str | None, key: str | None) -> ClientTls:
    """kube-scheduler's client, but presenting ``cert`` (None: no certificate at all)."""
    good = material.client(url)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=os.path.join(material.dir, "ca.crt"))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return ClientTls(context, good.server_name, url)


def secret_volume(directory: str, source: str) -> None:
    """``source``'s files as kubelet puts a Secret in a volume: ``name -> ..data/name``,
    ``..data`` -> a timestamped directory; called again, the link is swapped atomically
    (what an updated Secret does to a running pod)."""
    os.makedirs(directory, exist_ok=True)
    stamp = f"..{time.time_ns()}"
    shutil.copytree(source, os.path.join(directory, stamp))
    link = os.path.join(directory, "..data_tmp")
    os.symlink(stamp, link)
    os.replace(link, os.path.join(directory, "..data"))
    for name in os.listdir(source):
        path = os.path.join(directory, name)
        if not os.path.islink(path):
            os.symlink(os.path.join("..data", name), path)
