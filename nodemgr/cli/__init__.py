"""``nodemgr``: the operator's command line.

``main`` parses the sub-commands; ``status`` (local and ``--cluster``),
``install`` (render and apply the systemd units, hooks and config) and
``doctor`` (one module per check family) each own theirs.

What it must not do: change allocation state of a running daemon (it talks
to it only over the status socket); import ``nodemgr.runtime``.
"""
