"""The Kubernetes API edge: pod identity, annotations, labels and events.

- ``adapter``: the one facade the daemon uses;
- ``client``: the official kubernetes client, configured (kubeconfig,
  in-cluster, exec plugins) and its errors translated;
- ``podwatch``: the LIST+WATCH of this node's pods, kept as a candidate index;
- ``writes`` and ``publish``: the patches and the node annotation (pure);
- ``sync``: the bridge between the allocation state and the adapter.

This package is imported only when ``kubernetes.enabled`` (the client alone
is ~20 MiB of memory), so this ``__init__`` imports nothing. What it must not
do: sit on the Allocate path with a network call; import ``kubelet``,
``enforcement`` or ``supervision``.
"""
