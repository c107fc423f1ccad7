"""The Kubernetes API edge: pod identity, annotations, labels and events.

- ``adapter``: the one facade the daemon uses;
- ``kubeclient``: the only importer of the official kubernetes client, imported
  slim (its configuration, kubeconfig and in-cluster loaders, exec plugins and
  REST client; none of its ~850 generated models);
- ``client``: that client configured and its errors translated;
- ``listwatch``: one LIST+WATCH follower (resource versions, expiry, backoff);
- ``podwatch``: this node's pods through it, kept as a candidate index;
- ``writes`` and ``publish``: the patches and the node annotation (pure);
- ``sync``: the bridge between the allocation state and the adapter;
- ``scheduling``: the scheduler extender's requests (its session, the pod
  annotations, the Binding);
- ``dra``: the DRA front door's side: the node's ResourceSlice, claims' status,
  refused claims as Events (through the adapter's queued writes).

This package is imported only when ``kubernetes.enabled`` (the client alone
imported slim is ~8 MiB of memory), so this ``__init__`` imports nothing. What it must not
do: sit on the Allocate path with a network call; import ``kubelet``,
``enforcement`` or ``supervision``.
"""
