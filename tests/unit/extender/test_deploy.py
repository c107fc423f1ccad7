"""deploy/ for gpushare-scheduler: RBAC, Deployment + Service, KubeSchedulerConfiguration.

Pins: every object deserializes into the kubernetes client's model with nothing dropped
(a typo fails); the ClusterRole grants exactly the requests the extender makes
(``EXTENDER_API_VERBS``, compared with what it really requests of the test API server
in test_main/test_kube_edge: nodes list+watch, pods list+watch+patch, pods/binding
create, events create); the Deployment runs one replica (the assume cache is per process) as the
account, with its Service's NodePort where the scheduler config points; the
KubeSchedulerConfiguration matches the v1 schema and has filter, prioritize and bind,
nodeCacheCapable true (names only: the extender has its own node cache), all three
resources managed and not ignored, ignorable false, HTTPS only with kube-scheduler's
client certificate (tlsConfig: files by path, or embedded); the Deployment mounts the
TLS and signing Secrets and is probed on the plain port; ``tls`` and ``placement-keys``
make the certificates (serverAuth / clientAuth, one CA of the extender's own) and the
key pair, and the Secrets and ConfigMap carry them as made; the renderer refuses a
missing image, bad ports, resource names, PEM values and plain-HTTP URLs.
"""

from __future__ import annotations

import json

import pytest

import tests.unit.deploy.test_render as base
from nodemgr.kubernetes.listwatch import RESOURCES as WATCHED

render = base.render

# What gpushare-scheduler requests: (API group, resource) -> verbs.
#   nodes: one LIST+WATCH (nodemgr.kubernetes.listwatch);
#   pods: one LIST+WATCH, a merge patch of the bound pod's annotations (scheduling);
#   pods/binding: create (scheduling.create_binding);
#   events: create (scheduling.create_event: a placement annotation it ignored).
EXTENDER_API_VERBS = {
    ("", "nodes"): {"list", "watch"},
    ("", "pods"): {"list", "watch", "patch"},
    ("", "pods/binding"): {"create"},
    ("", "events"): {"create"},
}
MODELS = {
    **base.MODELS,
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "ConfigMap"): "V1ConfigMap",
}


def to_model(doc):
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in MODELS, key
    sent = base._quantities_as_strings(doc)
    obj = base._API.deserialize(json.dumps(sent), MODELS[key], "application/json")
    problems = list(base._differences(sent, base._API.sanitize_for_serialization(obj)))
    assert not problems, problems
    return obj


def rendered(template, values=None):
    return base._documents(render.render(template, values or {}))


def test_rbac_grants_exactly_what_the_extender_requests():
    docs = rendered("scheduler-rbac", {"namespace": "gpu-system"})
    assert [d["kind"] for d in docs] == [
        "ServiceAccount",
        "Secret",
        "ClusterRole",
        "ClusterRoleBinding",
    ]
    account, secret, role, binding = (to_model(d) for d in docs)
    assert (account.metadata.namespace, account.metadata.name) == (
        "gpu-system",
        "gpushare-scheduler",
    )
    assert secret.type == "kubernetes.io/service-account-token"
    assert secret.metadata.annotations == {
        "kubernetes.io/service-account.name": "gpushare-scheduler"
    }
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role.rules:
        assert not rule.resource_names
        for group in rule.api_groups:
            for resource in rule.resources:
                granted.setdefault((group, resource), set()).update(rule.verbs)
    assert granted == EXTENDER_API_VERBS
    assert set(WATCHED) == {r for (_, r), verbs in EXTENDER_API_VERBS.items() if "watch" in verbs}
    assert [(s.kind, s.namespace, s.name) for s in binding.subjects] == [
        ("ServiceAccount", "gpu-system", "gpushare-scheduler")
    ]
    assert binding.role_ref.name == role.metadata.name


def test_deployment_and_service():
    docs = rendered("scheduler-deployment", {"image": "registry.example/gpushare-node:0.1.0"})
    deployment, service = (to_model(d) for d in docs)
    assert deployment.spec.replicas == 1 and deployment.spec.strategy.type == "Recreate"
    pod = deployment.spec.template.spec
    assert pod.service_account_name == "gpushare-scheduler"
    (container,) = pod.containers
    assert container.image == "registry.example/gpushare-node:0.1.0"
    # The command is the entrypoint of scripts/build-image's image (tests/engines/test_image.py
    # runs the image with this command and these args); the flags are args.
    assert container.command == ["gpushare-scheduler"]
    assert "--address=0.0.0.0:32766" in container.args
    assert "--url-prefix=/gpushare-scheduler" in container.args
    # Mutual TLS from the TLS Secret, signing with the signing Secret: both mounted
    # read-only where the flags point, readable by the non-root user (fsGroup).
    assert "--tls-dir=/etc/gpushare-scheduler/tls" in container.args
    assert "--placement-key=/etc/gpushare-scheduler/signing/placement.key" in container.args
    mounts = {m.name: (m.mount_path, m.read_only) for m in container.volume_mounts}
    assert mounts == {
        "tls": ("/etc/gpushare-scheduler/tls", True),
        "signing": ("/etc/gpushare-scheduler/signing", True),
    }
    secrets = {v.name: (v.secret.secret_name, v.secret.default_mode) for v in pod.volumes}
    assert secrets == {
        "tls": ("gpushare-scheduler-tls", 0o440),
        "signing": ("gpushare-scheduler-signing", 0o440),
    }
    assert pod.security_context.fs_group == pod.security_context.run_as_user == 65534
    # kubelet probes the plain port, which the Service does not expose.
    assert "--health-address=0.0.0.0:9446" in container.args
    assert {(p.name, p.container_port) for p in container.ports} == {
        ("https", 32766),
        ("health", 9446),
    }
    assert container.readiness_probe.http_get.path == "/healthz"
    assert container.readiness_probe.http_get.port == "health"
    assert container.liveness_probe.tcp_socket.port == "health"
    assert container.security_context.read_only_root_filesystem is True
    assert service.spec.type == "NodePort"
    (port,) = service.spec.ports
    assert (port.node_port, port.port, port.target_port) == (32766, 32766, "https")
    assert service.spec.selector == deployment.spec.selector.match_labels


@pytest.mark.parametrize("values", base.VALUE_SETS.values(), ids=base.VALUE_SETS.keys())
def test_scheduler_config_sends_all_three_resources_to_gpushare_scheduler(values):
    values = {
        k: v
        for k, v in values.items()
        if k in ("extender_url", "scheduler_kubeconfig", "namespace")
    }
    (config,) = rendered("gpushare-scheduler-config", values)
    assert base.schema_errors(config, base.SCHEDULER_CONFIG_SCHEMA) == []
    assert (config["apiVersion"], config["kind"]) == (
        "kubescheduler.config.k8s.io/v1",
        "KubeSchedulerConfiguration",
    )
    url = values.get("extender_url", "https://127.0.0.1:32766/gpushare-scheduler")
    namespace = values.get("namespace", "kube-system")
    (extender,) = config["extenders"]
    assert extender == {
        "urlPrefix": url,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": 5,
        "bindVerb": "bind",
        "enableHTTPS": True,
        "tlsConfig": {
            "insecure": False,
            "serverName": f"gpushare-scheduler.{namespace}.svc",
            "certFile": "/etc/kubernetes/gpushare-scheduler/client.crt",
            "keyFile": "/etc/kubernetes/gpushare-scheduler/client.key",
            "caFile": "/etc/kubernetes/gpushare-scheduler/ca.crt",
        },
        "nodeCacheCapable": True,
        "httpTimeout": "10s",
        "managedResources": [
            {"name": "aliyun.com/gpu-mem", "ignoredByScheduler": False},
            {"name": "aliyun.com/gpu-core.percentage", "ignoredByScheduler": False},
            {"name": "nvidia.com/gpu", "ignoredByScheduler": False},
        ],
        "ignorable": False,
    }


@pytest.mark.parametrize(
    ("template", "values", "message"),
    [
        ("scheduler-deployment", {}, "image is required"),
        ("scheduler-deployment", {"image": "a b"}, "one image reference"),
        ("scheduler-deployment", {"image": "x", "node_port": "80"}, r"\[30000, 32767\]"),
        ("gpushare-scheduler-config", {"memory_resource": "gpu-mem"}, "extended resource name"),
        ("gpushare-scheduler-config", {"extender_url": "http://h:1/g"}, "only HTTPS"),
        ("gpushare-scheduler-config", {"client_tls_dir": "relative"}, "absolute path"),
        ("gpushare-scheduler-config", {"client_cert_pem": "x"}, "not PEM"),
        ("gpushare-scheduler-config", {"server_name": "Not A Name"}, "not a DNS name"),
        ("scheduler-signing-secret", {"placement_key_pem": "x"}, "not PEM"),
        ("scheduler-rbac", {"scheduler_account": "Bad_Name"}, "DNS-1123"),
    ],
)
def test_renderer_refuses_bad_values(template, values, message):
    with pytest.raises(render.RenderError, match=message):
        render.render(template, values)


def test_cli_renders_the_deployment():
    done = base._run_cli("scheduler-deployment", "--image", "r/g:1", "--namespace", "gpu")
    assert done.returncode == 0, done.stderr
    assert {d["metadata"]["namespace"] for d in base._documents(done.stdout)} == {"gpu"}
    assert base._run_cli("scheduler-deployment").returncode == 2  # --image is required


def test_tls_makes_a_ca_a_server_and_a_client_certificate(tmp_path):
    """render.py tls: a CA of the extender's own, the server certificate (serverAuth, the
    Service's names and 127.0.0.1) and kube-scheduler's (clientAuth, CN kube-scheduler),
    keys 0600; nothing overwritten; --ca-from signs new ones with the same CA."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    done = base._run_cli("tls", "--dir", str(tmp_path / "tls"), "--ip", "10.0.0.5")
    assert done.returncode == 0, done.stderr
    files = {p.name: p for p in (tmp_path / "tls").iterdir()}
    assert set(files) == set(render.TLS_FILES)
    for name in ("ca.key", "tls.key", "client.key"):
        assert files[name].stat().st_mode & 0o777 == 0o600
    ca = x509.load_pem_x509_certificate(files["ca.crt"].read_bytes())
    server = x509.load_pem_x509_certificate(files["tls.crt"].read_bytes())
    client = x509.load_pem_x509_certificate(files["client.crt"].read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for cert in (server, client):
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
    usage = x509.ExtendedKeyUsage
    assert list(server.extensions.get_extension_for_class(usage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]
    assert list(client.extensions.get_extension_for_class(usage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gpushare-scheduler.kube-system.svc" in names.get_values_for_type(x509.DNSName)
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1",
        "10.0.0.5",
    ]
    assert client.subject.rfc4514_string() == "CN=kube-scheduler"
    again = base._run_cli("tls", "--dir", str(tmp_path / "tls"))
    assert again.returncode == 2 and "nothing is overwritten" in again.stderr
    rotated = base._run_cli(
        "tls", "--dir", str(tmp_path / "next"), "--ca-from", str(tmp_path / "tls")
    )
    assert rotated.returncode == 0, rotated.stderr
    new_server = x509.load_pem_x509_certificate((tmp_path / "next" / "tls.crt").read_bytes())
    new_server.verify_directly_issued_by(ca)
    assert (tmp_path / "next" / "ca.crt").read_bytes() == files["ca.crt"].read_bytes()


def test_the_secrets_and_the_configmap_carry_the_files_as_made(tmp_path):
    """scheduler-tls-secret (tls.crt, tls.key, ca.crt: cert-manager's keys),
    scheduler-signing-secret (placement.key only) and the public key's ConfigMap, from
    the --dir the generators wrote; the public key reads back as the nodes read it."""
    import base64

    from nodemgr.common.placementkey import public_key_from_pem, read_private_key

    assert base._run_cli("tls", "--dir", str(tmp_path / "tls")).returncode == 0
    assert base._run_cli("placement-keys", "--dir", str(tmp_path / "keys")).returncode == 0
    assert (tmp_path / "keys" / "placement.key").stat().st_mode & 0o777 == 0o600
    rendered_docs = {}
    for command, directory in (
        ("scheduler-tls-secret", "tls"),
        ("scheduler-signing-secret", "keys"),
        ("placement-public-key-configmap", "keys"),
    ):
        done = base._run_cli(command, "--dir", str(tmp_path / directory), "--namespace", "gpu")
        assert done.returncode == 0, done.stderr
        (doc,) = base._documents(done.stdout)
        to_model(doc)
        assert doc["metadata"]["namespace"] == "gpu"
        rendered_docs[command] = doc
    tls = rendered_docs["scheduler-tls-secret"]
    assert tls["type"] == "kubernetes.io/tls"
    for key in ("tls.crt", "tls.key", "ca.crt"):
        assert base64.b64decode(tls["data"][key]) == (tmp_path / "tls" / key).read_bytes()
    signing = rendered_docs["scheduler-signing-secret"]
    assert set(signing["data"]) == {"placement.key"}
    key = read_private_key(str(tmp_path / "keys" / "placement.key"))
    public = rendered_docs["placement-public-key-configmap"]["data"]["placement.pub"]
    assert public_key_from_pem(public).raw == key.public_key.raw
    wrong = base._run_cli("scheduler-signing-secret", "--dir", str(tmp_path / "tls"))
    assert wrong.returncode == 2 and "placement.key" in wrong.stderr


def test_the_embedded_scheduler_configuration_holds_the_client_files(tmp_path):
    """--embed-from: certData, keyData and caData instead of the paths; written 0600."""
    import base64

    assert base._run_cli("tls", "--dir", str(tmp_path / "tls")).returncode == 0
    out = tmp_path / "config.yaml"
    done = base._run_cli(
        "gpushare-scheduler-config", "--embed-from", str(tmp_path / "tls"), "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    (config,) = base._documents(out.read_text())
    assert base.schema_errors(config, base.SCHEDULER_CONFIG_SCHEMA) == []
    tls = config["extenders"][0]["tlsConfig"]
    assert set(tls) == {"insecure", "serverName", "certData", "keyData", "caData"}
    assert base64.b64decode(tls["keyData"]) == (tmp_path / "tls" / "client.key").read_bytes()
