"""The OCI runtime hook ``gpushare-hook`` and its runtime configurations.

The runtime (runc through containerd, CRI-O or podman) runs the hook on every
container creation on the node, so it is small and fast and imports only the
standard library: a container that asks for no GPU is let through without
even a connection to the daemon. GPU containers are checked by the daemon
over ``<run_dir>/hook.sock`` (see :mod:`hooks.protocol`).

- ``gpushare_hook``: the hook's command line (``gpushare-hook`` is the launcher
  ``nodemgr install`` writes; ``oci-hooks.d`` and ``containerd`` hold the runtime
  configurations);
- ``protocol``: the hook socket protocol;
- ``wirejson``: JSON as Go and Python both read it (a key twice in one object refused);
- ``gpuenv``, ``specfacts``: what a container's env and OCI spec ask of the GPUs
  (shared with the daemon);
- ``podidentity``: which pod a container belongs to, from its runtime's annotations;
- ``textsafe``: values from containers made safe to log and show.

What it must not do: import anything outside the standard library (not even
``nodemgr``), decide about a GPU container itself, or ever block a creation
longer than a couple of seconds. Its start-up is most of its cost: nodemgr
install runs it in Python's isolated mode without site, and it imports only the
standard modules it uses (``json``, ``os``; ``socket`` only to call the daemon; not
``argparse`` or even ``__future__``: its modules do without ``from __future__ import
annotations``).
"""
