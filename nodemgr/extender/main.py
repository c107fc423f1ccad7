"""``gpushare-scheduler``: the scheduler extender process.

    gpushare-scheduler --placement-key FILE
                       [--address 127.0.0.1:32766] [--url-prefix /gpushare-scheduler]
                       [--kubeconfig FILE] [--policy binpack|spread]
                       [--memory-resource NAME] [--memory-unit-mib N] [--core-resource NAME]
                       [--whole-resource NAME] [--label-prefix PREFIX]
                       [--assume-ttl-seconds S] [--request-timeout-seconds S] [--log-level L]

The resource names, memory unit, label prefix and policy must be those of the
node daemons (their config's ``resources`` and ``kubernetes.label_prefix``;
the defaults are the same). Credentials are found as gpushare-node finds
them: ``--kubeconfig``, $KUBECONFIG, the in-cluster service account,
~/.kube/config.

``--placement-key``: the extender's Ed25519 private key (PKCS#8 PEM, made by
``deploy/render.py placement-keys``); it signs the placement it writes on each
pod it binds, and the node daemons believe only placements that verify with its
public key (``kubernetes.placement_public_key``).

Starts the node and pod watches (one LIST+WATCH each), then serves HTTP at
once: ``/healthz`` says 503 until both are listed, and filter/bind answer
with an error until then. SIGTERM and SIGINT stop it (exit 0); SIGHUP is
ignored (there is no file to reload: restart it to change a flag). Exit 2:
bad arguments; 1: no usable credentials, an unusable key, or the address cannot
be bound.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from nodemgr.common.placementkey import PlacementKeyError, read_private_key
from nodemgr.config.schema import KubernetesSettings, ResourceSettings
from nodemgr.domain.extenderchoice import PlacementTrust
from nodemgr.errors import KubeCredentialsError
from nodemgr.extender.cache import ClusterCache
from nodemgr.extender.events import PLACEMENT_IGNORED_REASON, EventPoster
from nodemgr.extender.logic import Resources, check_policy
from nodemgr.extender.server import Extender, ExtenderServer

log = logging.getLogger("nodemgr.extender")

DEFAULT_ADDRESS = "127.0.0.1:32766"
DEFAULT_URL_PREFIX = "/gpushare-scheduler"


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
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
        server = ExtenderServer(extender, args.address, args.url_prefix, dict(watches))
    except OSError as e:
        print(
            f"gpushare-scheduler: cannot listen on {args.address[0]}:{args.address[1]}: "
            f"{e.strerror or e}",
            file=sys.stderr,
        )
        return 1
    host, port = server.address
    log.info(
        "gpushare-scheduler on http://%s:%d%s (policy %s; %s %d MiB units, %s, %s); API server "
        "%s, credentials from %s",
        host,
        port,
        server.url_prefix,
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
    serving = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    serving.start()
    while not stop.wait(1.0):
        cache.expire()
    server.shutdown()
    for watch in watches.values():
        watch.abort()
    events.stop()
    session.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
