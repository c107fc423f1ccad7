"""Stand-ins for what cannot run on a GPU-less CI machine, shipped as an importable harness.

- ``kubelet_sim``: a test kubelet speaking the real v1beta1 Registration and
  DevicePlugin protocol and PodResources v1, over unix sockets;
- ``apiserver_sim``: a test Kubernetes API server (the real REST protocol,
  driven by the official client end to end);
- ``fakes/nvidia-cuda-mps-control``: the MPS control binary's stand-in,
  held to NVIDIA's real binary by a contract test;
- ``daemon_proc``: the real ``gpushare-node`` process on a simulated node;
- ``runc_env``: real runc containers with the shipped OCI hook;
- ``mps_tenant``: a node with NVIDIA's real MPS control binary whose containers act as
  tenants (bind-mounted binary, host network, impostors);
- ``outcome_table``: docs tables rendered from what a test module observed;
- ``transcript``: a console transcript in a Markdown page (the README's quick start)
  read as commands to run and the output they must print;
- small helpers: simulated ``cards``, a hand-moved ``clock``, a systemd
  ``notify_listener`` and ledger rows.

Each stand-in has its own tests. ``bench/`` and ``scripts/`` import from here,
never from a test module. What it must not do: import a test module.
"""
