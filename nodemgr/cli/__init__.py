"""``nodemgr``: the operator's command line.

- ``main``: parses the sub-commands; each of the others owns one:
- ``status``, ``cluster_status``: this node, and its ``--cluster`` view;
- ``check_ledger``: are the ledger's invariants intact;
- ``mps_start``: one card's MPS control daemon, for the ``gpushare-mps@`` unit;
- ``inspect``: ``kubectl inspect gpushare`` (the ``kubectl-inspect-gpushare`` plugin);
- ``install``: a package: render and apply the systemd units, hooks and config;
- ``doctor``: a package: one module per check family.

What it must not do: change allocation state of a running daemon (it talks
to it only over the status socket); import ``nodemgr.runtime``.
"""
