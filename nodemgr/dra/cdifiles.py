"""The CDI spec files of prepared claims, one per claim, in ``dra.cdi_dir``.

The container runtime reads every ``*.json`` of the directory when a container asks
for a CDI device, so a file is written whole or not at all (a temporary name that
does not end in ``.json``, then a rename) and removed when its claim is unprepared.
Not fsync'd (it cost more than the rest of a prepare together): a rename is atomic
for every reader whatever the daemon's fate, and only a power loss could take a spec
back, which takes every container with it; at start the daemon writes the spec of
every claim the ledger holds again (``DraDriver.restore``), as ``/var/run/cdi`` is a
tmpfs emptied at boot anyway.
Files are named by ``nodemgr.domain.cdi.spec_file_name`` (driver and claim UID), so
the files of this driver are told apart from other drivers' in a shared directory,
and those whose claim the ledger no longer holds are found at start (``stale``).

Mode 0600: the runtime reads them as root; the allocation id in them is nobody
else's business (the metrics endpoint never shows one either).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from nodemgr.domain import cdi
from nodemgr.errors import GpushareError

log = logging.getLogger(__name__)

FILE_MODE = 0o600


class CdiDirectory:
    def __init__(self, path: str, driver: str):
        self.path = path
        self.driver = driver
        self._prefix = f"{driver}-{cdi.DEVICE_CLASS}_"

    def file(self, claim_uid: str) -> str:
        return os.path.join(self.path, cdi.spec_file_name(self.driver, claim_uid))

    def write(self, claim_uid: str, spec: dict[str, Any]) -> str:
        """Write (or replace) the claim's spec atomically; its path. OSError on failure,
        with nothing left behind. The directory is made when it is missing (at the
        first spec, or after someone removed it)."""
        target = self.file(claim_uid)
        temporary = os.path.join(self.path, f".{os.path.basename(target)}.{os.getpid()}.tmp")
        data = cdi.render(spec).encode("utf-8")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(temporary, flags, FILE_MODE)
        except FileNotFoundError:
            os.makedirs(self.path, mode=0o755, exist_ok=True)
            fd = os.open(temporary, flags, FILE_MODE)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return target

    def read(self, claim_uid: str) -> dict[str, Any] | None:
        """The claim's spec as on disk; None when there is none or it is not JSON."""
        try:
            with open(self.file(claim_uid), encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError):
            return None
        return spec if isinstance(spec, dict) else None

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec; False when there was none."""
        try:
            os.unlink(self.file(claim_uid))
        except FileNotFoundError:
            return False
        return True

    def claim_uids(self) -> list[str]:
        """The claim UIDs this driver has spec files for."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(
            name[len(self._prefix) : -len(".json")]
            for name in names
            if name.startswith(self._prefix) and name.endswith(".json")
        )

    def remove_stale(self, live_claim_uids: set[str]) -> list[str]:
        """Remove the specs of claims the ledger no longer holds (a crash between the
        release and the removal); the UIDs removed."""
        removed = []
        for uid in self.claim_uids():
            if uid not in live_claim_uids:
                with contextlib.suppress(OSError, GpushareError):
                    if self.remove(uid):
                        removed.append(uid)
        if removed:
            log.info("removed the CDI specs of %d claims no longer prepared", len(removed))
        return removed
