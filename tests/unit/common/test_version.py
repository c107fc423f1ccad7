from nodemgr.common import version


def test_the_version_is_the_installed_distributions():
    """package_version reads what pip recorded for gpushare-node (the project is installed
    editable in the test venv), so --version and the status document agree with pip."""
    import importlib.metadata

    assert version.package_version() == importlib.metadata.version("gpushare-node")


def test_an_uninstalled_distribution_says_so(monkeypatch):
    """Run from a bare checkout there is no version to read: it says so instead of raising."""
    monkeypatch.setattr(version, "DISTRIBUTION", "gpushare-node-not-installed-anywhere")
    assert version.package_version() == "unknown (not installed)"
