"""Where things are: the checkout this package sits in, and the MPS stand-in binaries.

``REPO`` is the checkout's root (the parent of this package): the modules that run
the checkout's scripts (``scripts/setup-*``), its shipped hook files (``hooks/``) or
``deploy/render.py`` need the package where a checkout holds it (an editable install).
``MPS_STANDIN`` is the stand-in control binary, package data that an installed
package carries too (its server, ``nvidia-cuda-mps-server``, lies beside it).
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
REPO = str(PACKAGE.parent)
FAKES = str(PACKAGE / "fakes")
MPS_STANDIN = str(PACKAGE / "fakes" / "nvidia-cuda-mps-control")
