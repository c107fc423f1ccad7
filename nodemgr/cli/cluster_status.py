"""``nodemgr status --cluster [-d] [--json] [--kubeconfig FILE]``: every node's GPUs.

In the shape of ``kubectl inspect gpushare``: one LIST of the nodes, then each node's
``<label_prefix>gpus`` annotation; nodes without it are named below the table. Listing
nodes needs RBAC ``nodes list``, which the daemon's ClusterRole does not grant: an
admin's command, with the admin's kubeconfig. Exit codes: 0 shown; 1 no credentials,
or the API server unreachable or refusing; 2 bad config, or ``kubernetes.enabled:
false``. The kubectl plugin (nodemgr.cli.inspect) uses the same functions with
``share=True``. It changes nothing.
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
from nodemgr.kubernetes.publish import (
    NODE_ANNOTATION,
    NODE_ANNOTATION_VERSION,
    parse_node_annotation,
)

ANNOTATION_VERSION = NODE_ANNOTATION_VERSION
_NAMES_SHOWN = 10  # nodes named in a note before "and N more"
ADMIN_FIX = (
    "give --kubeconfig FILE: a kubeconfig allowed to list nodes (an admin's; gpushare-node's "
    "own may not)"
)


class ClusterViewError(Exception):
    """The message says why and the fix."""


def run_cluster(args: argparse.Namespace, settings: Settings) -> int:
    kubernetes = settings.kubernetes
    if not kubernetes.enabled:
        print(
            "nodemgr: --cluster needs the Kubernetes integration (kubernetes.enabled); it is "
            "false in this config: set it to true, or give a config without it",
            file=sys.stderr,
        )
        return 2
    try:
        view = fetch_view(
            args.kubeconfig,
            kubernetes.kubeconfig,
            kubernetes.request_timeout_seconds,
            kubernetes.label_prefix,
        )
    except ClusterViewError as e:
        print(f"nodemgr: {e}", file=sys.stderr)
        return 1
    print(render(view, details=args.details, as_json=args.json))
    return 0


def fetch_view(
    kubeconfig_flag: str | None,
    kubeconfig_setting: str,
    timeout_seconds: float,
    label_prefix: str,
    command: str = "`nodemgr status --cluster`",
) -> dict:
    """``kubeconfig_flag`` (--kubeconfig) must exist; else the credentials are found from
    ``kubeconfig_setting`` as the daemon finds them."""
    # The kubernetes client takes half a second to load; `nodemgr status` need not pay it.
    from nodemgr.kubernetes import client as kube_client

    try:
        if kubeconfig_flag:
            if not os.path.isfile(kubeconfig_flag):
                raise KubeCredentialsError(f"--kubeconfig {kubeconfig_flag}: no such file")
            credentials = kube_client.Credentials("kubeconfig", kubeconfig_flag, "--kubeconfig")
        else:
            credentials = kube_client.find_credentials(kubeconfig_setting)
        client = kube_client.CommandClient(credentials, timeout_seconds)
    except KubeCredentialsError as e:
        raise ClusterViewError(f"{kube_client.credentials_problem(str(e))}; {ADMIN_FIX}") from e
    with client:
        try:
            nodes = client.list_nodes()
        except KubeApiError as e:
            raise ClusterViewError(
                list_error(e, client.server, credentials.describe(), command)
            ) from e
    return cluster_view(
        ((n.name, n.internal_ip, n.annotations) for n in nodes), label_prefix + NODE_ANNOTATION
    )


def render(view: dict, *, details: bool = False, as_json: bool = False, share: bool = False) -> str:
    """``share``: each card's allocated compute share too (the kubectl plugin)."""
    if as_json:
        return json.dumps(view, indent=2)
    if details:
        return render_cluster_details(view, share=share)
    return render_cluster(view, share=share)


def list_error(
    error: KubeApiError,
    server: str,
    credentials: str,
    command: str = "`nodemgr status --cluster`",
) -> str:
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
            f"{command} needs RBAC nodes list, which gpushare-node's own "
            "ClusterRole does not grant; run it with an admin's kubeconfig: --kubeconfig FILE"
        )
    return f"listing the nodes at {server} failed: {error}"


def cluster_view(nodes: Iterable[tuple[str, str | None, Mapping[str, str]]], key: str) -> dict:
    """``{"annotation": key, "nodes": [{name, address, gpus}], "skipped": [{name, reason}]}``
    from (name, InternalIP, annotations); a node whose annotation is missing or
    unreadable is skipped with the reason."""
    shown, skipped = [], []
    for name, address, node_annotations in sorted(nodes, key=lambda n: n[0]):
        text = node_annotations.get(key)
        if text is None:
            skipped.append({"name": name, "reason": "no annotation"})
            continue
        try:
            gpus = parse_node_annotation(text)
        except ValueError as e:
            skipped.append({"name": name, "reason": f"unreadable {key} annotation: {e}"})
            continue
        shown.append({"name": name, "address": address, "gpus": gpus})
    return {"annotation": key, "nodes": shown, "skipped": skipped}


def render_cluster(view: dict, share: bool = False) -> str:
    """One row per node and the cluster's total; ``share`` adds ``GPU<i>(Core)`` columns."""
    columns = _gpu_columns(view["nodes"])
    rows = [
        (
            "NAME",
            "IPADDRESS",
            *(f"GPU{i}(Allocated/Total)" for i in columns),
            "GPU Memory(GiB)",
            *((f"GPU{i}(Core)" for i in columns) if share else ()),
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
        cores = [f"{_core(by_index[i])}%" if i in by_index else "-" for i in columns]
        allocated, total = _memory(node["gpus"])
        rows.append(
            (
                node["name"],
                _address(node),
                *cells,
                f"{_gib(allocated)}/{_gib(total)}",
                *(cores if share else ()),
            )
        )
    lines = _aligned(rows)
    gpus = [g for n in view["nodes"] for g in n["gpus"]]
    allocated, total = _memory(gpus)
    lines += [
        "-" * max(len(line) for line in lines),
        "Allocated/Total GPU Memory In Cluster:",
        f"{_gib(allocated)}/{_gib(total)} ({_percent(allocated, total)}%)",
    ]
    if share:
        core = sum(_core(g) for g in gpus)
        lines += [
            "Allocated/Total GPU Core In Cluster:",
            f"{core}/{100 * len(gpus)}% ({_percent(core, 100 * len(gpus))}%)",
        ]
    return "\n".join(lines + _notes(view))


def render_cluster_details(view: dict, share: bool = False) -> str:
    """``kubectl inspect gpushare -d``; ``share`` adds the compute shares."""
    lines: list[str] = []
    for node in view["nodes"]:
        lines += ["", *_aligned([("NAME:", node["name"]), ("IPADDRESS:", _address(node))]), ""]
        columns = [gpu["index"] for gpu in node["gpus"]]
        pods: dict[tuple, dict[int, int]] = {}  # (namespace, pod) -> {card index: MiB}
        cores: dict[tuple, dict[int, int]] = {}  # (namespace, pod) -> {card index: percent}
        for gpu in node["gpus"]:
            whole = gpu.get("mode") == "whole"
            for namespace, pod, _container, memory_mib, core in _entries(gpu):
                # A card given out whole: the pod holds all of it.
                mib = gpu["memory_mib"] if whole else memory_mib
                held = pods.setdefault((namespace, pod), {})
                held[gpu["index"]] = held.get(gpu["index"], 0) + mib
                share_held = cores.setdefault((namespace, pod), {})
                share_held[gpu["index"]] = share_held.get(gpu["index"], 0) + (
                    100 if whole else int(core or 0)
                )
        allocated, total = _memory(node["gpus"])
        block = [
            (
                "NAME",
                "NAMESPACE",
                *(f"GPU{i}(Allocated)" for i in columns),
                *((f"GPU{i}(Core)" for i in columns) if share else ()),
            )
        ]
        for (namespace, pod), held in pods.items():
            block.append(
                (
                    pod or "(not yet known)",
                    namespace or "-",
                    *(_gib(held.get(i, 0)) for i in columns),
                    *((f"{cores[(namespace, pod)].get(i, 0)}%" for i in columns) if share else ()),
                )
            )
        block.append(("Allocated :", f"{_gib(allocated)} ({_percent(allocated, total)}%)"))
        block.append(("Total :", _gib(total)))
        if share:
            core = sum(_core(g) for g in node["gpus"])
            whole_share = 100 * len(node["gpus"])
            block.append(
                ("Allocated Core :", f"{core}/{whole_share}% ({_percent(core, whole_share)}%)")
            )
        table = _aligned(block)
        lines += [*table, "-" * max(len(line) for line in table)]
    allocated, total = _memory(g for n in view["nodes"] for g in n["gpus"])
    lines += [
        "",
        "Allocated/Total GPU Memory In Cluster:  "
        f"{_gib(allocated)}/{_gib(total)} ({_percent(allocated, total)}%)",
    ]
    return "\n".join(lines + _notes(view))


def _core(gpu: dict) -> int:
    value = gpu.get("core_allocated_percent")
    return value if type(value) is int else 0


def _entries(gpu: dict) -> list[tuple]:
    """[namespace, pod, container, memory_mib, core_percent]; pod None until known."""
    return [tuple(entry) for entry in gpu.get("allocations") or [] if len(entry) == 5]


def _gpu_columns(nodes: list[dict]) -> list[int]:
    return list(range(max((g["index"] + 1 for n in nodes for g in n["gpus"]), default=0)))


def _memory(gpus: Iterable[dict]) -> tuple[int, int]:
    allocated = total = 0
    for gpu in gpus:
        allocated += gpu["memory_allocated_mib"]
        total += gpu["memory_mib"]
    return allocated, total


def _gib(mib: int) -> str:
    """As the gpushare tools show them: one decimal, rounded down, when not whole."""
    if mib % 1024 == 0:
        return str(mib // 1024)
    return f"{math.floor(mib * 10 / 1024) / 10:.1f}"


def _percent(part: int, whole: int) -> int:
    return part * 100 // whole if whole else 0  # truncated, as kubectl inspect gpushare


def _address(node: dict) -> str:
    return node["address"] or "unknown"


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """As Go's tabwriter aligns them: rows may have fewer cells."""
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
