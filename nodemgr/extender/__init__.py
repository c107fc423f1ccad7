"""``gpushare-scheduler``: the kube-scheduler extender, the cluster side of gpushare-node.

kube-scheduler sees only node totals of gpu-mem, gpu-core.percentage and
nvidia.com/gpu; this extender places each container's memory and share on
ONE card, with the same arithmetic the node daemon uses
(``nodemgr.domain.placement``), so what it binds the node admits:

- ``wire``: the v1 extender JSON types, parsed and written field by field;
- ``logic``: filter, prioritize and bind's card choice (pure);
- ``cache``: every GPU node's cards (the ``<label_prefix>gpus`` annotation
  the daemons publish), the GPU pods and the assumed binds, kept by one
  LIST+WATCH of nodes and one of pods (``nodemgr.kubernetes.listwatch``);
- ``server``: the verbs over the cache and the HTTP server (filter,
  prioritize, bind, healthz, metrics);
- ``listener``: HTTP/1.1 on one event loop, with a budget for every peer
  (connections, handshakes, bytes, deadlines);
- ``metrics``: its Prometheus metrics (prometheus_client's own registry);
- ``tls``: mutual TLS (kube-scheduler's client certificate), rotated files
  picked up without a restart;
- ``events``: pod Events (a placement annotation it does not believe);
- ``main``: the ``gpushare-scheduler`` console script (argv, signals).

Trust: the verbs answer only a client whose certificate the configured CA
signed; a bind goes only to a node that passed this extender's filter for
that pod, named by its UID; what it writes on the pod is signed with its
Ed25519 key (``nodemgr.domain.extenderchoice``), the only placement the node
daemons believe.

A top layer of its own, beside ``runtime`` and ``cli`` (pyproject.toml's
contracts): it runs on control-plane nodes, not next to kubelet.

What it must not do: import ``nodemgr.runtime``, ``nodemgr.cli``,
``nodemgr.kubelet`` or ``nodemgr.allocation`` (no node state: only what the
API shows); import the kubernetes client (``nodemgr.kubernetes`` is its edge);
list the API per request; make an API request while holding the cache lock;
decide a bind before its cache has listed nodes and pods.
"""
