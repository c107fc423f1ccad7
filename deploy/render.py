#!/usr/bin/env python3
"""Render the per-cluster templates in deploy/templates/ (jinja2), and make the keys.

For cluster admins; not part of the installed package. Needs Python 3.11+ and
jinja2; ``tls`` and ``placement-keys`` also the ``cryptography`` package (a
dependency of gpushare-node). One template per run, written to stdout or, with
``-o FILE``, to a new file of mode 0600 (the kubeconfig holds a credential)::

    python deploy/render.py rbac > gpushare-node-rbac.yaml
    python deploy/render.py scheduler-config --extender-url http://10.0.0.5:32766/gpushare-scheduler
    python deploy/render.py kubeconfig --server https://10.0.0.1:6443 \\
        --ca-file ca.crt --token-file token -o kubeconfig
    python deploy/render.py scheduler-rbac | kubectl apply -f -
    python deploy/render.py scheduler-deployment --image REGISTRY/gpushare-scheduler:0.1.0
    python deploy/render.py gpushare-scheduler-config --client-tls-dir /etc/kubernetes/gpushare-scheduler

gpushare-scheduler speaks only mutual TLS, and signs the placements it writes::

    python deploy/render.py tls --dir tls                 # CA, server and client certificates
    python deploy/render.py placement-keys --dir keys     # its Ed25519 key pair
    python deploy/render.py scheduler-tls-secret --dir tls | kubectl apply -f -
    python deploy/render.py scheduler-signing-secret --dir keys | kubectl apply -f -
    python deploy/render.py placement-public-key-configmap --dir keys | kubectl apply -f -

``tls`` writes ``ca.crt``/``ca.key`` (a CA for this extender only),
``tls.crt``/``tls.key`` (the extender's server certificate: serverAuth, the
Service's DNS names and 127.0.0.1) and ``client.crt``/``client.key``
(kube-scheduler's client certificate: clientAuth, CN ``kube-scheduler``);
``--ca-from DIR`` signs new ones with the CA already in DIR (rotation without a
new CA). ``placement-keys`` writes ``placement.key`` (PKCS#8, the extender's
Secret only) and ``placement.pub`` (every node's
``kubernetes.placement_public_key``). Keys are written with mode 0600; an
existing file is never overwritten.
    python deploy/render.py dra | kubectl apply -f -      # the DRA front door (docs/dra.md)

Every value except the kubeconfig's server, CA and token has a default
(``DEFAULTS``); rendering with the defaults gives valid manifests. Values are
checked before rendering and every one a template uses must be given
(``jinja2.StrictUndefined``), so a mistake fails here rather than in kubectl.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"

# Template name (the command line's first argument) -> file in TEMPLATE_DIR.
TEMPLATES: dict[str, str] = {
    "rbac": "rbac.yaml.j2",
    "scheduler-config": "scheduler-config.yaml.j2",
    "kubeconfig": "kubeconfig.yaml.j2",
    # gpushare-scheduler, this project's extender (nodemgr/extender).
    "scheduler-rbac": "scheduler-rbac.yaml.j2",
    "scheduler-deployment": "scheduler-deployment.yaml.j2",
    "gpushare-scheduler-config": "gpushare-scheduler-config.yaml.j2",
    "scheduler-tls-secret": "scheduler-tls-secret.yaml.j2",
    "scheduler-signing-secret": "scheduler-signing-secret.yaml.j2",
    "placement-public-key-configmap": "placement-public-key-configmap.yaml.j2",
    # The DRA front door: DeviceClasses, the driver's RBAC and ResourceSlice policy.
    "dra": "dra.yaml.j2",
}
# Defaults of one template only: gpushare-scheduler speaks only HTTPS, on its NodePort
# on the scheduler's own host.
TEMPLATE_DEFAULTS: dict[str, dict[str, str]] = {
    "gpushare-scheduler-config": {
        "extender_url": "https://127.0.0.1:32766/gpushare-scheduler",
    },
}
# Commands that make files instead of rendering a template.
GENERATORS = ("tls", "placement-keys")

# The defaults, and which values each template takes. The kubeconfig's server,
# CA and token differ for every cluster and have no default.
DEFAULTS: dict[str, str] = {
    "namespace": "kube-system",
    "service_account": "gpushare-node",
    # The gpushare scheduler extender's Service is a NodePort on 32766; the
    # scheduler reaches it on its own host (upstream's example config).
    "extender_url": "http://127.0.0.1:32766/gpushare-scheduler",
    # Where kube-scheduler's client certificate, key and the extender's CA are on each
    # control-plane node (tlsConfig certFile, keyFile, caFile); "" with the *_pem values
    # embeds them instead (certData, keyData, caData).
    "client_tls_dir": "/etc/kubernetes/gpushare-scheduler",
    "client_cert_pem": "",
    "client_key_pem": "",
    "client_ca_pem": "",
    # The name in the extender's certificate kube-scheduler checks (tlsConfig serverName):
    # its Service's, whatever address urlPrefix names (127.0.0.1 through the NodePort).
    "server_name": "",
    # kubeadm's kubeconfig of kube-scheduler on each control-plane node.
    "scheduler_kubeconfig": "/etc/kubernetes/scheduler.conf",
    "cluster_name": "kubernetes",
    "scheduler_account": "gpushare-scheduler",
    # The extender's NodePort (and container port): where the default extender_url points.
    "node_port": "32766",
    "container_port": "32766",
    # The plain port of kubelet's probes (GET /healthz, /metrics; nothing else).
    "health_port": "9446",
    # The node daemons' resources.memory, .core and .whole.
    "memory_resource": "aliyun.com/gpu-mem",
    "core_resource": "aliyun.com/gpu-core.percentage",
    "whole_resource": "nvidia.com/gpu",
    # The node daemons' dra.driver.
    "driver": "gpushare.aliyun.com",
}
VALUES: dict[str, tuple[str, ...]] = {
    "rbac": ("namespace", "service_account"),
    "scheduler-config": ("extender_url", "scheduler_kubeconfig"),
    "kubeconfig": ("namespace", "service_account", "cluster_name", "server", "ca_pem", "token"),
    "scheduler-rbac": ("namespace", "scheduler_account"),
    "scheduler-deployment": (
        "namespace",
        "scheduler_account",
        "image",
        "node_port",
        "container_port",
        "health_port",
        "memory_resource",
        "core_resource",
        "whole_resource",
    ),
    "dra": ("namespace", "service_account", "driver"),
    "gpushare-scheduler-config": (
        "namespace",
        "extender_url",
        "scheduler_kubeconfig",
        "memory_resource",
        "core_resource",
        "whole_resource",
        "server_name",
        "client_tls_dir",
        "client_cert_pem",
        "client_key_pem",
        "client_ca_pem",
    ),
    "scheduler-tls-secret": ("namespace", "tls_cert_pem", "tls_key_pem", "tls_ca_pem"),
    "scheduler-signing-secret": ("namespace", "placement_key_pem"),
    "placement-public-key-configmap": ("namespace", "placement_public_pem"),
}
# The files of a --dir the templates above read: value -> file name.
DIR_FILES: dict[str, str] = {
    "tls_cert_pem": "tls.crt",
    "tls_key_pem": "tls.key",
    "tls_ca_pem": "ca.crt",
    "placement_key_pem": "placement.key",
    "placement_public_pem": "placement.pub",
    "client_cert_pem": "client.crt",
    "client_key_pem": "client.key",
    "client_ca_pem": "ca.crt",
}
# An extended resource name as kubelet takes it: <DNS subdomain>/<name>.
_RESOURCE = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)

# A DRA driver name: a DNS subdomain of at most 63 characters starting with a letter
# (it is also the vendor of the CDI specs the node writes).
_DRIVER = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# A DNS-1123 label: what a namespace name must be. The service account name is
# held to the same rule (its "-token" Secret and the ClusterRole share it).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_PEM_CERT = re.compile(
    r"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----"
)
_PEM_BLOCK = re.compile(
    r"-----BEGIN ([A-Z ]+)-----\r?\n[A-Za-z0-9+/=\r\n]+-----END \1-----\r?\n?"
)
# What each PEM value must hold (its PEM labels, in order).
_PEM_LABELS: dict[str, tuple[str, ...]] = {
    "tls_cert_pem": ("CERTIFICATE",),
    "tls_ca_pem": ("CERTIFICATE",),
    "client_cert_pem": ("CERTIFICATE",),
    "client_ca_pem": ("CERTIFICATE",),
    "tls_key_pem": ("PRIVATE KEY", "EC PRIVATE KEY", "RSA PRIVATE KEY"),
    "client_key_pem": ("PRIVATE KEY", "EC PRIVATE KEY", "RSA PRIVATE KEY"),
    "placement_key_pem": ("PRIVATE KEY",),
    "placement_public_pem": ("PUBLIC KEY",),
}


class RenderError(ValueError):
    """A value that would give a broken manifest or kubeconfig."""


def render(template: str, values: Mapping[str, str] | None = None) -> str:
    """Render ``template`` (a key of ``TEMPLATES``) with ``DEFAULTS`` updated by ``values``."""
    if template not in TEMPLATES:
        raise RenderError(f"unknown template {template!r} (one of: {', '.join(TEMPLATES)})")
    given = {**DEFAULTS, **TEMPLATE_DEFAULTS.get(template, {}), **(values or {})}
    context: dict[str, object] = {}
    for name in VALUES[template]:
        if name not in given:
            raise RenderError(f"{template}: {name} is required")
        context.update(_check(name, given[name]))
    if template == "gpushare-scheduler-config":
        if not context["extender_https"]:
            raise RenderError(
                f"extender_url {given['extender_url']!r}: gpushare-scheduler speaks only HTTPS "
                "(mutual TLS)"
            )
        context.update(_client_tls(given))
    return _environment().get_template(TEMPLATES[template]).render(context)


def _client_tls(given: Mapping[str, str]) -> dict[str, object]:
    """tlsConfig: kube-scheduler's client files by path, or all three embedded."""
    embedded = [given[n] for n in ("client_cert_pem", "client_key_pem", "client_ca_pem")]
    if any(embedded) and not all(embedded):
        raise RenderError("embed all three of the client certificate, its key and the CA, or none")
    if not all(embedded) and not given["client_tls_dir"]:
        raise RenderError("client_tls_dir is required unless the client files are embedded")
    server_name = given["server_name"] or f"gpushare-scheduler.{given['namespace']}.svc"
    return {"embedded": all(embedded), "tls_server_name": server_name}


def _check(name: str, value: str) -> dict[str, object]:
    """The template variables for one value, after checking it."""
    if not isinstance(value, str):
        raise RenderError(f"{name} must be a string, not {type(value).__name__}")
    if name in _SCHEDULER_VALUES:
        return _check_scheduler_value(name, value)
    if name in _PEM_LABELS:
        return _check_pem(name, value)
    if name in ("namespace", "service_account", "scheduler_account"):
        if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
            raise RenderError(
                f"{name} {value!r} is not a DNS-1123 label "
                "(at most 63 of a-z, 0-9 and '-', starting and ending alphanumeric)"
            )
        return {name: value}
    if name in ("extender_url", "server"):
        parts = urlsplit(value)
        schemes = ("http", "https") if name == "extender_url" else ("https",)
        if parts.scheme not in schemes or not parts.hostname or parts.query or parts.fragment:
            raise RenderError(
                f"{name} {value!r} must be a {' or '.join(schemes)} URL with a host "
                "and no query or fragment"
            )
        if name == "extender_url":
            # enableHTTPS follows the URL, so the two can never disagree.
            return {name: value, "extender_https": parts.scheme == "https"}
        return {name: value}
    if name == "client_tls_dir":
        if value and (not os.path.isabs(value) or any(c.isspace() for c in value)):
            raise RenderError(f"{name} {value!r} must be an absolute path without blanks")
        return {name: value.rstrip("/")}
    if name == "server_name":
        if value and (len(value) > 253 or not _DNS_NAME.fullmatch(value)):
            raise RenderError(f"{name} {value!r} is not a DNS name")
        return {name: value}
    if name == "driver":
        if len(value) > 63 or not _DRIVER.fullmatch(value):
            raise RenderError(
                f"driver {value!r} is not a DRA driver name (a DNS subdomain of at most 63 "
                "characters starting with a letter, as dra.driver)"
            )
        return {name: value}
    if name == "scheduler_kubeconfig":
        if not os.path.isabs(value) or "\n" in value:
            raise RenderError(f"{name} {value!r} must be an absolute path")
        return {name: value}
    if name == "cluster_name":
        if not value or any(c.isspace() for c in value):
            raise RenderError(f"{name} {value!r} must be non-empty, without blanks")
        return {name: value}
    if name == "ca_pem":
        if not _PEM_CERT.search(value):
            raise RenderError("the CA file holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
        # certificate-authority-data: the PEM file, base64-encoded.
        return {"ca_data": base64.b64encode(value.encode("ascii")).decode("ascii")}
    if name == "token":
        token = value.strip()
        if not token or any(c.isspace() for c in token):
            raise RenderError("the token must be one non-empty word (a JWT)")
        if token.startswith("ZXlK"):  # base64 of "eyJ", how every JWT starts
            raise RenderError("the token is still base64-encoded, as in the Secret: base64 -d it")
        return {name: token}
    raise RenderError(f"unknown value {name!r}")


def _check_pem(name: str, value: str) -> dict[str, object]:
    """A PEM value (one or more blocks of the labels it must have), and its base64."""
    if name in ("client_cert_pem", "client_key_pem", "client_ca_pem") and not value:
        return {name: "", name.replace("_pem", "_data"): ""}
    blocks = list(_PEM_BLOCK.finditer(value))
    labels = _PEM_LABELS[name]
    if not blocks or "".join(b.group(0) for b in blocks).strip() != value.strip():
        raise RenderError(f"{name.replace('_pem', '')}: not PEM ({' or '.join(labels)})")
    wrong = [b.group(1) for b in blocks if b.group(1) not in labels]
    if wrong or (labels[0] != "CERTIFICATE" and len(blocks) != 1):
        raise RenderError(
            f"{name.replace('_pem', '')}: holds {', '.join(b.group(1) for b in blocks)}, "
            f"not one {' or '.join(labels)}"
        )
    encoded = base64.b64encode(value.encode("ascii")).decode("ascii")
    return {name: value, name.replace("_pem", "_data"): encoded}


_SCHEDULER_VALUES = (
    "image",
    "node_port",
    "container_port",
    "health_port",
    "memory_resource",
    "core_resource",
    "whole_resource",
)


def _check_scheduler_value(name: str, value: str) -> dict[str, object]:
    """The values only gpushare-scheduler's templates take."""
    if name == "image":
        if not value or any(c.isspace() for c in value) or value.startswith("-"):
            raise RenderError(f"image {value!r} must be one image reference, e.g. repo/name:tag")
        return {name: value}
    if name in ("node_port", "container_port", "health_port"):
        low, high = (30000, 32767) if name == "node_port" else (1, 65535)
        if not value.isdigit() or not low <= int(value) <= high:
            raise RenderError(f"{name} {value!r} must be a port number in [{low}, {high}]")
        return {name: int(value)}
    if len(value) > 253 or not _RESOURCE.fullmatch(value) or "kubernetes.io/" in value:
        raise RenderError(f"{name} {value!r} is not an extended resource name (domain/name)")
    return {name: value}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # YAML, not HTML
    )
    # jinja2's globals include namespace(), which a forgotten {{ namespace }}
    # would print instead of failing; the templates use no globals.
    env.globals.clear()
    # A YAML double-quoted scalar: a JSON string is one, whatever it holds.
    env.filters["q"] = lambda value: json.dumps(str(value))
    return env


# ---------------------------------------------------------------- the keys


def _new_file(path: Path, data: bytes, mode: int) -> None:
    """Write a new file (never over an existing one) with ``mode``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), mode)
        file.write(data)


def _check_new(directory: Path, names: tuple[str, ...]) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = [n for n in names if (directory / n).exists()]
    if existing:
        raise RenderError(
            f"{directory} already holds {', '.join(existing)}: make new ones in another "
            "directory (nothing is overwritten)"
        )


TLS_FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key", "client.crt", "client.key")


def make_tls(
    directory: str,
    namespace: str = "kube-system",
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = ("127.0.0.1",),
    client_name: str = "kube-scheduler",
    days: int = 365,
    ca_from: str | None = None,
    not_before: datetime | None = None,
) -> dict[str, Path]:
    """The extender's mutual TLS material in ``directory`` (``TLS_FILES``).

    A CA for this extender only (or the one in ``ca_from``), the server certificate
    (serverAuth; the Service's DNS names, ``localhost``, ``dns`` and ``ips``) and
    kube-scheduler's client certificate (clientAuth, CN ``client_name``); EC P-256 keys,
    mode 0600. ``not_before`` (tests): the start of validity, default now.
    """
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    _check("namespace", namespace)
    if not 1 <= days <= 3650:
        raise RenderError(f"days {days} must be in [1, 3650]")
    for name in (*dns, client_name):
        if len(name) > 253 or not _DNS_NAME.fullmatch(name):
            raise RenderError(f"{name!r} is not a DNS name")
    try:
        addresses = [ipaddress.ip_address(ip) for ip in ips]
    except ValueError as e:
        raise RenderError(str(e)) from None
    out = Path(directory)
    same = ca_from is not None and out.resolve() == Path(ca_from).resolve()
    _check_new(out, TLS_FILES[2:] if same else TLS_FILES)
    start = not_before or datetime.now(UTC) - timedelta(minutes=5)
    end = start + timedelta(days=days)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    if ca_from is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpushare-scheduler CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + timedelta(days=max(days, 3650)))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        _new_file(out / "ca.key", key_pem(ca_key), 0o600)
        _new_file(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    else:
        source = Path(ca_from)
        loaded_key = serialization.load_pem_private_key((source / "ca.key").read_bytes(), None)
        if not isinstance(loaded_key, ec.EllipticCurvePrivateKey):
            raise RenderError(f"{source / 'ca.key'} is not an EC key made by this command")
        ca_key = loaded_key
        ca_cert = x509.load_pem_x509_certificate((source / "ca.crt").read_bytes())
        if out.resolve() != source.resolve():
            _new_file(out / "ca.key", key_pem(ca_key), 0o600)
            _new_file(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)

    def issue(file: str, name: str, usage: x509.ObjectIdentifier, alt: list) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        _new_file(out / f"{file}.key", key_pem(key), 0o600)
        _new_file(out / f"{file}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)

    service = "gpushare-scheduler"
    names = [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        "localhost",
        *dns,
    ]
    alt_names = [x509.DNSName(n) for n in dict.fromkeys(names)]
    alt_names += [x509.IPAddress(a) for a in addresses]
    issue("tls", f"{service}.{namespace}.svc", ExtendedKeyUsageOID.SERVER_AUTH, alt_names)
    issue("client", client_name, ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName(client_name)])
    return {name: out / name for name in TLS_FILES}


PLACEMENT_FILES = ("placement.key", "placement.pub")


def make_placement_keys(directory: str) -> dict[str, Path]:
    """gpushare-scheduler's Ed25519 pair: placement.key (PKCS#8, 0600), placement.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    out = Path(directory)
    _check_new(out, PLACEMENT_FILES)
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _new_file(out / "placement.key", private, 0o600)
    _new_file(out / "placement.pub", public, 0o644)
    return {name: out / name for name in PLACEMENT_FILES}


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    return Path(path).read_text(encoding="ascii")


def _write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, also when it already exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        os.fchmod(file.fileno(), 0o600)
        file.write(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="render.py",
        description="Render one of gpushare-node's per-cluster templates (deploy/templates).",
    )
    commands = parser.add_subparsers(dest="template", required=True, metavar="TEMPLATE")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "-o", "--output", metavar="FILE", help="write FILE (mode 0600) instead of stdout"
        )
        return sub

    rbac = add("rbac", "ServiceAccount, token Secret, ClusterRole and binding of gpushare-node")
    scheduler = add("scheduler-config", "KubeSchedulerConfiguration with the gpushare extender")
    kubeconfig = add("kubeconfig", "the kubeconfig each node's gpushare-node reads")
    scheduler_rbac = add(
        "scheduler-rbac", "ServiceAccount, token Secret and RBAC of gpushare-scheduler"
    )
    deployment = add(
        "scheduler-deployment", "gpushare-scheduler as a Deployment and NodePort Service"
    )
    our_config = add(
        "gpushare-scheduler-config", "KubeSchedulerConfiguration with gpushare-scheduler"
    )
    for sub in (scheduler_rbac, deployment):
        sub.add_argument("--namespace", default=DEFAULTS["namespace"], help="default: %(default)s")
        sub.add_argument(
            "--scheduler-account",
            default=DEFAULTS["scheduler_account"],
            help="default: %(default)s",
        )
    deployment.add_argument(
        "--image",
        required=True,
        help="gpushare-scheduler:VERSION of scripts/build-image, or any with this package",
    )
    for name in ("node_port", "container_port", "health_port"):
        deployment.add_argument(
            "--" + name.replace("_", "-"), default=DEFAULTS[name], help="default: %(default)s"
        )
    for sub in (deployment, our_config):
        for name in ("memory_resource", "core_resource", "whole_resource"):
            sub.add_argument(
                "--" + name.replace("_", "-"),
                default=DEFAULTS[name],
                help="as the node daemons' config; default: %(default)s",
            )
    our_config.add_argument(
        "--extender-url",
        default=TEMPLATE_DEFAULTS["gpushare-scheduler-config"]["extender_url"],
        help="urlPrefix of gpushare-scheduler (https); default: %(default)s",
    )
    our_config.add_argument(
        "--namespace",
        default=DEFAULTS["namespace"],
        help="the extender's namespace (its certificate's name); default: %(default)s",
    )
    our_config.add_argument(
        "--server-name",
        default="",
        help="the name kube-scheduler checks in the extender's certificate; default: "
        "gpushare-scheduler.<namespace>.svc",
    )
    tls_files = our_config.add_mutually_exclusive_group()
    tls_files.add_argument(
        "--client-tls-dir",
        default=DEFAULTS["client_tls_dir"],
        help="where client.crt, client.key and ca.crt (from `tls`) are on each control-plane "
        "node, for kube-scheduler (tlsConfig certFile, keyFile, caFile); default: %(default)s",
    )
    tls_files.add_argument(
        "--embed-from",
        metavar="DIR",
        help="embed client.crt, client.key and ca.crt of DIR (from `tls`) in the "
        "configuration instead (certData, keyData, caData; the file is written 0600 with -o)",
    )
    secrets = [
        add("scheduler-tls-secret", "the extender's TLS Secret (tls.crt, tls.key, ca.crt)"),
        add("scheduler-signing-secret", "the extender's Secret holding placement.key"),
        add(
            "placement-public-key-configmap",
            "a ConfigMap holding placement.pub, for the node daemons",
        ),
    ]
    for sub in secrets:
        sub.add_argument("--namespace", default=DEFAULTS["namespace"], help="default: %(default)s")
        sub.add_argument("--dir", required=True, help="the directory `tls` or `placement-keys` wrote")
    tls = commands.add_parser(
        "tls", help="make the extender's CA, server and client certificates"
    )
    tls.add_argument("--dir", required=True, help="a new directory (nothing is overwritten)")
    tls.add_argument("--namespace", default=DEFAULTS["namespace"], help="default: %(default)s")
    tls.add_argument(
        "--dns", action="append", default=[], help="another DNS name of the extender (repeat)"
    )
    tls.add_argument(
        "--ip",
        action="append",
        default=[],
        help="an IP address kube-scheduler reaches it at besides 127.0.0.1 (repeat)",
    )
    tls.add_argument("--client-name", default="kube-scheduler", help="default: %(default)s")
    tls.add_argument("--days", type=int, default=365, help="validity; default: %(default)s")
    tls.add_argument("--ca-from", metavar="DIR", help="sign with the CA already in DIR")
    keys = commands.add_parser("placement-keys", help="make the extender's Ed25519 key pair")
    keys.add_argument("--dir", required=True, help="a directory (nothing is overwritten)")
    our_config.add_argument(
        "--scheduler-kubeconfig",
        default=DEFAULTS["scheduler_kubeconfig"],
        help="kube-scheduler's own kubeconfig (clientConnection); default: %(default)s",
    )
    dra = add("dra", "DeviceClasses, RBAC and ResourceSlice policy of the DRA front door")
    dra.add_argument("--driver", default=DEFAULTS["driver"], help="dra.driver; default: %(default)s")
    for sub in (rbac, kubeconfig, dra):
        sub.add_argument("--namespace", default=DEFAULTS["namespace"], help="default: %(default)s")
        sub.add_argument(
            "--service-account", default=DEFAULTS["service_account"], help="default: %(default)s"
        )
    scheduler.add_argument(
        "--extender-url",
        default=DEFAULTS["extender_url"],
        help="urlPrefix of the gpushare scheduler extender; default: %(default)s",
    )
    scheduler.add_argument(
        "--scheduler-kubeconfig",
        default=DEFAULTS["scheduler_kubeconfig"],
        help="kube-scheduler's own kubeconfig (clientConnection); default: %(default)s",
    )
    kubeconfig.add_argument("--server", required=True, help="API server URL, https://HOST:PORT")
    kubeconfig.add_argument(
        "--ca-file",
        required=True,
        help="the cluster CA certificate (PEM), e.g. the Secret's ca.crt",
    )
    kubeconfig.add_argument(
        "--token-file", required=True, help="file holding the token (decoded); - reads stdin"
    )
    kubeconfig.add_argument(
        "--cluster-name", default=DEFAULTS["cluster_name"], help="default: %(default)s"
    )
    return parser


def _generate(args: argparse.Namespace) -> int:
    if args.template == "tls":
        made = make_tls(
            args.dir,
            args.namespace,
            tuple(args.dns),
            ("127.0.0.1", *args.ip),
            args.client_name,
            args.days,
            args.ca_from,
        )
    else:
        made = make_placement_keys(args.dir)
    for path in made.values():
        print(path)
    return 0


def _value(args: argparse.Namespace, name: str) -> str:
    if name == "ca_pem":
        return _read(args.ca_file)
    if name == "token":
        return _read(args.token_file)
    if name in ("client_cert_pem", "client_key_pem", "client_ca_pem"):
        return _read(os.path.join(args.embed_from, DIR_FILES[name])) if args.embed_from else ""
    if name == "client_tls_dir" and args.embed_from:
        return ""
    if name in DIR_FILES:
        return _read(os.path.join(args.dir, DIR_FILES[name]))
    return str(getattr(args, name))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.template in GENERATORS:
            return _generate(args)
        values = {name: _value(args, name) for name in VALUES[args.template]}
        text = render(args.template, values)
    except (OSError, UnicodeDecodeError, RenderError, ValueError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    if args.output:
        _write_private(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
