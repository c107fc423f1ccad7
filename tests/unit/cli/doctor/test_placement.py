"""Pins doctor's ``placement key`` check: a readable Ed25519 public key passes (read
without loading cryptography, as the daemon reads it), an unusable one FAILs naming the
file and why, none WARNs that the extender's choices are ignored, ``placement_trust:
annotations`` WARNs that pod owners choose, and a disabled Kubernetes API passes with
nothing to check; each non-PASS with the fix."""

from __future__ import annotations

import dataclasses

from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.placement import check_placement_key
from nodemgr.cli.doctor.report import FAIL, PASS, WARN
from nodemgr.config.schema import KubernetesSettings, Settings
from standins import placementkeys


def settings(**kubernetes):
    return Settings(node_name="node-a", kubernetes=KubernetesSettings(**kubernetes))


def test_verdicts(tmp_path):
    private, public = placementkeys.write_pair(str(tmp_path))
    result = check_placement_key(settings(placement_public_key=public), Host())
    assert result.status == PASS and "an Ed25519 public key" in result.detail
    for path, why in ((private, "holds a PRIVATE KEY"), ("/nonexistent.pub", "No such file")):
        result = check_placement_key(settings(placement_public_key=path), Host())
        assert result.status == FAIL and why in result.detail and path in result.fix
    result = check_placement_key(settings(), Host())
    assert result.status == WARN and "card choices are ignored" in result.detail
    assert "placement-keys" in result.fix
    result = check_placement_key(settings(placement_trust="annotations"), Host())
    assert result.status == WARN and "a pod owner can choose its card" in result.detail
    off = dataclasses.replace(settings(), kubernetes=KubernetesSettings(enabled=False))
    assert check_placement_key(off, Host()).status == PASS


def test_the_key_is_read_under_the_hosts_root(tmp_path):
    """Doctor run against a node's root reads the key there."""
    (tmp_path / "etc").mkdir()
    placementkeys.write_pair(str(tmp_path / "etc"))
    result = check_placement_key(
        settings(placement_public_key="/etc/placement.pub"), Host(root=str(tmp_path))
    )
    assert result.status == PASS, result
