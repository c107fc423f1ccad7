"""Small building blocks every flow uses, knowing nothing of GPUs or Kubernetes.

- ``workers``: the one lifecycle of a background worker (start, stop,
  join with a deadline, alive);
- ``changes``: a generation counter threads wait on for "something changed";
- ``unixserver``: a threaded unix-socket server with the socket's mode set
  on the path itself;
- ``logline``: the log format, every record one line whatever values it shows;
- ``version``: the installed distribution's version.

What it must not do: import any other nodemgr package but ``nodemgr.errors``.
"""
