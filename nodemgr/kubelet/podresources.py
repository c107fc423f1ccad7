"""kubelet's PodResources API: its own record of which container holds which devices.

A failed read raises ``KubeletUnavailable``, never an empty record: nothing must be
released because kubelet was restarting. With ``dra_driver``, the driver's
``dynamic_resources`` go in under ``CLAIMS_RECORD`` (nodemgr.domain.podtie), each once
(kubelet repeats them, docs/dra.md, "PodResources").

While kubelet's answer is byte for byte the last one, the same record object is
returned: building it is most of a periodic reconcile's cost on a full node, and the
allocator skips a record it already settled. Callers only read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from nodemgr.domain.model import ContainerRef
from nodemgr.domain.podtie import CLAIMS_RECORD, claim_record_id
from nodemgr.kubelet.api import podresources_v1_pb2 as pr
from nodemgr.kubelet.registration import KubeletUnavailable

KubeletRecord = dict[ContainerRef, dict[str, list[str]]]


@dataclass(frozen=True)
class _Answer:
    raw: bytes
    record: KubeletRecord


class PodResourcesClient:
    def __init__(
        self, socket_path: str, timeout_seconds: float = 2.0, dra_driver: str | None = None
    ):
        self.socket_path = socket_path
        self._dra_driver = dra_driver
        self._timeout_seconds = timeout_seconds
        # gRPC's default reconnect backoff grows to 120 s, which would keep refusing GPU
        # containers long after kubelet is back.
        self._channel = grpc.insecure_channel(
            f"unix://{socket_path}",
            options=[
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.initial_reconnect_backoff_ms", 100),
            ],
        )
        self._list = self._channel.unary_unary(
            "/v1.PodResourcesLister/List",
            request_serializer=pr.ListPodResourcesRequest.SerializeToString,
            response_deserializer=None,
        )
        self._last: _Answer | None = None

    def list(self) -> KubeletRecord:
        """Callers must not change it."""
        try:
            answer = self._list(pr.ListPodResourcesRequest(), timeout=self._timeout_seconds)
        except grpc.RpcError as e:
            raise KubeletUnavailable(
                f"kubelet PodResources API at {self.socket_path} did not answer: "
                f"{e.code().name}: {e.details()} (is kubelet running? is the path in "
                "kubelet.pod_resources_socket right?)"
            ) from e
        last = self._last
        if last is not None and last.raw == answer:
            return last.record
        try:
            response = pr.ListPodResourcesResponse.FromString(answer)
        except DecodeError as e:
            raise KubeletUnavailable(
                f"kubelet PodResources API at {self.socket_path} answered {len(answer)} bytes "
                f"that are not a ListPodResourcesResponse ({e})"
            ) from e
        record: KubeletRecord = {}
        for pod in response.pod_resources:
            for container in pod.containers:
                ref = ContainerRef(pod.namespace, pod.name, container.name)
                for devices in container.devices:
                    ids = record.setdefault(ref, {}).setdefault(devices.resource_name, [])
                    ids.extend(devices.device_ids)
                if self._dra_driver is not None and container.dynamic_resources:
                    self._add_claims(record, ref, container.dynamic_resources)
        self._last = _Answer(answer, record)
        return record

    def _add_claims(self, record: KubeletRecord, ref: ContainerRef, dynamic_resources) -> None:
        ids = record.setdefault(ref, {}).setdefault(CLAIMS_RECORD, [])
        for claim in dynamic_resources:
            for device in claim.claim_resources:
                if device.driver_name != self._dra_driver:
                    continue
                share = device.share_id if device.HasField("share_id") else ""
                found = claim_record_id(
                    claim.claim_namespace, claim.claim_name, device.pool_name,
                    device.device_name, share,
                )  # fmt: skip
                if found not in ids:
                    ids.append(found)

    def close(self) -> None:
        self._channel.close()
