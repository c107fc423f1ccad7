"""A test Kubernetes API server speaking the real REST and watch protocol over HTTP/1.1.

The official ``kubernetes`` Python client (and the daemon, through a kubeconfig) runs end
to end against it. ``TestApiServer`` serves from a thread on 127.0.0.1; ``stop()`` closes
the listening socket and every open connection (like a crashed API server) and
``restart()`` serves the same objects on the same port.

Implemented, with the real server's wire shapes and status codes:

* core/v1 ``pods``, ``nodes``, ``events`` and events.k8s.io/v1 ``events``: list (all
  namespaces or one), get, create (201), patch, update (PUT) and delete; the ``status``
  subresource of pods and nodes (the main resource ignores status changes, the
  subresource takes only status). List items carry no kind/apiVersion and empty
  labels/annotations are omitted, as on the wire (so JSON-patching
  ``/metadata/annotations/x`` into an object without annotations fails, as for real).
* resourceVersion is one global counter (etcd's revision): every change bumps it and goes
  into a bounded history (``history_size``; ``compact()`` empties it). A no-op write
  changes nothing and emits nothing.
* ``fieldSelector`` (=, ==, != on the fields the real server supports; others give 400)
  and ``labelSelector`` (=, ==, !=, in, notin, exists, !exists), for lists and watches.
* Watches (``watch=true``): chunked, newline-delimited JSON events. Without
  resourceVersion (or "0"): synthetic ADDED for what exists, then live. From N: the
  history after N, then live; N older than the history gives HTTP 200 with one ERROR
  event holding a 410 "Expired" Status, and the stream ends (what the real server
  does). An object entering or leaving the selection arrives as ADDED/DELETED.
  ``timeoutSeconds`` ends the stream cleanly; ``allowWatchBookmarks`` gives a BOOKMARK
  every ``bookmark_interval`` seconds.
* A list with ``resourceVersionMatch=Exact`` answers the state at that RV (rebuilt from
  history) or HTTP 410 when the RV is older than the history. A list or watch from an RV
  newer than the server's gives 504 "Too large resource version" (without the real
  server's 3 s wait for it).
* Patches: strategic merge (merge patch, plus merge-by-key for the usual list fields and
  ``$patch: delete|replace``), merge patch (RFC 7386), JSON patch (RFC 6902 add, remove,
  replace, test; ``~0``/``~1``; a failing op gives 422). A stale
  ``metadata.resourceVersion`` in a patch or PUT, or a stale DELETE precondition, gives
  409 Conflict.
* Checks that real clusters make and clients get wrong: label/annotation maps of strings,
  label syntax (422), event times with a zone (400), core Event namespace rules (422).
* authorization.k8s.io/v1 ``selfsubjectaccessreviews`` (create only, 201, what ``kubectl
  auth can-i`` asks): a resource review is allowed when ``rbac_allowed`` is None (the
  default: everything) or holds its (resource[/subresource], verb), e.g. ("nodes/status",
  "patch"); group, namespace and name are not looked at; a non-resource review is allowed
  only when everything is. Exactly one of resourceAttributes and nonResourceAttributes, or
  422.
* Bearer-token auth (401; the scheme in any case, as kube-apiserver), 404/405/415 Status
  bodies, failure injection (``fail_next``, ``delay_next``), ``drop_watches()`` and a
  request log (``requests``).

* resource.k8s.io/v1 (DRA, GA in 1.34): cluster-scoped ``resourceslices`` (field
  selectors spec.nodeName, spec.driver, spec.pool.name) and ``deviceclasses``,
  namespaced ``resourceclaims`` (with the ``status`` subresource) and
  ``resourceclaimtemplates``, served like the other kinds (list, watch, get, create,
  update, patch, delete) plus DELETE on a collection (deletecollection, with selectors:
  how kubelet wipes a node's slices). Every write goes through the API server's
  admission (standins.resource_v1): quantities parsed and stored canonical (one
  that does not parse: 400), the request defaults, and the validation of each kind,
  answered as 422 with the real field paths and one cause per error. A claim is created
  without status; ``reservedFor`` merges by uid in a strategic merge patch. Test-side
  helpers: ``add_resource_slice``, ``add_device_class``, ``add_resource_claim``,
  ``allocate_claim`` (as kube-scheduler: standins.dra_allocator),
  ``reserve_claim``, and pods with ``resource_claims`` and containers with ``claims``.
* Pod ``binding`` (POST ``/api/v1/namespaces/{ns}/pods/{name}/binding``, what a scheduler
  or a binding scheduler extender creates): sets spec.nodeName and the PodScheduled
  condition, copies the Binding's annotations onto the pod, answers 201 with a Success
  Status; 409 for a pod already bound or being deleted or a metadata.uid precondition
  that does not match, 400 for a name differing from the URL's, 422 without target.name
  or with a target kind other than Node, 404 for no such pod.
* ``limit``/``continue`` paging of lists: pages of ``limit`` items from one snapshot (the
  first page's resourceVersion); an opaque continue token; a token whose snapshot left
  the history gives 410 Expired.
* Discovery, for kubectl: ``/version`` (v1.30.2), ``/api``, ``/apis``, ``/apis/<group>``
  and the APIResourceLists of ``/api/v1`` and ``/apis/<group>/v1`` (legacy discovery: a
  client asking for aggregated discovery gets it, as from a server without that). A GET
  whose Accept header prefers ``application/json;as=Table;v=v1;g=meta.k8s.io`` (``kubectl
  get`` without ``-o``) gets pods, nodes and events as the server-side printed Table
  (kubectl's columns, ``-o wide`` ones included); watches are not converted.
* ``anonymous = True``: a request without credentials is served, as by a server allowing
  anonymous requests (kubectl sends no token over plain HTTP); a wrong token still gets
  401.

Not implemented: other resources and access reviews, server-side apply (415),
``remainingItemCount``, ``sendInitialEvents``,
``dryRun``, managedFields, generation, quantity checks and canonical forms outside
resource.k8s.io, finalizers and the claim controllers (a claim is not deallocated or
unreserved when its pod goes), graceful
deletion over HTTP (a DELETE removes at once; ``delete_pod(graceful=True)`` marks a pod
terminating), strategic merge directives other than ``$patch``, shared storage of the two
Event APIs, pod spec immutability, TLS.

Why this module is longer than 400 lines: it stands in for the Kubernetes API server's
REST and watch protocol as the official client and kubectl use it (discovery, lists with
paging and selectors, watches, patches, bindings, access reviews, events, Table output,
resource.k8s.io); one server, one store.
"""

from __future__ import annotations

import base64
import bisect
import copy
import hashlib
import http
import json
import re
import secrets
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from standins import dra_allocator, resource_v1


@dataclass(frozen=True)
class _Res:
    group: str
    plural: str
    kind: str
    api_version: str
    namespaced: bool
    status_sub: bool  # has a status subresource
    fields: tuple[str, ...]  # the field selectors the real server supports
    return_deleted: bool  # DELETE answers the object (pods), not a Status


_POD_FIELDS = """metadata.name metadata.namespace spec.nodeName spec.restartPolicy
    spec.schedulerName spec.serviceAccountName spec.hostNetwork status.phase status.podIP
    status.nominatedNodeName""".split()
_EVENT_FIELDS = """metadata.name metadata.namespace involvedObject.kind involvedObject.namespace
    involvedObject.name involvedObject.uid involvedObject.apiVersion involvedObject.fieldPath
    reason reportingComponent type""".split()
PODS = _Res("", "pods", "Pod", "v1", True, True, tuple(_POD_FIELDS), True)
NODES = _Res("", "nodes", "Node", "v1", False, True, ("metadata.name", "spec.unschedulable"), False)
EVENTS = _Res("", "events", "Event", "v1", True, False, tuple(_EVENT_FIELDS), False)
EVENTS_V1 = _Res(
    "events.k8s.io",
    "events",
    "Event",
    "events.k8s.io/v1",
    True,
    False,
    tuple(_EVENT_FIELDS[:2]),
    False,
)
# resource.k8s.io/v1 (DRA). DELETE answers the deleted object, as for pods.
_RESOURCE_GROUP, _RESOURCE_V1 = resource_v1.GROUP, resource_v1.API_VERSION
_NS_FIELDS = ("metadata.name", "metadata.namespace")
RESOURCE_SLICES = _Res(
    _RESOURCE_GROUP,
    "resourceslices",
    resource_v1.SLICE,
    _RESOURCE_V1,
    False,
    False,
    ("metadata.name", "spec.nodeName", "spec.driver", "spec.pool.name"),
    True,
)
RESOURCE_CLAIMS = _Res(
    _RESOURCE_GROUP, "resourceclaims", resource_v1.CLAIM, _RESOURCE_V1, True, True, _NS_FIELDS, True
)
DEVICE_CLASSES = _Res(
    _RESOURCE_GROUP,
    "deviceclasses",
    resource_v1.CLASS,
    _RESOURCE_V1,
    False,
    False,
    ("metadata.name",),
    True,
)
RESOURCE_CLAIM_TEMPLATES = _Res(
    _RESOURCE_GROUP,
    "resourceclaimtemplates",
    resource_v1.TEMPLATE,
    _RESOURCE_V1,
    True,
    False,
    _NS_FIELDS,
    True,
)
_DRA = (RESOURCE_SLICES, RESOURCE_CLAIMS, DEVICE_CLASSES, RESOURCE_CLAIM_TEMPLATES)
_RESOURCES = {(r.group, r.plural): r for r in (PODS, NODES, EVENTS, EVENTS_V1, *_DRA)}
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[a-z0-9.-]+)/v1)/(?:namespaces/(?P<ns>[^/]+)/)?"
    r"(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)
# Status reasons where the API server's differ from the HTTP phrase without spaces.
_REASONS = {410: "Expired", 422: "Invalid", 500: "InternalError", 504: "Timeout"}
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# patchMergeKey of the list fields of pods and nodes that strategic merge merges by key.
_MERGE_KEYS = dict(
    containers="name", initContainers="name", volumes="name", env="name",
    volumeMounts="mountPath", conditions="type", addresses="type", taints="key",
    containerStatuses="name", initContainerStatuses="name", reservedFor="uid",
)  # fmt: skip

# What the API server adds to a pod spec and a node on their way in (defaults, kubelet).
_POD_SPEC_DEFAULTS = """{"restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
  "dnsPolicy": "ClusterFirst", "serviceAccountName": "default", "serviceAccount": "default",
  "securityContext": {}, "schedulerName": "default-scheduler", "priority": 0,
  "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority", "tolerations": [
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
     "tolerationSeconds": 300},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
     "tolerationSeconds": 300}]}"""
_NODE = """{"kind": "Node", "apiVersion": "v1",
  "metadata": {"labels": {"beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
      "kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux"},
    "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
  "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
  "status": {"capacity": {"cpu": "16", "ephemeral-storage": "104845292Ki", "hugepages-1Gi": "0",
      "hugepages-2Mi": "0", "memory": "131900236Ki", "pods": "110"},
    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
      "message": "kubelet is posting ready status"}],
    "addresses": [{"type": "InternalIP", "address": "10.0.0.11"}],
    "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
    "nodeInfo": {"machineID": "0f3c5d0b9a3e4c7f8e2d1a6b5c4d3e2f", "bootID":
      "5b1f7c2e-8d4a-4e6b-9c3f-2a1d0e9f8b7c", "systemUUID": "4c4c4544-0037-3010-8052-b4c04f4e3732",
      "kernelVersion": "6.1.0", "osImage": "Ubuntu 22.04.4 LTS",
      "containerRuntimeVersion": "containerd://1.7.13", "kubeletVersion": "v1.30.2",
      "kubeProxyVersion": "v1.30.2", "operatingSystem": "linux", "architecture": "amd64"}}}"""


def status_obj(code: int, message: str, reason: str | None = None, details=None) -> dict:
    phrase = http.HTTPStatus(code).phrase.replace(" ", "")
    st = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    st |= {"message": message, "reason": reason or _REASONS.get(code, phrase), "code": code}
    return st | ({"details": details} if details else {})


class ApiError(Exception):
    """An error answered as a Status object with that HTTP code."""

    def __init__(self, code: int, message: str, reason: str | None = None, details=None):
        super().__init__(message)
        self.code = code
        self.status = status_obj(code, message, reason, details)


def _now(micro: bool = False) -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


# ---- patches: pure functions, they never mutate their inputs ----


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: null removes a key, objects merge, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def strategic_merge_patch(target, patch):
    """A merge patch where the lists in _MERGE_KEYS merge item by item on their key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue  # $setElementOrder and the like only order or retain: ignored here
        if v is None:
            out.pop(k, None)
        elif k in _MERGE_KEYS and isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = _merge_list(out[k], v, _MERGE_KEYS[k])
        else:
            out[k] = strategic_merge_patch(out.get(k), v)
    return out


def _merge_list(cur: list, items: list, key: str) -> list:
    out = list(cur)
    for item in items:
        if not isinstance(item, dict):
            return copy.deepcopy(items)  # not a list of keyed objects: replaced
        at = next((i for i, x in enumerate(out) if x.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            out = [x for x in out if x.get(key) != item.get(key)]
        elif at is None:
            out.append(strategic_merge_patch({}, item))
        else:
            out[at] = strategic_merge_patch(out[at], item)
    return out


def _walk(doc, toks: list[str]):
    for t in toks:
        if isinstance(doc, dict) and t in doc:
            doc = doc[t]
        elif isinstance(doc, list) and t.isdigit() and int(t) < len(doc):
            doc = doc[int(t)]
        else:
            raise ApiError(422, f"doc is missing path: /{'/'.join(toks)}")
    return doc


def json_patch(doc, ops: list):
    """RFC 6902 JSON patch: add, remove, replace and test (move and copy are not used)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = (op.get("op"), op.get("path")) if isinstance(op, dict) else (None, None)
        if kind not in ("add", "remove", "replace", "test") or not isinstance(path, str):
            raise ApiError(400, f"invalid JSON patch operation: {op!r}")
        if kind != "remove" and "value" not in op:
            raise ApiError(400, f"JSON patch operation without value: {op!r}")
        toks = [t.replace("~1", "/").replace("~0", "~") for t in path.split("/")[1:]]
        if kind == "test":
            if _walk(doc, toks) != op["value"]:
                raise ApiError(422, f"testing value {path} failed: test failed")
            continue
        if not toks:  # the whole document
            doc = copy.deepcopy(op["value"]) if kind != "remove" else None
            continue
        parent, last = _walk(doc, toks[:-1]), toks[-1]
        value = copy.deepcopy(op.get("value"))
        if isinstance(parent, dict) and (kind == "add" or last in parent):
            parent.pop(last) if kind == "remove" else parent.__setitem__(last, value)
        elif isinstance(parent, list) and kind == "add" and last == "-":
            parent.append(value)
        elif isinstance(parent, list) and last.isdigit():
            i, size = int(last), len(parent) + (kind == "add")
            if i >= size:
                raise ApiError(422, f"{kind} operation does not apply: index out of range: {path}")
            parent[i : i + (kind != "add")] = [] if kind == "remove" else [value]
        else:
            raise ApiError(422, f"{kind} operation does not apply: doc is missing path: {path}")
    return doc


_PATCHERS = {
    "application/strategic-merge-patch+json": strategic_merge_patch,
    "application/merge-patch+json": merge_patch,
    "application/json-patch+json": json_patch,
}


# ---- selectors ----


def _field(obj: dict, path: str) -> str:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return "" if obj is None else str(obj).lower() if isinstance(obj, bool) else str(obj)


def _matcher(res: _Res, ns: str, query: dict):
    """The predicate of a list or watch: namespace, fieldSelector, labelSelector."""
    fields, labels = [], []
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        m = re.match(r"^([^!=]+)(==|=|!=)(.*)$", term)
        if not m or m[1] not in res.fields:
            raise ApiError(400, f"field label not supported: {m[1] if m else term}")
        fields.append((m[1], m[2] == "!=", m[3]))
    selector = query.get("labelSelector", "")
    for term in re.split(r",(?![^(]*\))", selector) if selector.strip() else []:
        if m := re.match(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$", term):
            vals = {v.strip() for v in m[3].split(",")}
            labels.append(lambda lb, k=m[1], vs=vals, neg=m[2] == "notin": (lb.get(k) in vs) != neg)
        elif m := re.match(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$", term):
            labels.append(lambda lb, k=m[1], v=m[3], neg=m[2] == "!=": (lb.get(k) == v) != neg)
        elif m := re.match(r"^\s*(!?)\s*([\w./-]+)\s*$", term):
            labels.append(lambda lb, k=m[2], neg=m[1] == "!": (k in lb) != neg)
        else:
            raise ApiError(400, f"unable to parse requirement: {term!r}")

    def match(obj: dict | None) -> bool:
        if obj is None or (ns and obj["metadata"].get("namespace") != ns):
            return False
        if any((_field(obj, f) == v) == neg for f, neg, v in fields):
            return False
        return all(p(obj["metadata"].get("labels") or {}) for p in labels)

    return match


# ---- checks that real clusters make ----


def _validate(res: _Res, obj: dict) -> None:
    meta = obj["metadata"]
    for what in ("labels", "annotations"):
        m = meta.get(what)
        if m is not None and not (isinstance(m, dict) and all(type(v) is str for v in m.values())):
            raise ApiError(400, f"json: cannot unmarshal metadata.{what}: values must be strings")
        if not m:
            meta.pop(what, None)  # omitempty, as the real server serialises it
        for k, v in (m or {}).items():
            prefix, _, name = k.rpartition("/")
            bad_key = (
                len(name) > 63 or not _NAME.match(name) or (prefix and not _PREFIX.match(prefix))
            )
            if bad_key or (what == "labels" and v and (len(v) > 63 or not _NAME.match(v))):
                raise ApiError(
                    422,
                    f"{res.kind} {meta['name']!r} is invalid: metadata.{what}: Invalid value: "
                    f"{v if not bad_key else k!r}: must consist of alphanumeric characters, '-',"
                    " '_' or '.', and must start and end with an alphanumeric character",
                )
    if res.kind != "Event":
        return
    for f in ("firstTimestamp", "lastTimestamp", "eventTime"):
        if obj.get(f):
            obj[f] = _time(obj[f], micro=f == "eventTime")
    if res is EVENTS_V1 and not obj.get("eventTime"):
        raise ApiError(422, f"Event {meta['name']!r} is invalid: eventTime: Required value")
    if res is EVENTS:  # core/v1: the event lives in its object's namespace, "default" if none
        ns, involved = meta["namespace"], (obj.get("involvedObject") or {}).get("namespace")
        if (involved and involved != ns) or (not involved and ns != "default"):
            raise ApiError(
                422,
                f"Event {meta['name']!r} is invalid: involvedObject.namespace: Invalid value: "
                f"{involved!r}: does not match event.namespace",
            )


def _qualified(res: _Res) -> str:
    """The resource as the API server names it in messages: pods, events.events.k8s.io."""
    return f"{res.plural}.{res.group}" if res.group else res.plural


def _admit_dra(res: _Res, obj: dict, old: dict | None, sub: str | None) -> None:
    """resource.k8s.io objects: what kube-apiserver does with the body
    (standins.resource_v1): canonical quantities (one that does not parse: 400), defaults, and
    validation (422 with one cause per field). ``sub``: as for ``_update``."""
    if res not in _DRA:
        return
    status = sub == "status" or (
        sub == "all" and old is not None and old.get("status") != obj.get("status")
    )
    try:
        errors = resource_v1.admit(res.kind, obj, old, status=status)
    except resource_v1.DecodeError as e:
        raise ApiError(
            400, f'{res.kind} in version "v1" cannot be handled as a {res.kind}: {e}'
        ) from None
    if errors:
        name = (obj.get("metadata") or {}).get("name", "")
        message, details = resource_v1.invalid_details(res.kind, name, errors)
        raise ApiError(422, message, details=details)


def _time(value, micro: bool) -> str:
    """A Time/MicroTime in the server's format; Go's parser refuses a time without a zone."""
    try:
        t = datetime.fromisoformat(str(value))
    except ValueError:
        t = None
    if t is None or t.tzinfo is None:
        raise ApiError(400, f'parsing time "{value}" as RFC 3339: a zone is required')
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


# ---- discovery and Table output: what kubectl asks for besides the objects ----

_VERSION = """{"major": "1", "minor": "30", "gitVersion": "v1.30.2", "gitCommit":
  "39683505b630ff2121012f3c5b16215a1449d5ed", "gitTreeState": "clean", "buildDate":
  "2024-06-11T20:21:00Z", "goVersion": "go1.22.4", "compiler": "gc", "platform": "linux/amd64"}"""
_VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")
_VERBS_ALL = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
_GROUPS = {"events.k8s.io": "v1", "authorization.k8s.io": "v1", "resource.k8s.io": "v1"}


def _api_resource(name, kind, namespaced, verbs=_VERBS, singular="", short=()) -> dict:
    out = {"name": name, "singularName": singular, "namespaced": namespaced, "kind": kind}
    return out | {"verbs": list(verbs)} | ({"shortNames": list(short)} if short else {})


def _api_resources(path: str) -> list[dict] | None:
    status, event = ("get", "patch", "update"), ("events", "Event", True)
    return {
        "/api/v1": [
            _api_resource(*event, singular="event", short=["ev"]),
            _api_resource("nodes", "Node", False, singular="node", short=["no"]),
            _api_resource("nodes/status", "Node", False, status),
            _api_resource("pods", "Pod", True, singular="pod", short=["po"])
            | {"categories": ["all"]},
            _api_resource("pods/binding", "Binding", True, ("create",)),
            _api_resource("pods/status", "Pod", True, status),
        ],
        "/apis/events.k8s.io/v1": [_api_resource(*event, singular="event", short=["ev"])],
        "/apis/resource.k8s.io/v1": [
            _api_resource("deviceclasses", "DeviceClass", False, _VERBS_ALL, "deviceclass"),
            _api_resource(
                "resourceclaims", "ResourceClaim", True, _VERBS_ALL, "resourceclaim"
            ),
            _api_resource("resourceclaims/status", "ResourceClaim", True, status),
            _api_resource(
                "resourceclaimtemplates", "ResourceClaimTemplate", True, _VERBS_ALL,
                "resourceclaimtemplate",
            ),
            _api_resource(
                "resourceslices", "ResourceSlice", False, _VERBS_ALL, "resourceslice"
            ),
        ],
        "/apis/authorization.k8s.io/v1": [
            _api_resource(
                "selfsubjectaccessreviews", "SelfSubjectAccessReview", False, ("create",),
                "selfsubjectaccessreview",
            )
        ],
    }.get(path)  # fmt: skip


def discovery(path: str) -> dict | None:
    """The legacy discovery document at ``path`` (/version, /api, /apis, /apis/<group>,
    /api/v1, /apis/<group>/v1) of what this server serves; None for any other path."""
    path = path.rstrip("/")  # the real server takes a trailing slash there too
    gv = {g: {"groupVersion": f"{g}/{v}", "version": v} for g, v in _GROUPS.items()}
    groups = {g: {"name": g, "versions": [gv[g]], "preferredVersion": gv[g]} for g in gv}
    if path == "/version":
        return json.loads(_VERSION)
    if path == "/api":
        cidrs = [{"clientCIDR": "0.0.0.0/0", "serverAddress": "10.0.0.1:6443"}]
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": cidrs}
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": list(groups.values())}
    if path.startswith("/apis/") and path[6:] in groups:
        return {"kind": "APIGroup", "apiVersion": "v1"} | groups[path[6:]]
    resources = _api_resources(path)
    if resources is None:
        return None
    out = {"kind": "APIResourceList", "groupVersion": path.split("/", 2)[2]}
    # The core group's list has no apiVersion on the wire, the named groups' have one.
    return (
        out | ({"apiVersion": "v1"} if path.startswith("/apis/") else {}) | {"resources": resources}
    )


def human_age(timestamp: str | None, now: datetime | None = None) -> str:
    """The time since ``timestamp`` as kubectl prints an age (apimachinery's
    duration.HumanDuration): 90s, 5m3s, 42m, 3h12m, 30h, 3d4h, 20d, 2y10d."""
    if not timestamp:
        return "<unknown>"
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    s = int(((now or datetime.now(UTC)) - then).total_seconds())
    if s < -1:
        return "<invalid>"
    s = max(s, 0)
    m, h, d = s // 60, s // 3600, s // 86400
    steps = (
        (s < 120, f"{s}s"),
        (m < 10, f"{m}m{s % 60}s" if s % 60 else f"{m}m"),
        (m < 180, f"{m}m"),
        (h < 8, f"{h}h{m % 60}m" if m % 60 else f"{h}h"),
        (h < 48, f"{h}h"),
        (h < 24 * 8, f"{d}d{h % 24}h" if h % 24 else f"{d}d"),
        (d < 365 * 2, f"{d}d"),
        (d < 365 * 8, f"{d // 365}y{d % 365}d"),
    )
    return next((text for small, text in steps if small), f"{d // 365}y")


def _col(name: str, description: str, priority: int = 0, kind="string", fmt="") -> dict:
    return {"name": name, "type": kind, "format": fmt, "description": description} | {
        "priority": priority
    }


_NAME_COL = _col("Name", "Name must be unique within a namespace.", fmt="name")
_AGE_DOC = "CreationTimestamp is the server time when this object was created."


def _node_cells(o: dict) -> list:
    st, meta = o.get("status") or {}, o["metadata"]
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )
    status = "Ready" if ready else "NotReady"
    if (o.get("spec") or {}).get("unschedulable"):
        status += ",SchedulingDisabled"
    role = "node-role.kubernetes.io/"
    roles = sorted(k[len(role) :] for k in meta.get("labels") or {} if k.startswith(role))
    info, addresses = st.get("nodeInfo") or {}, st.get("addresses") or []
    ip = {
        t: ",".join(a["address"] for a in addresses if a.get("type") == t) or "<none>"
        for t in ("InternalIP", "ExternalIP")
    }
    return [
        meta["name"], status, ",".join(roles) or "<none>", human_age(meta.get("creationTimestamp")),
        info.get("kubeletVersion", ""), ip["InternalIP"], ip["ExternalIP"],
        info.get("osImage", "<unknown>"), info.get("kernelVersion", "<unknown>"),
        info.get("containerRuntimeVersion", "<unknown>"),
    ]  # fmt: skip


def _pod_cells(o: dict) -> list:
    st, meta, spec = o.get("status") or {}, o["metadata"], o.get("spec") or {}
    statuses = st.get("containerStatuses") or []
    reason = st.get("reason") or st.get("phase") or "Unknown"
    for cs in statuses:  # a waiting or terminated container's reason wins, the last one
        state = cs.get("state") or {}
        reason = (state.get("waiting") or state.get("terminated") or {}).get("reason") or reason
    if meta.get("deletionTimestamp"):
        reason = "Terminating"
    ready = sum(bool(cs.get("ready")) for cs in statuses)
    return [
        meta["name"], f"{ready}/{len(spec.get('containers') or [])}", reason,
        sum(cs.get("restartCount", 0) for cs in statuses),
        human_age(meta.get("creationTimestamp")), st.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>", st.get("nominatedNodeName") or "<none>", "<none>",
    ]  # fmt: skip


def _event_cells(o: dict) -> list:
    """Both Event APIs (events.k8s.io/v1 names its fields differently)."""
    involved = o.get("involvedObject") or o.get("regarding") or {}
    source = o.get("source") or {}
    source = ", ".join(filter(None, (source.get("component") or o.get("reportingController"),
                                     source.get("host"))))  # fmt: skip
    last = o.get("lastTimestamp") or o.get("deprecatedLastTimestamp") or o.get("eventTime")
    first = o.get("firstTimestamp") or o.get("deprecatedFirstTimestamp") or o.get("eventTime")
    return [
        human_age(last), o.get("type", ""), o.get("reason", ""),
        f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
        involved.get("fieldPath", ""), source, o.get("message") or o.get("note") or "",
        human_age(first), o.get("count") or o.get("deprecatedCount") or 1,
        o["metadata"]["name"],
    ]  # fmt: skip


# Kind -> (columnDefinitions, cells of one object), the real server's printers (trimmed).
_TABLES = {
    "Node": ([
        _NAME_COL, _col("Status", "The status of the node"),
        _col("Roles", "The roles of the node"), _col("Age", _AGE_DOC),
        _col("Version", "Kubelet Version reported by the node."),
        _col("Internal-IP", "List of internal IPs in the node.", 1),
        _col("External-IP", "List of external IPs in the node.", 1),
        _col("OS-Image", "OS Image reported by the node from /etc/os-release.", 1),
        _col("Kernel-Version", "Kernel Version reported by the node.", 1),
        _col("Container-Runtime", "Container runtime version reported by the node.", 1),
    ], _node_cells),
    "Pod": ([
        _NAME_COL, _col("Ready", "The aggregate readiness state of this pod."),
        _col("Status", "The aggregate status of the containers in this pod."),
        _col("Restarts", "The number of times the containers have restarted.", 0, "integer"),
        _col("Age", _AGE_DOC), _col("IP", "IP address allocated to the pod.", 1),
        _col("Node", "Name of the Node the Pod is assigned to.", 1),
        _col("Nominated Node", "Name of the node the pod is nominated to.", 1),
        _col("Readiness Gates", "The readiness gates of the pod.", 1),
    ], _pod_cells),
    "Event": ([
        _col("Last Seen", "The time the event was last seen."), _col("Type", "Event type."),
        _col("Reason", "Why the event happened."), _col("Object", "The object it is about."),
        _col("Subobject", "The part of the object it is about.", 1),
        _col("Source", "The component reporting it.", 1), _col("Message", "What happened."),
        _col("First Seen", "The time the event was first seen.", 1),
        _col("Count", "How many times it happened.", 1, "integer"),
        _col("Name", "The event's name.", 1, fmt="name"),
    ], _event_cells),
}  # fmt: skip


def table_version(accept: str) -> str | None:
    """meta.k8s.io/v1 or /v1beta1 when the Accept header prefers a Table (kubectl's
    ``application/json;as=Table;v=v1;g=meta.k8s.io,...,application/json``), else None."""
    for media in accept.split(","):
        kind, *params = (p.strip() for p in media.split(";"))
        args = dict(p.partition("=")[::2] for p in params)
        if args.get("as") == "Table" and args.get("g") == "meta.k8s.io":
            if args.get("v") in ("v1", "v1beta1"):
                return "meta.k8s.io/" + args["v"]
        elif kind in ("application/json", "*/*", "application/*") and not args:
            return None
    return None


def as_table(obj: dict, api_version: str = "meta.k8s.io/v1") -> dict | None:
    """A pod, node or event, or a list of them, as the server-side printed Table (rows
    with cells and the object's metadata, includeObject=Metadata); None for anything else."""
    kind = str(obj.get("kind", ""))
    many = kind.endswith("List") and "items" in obj
    columns, cells = _TABLES.get(kind[:-4] if many else kind, (None, None))
    if cells is None:
        return None
    meta = {k: v for k, v in obj["metadata"].items() if k in ("resourceVersion", "continue")}
    rows = [
        {"cells": cells(o), "object": {"kind": "PartialObjectMetadata", "apiVersion":
         "meta.k8s.io/v1", "metadata": copy.deepcopy(o["metadata"])}}
        for o in (obj["items"] if many else [obj])
    ]  # fmt: skip
    return {"kind": "Table", "apiVersion": api_version, "metadata": meta} | {
        "columnDefinitions": copy.deepcopy(columns),
        "rows": rows,
    }


# ---- realistic objects for the test-side helpers ----


def _container(c: dict) -> dict:
    requests, limits = dict(c.get("requests") or {}), dict(c.get("limits") or {})
    for k, v in requests.items():
        if "/" in k and not k.startswith("kubernetes.io/"):
            limits.setdefault(k, v)  # an extended resource needs limits equal to requests
    for k, v in limits.items():
        requests.setdefault(k, v)  # API defaulting: requests default to limits
    out = {"name": c["name"], "image": c.get("image", "registry.k8s.io/pause:3.9")}
    out["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    if c.get("claims"):  # DRA: [{"name": <pod claim name>, "request"?: <request>}]
        out["resources"]["claims"] = [dict(claim) for claim in c["claims"]]
    out |= {"terminationMessagePath": "/dev/termination-log", "imagePullPolicy": "IfNotPresent"}
    return out | ({"env": c["env"]} if c.get("env") else {})


def _pod_status(pod: dict, phase: str) -> dict:
    """The status kubelet reports for a pod in that phase."""
    spec, t = pod["spec"], _now()
    used = {
        r
        for c in spec["containers"]
        for part in (c["resources"].get("limits") or {}, c["resources"].get("requests") or {})
        for r in part
    }
    st = {"phase": phase, "qosClass": "Burstable" if {"cpu", "memory"} & used else "BestEffort"}
    bound = "True" if spec.get("nodeName") else "False"
    st["conditions"] = [{"type": "PodScheduled", "status": bound, "lastTransitionTime": t}]
    if not spec.get("nodeName"):
        return st
    st["hostIP"] = "10.0.0.11"
    if phase == "Pending":
        state = {"waiting": {"reason": "ContainerCreating"}}
    else:
        st |= {"podIP": "10.244.1.7", "startTime": t}
        code = int(phase == "Failed")
        done = {"exitCode": code, "reason": "Error" if code else "Completed", "finishedAt": t}
        state = {"running": {"startedAt": t}} if phase == "Running" else {"terminated": done}
    statuses = []
    for c in spec["containers"]:
        cs = {"name": c["name"], "state": state, "ready": phase == "Running", "restartCount": 0}
        cs |= {"image": c["image"], "imageID": "", "started": phase == "Running"}
        if phase != "Pending":
            digest = hashlib.sha256((pod["metadata"]["uid"] + c["name"]).encode()).hexdigest()
            cs["containerID"] = "containerd://" + digest
        statuses.append(cs)
    return st | {"containerStatuses": statuses}


def _dra_request(request: dict) -> dict:
    exact = {"deviceClassName": request["deviceClassName"]}
    if "count" in request:
        exact["count"] = request["count"]
    if request.get("capacity"):
        exact["capacity"] = {"requests": dict(request["capacity"])}
    if request.get("selectors"):
        exact["selectors"] = [{"cel": {"expression": e}} for e in request["selectors"]]
    return {"name": request["name"], "exactly": exact}


class _Ev(NamedTuple):
    rv: int
    key: tuple  # (_Res, namespace, name)
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict
    prev: dict | None  # the object before this change (None for ADDED)


@dataclass
class _Watch:
    res: _Res
    match: object
    last: int  # every change up to this RV has been looked at
    gen: int
    epoch: int
    end: float
    next_bookmark: float
    conn: socket.socket


class _Abort(Exception):
    """The watch's connection is gone (stop() or the client went away)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked watch streams, as kube-apiserver

    def setup(self):
        super().setup()
        # As kube-apiserver (Go sets TCP_NODELAY on every TCP connection): without it the
        # body, written after the headers, waits out the client's delayed ACK (~40 ms).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.sim._track(self.server, self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.sim._track(self.server, self.connection, False)

    def log_message(self, *args):
        pass  # tests assert on TestApiServer.requests instead

    def do_GET(self):
        self.server.sim._handle(self, "GET")

    def do_POST(self):
        self.server.sim._handle(self, "POST")

    def do_PUT(self):
        self.server.sim._handle(self, "PUT")

    def do_PATCH(self):
        self.server.sim._handle(self, "PATCH")

    def do_DELETE(self):
        self.server.sim._handle(self, "DELETE")


class TestApiServer:
    """An in-process Kubernetes API server on 127.0.0.1 (see the module docstring)."""

    __test__ = False  # not a pytest test class despite its name

    def __init__(self, history_size: int = 1000, token: str | None = None):
        self.token = token or secrets.token_hex(16)
        self.history_size = history_size
        self.bookmark_interval = 60.0  # seconds between BOOKMARKs, for watches asking for them
        self.default_watch_timeout = 1800.0  # kube-apiserver's --min-request-timeout
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, query) of each request
        # SelfSubjectAccessReviews: None allows everything, else only these (resource, verb).
        self.rbac_allowed: set[tuple[str, str]] | None = None
        # Serve requests without credentials (kubectl sends no token over plain HTTP).
        self.anonymous = False
        self._cond = threading.Condition()  # guards all below; watches wait on it
        self._objs: dict[tuple, dict] = {}  # (_Res, namespace, name) -> object, never mutated
        self._rv = 1000  # not 0: "0" means "any version" in the API
        self._floor = self._rv  # a watch from an RV below this gets 410 Expired
        self._history: list[_Ev] = []
        self._rules: list[list] = []  # [what, method, regex, watch, value, count]
        self._watch_epoch = 0  # drop_watches() bumps it: watches end cleanly
        self._gen = 0  # stop() bumps it: watches end abruptly
        self._conns: set[socket.socket] = set()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = 0

    # ---- lifecycle ----

    def start(self) -> None:
        """Listen on 127.0.0.1: a free port the first time, the same port afterwards."""
        if self._httpd:
            return
        httpd = ThreadingHTTPServer(("127.0.0.1", self._port), _Handler)  # SO_REUSEADDR on
        httpd.sim = self
        self._port = httpd.server_address[1]
        name = f"kube-apiserver-sim-{self._port}"
        thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), name=name)
        thread.daemon = True
        thread.start()
        self._thread, self._httpd = thread, httpd  # both at once, serving: stop() joins it

    def stop(self) -> None:
        """Close the listening socket and every connection: open watches end abruptly."""
        # This server's own thread, taken now: a start() in another thread while this
        # stop() runs (a test restarting it once its watch broke) makes a new one.
        httpd, thread, self._httpd = self._httpd, self._thread, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        with self._cond:
            self._gen += 1
            conns = list(self._conns)
            self._cond.notify_all()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        thread.join()

    def restart(self, compact: bool = False) -> None:
        """stop() and start() on the same port with the same objects. A real API server
        rebuilds its watch cache when it restarts (old RVs then get 410): compact=True."""
        self.stop()
        if compact:
            self.compact()
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def write_kubeconfig(self, path) -> str:
        """A kubeconfig for this server with a bearer token (JSON is YAML); start() first."""
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "sim"}
        cfg["clusters"] = [{"name": "sim", "cluster": {"server": self.url}}]
        cfg["users"] = [{"name": "sim", "user": {"token": self.token}}]
        cfg["contexts"] = [{"name": "sim", "context": {"cluster": "sim", "user": "sim"}}]
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        return str(path)

    # ---- failure injection ----

    def fail_next(self, method, path_regex, status=500, count=1, watch=None) -> None:
        """Answer the next `count` matching requests with a Status of that code. The regex is
        searched in the path (no query); method "*" is any; watch=True/False picks watches
        or the other requests."""
        with self._cond:
            self._rules.append(["fail", method, re.compile(path_regex), watch, status, count])

    def delay_next(self, method, path_regex, seconds, count=1, watch=None) -> None:
        """Sleep before handling the next `count` matching requests (matched as fail_next).
        The request is carried out afterwards, as on a real server: a client's timeout does
        not undo a write."""
        with self._cond:
            self._rules.append(["delay", method, re.compile(path_regex), watch, seconds, count])

    def compact(self) -> None:
        """Forget the history: a watch or an Exact list from an older RV gets 410."""
        with self._cond:
            self._history.clear()
            self._floor = self._rv
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """End every open watch cleanly, as the API server does when a watch times out."""
        with self._cond:
            self._watch_epoch += 1
            self._cond.notify_all()

    # ---- test-side helpers (not over HTTP); they return copies ----

    @property
    def resource_version(self) -> int:
        return self._rv

    def add_pod(
        self,
        namespace,
        name,
        node_name=None,
        containers=None,
        annotations=None,
        phase="Pending",
        init_containers=None,
        labels=None,
        resource_claims=None,
        resource_claim_statuses=None,
    ) -> dict:
        """A pod as stored once bound to node_name (None: not scheduled yet). A container is
        {"name", "requests", optional "limits", "image", "env", "claims"}. DRA:
        resource_claims is spec.resourceClaims ([{"name", "resourceClaimName" or
        "resourceClaimTemplateName"}]), resource_claim_statuses status.resourceClaimStatuses
        ([{"name", "resourceClaimName"}], the claims generated from templates)."""
        containers = containers or [{"name": "main", "requests": {"aliyun.com/gpu-mem": "4"}}]
        spec = {"containers": [_container(c) for c in containers]} | json.loads(_POD_SPEC_DEFAULTS)
        if init_containers:
            spec["initContainers"] = [_container(c) for c in init_containers]
        if resource_claims:
            spec["resourceClaims"] = [dict(claim) for claim in resource_claims]
        if node_name:
            spec["nodeName"] = node_name
        meta = {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())}
        meta |= {"labels": dict(labels or {}), "annotations": dict(annotations or {})}
        pod = {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec}
        pod["status"] = _pod_status(pod, phase)
        if resource_claim_statuses:
            pod["status"]["resourceClaimStatuses"] = [dict(s) for s in resource_claim_statuses]
        return self._create(PODS, namespace, pod, uid=meta["uid"])

    def update_pod(self, namespace, name, fn) -> dict:
        """fn changes (or returns a replacement for) a copy of the pod: anything, status too."""
        with self._cond:
            obj = copy.deepcopy(self._objs[self._existing((PODS, namespace, name))])
            out = fn(obj)
            return self._update((PODS, namespace, name), obj if out is None else out, "all")

    def set_pod_phase(self, namespace, name, phase) -> dict:
        return self.update_pod(namespace, name, lambda p: p | {"status": _pod_status(p, phase)})

    def delete_pod(self, namespace, name, graceful=False) -> dict:
        """Remove the pod (DELETED). graceful=True only marks it terminating (MODIFIED), as
        the API server does until kubelet has stopped its containers."""
        if graceful:
            marks = {"deletionTimestamp": _now(), "deletionGracePeriodSeconds": 30}
            return self.update_pod(namespace, name, lambda p: p["metadata"].update(marks))
        with self._cond:
            return self._commit(self._existing((PODS, namespace, name)), None, "DELETED")

    def pod(self, namespace, name) -> dict | None:
        with self._cond:
            return copy.deepcopy(self._objs.get((PODS, namespace, name)))

    def pods(self) -> list[dict]:
        return self._all(PODS)

    def add_node(self, name, labels=None, capacity=None, annotations=None, address=None) -> dict:
        """A node as kubelet registers it; address: its InternalIP (default 10.0.0.11)."""
        node = json.loads(_NODE)
        node["metadata"] |= {"name": name}
        node["metadata"]["labels"] |= {"kubernetes.io/hostname": name, **(labels or {})}
        node["metadata"]["annotations"] |= annotations or {}
        status = node["status"]
        if address:
            status["addresses"][0]["address"] = address
        status["capacity"] |= capacity or {}
        status["allocatable"] = dict(status["capacity"])
        status["addresses"].append({"type": "Hostname", "address": name})
        status["conditions"][0] |= {"lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
        return self._create(NODES, "", node)

    def node(self, name) -> dict | None:
        with self._cond:
            return copy.deepcopy(self._objs.get((NODES, "", name)))

    def nodes(self) -> list[dict]:
        return self._all(NODES)

    # ---- resource.k8s.io (DRA); the writes go through the API server's admission ----

    def add_device_class(self, name, selectors=None, config=None) -> dict:
        """A DeviceClass; selectors are CEL expressions (strings)."""
        spec = {"selectors": [{"cel": {"expression": e}} for e in selectors or []]}
        if config:
            spec["config"] = [dict(c) for c in config]
        return self._create(DEVICE_CLASSES, "", {"metadata": {"name": name}, "spec": spec})

    def add_resource_slice(self, obj) -> dict:
        """A ResourceSlice as a driver would create it (admitted as over HTTP)."""
        return self._create(RESOURCE_SLICES, "", copy.deepcopy(obj))

    def add_resource_claim(self, namespace, name, requests=None, spec=None, owner=None) -> dict:
        """A ResourceClaim: ``spec`` as given, or one ``exactly`` request per entry of
        ``requests`` ({"name", "deviceClassName", optional "count", "capacity" (a map of
        capacity requests), "selectors" (CEL strings)}). ``owner``: a pod that controls
        it, as kube-controller-manager sets for a claim made from a template."""
        if spec is None:
            spec = {"devices": {"requests": [_dra_request(r) for r in requests or []]}}
        body = {"metadata": {"name": name, "namespace": namespace}, "spec": spec}
        if owner is not None:
            meta = owner["metadata"]
            body["metadata"]["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                 "controller": True, "blockOwnerDeletion": True}
            ]  # fmt: skip
        return self._create(RESOURCE_CLAIMS, namespace, body)

    def allocate_claim(self, namespace, name, node, pod=None, match=None) -> dict:
        """Allocate the claim as kube-scheduler would (standins.dra_allocator) from the
        ResourceSlices, classes and other claims stored now, reserved for ``pod`` (a pod
        dict, e.g. from add_pod); written through the status subresource. Raises
        dra_allocator.AllocationError when nothing fits."""
        with self._cond:
            key = self._existing((RESOURCE_CLAIMS, namespace, name))
            claim = copy.deepcopy(self._objs[key])
            slices = [o for _, o in self._items(RESOURCE_SLICES)]
            claims = [o for _, o in self._items(RESOURCE_CLAIMS)]
            classes = {k[2]: o for k, o in self._items(DEVICE_CLASSES)}
            claim["status"] = dra_allocator.allocate(
                claim, copy.deepcopy(slices), copy.deepcopy(claims), node, pod,
                copy.deepcopy(classes), match,
            )  # fmt: skip
            return self._update(key, claim, "status")

    def reserve_claim(self, namespace, name, pod) -> dict:
        """Add ``pod`` to the claim's reservedFor (another pod sharing it)."""
        with self._cond:
            key = self._existing((RESOURCE_CLAIMS, namespace, name))
            claim = copy.deepcopy(self._objs[key])
            claim["status"] = dra_allocator.reserve(claim, pod)
            return self._update(key, claim, "status")

    def update_resource_claim(self, namespace, name, fn) -> dict:
        """fn changes (or returns) a copy of the claim; stored as a status update."""
        with self._cond:
            key = self._existing((RESOURCE_CLAIMS, namespace, name))
            claim = copy.deepcopy(self._objs[key])
            out = fn(claim)
            return self._update(key, claim if out is None else out, "status")

    def delete_resource_claim(self, namespace, name) -> dict:
        with self._cond:
            return self._commit(self._existing((RESOURCE_CLAIMS, namespace, name)), None, "DELETED")

    def resource_claim(self, namespace, name) -> dict | None:
        with self._cond:
            return copy.deepcopy(self._objs.get((RESOURCE_CLAIMS, namespace, name)))

    def resource_claims(self) -> list[dict]:
        return self._all(RESOURCE_CLAIMS)

    def resource_slices(self, node=None) -> list[dict]:
        """The ResourceSlices (only ``node``'s with a node)."""
        return [
            s
            for s in self._all(RESOURCE_SLICES)
            if node is None or s["spec"].get("nodeName") == node
        ]

    def events(self) -> list[dict]:
        """The events of both APIs, core/v1 first."""
        return self._all(EVENTS) + self._all(EVENTS_V1)

    # ---- store; _commit and _update need self._cond held ----

    def _items(self, res) -> list[tuple[tuple, dict]]:
        return sorted(((k, o) for k, o in self._objs.items() if k[0] is res), key=_ns_name)

    def _all(self, res) -> list[dict]:
        with self._cond:
            return [copy.deepcopy(o) for _, o in self._items(res)]

    def _existing(self, key) -> tuple:
        if key not in self._objs:
            res, _, name = key
            details = {"name": name, "group": res.group, "kind": res.plural}
            raise ApiError(404, f'{_qualified(res)} "{name}" not found', details=details)
        return key

    def _commit(self, key, obj, ev_type) -> dict:
        self._rv += 1
        prev = self._objs.get(key)
        if ev_type == "DELETED":
            del self._objs[key]
            obj = copy.deepcopy(prev)  # a DELETED object carries the deletion's own RV
        else:
            self._objs[key] = obj
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._history.append(_Ev(self._rv, key, ev_type, obj, prev))
        if len(self._history) > self.history_size:
            self._floor = self._history[-self.history_size - 1].rv
            del self._history[: -self.history_size]
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _create(self, res, ns, body, uid=None) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        meta = body.setdefault("metadata", {})
        if res.namespaced and meta.setdefault("namespace", ns) != ns:
            raise ApiError(400, "the namespace of the object does not match the request's")
        if not meta.get("name") and meta.get("generateName"):
            suffix = "".join(secrets.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
            meta["name"] = meta["generateName"] + suffix
        if not meta.get("name"):
            raise ApiError(422, f"{res.kind} is invalid: metadata.name: Required value")
        meta.pop("resourceVersion", None)
        meta |= {"uid": uid or str(uuid.uuid4()), "creationTimestamp": _now()}
        body["kind"], body["apiVersion"] = res.kind, res.api_version
        if res is RESOURCE_CLAIMS:
            body.pop("status", None)  # a claim is created without status (its strategy)
        _validate(res, body)
        _admit_dra(res, body, None, None)
        key, name = (res, ns, meta["name"]), meta["name"]
        with self._cond:
            if key in self._objs:
                details = {"name": name, "kind": res.plural}
                raise ApiError(
                    409, f'{_qualified(res)} "{name}" already exists', "AlreadyExists", details
                )
            return self._commit(key, body, "ADDED")

    def _update(self, key, new, sub) -> dict:
        """Store `new` over the current object. sub: None (main resource: status kept),
        "status" (only status taken) or "all" (test helpers: everything taken)."""
        res, _, name = key
        cur = self._objs[self._existing(key)]
        if not isinstance(new, dict):
            raise ApiError(400, "the body must be a JSON object")
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if rv and rv != cur["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                f'Operation cannot be fulfilled on {_qualified(res)} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
                details={"name": name, "kind": res.plural},
            )
        if res.status_sub and sub == "status":
            new = cur | {"status": new.get("status", {})}
        elif res.status_sub and sub is None:
            new = new | {"status": cur.get("status")}
        new = copy.deepcopy(new)
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise ApiError(400, f"the name of the object ({meta['name']}) is not {name}")
        for f in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion"):
            if f in cur["metadata"]:  # server-managed: a client cannot change them
                meta[f] = cur["metadata"][f]
        new["kind"], new["apiVersion"] = res.kind, res.api_version
        _validate(res, new)
        _admit_dra(res, new, cur, sub)
        if new == cur:  # the real server does not bump the RV of a no-op write
            return copy.deepcopy(new)
        return self._commit(key, new, "MODIFIED")

    def _state_at(self, res, rv: int) -> dict:
        """The objects of one resource as they were at `rv`: history after it, undone."""
        if rv < self._floor:
            raise ApiError(410, "The resourceVersion for the provided list is too old.")
        state = dict(self._items(res))
        for ev in reversed(self._history):
            if ev.rv <= rv:
                break
            if ev.key[0] is res and ev.prev is None:
                state.pop(ev.key, None)
            elif ev.key[0] is res:
                state[ev.key] = ev.prev
        return state

    # ---- HTTP ----

    def _track(self, server, conn, add: bool) -> None:
        with self._cond:
            if not add:
                self._conns.discard(conn)
            elif server is self._httpd:
                self._conns.add(conn)
            else:  # accepted just as stop() ran: it goes the way of the others
                conn.shutdown(socket.SHUT_RDWR)

    def _take_rule(self, what, method, path, is_watch):
        with self._cond:
            for rule in self._rules:
                w, m, rx, watch, value, _ = rule
                if (
                    w == what
                    and m in (method, "*")
                    and rx.search(path)
                    and watch in (None, is_watch)
                ):
                    rule[5] -= 1
                    if rule[5] <= 0:
                        self._rules.remove(rule)
                    return value
        return None

    def _handle(self, h, method) -> None:
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        self.requests.append((method, url.path, query))
        is_watch = query.get("watch") in ("true", "1")
        try:
            auth = h.headers.get("Authorization")
            # The scheme in any case, as kube-apiserver takes it (the official client's
            # in-cluster loader sends "bearer").
            scheme, _, token = (auth or "").partition(" ")
            if (scheme.lower(), token) != ("bearer", self.token) and (
                auth is not None or not self.anonymous
            ):
                raise ApiError(401, "Unauthorized")
            if delay := self._take_rule("delay", method, url.path, is_watch):
                time.sleep(delay)
            if code := self._take_rule("fail", method, url.path, is_watch):
                raise ApiError(code, f"injected failure: HTTP {code}")
            result = self._route(h, method, url.path, query, body, is_watch)
            if result is None:
                return  # a watch wrote its own response
            code, obj = result
            table = table_version(h.headers.get("Accept") or "")
            if method == "GET" and code == 200 and table:
                obj = as_table(obj, table) or obj  # what `kubectl get` prints
        except ApiError as e:
            code, obj = e.code, e.status
        except Exception as e:  # a bug in this simulator: make it visible to the client
            code, obj = 500, status_obj(500, f"simulator error: {e!r}")
        data = json.dumps(obj).encode()
        try:
            h.send_response(code)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.send_header("Audit-Id", str(uuid.uuid4()))
            if code == 429:
                h.send_header("Retry-After", "1")
            h.end_headers()
            h.wfile.write(data)
        except OSError:
            h.close_connection = True

    def _route(self, h, method, path, query, body, is_watch):
        if method == "GET" and (document := discovery(path)) is not None:
            return 200, document
        if path == ACCESS_REVIEWS:
            if method != "POST":
                raise ApiError(
                    405, "the server does not allow this method on the requested resource"
                )
            return 201, self._access_review(_json(body))
        m = _PATH.match(path)
        res = m and _RESOURCES.get((m["group"] or "", m["plural"]))
        ns, name, sub = (m["ns"] or "", m["name"], m["sub"]) if res else ("", None, None)
        binding = res is PODS and bool(name) and sub == "binding"
        if (
            not res
            or (ns and not res.namespaced)
            or (name and res.namespaced and not ns)
            or (sub and not binding and (sub != "status" or not res.status_sub))
        ):
            raise ApiError(404, "the server could not find the requested resource")
        key = (res, ns, name)
        if binding:
            if method != "POST":
                raise ApiError(
                    405, "the server does not allow this method on the requested resource"
                )
            return 201, self._bind(key, _json(body))
        if name is None and method == "GET" and is_watch:
            return self._watch(h, res, ns, query)
        if name is None and method == "GET":
            return 200, self._list(res, ns, query)
        if name is None and method == "POST" and (ns or not res.namespaced):
            return 201, self._create(res, ns, _json(body))
        if name and method == "GET":
            with self._cond:
                return 200, copy.deepcopy(self._objs[self._existing(key)])
        if name and method == "PUT":
            with self._cond:
                return 200, self._update(key, _json(body), sub)
        if name and method == "PATCH":
            ctype = h.headers.get("Content-Type", "").split(";")[0].strip()
            if ctype not in _PATCHERS:
                raise ApiError(415, f"the body of the request was in an unknown format: {ctype}")
            doc = _json(body)
            if isinstance(doc, list) != (ctype == "application/json-patch+json"):
                raise ApiError(400, f"the body is not a valid {ctype} document")
            with self._cond:
                patched = _PATCHERS[ctype](self._objs[self._existing(key)], doc)
                return 200, self._update(key, patched, sub)
        if name is None and method == "DELETE" and res.group == _RESOURCE_GROUP:
            return 200, self._delete_collection(res, ns, query)
        if name and method == "DELETE" and not sub:
            return 200, self._delete(key, _json(body) if body.strip() else {})
        raise ApiError(405, "the server does not allow this method on the requested resource")

    def _access_review(self, review) -> dict:
        spec = review.get("spec") if isinstance(review, dict) else None
        spec = spec if isinstance(spec, dict) else {}
        attributes, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if (attributes is None) == (non_resource is None):
            raise ApiError(
                422,
                'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: '
                'spec.resourceAttributes: Invalid value: "null": exactly one of '
                "nonResourceAttributes or resourceAttributes must be specified",
            )
        allowed = self.rbac_allowed is None
        if attributes is not None and not allowed:
            resource, sub = attributes.get("resource", ""), attributes.get("subresource")
            allowed = (f"{resource}/{sub}" if sub else resource, attributes.get("verb")) in (
                self.rbac_allowed
            )
        status = {"allowed": allowed}  # a denial by RBAC alone gives no reason on the wire
        if allowed:
            status["reason"] = 'RBAC: allowed by ClusterRoleBinding "sim" of ClusterRole "sim"'
        review = {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1"}
        return review | {"metadata": {"creationTimestamp": None}, "spec": spec, "status": status}

    def _list(self, res, ns, query) -> dict:
        match, rv = _matcher(res, ns, query), query.get("resourceVersion", "")
        limit = int(query.get("limit") or 0) if (query.get("limit") or "0").isdigit() else 0
        token = query.get("continue") or ""
        with self._cond:
            n = _parse_rv(rv) if rv else 0
            if n > self._rv:  # the real server waits 3 s for it, then says this
                raise ApiError(504, f"Too large resource version: {n}, current: {self._rv}")
            exact = query.get("resourceVersionMatch") == "Exact"
            start = None
            if token:  # the next page of an earlier list: the same snapshot
                n, start = _parse_continue(token)
                exact = True
                if n < self._floor:
                    raise ApiError(
                        410,
                        "The provided continue parameter is too old to display a consistent "
                        "list result. You can start a new list without the continue parameter.",
                    )
            elif limit and not exact:
                n, exact = self._rv, True  # a paged list is a snapshot at this version
            state = self._state_at(res, n) if exact else dict(self._items(res))
            ordered = sorted(state.items(), key=_ns_name)
            if start is not None:
                ordered = [(k, o) for k, o in ordered if list(k[1:]) > start]
            items = [(k, o) for k, o in ordered if match(o)]
            meta = {"resourceVersion": str(n if exact else self._rv)}
            if limit and len(items) > limit:
                items = items[:limit]
                meta["continue"] = _continue_token(n, items[-1][0])
            # List items go without kind and apiVersion on the wire.
            out = [
                {k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for _, o in items
            ]
            return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta} | {
                "items": copy.deepcopy(out)
            }

    def _bind(self, key, binding) -> dict:
        """A Binding: the pod gets spec.nodeName (what kube-scheduler's bind does)."""
        _, ns, name = key
        if not isinstance(binding, dict):
            raise ApiError(400, "the body must be a JSON object")
        meta = binding.get("metadata") or {}
        if meta.get("name", name) != name:
            raise ApiError(400, "name in URL does not match name in Binding object")
        target = binding.get("target") or {}
        if target.get("kind") not in (None, "", "Node"):
            raise ApiError(
                422,
                f'Binding "{name}" is invalid: target.kind: Unsupported value: '
                f'"{target.get("kind")}": supported values: "Node"',
            )
        if not target.get("name"):
            raise ApiError(422, f'Binding "{name}" is invalid: target.name: Required value')
        with self._cond:
            pod = copy.deepcopy(self._objs[self._existing(key)])
            pod_meta = pod["metadata"]
            uid = meta.get("uid")
            if uid and uid != pod_meta["uid"]:
                raise ApiError(
                    409,
                    f'Operation cannot be fulfilled on pods/binding "{name}": Precondition '
                    f"failed: UID in precondition: {uid}, UID in object meta: {pod_meta['uid']}",
                    details={"name": name, "kind": "pods/binding"},
                )
            if pod_meta.get("deletionTimestamp"):
                raise ApiError(
                    409,
                    f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is '
                    "being deleted, cannot be assigned to a host",
                    details={"name": name, "kind": "pods/binding"},
                )
            if pod["spec"].get("nodeName"):
                raise ApiError(
                    409,
                    f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is '
                    f'already assigned to node "{pod["spec"]["nodeName"]}"',
                    details={"name": name, "kind": "pods/binding"},
                )
            pod["spec"]["nodeName"] = target["name"]
            if meta.get("annotations"):
                pod_meta["annotations"] = {**(pod_meta.get("annotations") or {})}
                pod_meta["annotations"].update(meta["annotations"])
            status = pod.setdefault("status", {})
            conditions = [c for c in status.get("conditions") or [] if c["type"] != "PodScheduled"]
            scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
            status["conditions"] = [scheduled, *conditions]
            self._update(key, pod, "all")
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"} | {
            "code": 201
        }

    def _delete_collection(self, res, ns, query) -> dict:
        """DELETE on a collection (what kubelet wipes a node's ResourceSlices with): every
        object the selectors match goes; the answer lists them."""
        match = _matcher(res, ns, query)
        with self._cond:
            gone = [self._commit(k, None, "DELETED") for k, o in self._items(res) if match(o)]
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in gone]
            meta = {"resourceVersion": str(self._rv)}
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta} | {
            "items": items
        }

    def _delete(self, key, opts) -> dict:
        res, _, name = key
        with self._cond:
            cur = self._objs[self._existing(key)]
            for f, want in ((opts or {}).get("preconditions") or {}).items():
                if want and want != cur["metadata"].get(f):
                    msg = f"Precondition failed: {f}: {want}, {f} in object meta: "
                    msg += str(cur["metadata"].get(f))
                    raise ApiError(
                        409, f'Operation cannot be fulfilled on {_qualified(res)} "{name}": ' + msg
                    )
            obj = self._commit(key, None, "DELETED")
        if res.return_deleted:
            return obj
        details = {"name": name, "kind": res.plural, "uid": obj["metadata"]["uid"]}
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"} | {
            "details": details
        }

    def _watch(self, h, res, ns, query) -> None:
        match, rv = _matcher(res, ns, query), query.get("resourceVersion", "")
        now = time.monotonic()
        end = now + float(query.get("timeoutSeconds") or self.default_watch_timeout)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        bookmark = now + self.bookmark_interval if bookmarks else float("inf")
        with self._cond:
            w = _Watch(
                res, match, self._rv, self._gen, self._watch_epoch, end, bookmark, h.connection
            )
            if rv in ("", "0"):  # "get state and start at most recent": synthetic ADDEDs
                batch = [("ADDED", o) for _, o in self._items(res) if match(o)]
            else:
                w.last, batch = _parse_rv(rv), []  # a bad RV is a 400, before any header
                if w.last > self._rv:  # the real server waits 3 s for it, then says this
                    msg = f"Too large resource version: {w.last}, current: {self._rv}"
                    raise ApiError(504, msg)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Cache-Control", "no-cache, private")
        h.end_headers()
        try:
            while batch is not None:
                for ev_type, obj in batch:
                    line = json.dumps({"type": ev_type, "object": obj}).encode() + b"\n"
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                if batch and batch[-1][0] == "ERROR":
                    break
                batch = self._next_batch(w)
            h.wfile.write(b"0\r\n\r\n")  # the clean end of a chunked stream
        except (OSError, _Abort):
            h.close_connection = True  # no last chunk: the client sees a broken stream

    def _next_batch(self, w: _Watch) -> list | None:
        """Wait for what a watch sends next; None at its clean end (timeout, drop_watches)."""
        with self._cond:
            while True:
                now = time.monotonic()
                if w.gen != self._gen or _peer_closed(w.conn):
                    raise _Abort
                if w.epoch != self._watch_epoch or now >= w.end:
                    return None
                if w.last < self._floor:  # the history went past this watch: it must re-list
                    msg = f"too old resource version: {w.last} ({self._floor})"
                    return [("ERROR", status_obj(410, msg))]
                start = bisect.bisect_right(self._history, w.last, key=_rv_of)
                batch = [(t, ev.obj) for ev in self._history[start:] if (t := _seen_as(ev, w))]
                w.last = self._rv
                if now >= w.next_bookmark:
                    meta = {"resourceVersion": str(w.last)}
                    obj = {"kind": w.res.kind, "apiVersion": w.res.api_version, "metadata": meta}
                    batch.append(("BOOKMARK", obj))
                    w.next_bookmark = now + self.bookmark_interval
                if batch:
                    return batch
                self._cond.wait(min(w.end, w.next_bookmark, now + 1.0) - now)


def _seen_as(ev: _Ev, w: _Watch) -> str | None:
    """The event a watch sees: entering or leaving its selection is an ADDED or DELETED."""
    if ev.key[0] is not w.res:
        return None
    if ev.type != "MODIFIED":
        return ev.type if w.match(ev.obj) else None
    was, now = w.match(ev.prev), w.match(ev.obj)
    return ("MODIFIED" if was else "ADDED") if now else ("DELETED" if was else None)


def _continue_token(rv: int, key: tuple) -> str:
    """An opaque continue token: the snapshot's version and the last key returned."""
    data = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": [key[1], key[2]]})
    return base64.urlsafe_b64encode(data.encode()).decode()


def _parse_continue(token: str) -> tuple[int, list]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), list(data["start"])
    except (ValueError, KeyError, TypeError):
        raise ApiError(400, f"invalid continue token: {token!r}") from None


def _rv_of(ev: _Ev) -> int:
    return ev.rv


def _ns_name(item) -> tuple:
    return item[0][1:]


def _parse_rv(rv: str) -> int:
    try:
        return int(rv)
    except ValueError:
        raise ApiError(400, f"invalid resource version: {rv!r}") from None


def _json(body: bytes):
    try:
        return json.loads(body or b"null")
    except ValueError as e:
        raise ApiError(400, f"couldn't decode the request body: {e}") from None


def _peer_closed(sock) -> bool:
    """Whether the client closed its end: a watch that sends nothing would never notice."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
