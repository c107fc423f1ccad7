"""The kubelet edge: the device plugin API served, and kubelet's APIs called.

- ``servicer``: one gRPC DevicePlugin server per resource; it only translates
  between protobuf and the allocation state's narrow interface;
- ``pluginloop``: the one asyncio event loop thread that serves them all (grpc.aio:
  nothing polls at idle);
- ``devicelists``: the ListAndWatch message size, computed without building it;
- ``registration``: Register with kubelet over kubelet.sock;
- ``podresources``: kubelet's own record of who holds which device;
- ``rootsocket``: gRPC servers on root-only unix sockets, each with a budget (the
  device plugin's and the DRA plugin's);
- ``api``: code generated from kubelet's .proto files (see docs/kubelet-api.md and
  docs/dra.md).

What it must not do: decide placement or hold allocation state; import
``enforcement``, ``kubernetes`` or ``supervision``.
"""
