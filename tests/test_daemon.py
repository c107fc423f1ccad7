"""Pins the daemon's start-up checks: a memory unit so small that kubelet could not
read the device list is refused, naming the key and a working value."""

import pytest

from nodemgr.daemon import check_device_list_size
from nodemgr.errors import ConfigError
from nodemgr.inventory import Card

A100 = [Card(i, f"GPU-{i:08d}-0000-4000-8000-000000000000", "A100 80GB", 81920) for i in range(8)]


def test_mib_units_on_big_cards_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as refused:
        check_device_list_size(A100, 1)
    assert refused.value.key == "resources.memory_unit_mib"
    assert "655360 memory devices" in refused.value.problem
    assert "use 1024" in refused.value.problem


def test_gib_units_pass_on_the_same_cards():
    check_device_list_size(A100, 1024)
    check_device_list_size(A100, 128)  # 5120 devices: well within kubelet's limit


# --- the systemd watchdog follows the run loop ---------------------------------------------


def test_watchdog_pings_stop_while_the_run_loop_hangs_and_resume_after(monkeypatch):
    """The run loop in this process, a real notify socket, and a reconcile that hangs:
    WATCHDOG=1 stops while it hangs (systemd would restart us) and comes back after."""
    import tempfile
    import threading
    import time

    from nodemgr import daemon
    from nodemgr.config import settings_from_mapping
    from nodemgr.systemd_notify import ServiceNotifier
    from tests.conftest import GPU0
    from tests.kubelet_sim import TestKubelet
    from tests.test_systemd_notify import Listener

    root = tempfile.mkdtemp(prefix="gs-wd-", dir="/tmp")
    settings = settings_from_mapping(
        {
            "node_name": "node-a",
            "kubelet": {
                "device_plugin_dir": f"{root}/dp",
                "pod_resources_socket": f"{root}/pr/kubelet.sock",
                "reconcile_interval_seconds": 0.2,
            },
            "state_dir": f"{root}/state",
            "run_dir": f"{root}/run",
            "mps": {"enabled": False},
            "metrics": {"enabled": False},
            "gpus": {
                "backend": "simulated",
                "simulated": {"devices": [{"uuid": GPU0, "name": "T4", "memory_mib": 4096}]},
            },
        }
    )
    kubelet = TestKubelet(f"{root}/dp", f"{root}/pr/kubelet.sock")
    kubelet.start()
    systemd = Listener()
    notifier = ServiceNotifier({"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "400000"})
    hang, release = threading.Event(), threading.Event()
    real_reconcile = daemon._reconcile

    def reconcile(*args):
        if hang.is_set():
            release.wait(30)
        real_reconcile(*args)

    monkeypatch.setattr(daemon, "_reconcile", reconcile)
    stop = threading.Event()
    thread = threading.Thread(
        target=daemon.run, args=(settings, stop), kwargs={"notifier": notifier}
    )
    thread.start()
    try:

        def pings(seconds):
            found, deadline = 0, time.monotonic() + seconds
            while time.monotonic() < deadline:
                found += sum(m == {"WATCHDOG": "1"} for m in systemd.messages(wait=0.1))
            return found

        deadline = time.monotonic() + 20
        while not any(m.get("READY") == "1" for m in systemd.messages(wait=0.1)):
            assert time.monotonic() < deadline, "never READY"
        assert pings(1.0) >= 3
        hang.set()
        time.sleep(0.5)  # the loop reaches the hanging reconcile
        systemd.messages(wait=0.05)  # drop what was sent before it hung
        assert pings(1.5) == 0
        hang.clear()
        release.set()
        assert pings(1.0) >= 3
    finally:
        release.set()
        stop.set()
        thread.join(10)
        kubelet.stop()
        systemd.close()
    assert not thread.is_alive()
