"""The DRA front door: gpushare-node as a DRA kubelet plugin, beside the device plugin.

- ``plugin``: the two gRPC servers kubelet talks to, on the plugin event loop
  (``nodemgr.kubelet.pluginloop``): Registration on
  ``<plugins_registry_dir>/<driver>-reg.sock`` and the DRA service (v1 and v1beta1)
  on ``<plugins_dir>/<driver>/dra.sock``; the servicers only translate;
- ``driver``: NodePrepareResources as admission (read the claim, judge the
  scheduler's allocation, record it in the one ledger, write its CDI spec) and
  NodeUnprepareResources as release;
- ``cdifiles``: the CDI spec files of prepared claims in ``dra.cdi_dir``;
- ``recovery``: a ledger made at this start takes the prepared claims back from their
  CDI specs.

Claims are read and reported through narrow interfaces the wiring hands in (the
Kubernetes adapter implements them); the allocation state is seen only through
``nodemgr.allocation.claims.ClaimLedger``. docs/dra.md describes the whole door.

What it must not do: import ``kubernetes``, ``enforcement`` or ``supervision`` (an
edge of its own); decide placement (the scheduler did; the allocation state checks).
"""
