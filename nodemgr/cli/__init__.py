"""``nodemgr``: the operator's command line.

``main`` parses the sub-commands; ``status`` (this node; its ``--cluster``
view is ``cluster_status``), ``install`` (a package: render and apply the
systemd units, hooks and config) and ``doctor`` (a package: one module per
check family) each own theirs.

What it must not do: change allocation state of a running daemon (it talks
to it only over the status socket); import ``nodemgr.runtime``.
"""
