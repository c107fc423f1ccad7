"""What gpushare-hook adds to a container's creation, with real runc.

Creates and deletes busybox containers with runc, rounds interleaved so that
machine noise hits every variant alike:
- ``no hook``: config.json without hooks (the baseline of ``hook, no GPU``);
- ``hook, no GPU``: the shipped hooks, a container that asks for no GPU (the
  hook's fast path: no connection to the daemon);
- ``no hook, GPU``: the shared-GPU container below without hooks: its env and
  the mount of its allocation (the MPS client directory), the baseline of
  ``hook, GPU``. runc's work for that mount is the allocation's, not the
  hook's;
- ``hook, GPU``: the shipped hooks, a shared-GPU container whose env the real
  daemon checks against its allocation and registers (and unregisters at
  poststop).

Creation is ``runc run -d`` (create + start, where createRuntime runs);
deletion is ``runc delete -f`` (where poststop runs). Reported: p50/p90 per
variant and the p50 difference to the baseline.

Every runc call is timed to the moment runc exits (``standins.exitwait``
waits on a pidfd): ``subprocess.run(..., timeout=60)`` would poll at 1, 3, 7, 15,
31, 63 ms..., reading every creation as 31 or 63 ms, so that an 8 ms hook would push it
from one step to the next. containerd's and CRI-O's shims run ``runc create`` then
``runc start``: the same rounds also time that pair
(``hook_overhead_create_start_p50_ms``), the path a Kubernetes node takes.

Run (root, runc and busybox-static installed, see scripts/setup-runtime):
``.venv/bin/python -m bench.hook_overhead [--rounds 60]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from bench.report import Figure, machine_lines
from bench.stats import percentile
from standins import exitwait
from standins.runc_env import EnforcementNode, cri_annotations

# Target: the hook adds at most 35 ms to runc run -d of a GPU container, p50. About 6 ms
# is Python's start-up and 10 ms the imports of json (re, enum) and socket: the hook uses
# the standard library's public modules, not their C parts (docs/enforcement.md, "Cost").
OVERHEAD_TARGET_MS = 35.0


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    node = EnforcementNode()
    try:
        gpu_env, mounts = node.admit("bench")
        # As a CRI runtime makes it: with its pod's identity (the daemon ties it to the pod).
        identity = cri_annotations("default", "bench", "main")
        bundles = {
            "no hook": node.runtime.bundle("plain", {"HOME": "/"}, hooks=False),
            "hook, no GPU": node.runtime.bundle("nogpu", {"HOME": "/"}),
            NO_HOOK_GPU: node.runtime.bundle(
                "gpu-nohook", gpu_env, mounts, annotations=identity, hooks=False
            ),
            "hook, GPU": node.runtime.bundle("gpu", gpu_env, mounts, annotations=identity),
        }
        times: dict[str, dict[str, list[float]]] = {
            name: {"create": [], "delete": [], "create_start": []} for name in bundles
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
                times[name]["create_start"].append(create_then_start(node, container_id, bundle))
                node.runtime.delete(container_id)
        times[ALONE] = {"create": hook_alone(node, bundles["hook, no GPU"], rounds)}
        return times
    finally:
        node.close()


ALONE = "hook alone, no GPU"
NO_HOOK_GPU = "no hook, GPU"
# Each variant's baseline: the same container without the hooks.
BASELINE = {"hook, no GPU": "no hook", "hook, GPU": NO_HOOK_GPU}


def create_then_start(node: EnforcementNode, container_id: str, bundle: str) -> float:
    """``runc create`` then ``runc start`` of the container again, as a CRI runtime's
    shim runs them: milliseconds for the pair. (runc's output goes to a file: the
    container keeps its stdio, so a pipe would never reach its end.)"""
    runc = ["runc", "--root", node.runtime.state_root]
    log_path = os.path.join(node.runtime.root, f"{container_id}.create-start.out")
    with open(log_path, "w") as log:
        started = time.perf_counter()
        for command in (["create", "--bundle", bundle, container_id], ["start", container_id]):
            done = exitwait.run(
                [*runc, *command], stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60
            )
            if done.returncode != 0:
                with open(log_path) as said:
                    raise SystemExit(f"runc {command[0]} failed: {said.read()}")
        return (time.perf_counter() - started) * 1000


def hook_alone(node: EnforcementNode, bundle: str, rounds: int) -> list[float]:
    """The hook's own wall time (ms), run as runc runs it at createRuntime (the launcher,
    the OCI state on stdin) for a container asking no GPU: what it adds to a creation
    without runc's own timing steps around it."""
    runtime = node.runtime
    state = json.dumps(
        {"ociVersion": "1.0.2", "id": "alone", "status": "creating", "pid": os.getpid(),
         "bundle": bundle}
    ).encode()  # fmt: skip
    command = [runtime.launcher, "--socket", runtime.hook_socket, "createRuntime"]
    wall = []
    for _ in range(rounds):
        started = time.perf_counter()
        done = exitwait.run(command, input=state, capture_output=True, timeout=30)
        wall.append((time.perf_counter() - started) * 1000)
        if done.returncode != 0:
            raise SystemExit(f"the hook refused a no-GPU container: {done.stderr!r}")
    return wall


def figures(times: dict[str, dict[str, list[float]]]) -> list[Figure]:
    """What the hook adds to the median, per operation: the p50 difference to no hook."""

    def p50(variant: str, op: str) -> float:
        return statistics.median(times[variant][op])

    def added(variant: str, op: str) -> float:
        return p50(variant, op) - p50(BASELINE[variant], op)

    create_start = []
    if times[NO_HOOK_GPU].get("create_start") and times["hook, GPU"].get("create_start"):
        create_start.append(
            Figure(
                "hook_overhead_create_start_p50_ms",
                added("hook, GPU", "create_start"),
                "hook adds to runc create + runc start (a CRI shim's path), GPU, p50 (ms)",
                note=f"no hook: {p50(NO_HOOK_GPU, 'create_start'):.1f} ms",
            )
        )
    overhead = added("hook, GPU", "create")
    return [
        Figure("hook_rounds", len(times["no hook"]["create"]), "hook rounds (real runc)"),
        Figure("create_p50_ms_no_hook", p50("no hook", "create"), "runc run -d, no hook, p50 (ms)"),
        Figure(
            "create_p50_ms_no_hook_gpu",
            p50(NO_HOOK_GPU, "create"),
            "runc run -d, GPU container's env and mounts, no hook, p50 (ms)",
        ),
        Figure(
            "hook_overhead_p50_ms",
            overhead,
            "hook adds to creation, GPU container, p50 (ms)",
            target=f"<= +{OVERHEAD_TARGET_MS:g}",
            met=overhead <= OVERHEAD_TARGET_MS,
            note="against the same container without hooks",
        ),
        Figure(
            "hook_overhead_nogpu_p50_ms",
            added("hook, no GPU", "create"),
            "hook adds to creation, no GPU, p50 (ms)",
        ),
        Figure(
            "create_p50_ratio_gpu",
            p50("hook, GPU", "create") / p50(NO_HOOK_GPU, "create"),
            "creation with hook / without, GPU, p50",
        ),
        Figure(
            "hook_alone_nogpu_p50_ms",
            p50(ALONE, "create"),
            "the hook's own wall time, no GPU, p50 (ms)",
        ),
        Figure(
            "hook_delete_overhead_p50_ms",
            added("hook, GPU", "delete"),
            "poststop hook adds to deletion, p50 (ms)",
        ),
    ] + create_start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    times = measure(args.rounds)
    print(f"{'variant':<18} {'op':<12} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'+p50 ms':>8}")
    for name, ops in times.items():
        for op, values in ops.items():
            p50 = statistics.median(values)
            # Against its baseline; a baseline against itself (+0), the hook alone against 0.
            baseline = BASELINE.get(name, name if name != ALONE else None)
            base = statistics.median(times[baseline][op]) if baseline else 0.0
            print(
                f"{name:<18} {op:<12} {len(values):>4} {p50:>8.2f} {percentile(values, 90):>8.2f} "
                f"{p50 - base:>+8.2f}"
            )
    print("\n".join(machine_lines(figures(times))))


if __name__ == "__main__":
    main()
