"""``nodemgr status --cluster [-d] [--json] [--kubeconfig FILE]``: every node's GPUs.

The whole cluster from the API server, in the shape of ``kubectl inspect
gpushare``: one GET of the node list, then each node's ``<label_prefix>gpus``
annotation (nodemgr.kubernetes.publish.node_annotation: what every node's daemon
publishes per card); nodes without it (no gpushare-node there) are named
below the table. Memory in GiB, as the gpushare tools show it (one decimal
where a value is not whole). Listing nodes needs RBAC ``nodes list``, which
the daemon's own ClusterRole does not grant: it is an admin's command, run
with the admin's kubeconfig (--kubeconfig; default: the config's
kubernetes.kubeconfig, then $KUBECONFIG, in-cluster, ~/.kube/config, as the
daemon finds its credentials). Exit codes: 0 shown; 1 no credentials, or
the API server unreachable or refusing; 2 bad config, or
``kubernetes.enabled: false``.

``run_cluster`` is called by ``status.run`` (which owns the flags);
``cluster_view`` reads the annotations, ``render_cluster`` and
``render_cluster_details`` print the summary and ``-d``. It changes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping

from nodemgr.config.schema import Settings
from nodemgr.errors import KubeApiError, KubeCredentialsError
from nodemgr.kubernetes.publish import NODE_ANNOTATION

ANNOTATION_VERSION = 1  # the "v" of nodemgr.kubernetes.publish.node_annotation
_NAMES_SHOWN = 10  # nodes named in a note before "and N more"


def run_cluster(args: argparse.Namespace, settings: Settings) -> int:
    kubernetes = settings.kubernetes
    if not kubernetes.enabled:
        print(
            "nodemgr: --cluster needs the Kubernetes integration (kubernetes.enabled); it is "
            "false in this config: set it to true, or give a config without it",
            file=sys.stderr,
        )
        return 2
    # Imported here: the kubernetes client takes half a second to load, which
    # `nodemgr status` of this node alone would pay.
    from nodemgr.kubernetes import client as kube_client

    admin_fix = (
        "give --kubeconfig FILE: a kubeconfig allowed to list nodes (an admin's; gpushare-node's "
        "own may not)"
    )
    try:
        if args.kubeconfig:
            if not os.path.isfile(args.kubeconfig):
                raise KubeCredentialsError(f"--kubeconfig {args.kubeconfig}: no such file")
            credentials = kube_client.Credentials("kubeconfig", args.kubeconfig, "--kubeconfig")
        else:
            credentials = kube_client.find_credentials(kubernetes.kubeconfig)
        client = kube_client.CommandClient(credentials, kubernetes.request_timeout_seconds)
    except KubeCredentialsError as e:
        print(f"nodemgr: {kube_client.credentials_problem(str(e))}; {admin_fix}", file=sys.stderr)
        return 1
    with client:
        try:
            nodes = client.list_nodes()
        except KubeApiError as e:
            print(
                f"nodemgr: {list_error(e, client.server, credentials.describe())}", file=sys.stderr
            )
            return 1
    view = cluster_view(
        ((n.name, n.internal_ip, n.annotations) for n in nodes),
        kubernetes.label_prefix + NODE_ANNOTATION,
    )
    if args.json:
        print(json.dumps(view, indent=2))
    elif args.details:
        print(render_cluster_details(view))
    else:
        print(render_cluster(view))
    return 0


def list_error(error: KubeApiError, server: str, credentials: str) -> str:
    """What a failed LIST of the nodes means for this command, and the fix."""
    if error.status is None:
        return (
            f"the API server {server} does not answer ({error}): check that it runs and that "
            f"this machine reaches it (the server address in {credentials})"
        )
    if error.status == 429 or error.status >= 500:
        why = str(error).removesuffix("; retrying later")  # the daemon's adapter retries
        return f"the API server {server} is unavailable ({why}): try again later"
    if error.status == 401:
        return (
            f"the API server {server} rejected the credentials from {credentials} (HTTP 401): "
            "their token or certificate is wrong, expired or revoked; give --kubeconfig FILE "
            "with valid ones"
        )
    if error.status == 403:
        return (
            f"the credentials from {credentials} may not list nodes (HTTP 403 from {server}): "
            "`nodemgr status --cluster` needs RBAC nodes list, which gpushare-node's own "
            "ClusterRole does not grant; run it with an admin's kubeconfig: --kubeconfig FILE"
        )
    return f"listing the nodes at {server} failed: {error}"


def cluster_view(nodes: Iterable[tuple[str, str | None, Mapping[str, str]]], key: str) -> dict:
    """``{"annotation": key, "nodes": [{name, address, gpus}], "skipped": [{name, reason}]}``
    from the nodes' (name, InternalIP, annotations); ``key`` names the annotation
    (``<label_prefix>gpus``).

    ``gpus`` is the annotation's list as published; a node without the
    annotation, or with one this version cannot read, is skipped with the reason.
    """
    shown, skipped = [], []
    for name, address, node_annotations in sorted(nodes, key=lambda n: n[0]):
        text = node_annotations.get(key)
        if text is None:
            skipped.append({"name": name, "reason": "no annotation"})
            continue
        try:
            gpus = _annotation_gpus(text)
        except ValueError as e:
            skipped.append({"name": name, "reason": f"unreadable {key} annotation: {e}"})
            continue
        shown.append({"name": name, "address": address, "gpus": gpus})
    return {"annotation": key, "nodes": shown, "skipped": skipped}


def _annotation_gpus(text: str) -> list[dict]:
    try:
        document = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if document.get("v") != ANNOTATION_VERSION:
        raise ValueError(
            f"format v{document.get('v')}, this nodemgr reads v{ANNOTATION_VERSION} "
            "(a newer gpushare-node wrote it: update nodemgr)"
        )
    gpus = document.get("gpus")
    if not isinstance(gpus, list):
        raise ValueError("no gpus list")
    for gpu in gpus:
        fields = ("index", "memory_mib", "memory_allocated_mib")
        if not isinstance(gpu, dict) or not all(type(gpu.get(f)) is int for f in fields):
            raise ValueError(f"a card without {', '.join(fields)}: {json.dumps(gpu)[:80]}")
        if not isinstance(gpu.get("allocations", []), list):
            raise ValueError(f"GPU{gpu['index']}: allocations is not a list")
    return sorted(gpus, key=lambda g: g["index"])


def render_cluster(view: dict) -> str:
    """The summary of ``kubectl inspect gpushare``: one row per node, the cluster's total."""
    columns = _gpu_columns(view["nodes"])
    rows = [
        (
            "NAME",
            "IPADDRESS",
            *(f"GPU{i}(Allocated/Total)" for i in columns),
            "GPU Memory(GiB)",
        )
    ]
    for node in view["nodes"]:
        by_index = {gpu["index"]: gpu for gpu in node["gpus"]}
        cells = [
            f"{_gib(by_index[i]['memory_allocated_mib'])}/{_gib(by_index[i]['memory_mib'])}"
            if i in by_index
            else "-"
            for i in columns
        ]
        allocated, total = _memory(node["gpus"])
        rows.append((node["name"], _address(node), *cells, f"{_gib(allocated)}/{_gib(total)}"))
    lines = _aligned(rows)
    allocated, total = _memory(g for n in view["nodes"] for g in n["gpus"])
    lines += [
        "-" * max(len(line) for line in lines),
        "Allocated/Total GPU Memory In Cluster:",
        f"{_gib(allocated)}/{_gib(total)} ({_percent(allocated, total)}%)",
    ]
    return "\n".join(lines + _notes(view))


def render_cluster_details(view: dict) -> str:
    """``kubectl inspect gpushare -d``: per node its pods' memory per card, allocated, total."""
    lines: list[str] = []
    for node in view["nodes"]:
        lines += ["", *_aligned([("NAME:", node["name"]), ("IPADDRESS:", _address(node))]), ""]
        columns = [gpu["index"] for gpu in node["gpus"]]
        pods: dict[tuple, dict[int, int]] = {}  # (namespace, pod) -> {card index: MiB}
        for gpu in node["gpus"]:
            for namespace, pod, _container, memory_mib, _core in _entries(gpu):
                # A card given out whole: the pod holds all of it (the entry's memory is
                # that of every card the allocation holds).
                mib = gpu["memory_mib"] if gpu.get("mode") == "whole" else memory_mib
                held = pods.setdefault((namespace, pod), {})
                held[gpu["index"]] = held.get(gpu["index"], 0) + mib
        allocated, total = _memory(node["gpus"])
        block = [("NAME", "NAMESPACE", *(f"GPU{i}(Allocated)" for i in columns))]
        for (namespace, pod), held in pods.items():
            block.append(
                (
                    pod or "(not yet known)",
                    namespace or "-",
                    *(_gib(held.get(i, 0)) for i in columns),
                )
            )
        block.append(("Allocated :", f"{_gib(allocated)} ({_percent(allocated, total)}%)"))
        block.append(("Total :", _gib(total)))
        table = _aligned(block)
        lines += [*table, "-" * max(len(line) for line in table)]
    allocated, total = _memory(g for n in view["nodes"] for g in n["gpus"])
    lines += [
        "",
        "Allocated/Total GPU Memory In Cluster:  "
        f"{_gib(allocated)}/{_gib(total)} ({_percent(allocated, total)}%)",
    ]
    return "\n".join(lines + _notes(view))


def _entries(gpu: dict) -> list[tuple]:
    """[namespace, pod, container, memory_mib, core_percent] of a card; pod None until known."""
    return [tuple(entry) for entry in gpu.get("allocations") or [] if len(entry) == 5]


def _gpu_columns(nodes: list[dict]) -> list[int]:
    return list(range(max((g["index"] + 1 for n in nodes for g in n["gpus"]), default=0)))


def _memory(gpus: Iterable[dict]) -> tuple[int, int]:
    """(allocated, total) MiB."""
    allocated = total = 0
    for gpu in gpus:
        allocated += gpu["memory_allocated_mib"]
        total += gpu["memory_mib"]
    return allocated, total


def _gib(mib: int) -> str:
    """Whole GiB as the gpushare tools show them; else one decimal, rounded down."""
    if mib % 1024 == 0:
        return str(mib // 1024)
    return f"{math.floor(mib * 10 / 1024) / 10:.1f}"


def _percent(part: int, whole: int) -> int:
    return part * 100 // whole if whole else 0  # truncated, as kubectl inspect gpushare


def _address(node: dict) -> str:
    return node["address"] or "unknown"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Columns two spaces apart; rows may have fewer cells (as Go's tabwriter aligns them)."""
    widths: list[int] = []
    for row in rows:
        for i, cell in enumerate(row):
            if i == len(widths):
                widths.append(0)
            widths[i] = max(widths[i], len(cell))
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows
    ]


def _notes(view: dict) -> list[str]:
    """Below the table: the nodes not in it, and the cards that are not healthy."""
    notes = []
    absent = [s["name"] for s in view["skipped"] if s["reason"] == "no annotation"]
    if absent:
        notes.append(
            f"Not shown: {len(absent)} node{'s' if len(absent) != 1 else ''} without the "
            f"{view['annotation']} annotation (no gpushare-node there, or it has not published "
            f"yet): {_names(absent)}"
        )
    notes += [
        f"Not shown: {s['name']}: {s['reason']}"
        for s in view["skipped"]
        if s["reason"] != "no annotation"
    ]
    unhealthy = [
        f"{n['name']} GPU{g['index']}"
        for n in view["nodes"]
        for g in n["gpus"]
        if g.get("healthy") is False
    ]
    if unhealthy:
        notes.append(f"Unhealthy cards (see nodemgr status on the node): {', '.join(unhealthy)}")
    return ["", *notes] if notes else []


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown
