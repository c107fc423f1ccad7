"""Pins nodemgr.errors: every error the daemon raises on purpose is a GpushareError (so
one ``except GpushareError`` at the top catches them all), the allocation refusals are
AllocationErrors (the device plugin maps them to gRPC codes), the API errors are
KubeApiErrors, and the errors carry what an operator needs (the key, the HTTP status)."""

import inspect

import pytest

from nodemgr import errors
from nodemgr.errors import (
    AllocationError,
    ConfigError,
    ConflictError,
    GpushareError,
    KubeApiError,
    KubeConflict,
    KubeCredentialsError,
    KubeExpired,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
    NoFitError,
    UnknownDeviceError,
)

ERROR_CLASSES = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
]


def test_the_module_defines_the_whole_hierarchy():
    """The introspection below sees every class of the module (a guard against an empty list)."""
    names = {cls.__name__ for cls in ERROR_CLASSES}
    assert {"GpushareError", "ConfigError", "NoFitError", "KubeCredentialsError"} <= names


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_is_a_gpushare_error(cls):
    """Each error class of nodemgr.errors derives from GpushareError (and is an Exception,
    never a BaseException a plain ``except Exception`` would miss)."""
    assert issubclass(cls, GpushareError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("cls", [NoFitError, UnknownDeviceError, ConflictError])
def test_refusals_of_kubelet_requests_are_allocation_errors(cls):
    """What kubelet is refused with is an AllocationError (the servicer maps these)."""
    assert issubclass(cls, AllocationError)
    assert not issubclass(cls, KubeApiError)


@pytest.mark.parametrize(
    "cls",
    [KubeUnavailable, KubeConflict, KubeNotFound, KubeForbidden, KubeExpired, KubeCredentialsError],
)
def test_api_server_errors_are_kube_api_errors(cls):
    """Every API server failure is a KubeApiError and carries the HTTP status given."""
    assert issubclass(cls, KubeApiError)
    assert not issubclass(cls, AllocationError)
    error = cls("patch pods/ml/p: HTTP 409", 409)
    assert error.status == 409
    assert str(error) == "patch pods/ml/p: HTTP 409"


def test_kube_api_error_without_an_answer_has_no_status():
    """No answer from the server (a refused connection): status is None, not 0."""
    assert KubeUnavailable("no answer").status is None


def test_config_error_names_the_key_and_the_problem():
    """A ConfigError reads ``<dotted key>: <problem>`` and keeps both parts."""
    error = ConfigError("resources.placement", "must be one of binpack, spread")
    assert str(error) == "resources.placement: must be one of binpack, spread"
    assert (error.key, error.problem) == ("resources.placement", "must be one of binpack, spread")
    assert isinstance(error, GpushareError)


def test_kubelet_unavailable_is_a_gpushare_error():
    """kubelet not answering is a GpushareError too (the run loop catches those)."""
    from nodemgr.kubelet.registration import KubeletUnavailable

    assert issubclass(KubeletUnavailable, GpushareError)
