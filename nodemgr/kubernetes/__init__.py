"""The Kubernetes API edge: pod identity, annotations, labels and events.

- ``adapter``: the one facade the daemon uses;
- ``kubeclient``: the only importer of the official kubernetes client, through
  its public API and at first use (its configuration, kubeconfig and in-cluster
  loaders, exec plugins and ApiClient; none of its generated API classes or
  models);
- ``client``: that client configured and its errors translated;
- ``listwatch``: one LIST+WATCH follower (resource versions, expiry, backoff);
- ``podwatch``: this node's pods through it, kept as a candidate index;
- ``writes`` and ``publish``: the patches and the node annotation (pure);
- ``sync``: the bridge between the allocation state and the adapter;
- ``scheduling``: the scheduler extender's requests (its session, the pod
  annotations, the Binding);
- ``dra``: the DRA front door's side: the node's ResourceSlice, claims' status,
  refused claims as Events (through the adapter's queued writes).

The kubernetes client is loaded only when ``kubernetes.enabled`` (it adds
~15 MiB to the daemon's memory), so this ``__init__`` imports nothing. What it must not
do: sit on the Allocate path with a network call; import ``kubelet``,
``enforcement`` or ``supervision``.
"""
