"""``kubectl inspect gpushare``: the kubectl plugin (the executable ``kubectl-inspect-gpushare``).

kubectl runs an executable of that name found in $PATH, with its own environment. The
view users know from the gpushare guide, rendered as ``nodemgr status --cluster`` plus
the compute share per card:

    kubectl inspect gpushare [-d] [--json] [--kubeconfig FILE] [--label-prefix P]
                             [--no-share]

Credentials: --kubeconfig, else $KUBECONFIG, in-cluster, ~/.kube/config (as
kubectl). Listing nodes needs RBAC ``nodes list``. Exit status 0 shown, 1 no
credentials or the API server down or refusing, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from nodemgr.cli.cluster_status import ClusterViewError, fetch_view, render
from nodemgr.config.schema import KubernetesSettings

PROG = "kubectl-inspect-gpushare"


def parser() -> argparse.ArgumentParser:
    defaults = KubernetesSettings()
    p = argparse.ArgumentParser(
        prog="kubectl inspect gpushare",
        description="GPU memory and compute share allocated per card, per node of the cluster",
    )
    p.add_argument("-d", "--details", action="store_true", help="per node: the pods on each card")
    p.add_argument("--json", action="store_true", help="the nodes' cards as published, as JSON")
    p.add_argument("--kubeconfig", metavar="FILE", help="default: $KUBECONFIG, ~/.kube/config")
    p.add_argument(
        "--label-prefix",
        default=defaults.label_prefix,
        help="gpushare-node's kubernetes.label_prefix (default %(default)s)",
    )
    p.add_argument(
        "--no-share",
        action="store_true",
        help="leave out the compute share (exactly the columns of the gpushare plugin)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_seconds,
        metavar="SECONDS",
        help="default %(default)s",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        view = fetch_view(
            args.kubeconfig,
            "",
            args.request_timeout,
            args.label_prefix,
            command="`kubectl inspect gpushare`",
        )
    except ClusterViewError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    print(render(view, details=args.details, as_json=args.json, share=not args.no_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
