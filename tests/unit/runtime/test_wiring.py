"""Pins the daemon's wiring (nodemgr.runtime.wiring) as one piece: the run loop in this
process against the test kubelet and a real systemd notify socket; WATCHDOG=1 pings stop
while the loop hangs and come back after. (The device-list size check moved to
tests/unit/kubelet/test_devicelists.py.)"""

import tempfile
import threading
import time

from nodemgr.config.loading import settings_from_mapping
from nodemgr.runtime import loop
from nodemgr.runtime import wiring as daemon
from nodemgr.runtime.notify import ServiceNotifier
from standins.cards import GPU0
from standins.kubelet_sim import TestKubelet
from standins.notify_listener import Listener


def test_watchdog_pings_stop_while_the_run_loop_hangs_and_resume_after(monkeypatch):
    """The run loop in this process, a real notify socket, and a reconcile that hangs:
    WATCHDOG=1 stops while it hangs (systemd would restart us) and comes back after."""
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
    hang, hanging, release = threading.Event(), threading.Event(), threading.Event()
    real_reconcile = loop.RunLoop._reconcile

    def reconcile(self):
        if hang.is_set():
            hanging.set()
            release.wait(30)
        real_reconcile(self)

    monkeypatch.setattr(loop.RunLoop, "_reconcile", reconcile)
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
        assert hanging.wait(10), "the run loop never reached the hanging reconcile"
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


def test_every_listener_has_its_cap_counted_the_dra_sockets_with_dra_enabled():
    """The open-file check counts each listener the daemon serves at its cap: the hook,
    status and metrics servers, one per device plugin socket, and the two DRA sockets
    only with dra.enabled."""
    base = {"node_name": "node-a"}
    without = daemon.listener_caps(settings_from_mapping(base))
    assert without == {
        "hook": 64,
        "status": 16,
        "metrics": 16,
        "device-plugin:aliyun.com/gpu-mem": 8,
        "device-plugin:aliyun.com/gpu-core.percentage": 8,
        "device-plugin:nvidia.com/gpu": 8,
    }
    enabled = settings_from_mapping({**base, "dra": {"enabled": True}})
    assert daemon.listener_caps(enabled) == {
        **without,
        "dra-registration": 8,
        "dra-service": 8,
    }
