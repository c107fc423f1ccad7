"""Small building blocks every flow uses, knowing nothing of GPUs or Kubernetes.

- ``workers``: the one lifecycle of a background worker (start, stop,
  join with a deadline, alive);
- ``changes``: a generation counter threads wait on for "something changed";
- ``unixserver``: a threaded unix-socket server with the socket's mode set
  on the path itself;
- ``serveloop``: a ``socketserver`` server served until stopped, without polling;
- ``wakepipe``: a pipe that ends another thread's ``select``;
- ``connbudget``: every listener's connection cap and deadlines;
- ``logline``: the log format, every record one line whatever values it shows;
- ``placementkey``: the scheduler extender's Ed25519 key (``cryptography`` loaded at
  first use);
- ``version``: the installed distribution's version.

What it must not do: import any other nodemgr package but ``nodemgr.errors``.
"""
