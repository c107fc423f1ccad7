"""The MPS supervisor: one NVIDIA MPS control daemon per shared card, kept healthy.

- ``supervisor``: starts, adopts, probes and restarts each card's control daemon
  (through the ``mps`` library), sets each card's compute mode, mounts and empties
  each card's /dev/shm tmpfs (its control daemon's and MPS servers'), and turns MPS
  trouble into card health that the allocation state publishes to kubelet.

What it must not do: import ``kubelet``, ``enforcement`` or ``kubernetes``;
kill anything on a card but the control daemon it started or verified.
"""
