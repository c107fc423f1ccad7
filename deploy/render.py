#!/usr/bin/env python3
"""Render the per-cluster templates in deploy/templates/ (jinja2).

For cluster admins; not part of the installed package. Needs only Python 3.11+
and jinja2. One template per run, written to stdout or, with ``-o FILE``, to a
new file of mode 0600 (the kubeconfig holds a credential)::

    python deploy/render.py rbac > gpushare-node-rbac.yaml
    python deploy/render.py scheduler-config --extender-url http://10.0.0.5:32766/gpushare-scheduler
    python deploy/render.py kubeconfig --server https://10.0.0.1:6443 \\
        --ca-file ca.crt --token-file token -o kubeconfig
    python deploy/render.py scheduler-rbac | kubectl apply -f -
    python deploy/render.py scheduler-deployment --image REGISTRY/gpushare-scheduler:0.1.0
    python deploy/render.py gpushare-scheduler-config
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
    # The DRA front door: DeviceClasses, the driver's RBAC and ResourceSlice policy.
    "dra": "dra.yaml.j2",
}

# The defaults, and which values each template takes. The kubeconfig's server,
# CA and token differ for every cluster and have no default.
DEFAULTS: dict[str, str] = {
    "namespace": "kube-system",
    "service_account": "gpushare-node",
    # The gpushare scheduler extender's Service is a NodePort on 32766; the
    # scheduler reaches it on its own host (upstream's example config).
    "extender_url": "http://127.0.0.1:32766/gpushare-scheduler",
    # kubeadm's kubeconfig of kube-scheduler on each control-plane node.
    "scheduler_kubeconfig": "/etc/kubernetes/scheduler.conf",
    "cluster_name": "kubernetes",
    "scheduler_account": "gpushare-scheduler",
    # The extender's NodePort (and container port): where the default extender_url points.
    "node_port": "32766",
    "container_port": "32766",
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
        "memory_resource",
        "core_resource",
        "whole_resource",
    ),
    "dra": ("namespace", "service_account", "driver"),
    "gpushare-scheduler-config": (
        "extender_url",
        "scheduler_kubeconfig",
        "memory_resource",
        "core_resource",
        "whole_resource",
    ),
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
_PEM_CERT = re.compile(
    r"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----"
)


class RenderError(ValueError):
    """A value that would give a broken manifest or kubeconfig."""


def render(template: str, values: Mapping[str, str] | None = None) -> str:
    """Render ``template`` (a key of ``TEMPLATES``) with ``DEFAULTS`` updated by ``values``."""
    if template not in TEMPLATES:
        raise RenderError(f"unknown template {template!r} (one of: {', '.join(TEMPLATES)})")
    given = {**DEFAULTS, **(values or {})}
    context: dict[str, object] = {}
    for name in VALUES[template]:
        if name not in given:
            raise RenderError(f"{template}: {name} is required")
        context.update(_check(name, given[name]))
    return _environment().get_template(TEMPLATES[template]).render(context)


def _check(name: str, value: str) -> dict[str, object]:
    """The template variables for one value, after checking it."""
    if not isinstance(value, str):
        raise RenderError(f"{name} must be a string, not {type(value).__name__}")
    if name in _SCHEDULER_VALUES:
        return _check_scheduler_value(name, value)
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


_SCHEDULER_VALUES = (
    "image",
    "node_port",
    "container_port",
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
    if name in ("node_port", "container_port"):
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
    for name in ("node_port", "container_port"):
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
        default=DEFAULTS["extender_url"],
        help="urlPrefix of gpushare-scheduler; default: %(default)s",
    )
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    values: dict[str, str] = {}
    try:
        for name in VALUES[args.template]:
            if name == "ca_pem":
                values[name] = _read(args.ca_file)
            elif name == "token":
                values[name] = _read(args.token_file)
            else:
                values[name] = getattr(args, name)
        text = render(args.template, values)
    except (OSError, UnicodeDecodeError, RenderError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    if args.output:
        _write_private(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
