"""Enforcement: what env alone cannot guarantee, checked at creation and while running.

- ``hookserver``: answers the OCI runtime hook over a unix socket;
- ``registry``: which container (cgroup) holds which allocation;
- ``cgroupmarks``: registrations written onto the containers' own cgroups, so they
  outlive a lost ledger;
- ``hostdevices``: what the host says of NVIDIA's device nodes, for the spec check;
- ``watchdog``: scans /proc, cgroups and NVML usage, driven by process events,
  and acts on violations (log or kill through a checked pidfd);
- ``procfs`` and ``procevents``: the /proc reader and the netlink process
  connector (read with socket and struct; pyroute2 is not used).

Pure judgements (``containercheck``, ``violations``) live in ``domain``.
What it must not do: trust anything a container controls (argv, env, cgroup
names) for identity; import ``kubelet``, ``kubernetes`` or ``supervision``;
stop silently: a failed scan is logged and counted.
"""
