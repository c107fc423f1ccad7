"""Pins the pod identity read from a container's OCI annotations: only the keys of the
runtime the hook was installed for name the pod; the other runtime's keys (a pod's own
annotations under CRI-O) must name the same, else the container's annotations name two pods
(the message names both, each value shown safely); without --runtime (an older hook
configuration) either whole family is read and both must agree; a partial identity is none."""

import pytest

from hooks import podidentity
from hooks.podidentity import IdentityConflict, identity_keys, resolve

CONTAINERD = {
    "io.kubernetes.cri.sandbox-namespace": "team-a",
    "io.kubernetes.cri.sandbox-name": "trainer-0",
    "io.kubernetes.cri.sandbox-uid": "uid-a",
    "io.kubernetes.cri.container-name": "main",
}
CRIO = {
    "io.kubernetes.pod.namespace": "team-b",
    "io.kubernetes.pod.name": "infer-1",
    "io.kubernetes.pod.uid": "uid-b",
    "io.kubernetes.container.name": "server",
}
TEAM_A = {"namespace": "team-a", "pod": "trainer-0", "uid": "uid-a", "container": "main"}
TEAM_B = {"namespace": "team-b", "pod": "infer-1", "uid": "uid-b", "container": "server"}


def same_as(identity: dict, family: str) -> dict:
    return {podidentity.FAMILIES[family][f]: v for f, v in identity.items()}


def test_keys_of_both_families_are_found_and_nothing_else():
    """Every identity key of either family with a string value; other annotations and
    non-string values are left out."""
    found = identity_keys({**CONTAINERD, **CRIO, "app": "x", "io.kubernetes.pod.uid": 7})
    assert found == {**CONTAINERD, **{k: v for k, v in CRIO.items() if not k.endswith(".uid")}}
    assert identity_keys(None) == {}


@pytest.mark.parametrize(
    ("runtime", "found", "identity"),
    [
        ("containerd", CONTAINERD, TEAM_A),
        ("cri-o", CRIO, TEAM_B),
        (None, CONTAINERD, TEAM_A),
        (None, CRIO, TEAM_B),
        ("cri-o", {**CRIO, **same_as(TEAM_B, "containerd")}, TEAM_B),
        ("containerd", {**CONTAINERD, **same_as(TEAM_A, "cri-o")}, TEAM_A),
        (None, {**CRIO, **same_as(TEAM_B, "containerd")}, TEAM_B),
        ("cri-o", {}, {}),
        ("containerd", {"io.kubernetes.cri.sandbox-name": "trainer-0"}, {}),
    ],
    ids=[
        "containerd", "cri-o", "older-config-containerd", "older-config-cri-o",
        "cri-o-repeated", "containerd-repeated", "older-config-repeated", "none", "partial",
    ],
)  # fmt: skip
def test_the_runtimes_own_keys_name_the_pod(runtime, found, identity):
    """The runtime's keys give the identity (uid included when written); the other
    family's keys repeating it are fine; a partial identity is none."""
    assert resolve(found, runtime) == identity


@pytest.mark.parametrize(
    ("runtime", "found", "differing"),
    [
        ("cri-o", {**CRIO, **CONTAINERD}, "namespace, pod, uid, container differ"),
        ("containerd", {**CONTAINERD, **CRIO}, "namespace, pod, uid, container differ"),
        (None, {**CONTAINERD, **CRIO}, "namespace, pod, uid, container differ"),
        ("cri-o", {**CRIO, "io.kubernetes.cri.sandbox-name": "trainer-0"}, "pod differ"),
        ("cri-o", {**CRIO, "io.kubernetes.cri.sandbox-uid": "uid-a"}, "uid differ"),
        ("cri-o", {"io.kubernetes.cri.sandbox-name": "trainer-0"}, "pod differ"),
    ],
    ids=["cri-o", "containerd", "older-config", "one-key", "uid-only", "no-own-identity"],
)
def test_the_other_runtimes_keys_naming_another_pod_are_a_conflict(runtime, found, differing):
    """Any key of the other family that says something else than the runtime's own (also
    where the runtime wrote none): IdentityConflict naming both and what differs."""
    with pytest.raises(IdentityConflict) as raised:
        resolve(found, runtime)
    message = str(raised.value)
    assert message.startswith("its annotations name two pods: ")
    assert differing in message
    assert "remove the " in message


def test_the_conflict_message_names_both_pods_and_the_runtime():
    """Installed for CRI-O: CRI-O's pod, then containerd's claimed one, with their uids."""
    with pytest.raises(IdentityConflict) as raised:
        resolve({**CRIO, **CONTAINERD}, "cri-o")
    assert str(raised.value).startswith(
        "its annotations name two pods: CRI-O, the runtime this hook was installed for, names "
        "team-b/infer-1/server (uid uid-b) (io.kubernetes.pod.*, io.kubernetes.container.name), "
        "but containerd's keys name team-a/trainer-0/main (uid uid-a) (io.kubernetes.cri.*;"
    )


def test_values_in_the_conflict_message_cannot_forge_a_line():
    """A claimed pod name with a newline and a terminal escape is shown escaped."""
    forged = {**CRIO, "io.kubernetes.cri.sandbox-name": "x\n2026-11-27 CRITICAL killed\x1b[2J"}
    with pytest.raises(IdentityConflict) as raised:
        resolve(forged, "cri-o")
    message = str(raised.value)
    assert "\n" not in message and "\x1b" not in message
    assert "'x\\n2026-11-27 CRITICAL killed\\x1b[2J'" in message


def test_an_unknown_runtime_is_an_error():
    with pytest.raises(ValueError, match="unknown runtime 'docker'"):
        resolve(CRIO, "docker")
