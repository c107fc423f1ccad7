"""Where each card's MPS files live under the node daemon's run directory (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Where a shared container finds its card's pipe directory (mounted there).
CONTAINER_PIPE_DIRECTORY = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class MpsLayout:
    """``<run_dir>/mps/<card UUID>/{pipe,log}`` and one shared ``<run_dir>/mps/shm``."""

    run_dir: str

    @property
    def root(self) -> str:
        return os.path.join(self.run_dir, "mps")

    def pipe_dir(self, card_uuid: str) -> str:
        return os.path.join(self.root, card_uuid, "pipe")

    def log_dir(self, card_uuid: str) -> str:
        return os.path.join(self.root, card_uuid, "log")

    @property
    def shm_dir(self) -> str:
        return os.path.join(self.root, "shm")
