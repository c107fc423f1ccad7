"""Where each card's MPS files live under the node daemon's run directory (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Where a shared container finds its card's MPS daemon: the card's client directory
# is mounted there (read-only), and CUDA_MPS_PIPE_DIRECTORY names it.
CONTAINER_PIPE_DIRECTORY = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class MpsLayout:
    """``<run_dir>/mps/<card UUID>/{pipe,log,client,shm}`` and ``<run_dir>/mps/ns/<card UUID>``.

    ``pipe`` is the daemon's own pipe directory, used only by the node daemon;
    ``client``, what containers mount (mps.daemon), on the same file system (hard links
    need it); ``shm``, the card's tmpfs (mps.shm), the /dev/shm of its control daemon and
    MPS server and no container's; ``ns/<card UUID>``, the mount
    namespace the daemon runs in (mps.namespace), in a private-mount directory.
    """

    run_dir: str

    @property
    def root(self) -> str:
        return os.path.join(self.run_dir, "mps")

    def pipe_dir(self, card_uuid: str) -> str:
        return os.path.join(self.root, card_uuid, "pipe")

    def log_dir(self, card_uuid: str) -> str:
        return os.path.join(self.root, card_uuid, "log")

    def client_dir(self, card_uuid: str) -> str:
        return os.path.join(self.root, card_uuid, "client")

    def shm_dir(self, card_uuid: str) -> str:
        return os.path.join(self.root, card_uuid, "shm")

    @property
    def namespace_dir(self) -> str:
        return os.path.join(self.root, "ns")

    def namespace_file(self, card_uuid: str) -> str:
        return os.path.join(self.namespace_dir, card_uuid)

    @property
    def retired_shm_dir(self) -> str:
        """A tmpfs for every card's containers, left by an older install: never used,
        unmounted at start."""
        return os.path.join(self.root, "shm")
