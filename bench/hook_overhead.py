"""What gpushare-hook adds to a container's creation, with real runc.

Creates and deletes busybox containers with runc, rounds interleaved so that
machine noise hits every variant alike:
- ``no hook``: config.json without hooks (the baseline);
- ``hook, no GPU``: the shipped hooks, a container that asks for no GPU (the
  hook's fast path: no connection to the daemon);
- ``hook, GPU``: the shipped hooks, a shared-GPU container whose env the real
  daemon checks against its allocation and registers (and unregisters at
  poststop).

Creation is ``runc run -d`` (create + start, where createRuntime runs);
deletion is ``runc delete -f`` (where poststop runs). Reported: p50/p90 per
variant and the p50 difference to the baseline.

Run (root, runc and busybox-static installed, see scripts/setup-runtime):
``.venv/bin/python -m bench.hook_overhead [--rounds 60]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from tests.runc_env import EnforcementNode


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    node = EnforcementNode()
    try:
        gpu_env, mounts = node.admit("bench")
        bundles = {
            "no hook": node.runtime.bundle("plain", {"HOME": "/"}, hooks=False),
            "hook, no GPU": node.runtime.bundle("nogpu", {"HOME": "/"}),
            "hook, GPU": node.runtime.bundle("gpu", gpu_env, mounts),
        }
        times: dict[str, dict[str, list[float]]] = {
            name: {"create": [], "delete": []} for name in bundles
        }
        for i in range(rounds):
            for name, bundle in bundles.items():
                container_id = f"b{i}-{name.replace(' ', '').replace(',', '')}"
                started = time.perf_counter()
                done = node.runtime.run(container_id, bundle)
                created = time.perf_counter()
                if done.returncode != 0:
                    raise SystemExit(f"{name}: runc run failed: {done.stdout}")
                node.runtime.delete(container_id)
                deleted = time.perf_counter()
                times[name]["create"].append((created - started) * 1000)
                times[name]["delete"].append((deleted - created) * 1000)
        return times
    finally:
        node.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    times = measure(args.rounds)
    base = {op: statistics.median(times["no hook"][op]) for op in ("create", "delete")}
    print(f"{'variant':<14} {'op':<7} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'+p50 ms':>8}")
    for name, ops in times.items():
        for op, values in ops.items():
            p50 = statistics.median(values)
            print(
                f"{name:<14} {op:<7} {len(values):>4} {p50:>8.2f} {percentile(values, 90):>8.2f} "
                f"{p50 - base[op]:>+8.2f}"
            )
    gpu = statistics.median(times["hook, GPU"]["create"]) - base["create"]
    nogpu = statistics.median(times["hook, no GPU"]["create"]) - base["create"]
    print(f"hook_overhead_p50_ms={gpu:.2f}")
    print(f"hook_overhead_nogpu_p50_ms={nogpu:.2f}")
    ratio = statistics.median(times["hook, GPU"]["create"]) / base["create"]
    print(f"create_p50_ratio_gpu={ratio:.2f}")


if __name__ == "__main__":
    main()
