"""A container runtime's CRI v1 API, as kubelet uses it: for the test kubelet and the
engine tests.

- ``configs``: the CRI v1 messages kubelet sends for a pod (sandbox and container configs);
- ``containerd``: a private containerd with its CRI plugin;
- ``api``: the client generated from the public CRI v1 proto.
"""
