"""SIGTERM to exit: how long gpushare-node takes to stop, in the two situations that were slow.

- ``busy``: the test kubelet holds the three ListAndWatch streams, as kubelet
  does, while two shared cards run MPS: every plugin server, worker and the
  netlink reader must end at once;
- ``hung_mps``: every card's MPS control daemon is SIGSTOPped (a hung
  daemon) before the SIGTERM, so the supervisor may be stuck in a control
  command: it must be left behind, not waited for.

Each trial starts the real daemon on two simulated cards behind the test
kubelet, waits until every resource is registered and listed, sends SIGTERM and
times until the process has exited; the figure is the p99 over the trials of
the slower situation (``shutdown_p99_ms``, target <= 1000 ms).

Run: ``.venv/bin/python -m bench.shutdown [--trials 20]``
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from bench.report import Figure, table
from bench.stats import percentile
from standins.daemon_proc import CORE, MEMORY, WHOLE, Node
from standins.kubelet_sim import TestKubelet

TARGET_MS = 1000.0


def one_trial(hang_mps: bool) -> float:
    """Milliseconds from SIGTERM to the daemon's exit, in one fresh node."""
    node = Node()
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    stopped: list[int] = []
    try:
        node.start()
        for resource in (MEMORY, CORE, WHOLE):
            kubelet.wait_for_resource(resource, timeout=30)
        if hang_mps:
            daemons = node.wait_for(
                lambda: len(node.mps_daemons()) == 2 and node.mps_daemons(), what="MPS daemons"
            )
            for pid in daemons.values():
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            time.sleep(0.6)  # let a health probe start and hang on a stopped daemon
        began = time.monotonic()
        node.signal(signal.SIGTERM)
        node.wait(30)
        return (time.monotonic() - began) * 1000
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        node.cleanup()
        kubelet.stop()


def measure(trials: int) -> dict[str, list[float]]:
    """Milliseconds per trial, per situation (interleaved: both see the same machine load)."""
    found: dict[str, list[float]] = {"busy": [], "hung_mps": []}
    for _ in range(trials):
        found["busy"].append(one_trial(hang_mps=False))
        found["hung_mps"].append(one_trial(hang_mps=True))
    return found


def figures(samples: dict[str, list[float]]) -> list[Figure]:
    p99 = {name: percentile(values, 99) for name, values in samples.items()}
    worst = max(p99.values())
    busy = "SIGTERM to exit, kubelet streaming"
    return [
        Figure("shutdown_busy_p50_ms", round(percentile(samples["busy"], 50)), f"{busy}, p50 (ms)"),
        Figure("shutdown_busy_p99_ms", round(p99["busy"]), f"{busy}, p99 (ms)"),
        Figure(
            "shutdown_hung_mps_p99_ms",
            round(p99["hung_mps"]),
            "SIGTERM to exit, MPS daemons SIGSTOPped, p99 (ms)",
        ),
        Figure(
            "shutdown_p99_ms",
            round(worst),
            f"SIGTERM to exit, worse situation, p99 over {len(samples['busy'])} trials (ms)",
            target=f"<= {TARGET_MS:g}",
            met=worst <= TARGET_MS,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    print(table(figures(measure(args.trials))))


if __name__ == "__main__":
    main()
