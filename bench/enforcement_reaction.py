"""Time from a GPU process going over its container's quota to its kill.

The real daemon (action: kill, default 1 s interval) and a real runc
container; each run starts one more process in the container, reports it (in
the simulated per-process usage file, as NVML would) above the container's
4 GiB quota, and times how long until it stops running. The distribution is
what matters: detection waits for the next scan, so it spreads over one
interval; the promise is under 2 s. The first run, right after the daemon
started, is not counted (its start-up work is READY's figure).

Run (root, runc and busybox-static installed, see scripts/setup-runtime):
``.venv/bin/python -m bench.enforcement_reaction [--runs 40]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.report import Figure, machine_lines
from bench.stats import Summary, percentile
from standins.daemon_proc import GPU0
from standins.runc_env import EnforcementNode, running

WARMUP_RUNS = 1


def measure(runs: int) -> list[float]:
    node = EnforcementNode()
    try:
        env, mounts = node.admit("bench")
        if node.start_in_pod("bench", "bench", env, mounts).returncode != 0:
            raise SystemExit("the benchmark container was refused")
        init = node.runtime.pid("bench")
        reactions = []
        # One run first, not counted: the daemon has only just started (its first MPS
        # checks and scans), which READY's figure covers, not this one.
        for run in range(runs + WARMUP_RUNS):
            pid = node.runtime.exec("bench", "sleep", "1000")
            # Let the exec-triggered scan pass (time the plain case), then a
            # random phase: otherwise every run would hit the scan cycle alike.
            time.sleep(0.3 + random.uniform(0, 1))
            started = time.monotonic()
            node.set_usage([(init, GPU0, 1000), (pid, GPU0, 4000)])
            while running(pid):
                if time.monotonic() - started > 10:
                    raise SystemExit(f"process {pid} still runs 10 s over quota")
                time.sleep(0.005)
            if run >= WARMUP_RUNS:
                reactions.append((time.monotonic() - started) * 1000)
            node.set_usage([(init, GPU0, 1000)])
        return reactions
    finally:
        node.close()


# The design's promise: a process over its quota runs at most 2 s more.
PROMISE_MS = 500  # target: over quota to killed, p99 <= 0.5 s (the design's promise: 2 s)


def figures(reactions_ms: list[float]) -> list[Figure]:
    summary = Summary.of(reactions_ms)
    return [
        Figure("enforcement_runs", summary.n, "enforcement runs (real runc, kill)"),
        Figure("enforcement_p50_ms", summary.p50, "over quota to killed, p50 (ms)"),
        Figure(
            "enforcement_p99_ms",
            summary.p99,
            "over quota to killed, p99 (ms)",
            target=f"<= {PROMISE_MS}",
            met=summary.p99 <= PROMISE_MS,
        ),
        Figure("enforcement_max_ms", summary.max, "over quota to killed, max (ms)"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    reactions = measure(args.runs)
    print(f"{'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    print(
        f"{len(reactions):>4} {statistics.median(reactions):>8.0f} "
        f"{percentile(reactions, 90):>8.0f} {percentile(reactions, 99):>8.0f} "
        f"{max(reactions):>8.0f}"
    )
    print("\n".join(machine_lines(figures(reactions))))


if __name__ == "__main__":
    main()
