"""``gpushare-scheduler``: the scheduler extender process.

    gpushare-scheduler --placement-key FILE
                       (--tls-dir DIR | --tls-cert-file F --tls-key-file F --tls-client-ca-file F)
                       [--tls-client-name NAME ...] [--health-address 127.0.0.1:9446|off]
                       [--address 127.0.0.1:32766] [--url-prefix /gpushare-scheduler]
                       [--kubeconfig FILE] [--policy binpack|spread]
                       [--memory-resource NAME] [--memory-unit-mib N] [--core-resource NAME]
                       [--whole-resource NAME] [--label-prefix PREFIX]
                       [--assume-ttl-seconds S] [--request-timeout-seconds S]
                       [--max-nodes N] [--log-level L]

The resource names, memory unit, label prefix and policy must be those of the
node daemons (their config's ``resources`` and ``kubernetes.label_prefix``;
the defaults are the same). Credentials are found as gpushare-node finds
them: ``--kubeconfig``, $KUBECONFIG, the in-cluster service account,
~/.kube/config.

TLS, always mutual: the verbs are served only over HTTPS to a client whose
certificate the client CA signed (kube-scheduler's tlsConfig; ``nodemgr.extender.tls``);
``--tls-dir`` names a directory of ``tls.crt``, ``tls.key`` and ``ca.crt`` (a
Secret volume, cert-manager's keys), the three ``--tls-*-file`` flags name
them one by one; new files are used without a restart. ``--tls-client-name``:
the client certificate must also name one of these (CN or DNS name).
``--health-address``: a plain HTTP port serving only ``GET /healthz`` and
``/metrics``, for kubelet's probes (``off``: none). ``--max-nodes``: the most
nodes one request may name (it sizes every request's budget; default 5,000,
the largest cluster Kubernetes supports).

``--placement-key``: the extender's Ed25519 private key (PKCS#8 PEM, made by
``deploy/render.py placement-keys``); it signs the placement it writes on each
pod it binds, and the node daemons believe only placements that verify with its
public key (``kubernetes.placement_public_key``).

It serves at once: ``/healthz`` says 503 and filter/bind answer an error until nodes
and pods are listed. SIGTERM and SIGINT stop it (exit 0) without waiting for a verb in
flight; SIGHUP is ignored (no file to reload). Exit 2: bad arguments; 1: no usable
credentials, an unusable key or TLS file, or an address that cannot be bound.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
import threading
from types import FrameType

from nodemgr.common import logline
from nodemgr.common.placementkey import PlacementKeyError, read_private_key
from nodemgr.config.schema import KubernetesSettings, ResourceSettings
from nodemgr.domain.extenderchoice import PlacementTrust
from nodemgr.errors import KubeCredentialsError
from nodemgr.extender.cache import ClusterCache
from nodemgr.extender.events import PLACEMENT_IGNORED_REASON, EventPoster
from nodemgr.extender.logic import Resources, check_policy
from nodemgr.extender.server import Extender, ExtenderServer
from nodemgr.extender.tls import ServerTls, TlsError, TlsFiles
from nodemgr.extender.wire import MAX_NODES, Limits

log = logging.getLogger("nodemgr.extender")

DEFAULT_ADDRESS = "127.0.0.1:32766"
DEFAULT_HEALTH_ADDRESS = "127.0.0.1:9446"
DEFAULT_URL_PREFIX = "/gpushare-scheduler"


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _health_address(text: str) -> tuple[str, int] | None:
    return None if text == "off" else parse_address(text)


def _max_nodes(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node count in [1, 100000]")
    return int(text)


def _policy(text: str) -> str:
    try:
        return check_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 86400]")
    return value


def _unit(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 1024 * 1024:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB in [1, 1048576]")
    return int(text)


def parser() -> argparse.ArgumentParser:
    resources, kubernetes = ResourceSettings(), KubernetesSettings()
    p = argparse.ArgumentParser(
        prog="gpushare-scheduler",
        description="kube-scheduler extender that places GPU memory and compute share per card",
    )
    p.add_argument(
        "--address",
        type=parse_address,
        default=DEFAULT_ADDRESS,
        metavar="HOST:PORT",
        help="listen address (default %(default)s, where the scheduler config points)",
    )
    p.add_argument(
        "--health-address",
        type=_health_address,
        default=DEFAULT_HEALTH_ADDRESS,
        metavar="HOST:PORT",
        help="plain HTTP for kubelet's probes, GET /healthz and /metrics only; off: none "
        "(default %(default)s)",
    )
    p.add_argument("--tls-dir", metavar="DIR", help="tls.crt, tls.key and ca.crt (a Secret)")
    p.add_argument("--tls-cert-file", metavar="FILE", help="the server certificate (PEM)")
    p.add_argument("--tls-key-file", metavar="FILE", help="its private key (PEM)")
    p.add_argument(
        "--tls-client-ca-file",
        metavar="FILE",
        help="the CA that must have signed the client's certificate (PEM)",
    )
    p.add_argument(
        "--tls-client-name",
        action="append",
        default=[],
        metavar="NAME",
        help="the client certificate must name this (CN or DNS name); repeat for several",
    )
    p.add_argument(
        "--max-nodes",
        type=_max_nodes,
        default=MAX_NODES,
        help="the most nodes one request may name (default %(default)s)",
    )
    p.add_argument(
        "--url-prefix",
        default=DEFAULT_URL_PREFIX,
        help="path of the scheduler config's urlPrefix (default %(default)s)",
    )
    p.add_argument("--kubeconfig", default="", metavar="FILE", help="API credentials")
    p.add_argument(
        "--placement-key",
        required=True,
        metavar="FILE",
        help="Ed25519 private key (PKCS#8 PEM) that signs the placements it writes",
    )
    p.add_argument("--policy", type=_policy, default=resources.placement, help="binpack or spread")
    p.add_argument("--memory-resource", default=resources.memory)
    p.add_argument("--memory-unit-mib", type=_unit, default=resources.memory_unit_mib)
    p.add_argument("--core-resource", default=resources.core)
    p.add_argument("--whole-resource", default=resources.whole, help='"" when not offered')
    p.add_argument("--label-prefix", default=kubernetes.label_prefix)
    p.add_argument(
        "--assume-ttl-seconds",
        type=_positive,
        default=60.0,
        help="how long a bind counts before the pod watch shows it (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout-seconds",
        type=_positive,
        default=kubernetes.request_timeout_seconds,
    )
    p.add_argument("--watch-timeout-seconds", type=int, default=300, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def tls_files(p: argparse.ArgumentParser, args: argparse.Namespace) -> TlsFiles:
    files = (args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    if args.tls_dir and any(files):
        p.error("give --tls-dir or the three --tls-*-file flags, not both")
    if args.tls_dir:
        return TlsFiles.in_directory(args.tls_dir)
    if not all(files):
        p.error(
            "TLS is required: --tls-dir DIR, or --tls-cert-file, --tls-key-file and "
            "--tls-client-ca-file (python deploy/render.py tls makes them)"
        )
    return TlsFiles(*files)


def _raise_open_files_limit() -> None:
    """Room for the connection budgets (and what a flood opens before it is closed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    files = tls_files(p, args)
    logline.configure(args.log_level.upper())
    # The client is imported here, not at module level: --help stays fast.
    from nodemgr.kubernetes import scheduling
    from nodemgr.kubernetes.listwatch import ListWatch
    from nodemgr.kubernetes.writes import Backoff

    try:
        signer = read_private_key(args.placement_key)
    except (OSError, PlacementKeyError) as e:
        print(f"gpushare-scheduler: --placement-key: {e}", file=sys.stderr)
        return 1
    try:
        tls = ServerTls(files, tuple(args.tls_client_name))
    except TlsError as e:
        print(f"gpushare-scheduler: {e}", file=sys.stderr)
        return 1
    _raise_open_files_limit()
    try:
        session = scheduling.open_session(args.kubeconfig, args.request_timeout_seconds)
        credentials = scheduling.describe_credentials(args.kubeconfig)
    except KubeCredentialsError as e:
        print(f"gpushare-scheduler: {e}", file=sys.stderr)
        return 1
    resources = Resources(
        args.memory_resource, args.core_resource, args.whole_resource, args.memory_unit_mib
    )
    events = EventPoster(
        lambda namespace, pod, uid, reason, message, count: scheduling.create_event(
            session, namespace, pod, uid, reason, message, count
        )
    )

    def ignored(namespace: str, pod: str, uid: str, why: str) -> None:
        log.warning("pod %s/%s: %s", namespace, pod, why)
        events.record(namespace, pod, uid, PLACEMENT_IGNORED_REASON, why)

    cache = ClusterCache(
        resources,
        args.label_prefix,
        args.policy,
        args.assume_ttl_seconds,
        trust=PlacementTrust("signed", args.label_prefix, signer.public_key, ""),
        on_ignored=ignored,
    )

    class SessionBinder:
        def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
            scheduling.patch_pod_annotations(session, namespace, name, annotations)

        def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
            scheduling.create_binding(session, namespace, name, uid, node)

    stop = threading.Event()
    watches = {
        "nodes": ListWatch(
            session,
            "nodes",
            cache.node_handler,
            stop,
            watch_timeout_seconds=args.watch_timeout_seconds,
            backoff=Backoff(0.5, 30.0),
        ),
        "pods": ListWatch(
            session,
            "pods",
            cache.pod_handler,
            stop,
            watch_timeout_seconds=args.watch_timeout_seconds,
            backoff=Backoff(0.5, 30.0),
        ),
    }
    extender = Extender(cache, SessionBinder(), signer)
    try:
        server = ExtenderServer(
            extender,
            args.address,
            args.url_prefix,
            dict(watches),
            tls=tls,
            health_address=args.health_address,
            limits=Limits(args.max_nodes),
        )
    except OSError as e:
        print(f"gpushare-scheduler: cannot listen: {e.strerror or e}", file=sys.stderr)
        return 1
    host, port = server.address
    health = server.health_address
    log.info(
        "gpushare-scheduler on https://%s:%d%s, mutual TLS (%s); probes on %s",
        host,
        port,
        server.url_prefix,
        ", ".join(files.paths),
        f"http://{health[0]}:{health[1]}/healthz" if health else "no plain port",
    )
    log.info(
        "policy %s; %s %d MiB units, %s, %s; API server %s, credentials from %s",
        args.policy,
        resources.memory,
        resources.memory_unit_mib,
        resources.core,
        resources.whole or "no whole cards",
        session.host,
        credentials,
    )

    def on_stop(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, lambda s, f: log.info("SIGHUP ignored: no file to reload"))
    events.start()
    for watch in watches.values():
        watch.start()
    server.start()
    while not stop.wait(1.0):
        cache.expire()
    server.shutdown()
    for watch in watches.values():
        watch.abort()
    events.stop()
    session.close()
    log.info("stopped")
    return 0


def entry() -> None:
    """``main``, then out at once: the interpreter's exit would wait for a worker inside
    one long C call (json.loads of the largest request) and collect its objects."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
