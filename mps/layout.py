"""Where each card's MPS files live under the node daemon's run directory (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Where a shared container finds its card's MPS daemon: the card's client directory
# is mounted there (read-only), and CUDA_MPS_PIPE_DIRECTORY names it.
CONTAINER_PIPE_DIRECTORY = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class MpsLayout:
    """``<run_dir>/mps/<card UUID>/{pipe,log,client}`` and one shared ``<run_dir>/mps/shm``.

    ``pipe`` is the control daemon's own pipe directory (with ``control_privileged``, which
    lets root quit it): only the node daemon uses it. ``client`` is what containers
    mount: it holds only ``control``, a hard link to the daemon's socket. Both stay on one
    file system (hard links need it).
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

    @property
    def shm_dir(self) -> str:
        return os.path.join(self.root, "shm")
