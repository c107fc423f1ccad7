"""What the daemon tells people and Prometheus: the status socket and the metrics.

- ``server``: ``<run_dir>/status.sock`` serving the status document live;
- ``metrics``: the Prometheus endpoint (the only importer of prometheus_client);
- ``http``: its HTTP server, with a budget;
- ``nodefacts``: the one place that reads the kernel facts behind an allocation's
  isolation.

The document itself is built by ``nodemgr.domain.statusdoc`` (pure). What it
must not do: change allocation state; block the Allocate path.
"""
