"""MPS control library: one NVIDIA MPS control daemon per card.

Start, adopt, health-check and stop ``nvidia-cuda-mps-control`` for one card
(``CUDA_VISIBLE_DEVICES=<card UUID>``, its own pipe and log directories), send it
control commands and parse the answers. Every call has a timeout: a hung control
daemon is reported as an error, never waited on.

It tells which process is a card's control daemon and which are its MPS servers from
facts in /proc no container can forge (mps.identity); gives containers only a client
directory (mps.layout); gives each card's daemon and MPS servers a /dev/shm tmpfs of
their own (mps.shm, mps.namespace), which no container gets; and names a client that holds the
one-client-at-a-time control daemon by sending nothing (mps.connections,
mps.holders), for the node daemon to act on.

The control daemon serves one client at a time and waits, with no time-out, on the one
it accepted: mps.connections reads its connections on the control socket from the
kernel (sock_diag, /proc) and mps.holders says which client holds it by sending
nothing, so the node daemon can name and act on that process.

- ``control``: talking to a control daemon (``nvidia-cuda-mps-control`` in client mode);
- ``daemon``: one card's control daemon: start, adopt, probe, stop;
- ``identity``, ``proc``: which processes are a card's daemon and servers, judged and found;
- ``layout``: where each card's MPS files live under the run directory;
- ``shm``, ``mounts``: each card's /dev/shm tmpfs, and mounts read and made;
- ``namespace``: the mount namespace a card's daemon runs in;
- ``connections``, ``holders``, ``sockdiag``: who holds a control daemon.

What it must not do: import ``nodemgr`` (it is a library the daemon uses, not
part of it); kill anything (a health check and a look only read: acting on a holder is
the node daemon's enforcement); keep
state beyond what the running control daemon and the file system hold.
"""

from mps.control import (
    ControlClient,
    MpsError,
    MpsProtocolError,
    MpsTimeout,
    MpsUnavailable,
    MpsUnsupported,
)
from mps.daemon import CardDaemon, Health, HealthState
from mps.identity import DaemonIdentity
from mps.layout import MpsLayout

__all__ = [
    "CardDaemon",
    "ControlClient",
    "DaemonIdentity",
    "Health",
    "HealthState",
    "MpsError",
    "MpsLayout",
    "MpsProtocolError",
    "MpsTimeout",
    "MpsUnavailable",
    "MpsUnsupported",
]
