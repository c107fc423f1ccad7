"""The extender's TLS: its certificate, the CA its client must be signed by, and rotation.

kube-scheduler calls with a client certificate (``enableHTTPS`` and ``tlsConfig``); only
one chaining to ``client_ca`` is accepted (``ssl.CERT_REQUIRED``, TLS 1.2 or later),
optionally also named in ``client_names`` (CN or DNS name).

At most once per ``check_seconds`` ``context()`` looks at the files (device, inode, size
and mtime of what each path resolves to, so a Secret volume's symlink swap counts) and
builds a new context for new connections when one changed. Files that do not load (half
written, mismatched key) leave the last good context, logged once per state.

What it must not do: accept a connection without a client certificate the CA
signed; fall back to plain text.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("nodemgr.extender")

CHECK_SECONDS = 1.0


class TlsError(ValueError):
    """TLS files that do not make a server context; the message says which and why."""


@dataclass(frozen=True)
class TlsFiles:
    cert: str  # the server's certificate chain (PEM)
    key: str  # its private key (PEM)
    client_ca: str  # the CA(s) a client's certificate must chain to (PEM)

    @classmethod
    def in_directory(cls, directory: str) -> TlsFiles:
        """A cert-manager style Secret volume."""
        return cls(
            os.path.join(directory, "tls.crt"),
            os.path.join(directory, "tls.key"),
            os.path.join(directory, "ca.crt"),
        )

    @property
    def paths(self) -> tuple[str, str, str]:
        return self.cert, self.key, self.client_ca


def server_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(
            f"the certificate {files.cert} and key {files.key} do not load: {_why(e)}"
        ) from None
    try:
        context.load_verify_locations(cafile=files.client_ca)
    except (OSError, ssl.SSLError) as e:
        raise TlsError(f"the client CA {files.client_ca} does not load: {_why(e)}") from None
    if not context.get_ca_certs():
        raise TlsError(f"the client CA {files.client_ca} holds no CA certificate")
    return context


def _why(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def peer_names(certificate: dict) -> set[str]:
    """The subject CN and DNS names of a peer certificate (``SSLSocket.getpeercert()``)."""
    names = {
        value for rdn in certificate.get("subject", ()) for key, value in rdn if key == "commonName"
    }
    names |= {value for kind, value in certificate.get("subjectAltName", ()) if kind == "DNS"}
    return names


class ServerTls:
    def __init__(
        self,
        files: TlsFiles,
        client_names: tuple[str, ...] = (),
        check_seconds: float = CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.files = files
        self.client_names = frozenset(client_names)
        self._check_seconds = check_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._stamps = tuple(_stamp(p) for p in files.paths)
        self._context = server_context(files)  # at start, a bad file is an error
        self._checked_at = clock()
        self._failed: tuple | None = None
        self.reloads = 0

    def context(self) -> ssl.SSLContext:
        now = self._clock()
        with self._lock:
            if now - self._checked_at >= self._check_seconds:
                self._checked_at = now
                self._maybe_reload()
            return self._context

    def _maybe_reload(self) -> None:
        stamps = tuple(_stamp(p) for p in self.files.paths)
        if stamps == self._stamps or stamps == self._failed:
            return
        try:
            context = server_context(self.files)
        except TlsError as e:
            self._failed = stamps
            log.error("TLS files changed but do not load (%s); still serving the previous ones", e)
            return
        self._context, self._stamps, self._failed = context, stamps, None
        self.reloads += 1
        log.info("TLS files changed: new connections use %s", ", ".join(self.files.paths))

    def accepts(self, certificate: dict | None) -> str:
        """ "" when a client with this (verified) certificate may call, else why not."""
        if not certificate:
            return "no client certificate"
        if self.client_names and not peer_names(certificate) & self.client_names:
            return f"its certificate names none of {', '.join(sorted(self.client_names))}"
        return ""
