"""Pins doctor's daemon and ledger checks: the daemon verdicts (down, stale socket, not the
protocol, no status socket, not healthy and why, ready or not and why); the hook probe
answered by the real hook server, which it must leave unchanged, and refused by something
that is not the daemon; and the ledger (none yet, opens read-only with its counts, corrupt
with the recovery as fix)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading

from hooks import protocol
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.cli.doctor import daemon as daemon_checks
from nodemgr.cli.doctor.host import SocketProbe
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.enforcement.hookserver import HookServer
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.inventory import open_inventory
from standins.cards import simulated_settings
from tests.unit.cli.doctor.support import listening, short_dir, write

# --- verdicts ------------------------------------------------------------------------------


def test_daemon_verdicts():
    """No hook socket or a stale one FAILs (fail closed); a foreign answer FAILs; no status
    socket WARNs."""
    hook, status = "/run/gpushare/hook.sock", "/run/gpushare/status.sock"
    ok, missing = SocketProbe("ok"), SocketProbe("missing")
    down = daemon_checks.daemon_result(hook, missing, status, missing, None)
    assert down.status == FAIL and down.detail.startswith("not running: no hook socket")
    assert "fail closed" in down.detail and "systemctl enable --now gpushare-node" in down.fix
    stale = daemon_checks.daemon_result(
        hook, SocketProbe("refused"), status, SocketProbe("refused"), None
    )
    assert stale.status == FAIL and "stale socket" in stale.detail
    odd = daemon_checks.daemon_result(hook, SocketProbe("bad_answer", "not JSON"), status, ok, None)
    assert odd.status == FAIL and "not JSON" in odd.detail
    no_status = daemon_checks.daemon_result(hook, ok, status, missing, None)
    assert no_status.status == WARN and "`nodemgr status` cannot reach it" in no_status.detail


def test_daemon_readiness_from_its_status_document():
    """A ready daemon passes; one not ready WARNs naming why (kubelet registration, a card's
    MPS)."""
    hook, status, ok = "/run/gpushare/hook.sock", "/run/gpushare/status.sock", SocketProbe("ok")
    daemon = {"pid": 42, "version": "0.4.0", "ready": True, "registered": True}
    ready = daemon_checks.daemon_result(hook, ok, status, ok, {"daemon": daemon, "gpus": []})
    assert ready == Result(
        "gpushare-node",
        PASS,
        f"running (pid 42, version 0.4.0), ready: registered with kubelet, MPS healthy; "
        f"answers on {hook}",
    )
    sick = {"index": 1, "healthy": False, "problem": "MPS control daemon down"}
    document = {"daemon": dict(daemon, ready=False, registered=False), "gpus": [sick]}
    not_ready = daemon_checks.daemon_result(hook, ok, status, ok, document)
    assert not_ready.status == WARN
    assert "not ready: not registered with kubelet; GPU1: MPS control daemon down" in (
        not_ready.detail
    )


def test_a_daemon_that_is_not_healthy_fails_naming_why():
    """A daemon whose watchdog cannot judge (or a worker is down) FAILs with the reason from
    the status document's daemon.problems, even while ready."""
    hook, status, ok = "/run/gpushare/hook.sock", "/run/gpushare/status.sock", SocketProbe("ok")
    why = "watchdog: enforcement cannot judge: cannot read /proc: Too many open files"
    daemon = {"pid": 42, "version": "0.4.0", "ready": True, "registered": True}
    daemon.update(healthy=False, problems=[why])
    sick = daemon_checks.daemon_result(hook, ok, status, ok, {"daemon": daemon, "gpus": []})
    assert sick.status == FAIL
    assert sick.detail.startswith(f"running (pid 42, version 0.4.0) but NOT HEALTHY: {why}; ")
    daemon.update(healthy=True, problems=[])
    well = daemon_checks.daemon_result(hook, ok, status, ok, {"daemon": daemon, "gpus": []})
    assert well.status == PASS


def test_ledger_verdicts():
    """No ledger yet WARNs, an open ledger passes with its counts, a corrupt one FAILs with the
    recovery."""
    none = daemon_checks.ledger_result("/var/lib/gpushare", False, None, None)
    assert none.status == WARN and "no ledger yet" in none.detail
    assert "does not exist" in none.detail
    assert daemon_checks.ledger_result("/s", True, (2, 1), None) == Result(
        "ledger",
        PASS,
        f"/s/{LEDGER_FILE} opens read-only: 2 allocation(s), 1 registered container(s)",
    )
    corrupt = daemon_checks.ledger_result(
        "/s", True, None, "the ledger /s/ledger.sqlite is corrupt (x); to recover, stop it"
    )
    assert corrupt == Result(
        "ledger", FAIL, "the ledger /s/ledger.sqlite is corrupt (x)", "stop it"
    )


# --- probes against the real hook server and ledger ---------------------------------------


def test_hook_probe_is_answered_by_the_real_daemon_and_changes_nothing(tmp_path, caplog):
    """The real hook server answers the no-op poststop probe without registering or logging
    anything."""
    from standins.cards import simulated_settings

    settings = simulated_settings(str(tmp_path))
    ledger = Ledger(settings.state_dir)
    allocator = Allocator(settings, open_inventory(settings.gpus).cards(), ledger)
    registry = ContainerRegistry(ledger, allocator, None)
    directory = short_dir()
    server = HookServer(registry, os.path.join(directory, "hook.sock"))
    server.start()
    try:
        with caplog.at_level(logging.INFO):
            probe = daemon_checks.probe_hook_socket(server.socket_path, 2)
        assert probe == SocketProbe("ok")
        assert registry.registrations() == [] and ledger.load_registrations() == []
        assert [r for r in caplog.records if r.name.startswith("nodemgr")] == []
    finally:
        server.stop()
        ledger.close()
        shutil.rmtree(directory)


def test_hook_probe_wants_the_protocols_answer():
    """A socket that never answers times out and one refusing the probe is a bad answer, not the
    daemon."""
    directory = short_dir()
    try:
        silent, refusing = (os.path.join(directory, n) for n in ("silent.sock", "refusing.sock"))
        # Something listening that never answers is not taken for the daemon...
        with listening(silent):
            assert daemon_checks.probe_hook_socket(silent, 0.3).state == "timeout"
        # ...nor is one that refuses the no-op poststop (not gpushare-node's protocol).
        with listening(refusing) as server:
            answer = threading.Thread(target=refuse_one, args=(server,))
            answer.start()
            probe = daemon_checks.probe_hook_socket(refusing, 2)
            answer.join()
        assert probe == SocketProbe("bad_answer", "unknown request")
    finally:
        shutil.rmtree(directory)


def refuse_one(server: socket.socket) -> None:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(2)
        protocol.read_message(conn)
        conn.sendall(protocol.encode({"allowed": False, "message": "unknown request"}))


def test_ledger_probe(tmp_path):
    """check_ledger: no file WARNs, a real ledger passes, a file that is not a database FAILs."""
    settings = simulated_settings(str(tmp_path))
    assert daemon_checks.check_ledger(settings).status == WARN
    Ledger(settings.state_dir).close()
    assert daemon_checks.check_ledger(settings).status == PASS
    for suffix in ("-wal", "-shm"):
        if os.path.exists(os.path.join(settings.state_dir, LEDGER_FILE + suffix)):
            os.remove(os.path.join(settings.state_dir, LEDGER_FILE + suffix))
    write(os.path.join(settings.state_dir, LEDGER_FILE), "not a database at all " * 100)
    corrupt = daemon_checks.check_ledger(settings)
    assert corrupt.status == FAIL and "move the file aside" in corrupt.fix


def test_ready_without_registration_is_not_a_pass():
    """A document saying ready but not registered (a daemon whose kubelet went away, as an
    older daemon reported it) is not a PASS: doctor says it is not registered with kubelet."""
    hook, status, ok = "/run/gpushare/hook.sock", "/run/gpushare/status.sock", SocketProbe("ok")
    daemon = {"pid": 42, "version": "0.4.0", "ready": True, "registered": False}
    result = daemon_checks.daemon_result(hook, ok, status, ok, {"daemon": daemon, "gpus": []})
    assert result.status == WARN
    assert "not ready: not registered with kubelet" in result.detail
