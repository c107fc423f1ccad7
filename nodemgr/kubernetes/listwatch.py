"""LIST+WATCH of one resource (nodes, pods), handed to a handler as raw JSON.

For the scheduler extender's cache and the daemon's pod watch. One thread per
resource: a paged LIST (50,000 pods are never one body in memory), then a WATCH with
bookmarks, resumed from the last version when the server ends it or the connection
fails (with backoff), listed again when the version expired (410) or went back (504).

The handler gets decoded JSON dicts: ``replace(items)`` after a LIST (``items`` fetches
pages as consumed: the handler must not hold its own lock while iterating) and
``apply(kind, obj)`` per ADDED, MODIFIED or DELETED event.

What it must not do: list more than once per (re)start or expiry, hold a
lock over I/O, or let an error end the thread before ``stop``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from nodemgr.errors import KubeApiError, KubeExpired, KubeForbidden, KubeUnavailable
from nodemgr.kubernetes.client import ApiSession, map_error, status_error
from nodemgr.kubernetes.writes import Backoff

log = logging.getLogger("nodemgr.kubernetes.listwatch")

RESOURCES = ("nodes", "pods")


class WatchHandler(Protocol):
    def replace(self, items: Iterator[Mapping[str, Any]]) -> None: ...

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None: ...


class ListWatch:
    """``on_expired`` runs when the version expired, before the new LIST."""

    def __init__(
        self,
        session: ApiSession,
        resource: str,
        handler: WatchHandler,
        stop: threading.Event,
        *,
        watch_timeout_seconds: int = 300,
        page_size: int = 500,
        backoff: Backoff | None = None,
        field_selector: str | None = None,
        on_expired: Callable[[], None] | None = None,
        name: str = "",
        thread_name: str = "",
        logger: logging.Logger = log,
    ):
        if resource not in RESOURCES:
            raise ValueError(f"resource must be one of {RESOURCES}, not {resource!r}")
        self.resource = resource
        self._session = session
        self._handler = handler
        self._stop = stop
        self._watch_timeout_seconds = watch_timeout_seconds
        self._page_size = page_size
        self._backoff = backoff or Backoff()
        self._field_selector = field_selector
        self._on_expired = on_expired or (lambda: None)
        self._name = name or f"{resource} watch"
        self._log = logger
        self._response_lock = threading.Lock()
        self._response: Any = None  # for abort()
        self.synced = False  # since the last expiry
        self.watching = False
        self.lists = 0
        self.last_error: str | None = None
        self.thread = threading.Thread(
            target=self._run, name=thread_name or f"watch-{resource}", daemon=True
        )

    def _list_method(self) -> Callable[..., Any]:
        core = self._session.core
        if self.resource == "nodes":
            return core.list_node
        return core.list_pod_for_all_namespaces

    def _selection(self) -> dict[str, str]:
        return {"field_selector": self._field_selector} if self._field_selector else {}

    def start(self) -> None:
        self.thread.start()

    def abort(self) -> None:
        """After ``stop`` is set."""
        with self._response_lock:
            response = self._response
        if response is not None:
            _wake_reader(response)  # the watch thread closes it

    # --- the thread --------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._backoff
        resource_version: str | None = None
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                if resource_version is None:
                    resource_version = self._relist()
                resource_version = self._follow(resource_version)
                if time.monotonic() - began >= 1.0:
                    backoff.reset()
                    continue  # the server ended a long watch: resume at once
                delay = backoff.next_delay_seconds()  # ended at once: do not spin
            except KubeExpired:
                self._log.info(
                    "%s: version %s expired, listing again", self._name, resource_version
                )
                resource_version = None
                self.synced = False
                self._on_expired()
                if time.monotonic() - began >= 1.0:
                    continue
                delay = backoff.next_delay_seconds()  # expired at once again: do not spin
            except KubeApiError as e:
                self.last_error = str(e)
                delay = backoff.next_delay_seconds()
                self._log.debug("%s failed, again in %.1f s: %s", self._name, delay, e)
                if not isinstance(e, (KubeUnavailable, KubeForbidden)):  # those are logged
                    self._session.log_once(f"{self._name}: {e}", logging.WARNING)
            except Exception:  # a bug must not end the watch for the process's lifetime
                delay = backoff.next_delay_seconds()
                self._log.exception("%s failed, again in %.1f s", self._name, delay)
            self._stop.wait(delay)

    def _pages(self, first: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
        page = first
        while True:
            yield from page.get("items") or ()
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token or self._stop.is_set():
                return
            page = self._session.call(
                "list",
                self.resource,
                self._list_method(),
                limit=self._page_size,
                _continue=token,
                **self._selection(),
            )

    def _relist(self) -> str:
        """The list's resourceVersion."""
        first = self._session.call(
            "list", self.resource, self._list_method(), limit=self._page_size, **self._selection()
        )
        self.lists += 1
        version = str((first.get("metadata") or {}).get("resourceVersion") or "")
        self._handler.replace(self._pages(first))
        self.synced = True
        self.last_error = None
        return version

    def _follow(self, resource_version: str) -> str:
        """The last version seen."""
        session = self._session
        try:
            response = self._list_method()(
                watch=True,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_seconds,
                _preload_content=False,
                # The server ends the watch after timeout_seconds; a read that
                # waits longer than that means the connection died silently.
                _request_timeout=(
                    session.timeout_seconds,
                    self._watch_timeout_seconds + 2 * session.timeout_seconds,
                ),
                **self._selection(),
            )
        except Exception as e:
            error = map_error(e, "watch", self.resource)
            if error.status == 504 and "too large resource version" in str(error).lower():
                # The server's versions went back (etcd restored, a new
                # cluster at the same address): ours means nothing there.
                raise KubeExpired(str(error), 504) from e
            session.note_error(error)
            raise error from e
        with self._response_lock:
            self._response = response
        self.watching = True
        session.note_ok()
        try:
            if self._stop.is_set():  # stop came before the response was registered
                return resource_version
            for line in _lines(response):
                if self._stop.is_set():
                    break
                if line.strip():
                    resource_version = self._event(json.loads(line), resource_version)
        except KubeApiError as e:  # an ERROR event in the stream
            session.note_error(e)
            raise
        except Exception as e:
            if self._stop.is_set():
                return resource_version
            error = map_error(e, "watch", self.resource)
            session.note_error(error)
            raise error from e
        finally:
            self.watching = False
            with self._response_lock:
                self._response = None
            _close_response(response)
        return resource_version

    def _event(self, event: Mapping[str, Any], resource_version: str) -> str:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise status_error(obj, "watch", self.resource)
        version = (obj.get("metadata") or {}).get("resourceVersion") or resource_version
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._handler.apply(str(kind), obj)
        return str(version)  # BOOKMARK: only the version moves


def _lines(response: Any) -> Iterator[str]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if buffer.strip():
        yield buffer.decode("utf-8", "replace")


def _wake_reader(response: Any) -> None:
    """shutdown() of the socket: close() does not interrupt a blocked recv(), and closing
    the response waits for the reader's buffer lock."""
    connection = getattr(response, "connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _close_response(response: Any) -> None:
    _wake_reader(response)
    try:
        response.close()
    except Exception:  # already closed: done either way
        pass
