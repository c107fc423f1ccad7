"""The small error hierarchy of gpushare-node.

Errors are translated where they enter (NVML, SQLite, YAML, gRPC) into one of these,
the original chained, and carry what an operator needs: which card, which pod, how
much, what to do.
"""


class GpushareError(Exception):
    """Base of every error gpushare-node raises on purpose."""


class ConfigError(GpushareError):
    """The configuration file or a value in it is unusable; ``key`` is the dotted key
    (``resources.placement``), or the file when it cannot be read or parsed."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class InventoryError(GpushareError):
    """The GPUs cannot be enumerated (driver or NVML missing, bad simulated file)."""


class LedgerError(GpushareError):
    """The durable ledger cannot be opened, read or written."""


class AllocationError(GpushareError):
    """A kubelet request that cannot be honoured; the message goes to kubelet."""


# kubelet turns a failed GetPreferredAllocation or Allocate into UnexpectedAdmissionError
# and never admits the pod again, so every such refusal says so and what to do.
REFUSAL_IS_FINAL = (
    "kubelet rejects the pod for good (UnexpectedAdmissionError) and never retries it: "
    "create it again, or run it under a controller that does (a Deployment, a Job); with "
    "the gpushare scheduler extender, pods are bound only where one GPU fits them"
)


def final_refusal(message: str) -> str:
    return f"{message}. {REFUSAL_IS_FINAL}"


class NoFitError(AllocationError):
    """No single card has room for the container's request."""


class UnknownDeviceError(AllocationError):
    """Device IDs that this node never advertised for the resource."""


class ConflictError(AllocationError):
    """Device IDs that disagree: two cards for one container, a card used both ways."""


class BindError(GpushareError):
    """An address or socket the daemon serves on cannot be bound (in use, not ours, denied)."""


class KubeApiError(GpushareError):
    """A request to the Kubernetes API server failed; ``status``: the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class KubeUnavailable(KubeApiError):
    """The API server did not answer in time, refused the connection, or said 5xx/429: retry."""


class KubeConflict(KubeApiError):
    """HTTP 409: the object changed under a write that named its resourceVersion; re-read."""


class KubeNotFound(KubeApiError):
    """HTTP 404: the object (a pod that went away, a node not registered yet) does not exist."""


class KubeForbidden(KubeApiError):
    """HTTP 401/403: the credentials are rejected or lack an RBAC permission (deploy/ has it)."""


class KubeExpired(KubeApiError):
    """HTTP 410: a watch's resourceVersion is too old (compacted); list again."""


class KubeCredentialsError(KubeApiError):
    """No usable credentials for the API server (kubeconfig missing or unreadable)."""


class CdiError(GpushareError):
    """A CDI spec cannot be written for these values: a name, env entry or mount CDI refuses."""
