"""Pins the daemon's own paths the settings name: run_dir, state_dir, the hook and status
sockets wherever configured and the device plugin sockets in kubelet's directory; the ones
the runtime hook is told of with --guard (all but run_dir, its socket and what lies in
run_dir); and the directories whose parents are node-wide."""

from nodemgr.config.loading import settings_from_mapping
from nodemgr.config.schema import PLUGIN_SOCKETS


def test_own_paths_by_default():
    settings = settings_from_mapping({"node_name": "n"})
    plugins = "/var/lib/kubelet/device-plugins"
    assert settings.own_paths() == {
        "/run/gpushare": "gpushare-node's run_dir",
        "/var/lib/gpushare": "gpushare-node's state_dir (its ledger)",
        "/run/gpushare/hook.sock": "gpushare-node's hook socket",
        "/run/gpushare/status.sock": "gpushare-node's status socket",
        f"{plugins}/gpushare-memory.sock": "gpushare-node's device plugin socket (memory)",
        f"{plugins}/gpushare-core.sock": "gpushare-node's device plugin socket (core)",
        f"{plugins}/gpushare-whole.sock": "gpushare-node's device plugin socket (whole)",
    }
    assert settings.hook_guards() == (
        "/var/lib/gpushare",
        *(f"{plugins}/{name}" for name in PLUGIN_SOCKETS.values()),
    )
    assert settings.own_directories() == ("/run/gpushare", "/var/lib/gpushare", plugins)


def test_sockets_configured_elsewhere_are_guarded_too():
    """A status socket outside run_dir is told to the hook; a hook socket outside run_dir is
    not (the hook knows its own socket)."""
    settings = settings_from_mapping(
        {
            "node_name": "n",
            "run_dir": "/run/gs/",
            "state_dir": "/srv/state",
            "enforcement": {"hook_socket": "/var/run/gs-hook.sock"},
            "status": {"socket": "/srv/gs/status.sock"},
            "kubelet": {"device_plugin_dir": "/k/dp"},
        }
    )
    own = settings.own_paths()
    assert own["/srv/gs/status.sock"] == "gpushare-node's status socket"
    assert own["/var/run/gs-hook.sock"] == "gpushare-node's hook socket"
    assert own["/run/gs"] == "gpushare-node's run_dir"
    guards = settings.hook_guards()
    assert "/srv/gs/status.sock" in guards and "/srv/state" in guards
    assert "/var/run/gs-hook.sock" not in guards and "/run/gs" not in guards
    assert "/k/dp/gpushare-core.sock" in guards


def test_the_dra_door_s_paths_are_guarded_when_it_is_on():
    """With dra.enabled the DRA registration socket, the driver's plugin directory (its
    dra.sock: NodeUnprepareResources of any claim) and the CDI spec directory (specs the
    runtime applies to containers) are the daemon's own too, and the hook is told of them;
    with DRA off they are not guarded (other drivers may use those directories)."""
    off = settings_from_mapping({"node_name": "n"})
    on = settings_from_mapping({"node_name": "n", "dra": {"enabled": True}})
    dra = {
        "/var/lib/kubelet/plugins_registry/gpushare.aliyun.com-reg.sock": (
            "gpushare-node's DRA registration socket"
        ),
        "/var/lib/kubelet/plugins/gpushare.aliyun.com": (
            "gpushare-node's DRA plugin directory (its dra.sock)"
        ),
        "/var/run/cdi": "the CDI spec directory (gpushare-node writes its claims' specs there)",
    }
    assert on.own_paths() == {**off.own_paths(), **dra}
    assert set(dra) <= set(on.hook_guards())
    assert not set(dra) & set(off.own_paths())
