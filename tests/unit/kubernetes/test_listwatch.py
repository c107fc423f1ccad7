"""Pins nodemgr.kubernetes.listwatch as the one LIST+WATCH follower of the daemon's pod
watch and the extender, against the test API server: a field selector narrows every page
of the LIST (continue pages too) and the WATCH, so only the selected objects ever reach
the handler; on an expired version ``on_expired`` runs (the pod watch marks its cache
unsynced) before the one new LIST; the thread carries the name it was given. The
extender's paging, node watch and resource check are pinned in
tests/unit/extender/test_kube_edge.py."""

from __future__ import annotations

import threading
import time

import pytest

from nodemgr.kubernetes.client import ApiSession, find_credentials, new_api_client
from nodemgr.kubernetes.listwatch import ListWatch
from nodemgr.kubernetes.writes import Backoff
from tests.unit.kubernetes.support import NODE, TIMEOUT_SECONDS, requests_of, wait_until


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    def replace(self, items):
        names = [obj["metadata"]["name"] for obj in items]  # fetches the pages
        with self.lock:
            self.lists.append(names)

    def apply(self, kind, obj):
        with self.lock:
            self.events.append((kind, obj["metadata"]["name"]))


@pytest.fixture
def follow(api, tmp_path):
    made = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    def start(**options):
        session = ApiSession(
            new_api_client(find_credentials(kubeconfig, environ={})), TIMEOUT_SECONDS, time.time
        )
        recorder, stop = Recorder(), threading.Event()
        options.setdefault("backoff", Backoff(0.05, 0.4))
        watch = ListWatch(session, "pods", recorder, stop, **options)
        made.append((watch, stop, session))
        watch.start()
        wait_until(lambda: watch.synced and watch.watching, what="LIST and WATCH")
        return watch, recorder

    yield start
    for watch, stop, session in made:
        stop.set()
        watch.abort()
        watch.thread.join(2.0)
        session.close()


def test_a_field_selector_narrows_every_page_and_the_watch(api, follow):
    """With ``spec.nodeName=node-a`` and pages of 2: every LIST request (the continue pages
    too: the API requires the same selector) and the WATCH carry the selector; the handler
    gets node-a's pods only, in the LIST and in the events."""
    for i in range(5):
        api.add_pod("ml", f"a{i}", NODE)
        api.add_pod("ml", f"b{i}", "node-b")
    watch, recorder = follow(page_size=2, field_selector=f"spec.nodeName={NODE}")
    assert recorder.lists == [[f"a{i}" for i in range(5)]]
    lists = requests_of(api, "GET", r"^/api/v1/pods$", watch=False)
    assert len(lists) == 3 and all("continue" in q for _, _, q in lists[1:])
    [(_, _, watched)] = requests_of(api, "GET", r"^/api/v1/pods$", watch=True)
    for _, _, query in [*lists, (None, None, watched)]:
        assert query.get("fieldSelector") == f"spec.nodeName={NODE}", query
    api.add_pod("ml", "b9", "node-b")
    api.add_pod("ml", "a9", NODE)
    wait_until(lambda: recorder.events == [("ADDED", "a9")], what="the node's new pod")
    assert watch.thread.name == "watch-pods"


def test_an_expired_version_runs_on_expired_before_the_new_list(api, follow):
    """A watch resumed from a compacted version (410): ``on_expired`` runs once, while
    ``synced`` is False and before the second LIST; then the LIST and the watch go on."""
    seen = []

    def on_expired():
        seen.append((watch.synced, len(recorder.lists)))

    api.add_pod("ml", "old", NODE)
    watch, recorder = follow(on_expired=on_expired, thread_name="kube-watch")
    api.delay_next("GET", r"^/api/v1/pods$", 0.5, watch=True)
    api.drop_watches()
    api.add_pod("ml", "new", NODE)
    api.compact()
    wait_until(lambda: len(recorder.lists) == 2, what="the LIST after the expiry")
    assert seen == [(False, 1)]
    assert recorder.lists[1] == ["new", "old"] and watch.lists == 2
    assert watch.thread.name == "kube-watch"
