"""``nodemgr doctor``: checks of a node, each a PASS, WARN or FAIL with a precise fix.

- ``command``: the command line, the order of the checks;
- ``report``: Result, PASS/WARN/FAIL, the printed report;
- ``host``: the node's files under a root, unix socket probes;

and one per check family:

- ``config_checks``: the config file;
- ``system``: privileges, cgroups;
- ``gpu``: driver, NVML, cards, MPS control binary;
- ``kubelet``: its sockets;
- ``runtime_hook``: CRI-O/podman hooks.d, containerd base spec;
- ``daemon``: gpushare-node's sockets, its ledger;
- ``kubernetes_api``: credentials, node, RBAC;
- ``placement``: the scheduler extender's public key: whose card choice the node
  honours.

What it must not do: change anything on the node (its hook probe leaves the
hook server as it found it); import a sibling command package (install,
status): a test keeps shared constants equal.
"""
