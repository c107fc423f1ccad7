"""Pins the single-value checks the config loader composes: each names the key and says
what was found and what is allowed."""

import pytest

from nodemgr.config import values
from nodemgr.errors import ConfigError


def test_number_refuses_booleans_and_says_what_was_found():
    """``true`` is not a number even though Python counts bool as int."""
    with pytest.raises(ConfigError) as refused:
        values.number_value("mps.health_check_interval_seconds", True)
    assert refused.value.key == "mps.health_check_interval_seconds"
    assert "true" in refused.value.problem


def test_resource_name_refuses_the_reserved_kubernetes_domain():
    """Extended resources may not live under kubernetes.io."""
    with pytest.raises(ConfigError, match="reserved for Kubernetes"):
        values.resource_name("resources.memory", "kubernetes.io/gpu-mem")
    assert values.resource_name("resources.memory", "example.com/gpu-mem") == "example.com/gpu-mem"


def test_join_key_and_show_make_readable_messages():
    """Dotted keys join without a leading dot; long values are cut to 60 characters."""
    assert values.join_key("", "mps") == "mps"
    assert values.join_key("mps", "enabled") == "mps.enabled"
    assert values.show("x" * 100).endswith("...") and len(values.show("x" * 100)) == 60
