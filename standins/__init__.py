"""Stand-ins for the parts of a GPU node that a machine without them cannot run.

A CI machine or a laptop has no GPU, no kubelet, no API server and no kube-scheduler.
The stand-ins here take their places and speak the real protocols, field by field: the
real gRPC over unix sockets (device plugin v1beta1, PodResources v1, the DRA node API,
CRI v1), the real Kubernetes REST and watch protocol (the official client runs end to
end against it), the MPS control binary's command line and socket dialect. Where a real
part does run on such a machine (runc, podman, containerd, systemd in systemd-nspawn,
NVIDIA's MPS control binary and NVML library from Debian), the harnesses here drive
the real one. The tests (``tests/``), the benchmarks (``bench/``) and the quick start
(``scripts/quickstart``, ``scripts/demo-kubelet``) all use this package; it ships with
the project's distribution (the MPS stand-in binaries in ``fakes/`` as package data),
and is left out of the extender's image (``scripts/build-image``).

Kubernetes' side:

- ``kubelet_sim``: a test kubelet: device manager (Registration, DevicePlugin v1beta1)
  and PodResources v1 over unix sockets, containers made through a CRI runtime;
- ``kubelet_dra``: the test kubelet's DRA side: plugin registration, the DRA node API,
  the claims' part of PodResources;
- ``apiserver_sim``: a test API server (REST and watch over HTTP/1.1, resource.k8s.io/v1
  included);
- ``resource_v1`` and ``quantity``: resource.k8s.io/v1 admitted as kube-apiserver does
  (defaults, validation), Kubernetes quantities parsed and printed;
- ``dra_allocator``: a claim's allocation, written as kube-scheduler's structured
  allocator writes it;
- ``extender_proc`` and ``extender_tls``: the real gpushare-scheduler process, driven as
  kube-scheduler drives it, over the mutual TLS kube-scheduler builds;
- ``gofmt``: Go's ``fmt.Sprintf`` with no arguments (kube-scheduler's event messages);
- ``crio`` and ``cri``: a container's OCI annotations as CRI-O writes them; CRI v1
  messages, a private containerd and the generated CRI client.

The node:

- ``daemon_proc``: the real gpushare-node process on a simulated node;
- ``dra_node`` and ``dra_enforcement``: a node with the DRA front door on, and with
  real runc containers made from claims' CDI specs;
- ``runc_env``: real runc containers running the shipped OCI hook;
- ``mps_tenant``: a node whose MPS runs a given control binary, with runc tenants;
- ``real_parts``: NVIDIA's real MPS control binary and NVML library (Debian non-free);
- ``nspawn``: a real systemd as PID 1 in systemd-nspawn;
- ``notify_listener``: systemd's side of the notify protocol;
- ``setup_script``: one of ``scripts/setup-*`` run for its ``GPUSHARE_*`` lines;
- ``paths``: the checkout, the MPS stand-in binaries.

The MPS stand-in (not modules: executables the daemon runs by path, as it runs NVIDIA's,
held to NVIDIA's real binary by tests/contract/test_mps_control.py):
``fakes/nvidia-cuda-mps-control`` and the server it starts, ``fakes/nvidia-cuda-mps-server``.

Small helpers:

- ``cards``, ``ledger_rows`` and ``placementkeys``: simulated cards and settings,
  allocation rows, Ed25519 key pairs made as deploy/render.py makes them;
- ``clock``: a clock moved by hand;
- ``exitwait``, ``threadstats``, ``fdexhaust`` and ``listeners``: a child's exit met
  when it happens, a thread's wake-ups, a process out of file descriptors, every socket
  a process can be reached on;
- ``outcome_table`` and ``transcript``: docs tables rendered from what a test observed,
  a console transcript in a Markdown page read as commands and their output.

Its own tests are in ``tests/standins/`` (``test_<module>.py``, the stand-ins' behaviour
pinned against the real protocol's clients); a harness of a real part is exercised by the
tests that drive that part. What needs more than the project's own dependencies:
the harnesses that skip a test where their real part is missing (``real_parts``,
``nspawn``, ``runc_env``, and ``daemon_proc`` through ``real_parts``) import pytest (the
``test`` extra); those that run the checkout's scripts, hook files or deploy/render.py
need the checkout (``paths.REPO``).

What it must not do: be imported by the product (``nodemgr``, ``mps``, ``hooks``:
import-linter's contract in pyproject.toml), or import a test module (``tests``).
"""
