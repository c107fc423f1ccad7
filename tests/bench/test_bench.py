"""bench/: the suite reports every figure the issue asks for, in a form scripts can read.

Nothing here times anything (timings are the benchmarks' job and would make
tests flaky): the figure functions get synthetic samples, the suite's main
runs with its sections replaced, and the ListAndWatch sizing runs for real on
two units only (it is deterministic and fast), as does one small upkeep point
(its times are only checked to be there).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import yaml

from bench import (
    allocate_latency,
    enforcement_reaction,
    footprint,
    hook_overhead,
    listandwatch_size,
    nodes,
    restart,
    scale,
    suite,
    upkeep,
)
from bench.report import ABSENT, SKIPPED, Figure, format_value, machine_lines, table
from bench.stats import Summary, percentile

# The names the issue requires, verbatim.
ISSUE_NAMES = [
    "allocate_p50_us",
    "allocate_p99_us",
    "floor_p99_us",
    "allocate_p99_ratio",
    "listandwatch_bytes_8x141g_gib",
    "smallest_safe_unit_mib_8x141g",
    "idle_rss_mib",
    "idle_cpu_percent",
    "ready_seconds_384",
    "enforcement_p99_ms",
    "hook_overhead_p50_ms",
]


def names(figures: list[Figure]) -> list[str]:
    return [f.name for f in figures]


def test_the_suite_requires_exactly_the_issues_names():
    """Every name an issue asks bench/run for, in order: plus issue 5's Allocate latency
    with 5,000 pods cached, issue 15's SIGTERM-to-exit p99, issue 16's scale rules and its
    idle MPS probe cost with the real control binary, and the DRA prepare ratios."""
    assert suite.required_names() == [
        *ISSUE_NAMES,
        "kube_cache_allocate_p99_ratio",
        "shutdown_p99_ms",
        "scale_flat_in_allocations",
        "scale_linear_in_cards",
        "idle_children_cpu_percent_real",
        "dra_prepare_1_p99_ratio",
        "dra_prepare_16_p99_ratio",
    ]


def test_kube_cache_figures_are_ratios_of_the_two_phases():
    from bench import kube_cache_latency

    figures = {
        f.name: f
        for f in kube_cache_latency.figures({"empty": [0.004] * 50, "full": [0.005] * 50}, 5000)
    }
    assert figures["kube_cache_allocate_p99_ratio"].value == pytest.approx(1.25)
    assert figures["kube_cache_allocate_p99_ratio"].met is True
    assert figures["kube_allocate_p50_us_5000_pods"].value == pytest.approx(5000)


def synthetic_figures() -> list[Figure]:
    """Every section's figure function, fed made-up but well-formed samples."""
    samples = allocate_latency.Samples(
        allocate=[0.004, 0.005, 0.006] * 10,
        preferred=[0.003] * 30,
        floor=[0.001, 0.002] * 15,
        daemon_options=[0.002] * 15,
        ledger_commit=[0.0015] * 10,
        admissions=15,
        stale_reuses=0,
    )
    rows = [
        listandwatch_size.Row(1024, 1128, 71312, 73568, 8.0),
        listandwatch_size.Row(64, 18048, 1164240, 1200336, 140.0),
    ]
    refusal = listandwatch_size.Refusal(2, "... use 68 MiB or more ...", 68)
    full = footprint.FullNode(node=None, kubelet=None, per_card={i: 48 for i in range(8)})
    usage = footprint.Usage(30.0, 0.3, 2.0, 60.0, 64.0)
    busy = footprint.Busy(usage, admitted=500, refused=0, rate_per_second=50.0)
    hook_times = {
        variant: {"create": [30.0, 40.0], "delete": [100.0, 110.0]}
        for variant in ("no hook", "hook, no GPU")
    }
    # The GPU container's mounts cost runc 6 ms; the hook adds 13 ms on top of them.
    hook_times[hook_overhead.NO_HOOK_GPU] = {"create": [36.0, 46.0], "delete": [100.0, 110.0]}
    hook_times["hook, GPU"] = {"create": [49.0, 59.0], "delete": [110.0, 120.0]}
    hook_times[hook_overhead.ALONE] = {"create": [11.0, 13.0]}
    return (
        allocate_latency.figures(samples)
        + listandwatch_size.figures(rows, 74, refusal)
        + footprint.figures(full, usage, 12.5, busy)
        + footprint.figures(full, usage, None, busy, suffix="_no_kube")
        + restart.figures([4.0, 4.2], [("interpreter", 0.5)], [0.7, 0.8], 384)
        + enforcement_reaction.figures([400.0, 900.0, 950.0])
        + hook_overhead.figures(hook_times)
        + scale.figures(scale_points())
    )


def test_every_required_name_comes_out_of_the_sections_figures_once():
    figures = synthetic_figures()
    lines = machine_lines(figures)  # raises on a name reported twice
    keys = [line.partition("=")[0] for line in lines]
    assert set(ISSUE_NAMES) <= set(keys)
    for line in lines:
        key, sep, value = line.partition("=")
        assert sep and key and value and " " not in key, line


def test_dra_prepare_figures_are_ratios_to_the_floor_of_the_same_batch():
    """Per batch size: prepare over its own floor (a gRPC call and that many claim
    reads), p50 and p99, against 2; refused claims must be none."""
    from bench import dra_prepare_latency

    samples = dra_prepare_latency.Samples(
        prepare={1: [0.002, 0.003], 16: [0.010, 0.040]},
        floor={1: [0.001, 0.001], 16: [0.005, 0.010]},
        grpc_floor=[0.0005, 0.0006],
        refused=0,
    )
    found = {f.name: f for f in dra_prepare_latency.figures(samples)}
    assert found["dra_prepare_1_p50_ratio"].value == pytest.approx(2.5)
    assert found["dra_prepare_16_p99_ratio"].value == pytest.approx(4.0)
    assert not found["dra_prepare_16_p99_ratio"].met and found["dra_prepare_refused"].met


def test_figures_follow_their_samples():
    figures = {f.name: f for f in synthetic_figures()}
    assert figures["allocate_p50_us"].value == pytest.approx(5000)
    assert figures["floor_p99_us"].value == pytest.approx(2000)
    assert figures["allocate_p99_ratio"].value == pytest.approx(3.0)
    assert not figures["allocate_p99_ratio"].met  # issue 16: p99 within 2x the floor's
    assert figures["smallest_safe_unit_mib_8x141g"].value == 74
    assert figures["unsafe_unit_exit_code"].met
    assert figures["idle_cpu_percent"].met and not figures["busy_admissions_per_s"].met
    assert figures["idle_cpu_percent_no_kube"].met is None  # targets: the deployed daemon
    assert figures["busy_cpu_ms_per_admission"].value == pytest.approx(0.06)
    assert figures["ready_seconds_384"].value == pytest.approx(4.1)
    # Against the same GPU container without hooks (13 ms: met), not the plain one (19 ms).
    assert figures["hook_overhead_p50_ms"].value == pytest.approx(13.0)
    assert figures["hook_overhead_p50_ms"].met
    assert figures["create_p50_ms_no_hook_gpu"].value == pytest.approx(41.0)
    assert figures["hook_overhead_nogpu_p50_ms"].value == 0
    assert figures["hook_delete_overhead_p50_ms"].value == pytest.approx(10.0)
    assert figures["hook_alone_nogpu_p50_ms"].value == pytest.approx(12.0)


def test_the_refusal_must_name_the_unit():
    rows = [listandwatch_size.Row(1024, 1128, 71312, 73568, 8.0)]
    silent = listandwatch_size.Refusal(2, "config error", 68)
    figure = {f.name: f for f in listandwatch_size.figures(rows, 74, silent)}
    assert figure["unsafe_unit_exit_code"].met is False


def test_listandwatch_sizes_are_the_real_messages_and_the_formula_agrees():
    rows = listandwatch_size.measure((1024, 512), repeats=1)
    assert [r.devices for r in rows] == [8 * 141, 8 * 282]
    assert rows[0].message_bytes < rows[0].worst_bytes < rows[1].message_bytes
    assert all(r.safe for r in rows)


def test_a_failing_section_reports_its_names_as_failed_and_exits_1(monkeypatch, capsys):
    def broken():
        raise RuntimeError("boom")

    def fine():
        return [Figure("other_ms", 1.5, "other")]

    monkeypatch.setattr(
        suite,
        "sections",
        lambda settings, plot: [
            suite.Section("broken", ("allocate_p50_us", "floor_p99_us"), broken),
            suite.Section("fine", ("other_ms",), fine),
        ],
    )
    assert suite.main(["--quick", "--plot", ""]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert suite.value_of(lines, "allocate_p50_us") == "failed"
    assert suite.value_of(lines, "floor_p99_us") == "failed"
    assert suite.value_of(lines, "other_ms") == "1.50"
    assert suite.value_of(lines, "bench_quick") == "1"
    assert "RuntimeError: boom" in out.err
    # The table comes first, the machine-readable lines last.
    assert lines.index("allocate_p50_us=failed") > next(
        i for i, line in enumerate(lines) if line.startswith("figure")
    )


def test_without_runc_the_container_figures_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(suite.runc_env, "missing", lambda: "runc is not installed (test)")
    by_title = {s.title[:2]: s for s in suite.sections(suite.QUICK, None)}
    for key, name in (("5.", "enforcement_p99_ms"), ("6.", "hook_overhead_p50_ms")):
        (figure,) = by_title[key].run()
        assert figure.name == name and figure.value == SKIPPED
        assert "runc is not installed" in figure.note
        assert machine_lines([figure]) == [f"{name}=skipped"]


def test_output_formatting():
    assert format_value(3) == "3"
    assert format_value(2.0) == "2"
    assert format_value(1234.5678) == "1234.6"
    assert format_value(12.3456) == "12.35"
    assert format_value(0.012345) == "0.0123"
    assert format_value(ABSENT) == "absent"
    with pytest.raises(ValueError, match="reported twice"):
        machine_lines([Figure("x_ms", 1, "x"), Figure("x_ms", 2, "x again")])
    assert machine_lines([Figure("x_ms", 1.5, "x", target="< 2", met=True)]) == [
        "x_ms=1.50",
        "x_ms_target=< 2",
        "x_ms_met=yes",
    ]
    assert machine_lines([Figure("y_ms", SKIPPED, "y", target="< 2")])[-1] == "y_ms_met=no"
    text = table([Figure("x_ms", 1.5, "x", target="< 2", met=True, note="why")])
    assert "x_ms" in text and "yes" in text and "why" in text


def test_percentiles_are_measured_values():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 51
    assert percentile(values, 99) == 100
    assert Summary.of(values).max == 100
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)


def test_the_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="bench/run installs matplotlib; the suite does not")
    samples = allocate_latency.Samples(
        allocate=[0.004 + i * 1e-5 for i in range(200)],
        preferred=[0.003] * 200,
        floor=[0.001 + i * 1e-6 for i in range(200)],
        daemon_options=[0.002 + i * 1e-6 for i in range(100)],
        ledger_commit=[0.0015] * 10,
        admissions=100,
        stale_reuses=0,
    )
    path = tmp_path / "latency.png"
    allocate_latency.plot(samples, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shutdown_figure_is_the_worse_situations_p99_against_its_target():
    """shutdown_p99_ms is the p99 of the slower situation, judged against 1000 ms."""
    from bench import shutdown

    found = shutdown.figures({"busy": [100.0] * 10 + [300.0], "hung_mps": [200.0] * 11})
    by_name = {f.name: f for f in found}
    assert by_name["shutdown_p99_ms"].value == max(
        by_name["shutdown_busy_p99_ms"].value, by_name["shutdown_hung_mps_p99_ms"].value
    )
    assert by_name["shutdown_p99_ms"].met is True
    slow = shutdown.figures({"busy": [1500.0] * 5, "hung_mps": [10.0] * 5})
    assert {f.name: f for f in slow}["shutdown_p99_ms"].met is False


def scale_point(
    cards: int,
    allocations: int,
    rss_mib: float,
    cpu_percent: float,
    allocate_s: float = 0.004,
    tail_s: float | None = None,
    cpu_ms_per_admission: float = 3.0,
) -> scale.Point:
    """A measured point of the scale curve: every Allocate ``allocate_s`` (its worst two
    ``tail_s``, when given), the floor 2 ms."""
    allocate = [allocate_s] * 98 + [allocate_s if tail_s is None else tail_s] * 2
    return scale.Point(
        cards,
        allocations,
        allocate=allocate,
        floor=[0.002] * 200,
        preferred=[0.01] * 100,
        idle_cpu_percent=cpu_percent,
        children_cpu_percent=1.0,
        idle_seconds=10.0,
        rss_mib=rss_mib,
        held=allocations,
        events_per_s=80.0,
        rate_per_s=8.0,
        cpu_ms_per_admission=cpu_ms_per_admission,
    )


def scale_points(
    cards: tuple[int, ...] = (1, 8, 16), rss_per_card_mib: tuple[float, float] = (1.0, 1.0)
) -> list[scale.Point]:
    """1, 8, 16 cards x 0, 1,000 allocations: RSS 50 MiB + a card's share (MiB per card from
    1 to 8 cards, then beyond) + 4 MiB per 1,000 allocations; CPU 2 % + 0.2 % per card."""

    def rss(c: int) -> float:
        low, high = rss_per_card_mib
        return 50 + low * min(c, 8) + high * max(c - 8, 0)

    return [scale_point(c, a, rss(c) + 0.004 * a, 2 + 0.2 * c) for c in cards for a in (0, 1000)]


def test_scale_figures_name_every_point_and_meet_both_rules_when_cost_is_linear_and_flat():
    """Each point gives its figures; flat in allocations is the worst growth from 0 to
    1,000 of RSS or the Allocate p99 or p50 ratio; linear in cards is the
    worst of CPU growth over card growth and the per-card RSS increment of the last step
    over the first."""
    by_name = {f.name: f for f in scale.figures(scale_points())}
    for c in (1, 8, 16):
        for a in (0, 1000):
            assert by_name[f"scale_allocate_p99_ratio_c{c}_a{a}"].value == pytest.approx(2.0)
            assert f"scale_idle_cpu_percent_c{c}_a{a}" in by_name
            assert f"scale_rss_mib_c{c}_a{a}" in by_name
    assert by_name["scale_rss_mib_c16_a1000"].value == pytest.approx(70)
    assert by_name["scale_rss_growth_c1"].value == pytest.approx(55 / 51)
    assert by_name["scale_allocate_ratio_growth_c8"].value == pytest.approx(1.0)
    flat = by_name["scale_flat_in_allocations"]
    assert flat.value == pytest.approx(55 / 51) and flat.met is True
    assert by_name["scale_idle_cpu_vs_linear_a0"].value == pytest.approx((5.2 / 2.2) / 16)
    assert by_name["scale_rss_mib_per_card_a1000"].value == pytest.approx(1.0)
    linear = by_name["scale_linear_in_cards"]
    assert linear.value == pytest.approx(1.0) and linear.met is True
    lines = machine_lines([flat, linear])
    assert "scale_flat_in_allocations_target=<= 1.25" in lines
    assert "scale_linear_in_cards_met=yes" in lines


def _with_8_cards_1000(**changes) -> list[scale.Point]:
    """scale_points(), the 8-card 1,000-allocation point made with ``changes``."""
    return [
        scale_point(p.cards, p.allocations, p.rss_mib, p.idle_cpu_percent, **changes)
        if (p.cards, p.allocations) == (8, 1000)
        else p
        for p in scale_points()
    ]


def test_scale_flat_rule_fails_when_allocate_slows_with_allocations():
    """Allocate 1.5 x slower at 1,000 allocations on 8 cards (the floor unchanged): the
    median moved, so the rule fails."""
    by_name = {f.name: f for f in scale.figures(_with_8_cards_1000(allocate_s=0.006))}
    assert by_name["scale_allocate_p50_ratio_growth_c8"].value == pytest.approx(1.5)
    assert by_name["scale_allocate_ratio_growth_c8"].value == pytest.approx(1.5)
    assert by_name["scale_flat_in_allocations"].value == pytest.approx(1.5)
    assert by_name["scale_flat_in_allocations"].met is False


def test_scale_flat_rule_fails_on_a_slow_tail_and_shows_cpu_per_admission():
    """Two slow calls of 100 at one point (the p99 ratio x 3, the median unchanged) fail
    the rule: the points are measured side by side, so a tail is the daemon's. The CPU per
    admission is shown, marked as not judged."""
    points = _with_8_cards_1000(tail_s=0.012, cpu_ms_per_admission=6.0)
    by_name = {f.name: f for f in scale.figures(points)}
    assert by_name["scale_allocate_ratio_growth_c8"].value == pytest.approx(3.0)
    assert by_name["scale_allocate_p50_ratio_growth_c8"].value == pytest.approx(1.0)
    assert by_name["scale_flat_in_allocations"].value == pytest.approx(3.0)
    assert by_name["scale_flat_in_allocations"].met is False
    cpu = by_name["scale_cpu_per_admission_growth_c8"]
    assert cpu.value == pytest.approx(2.0) and cpu.note == "shown, not judged"
    assert by_name["scale_cpu_ms_per_admission_c8_a1000"].value == pytest.approx(6.0)


def test_scale_linear_rule_fails_when_each_card_costs_more_than_the_one_before():
    """1 MiB per card from 1 to 8 cards, 3 MiB per card from 8 to 16: RSS increment growth 3."""
    by_name = {f.name: f for f in scale.figures(scale_points(rss_per_card_mib=(1.0, 3.0)))}
    assert by_name["scale_rss_vs_linear_a0"].value == pytest.approx(3.0)
    assert by_name["scale_rss_mib_per_card_a0"].value == pytest.approx((8 + 24 - 1) / 15)
    assert by_name["scale_linear_in_cards"].met is False


def test_scale_cpu_rule_reads_a_quiet_window_as_one_clock_tick():
    """A 1-card daemon that used no CPU tick in its window: its idle CPU counts as one tick
    over the window (0.1 % of 10 s at 100 ticks/s), not 0, so the growth is finite."""
    points = [
        scale_point(p.cards, p.allocations, p.rss_mib, 0.0) if p.cards == 1 else p
        for p in scale_points()
    ]
    tick_percent = 100 / os.sysconf("SC_CLK_TCK") / 10.0
    by_name = {f.name: f for f in scale.figures(points)}
    assert by_name["scale_idle_cpu_vs_linear_a0"].value == pytest.approx(5.2 / tick_percent / 16)
    assert math.isfinite(by_name["scale_linear_in_cards"].value)


def test_scale_rss_rule_floors_a_tiny_first_increment():
    """0.01 then 0.03 MiB per card is noise, not a card costing 3 x more: the first
    increment counts as at least RSS_INCREMENT_FLOOR_MIB."""
    points = scale_points(rss_per_card_mib=(0.01, 0.03))
    by_name = {f.name: f for f in scale.figures(points)}
    assert by_name["scale_rss_vs_linear_a0"].value == pytest.approx(
        0.03 / scale.RSS_INCREMENT_FLOOR_MIB
    )
    assert by_name["scale_linear_in_cards"].met is True


def test_scale_with_two_card_counts_rss_takes_the_growth_over_card_ratio():
    """The quick run (1 and 8 cards) has no second step: RSS growth over the card ratio."""
    by_name = {f.name: f for f in scale.figures(scale_points(cards=(1, 8)))}
    assert by_name["scale_rss_vs_linear_a0"].value == pytest.approx((58 / 51) / 8)
    assert "growth over card ratio" in by_name["scale_rss_vs_linear_a0"].note


def test_a_skipped_scale_point_is_reported_with_its_reason_and_left_out_of_the_rules():
    """A config the daemon refuses: its figures are skipped with the daemon's words; the
    rules are judged on the points that were measured."""
    why = "the daemon exited (2): resources.memory_unit_mib: 136 MiB gives ..."
    points = [
        scale.Point(16, p.allocations, skipped=why) if p.cards == 16 else p for p in scale_points()
    ]
    figures = scale.figures(points)
    by_name = {f.name: f for f in figures}
    for name in ("scale_allocate_p99_ratio", "scale_idle_cpu_percent", "scale_rss_mib"):
        assert by_name[f"{name}_c16_a1000"].value == SKIPPED
        assert by_name[f"{name}_c16_a1000"].note == why
    assert by_name["scale_rss_growth_c16"].value == SKIPPED
    assert by_name["scale_flat_in_allocations"].value == pytest.approx(55 / 51)
    assert "1 to 8 cards" in by_name["scale_rss_vs_linear_a0"].note
    machine_lines(figures)  # every name once


def test_the_scale_plot_is_a_png_and_is_left_out_without_matplotlib(tmp_path, monkeypatch):
    """bench/run installs matplotlib; without it the figures still come, the plot does not."""
    pytest.importorskip("matplotlib", reason="bench/run installs matplotlib; the suite does not")
    points = scale_points() + [scale.Point(32, 0, skipped="not measured")]
    path = tmp_path / "scale.png"
    assert scale.plot(points, str(path), "test") is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert scale.plot(points, str(tmp_path / "none.png"), "test") is False
    assert not (tmp_path / "none.png").exists()


def test_h200_nodes_take_a_card_count_and_keep_eight_by_default():
    """bench/scale.py's 1 and 16 cards; every other bench keeps the 8-card node."""
    cards = nodes.h200_cards(16)
    assert len({c.uuid for c in cards}) == 16 and cards[15].numa_node == 3
    assert nodes.H200_CARDS == nodes.h200_cards(8)
    for count, expected in ((None, 8), (1, 1), (16, 16)):
        node = nodes.h200_node() if count is None else nodes.h200_node(cards=count)
        try:
            with open(node.config_path) as f:
                devices = yaml.safe_load(f)["gpus"]["simulated"]["devices"]
            assert [d["uuid"] for d in devices] == [c.uuid for c in nodes.h200_cards(expected)]
        finally:
            node.cleanup()


class _Api:
    def __init__(self):
        self.requests: list = []


def test_settle_returns_only_once_the_api_server_went_quiet():
    """Idle starts after the fill's queued writes drained: settle waits while requests
    arrive and returns once none came for the quiet spell; an API server that never goes
    quiet is an error, not an idle window."""
    import threading
    import time
    from types import SimpleNamespace

    api = _Api()
    done = threading.Event()

    def writes(count):
        for _ in range(count):
            api.requests.append(("PATCH", "/pods", {}))
            time.sleep(0.05)
        done.set()

    threading.Thread(target=writes, args=(10,), daemon=True).start()
    footprint.settle(SimpleNamespace(api=api), quiet_seconds=0.3, timeout_seconds=10)
    assert done.is_set()
    forever = _Api()
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            forever.requests.append(("PATCH", "/pods", {}))
            time.sleep(0.05)

    threading.Thread(target=busy, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="never went quiet"):
            footprint.settle(SimpleNamespace(api=forever), quiet_seconds=0.3, timeout_seconds=1)
    finally:
        stop.set()


def test_a_ledger_count_off_kubelets_record_is_explained_and_dumped():
    """Issue 15 item 6 (385 allocations for 384 pods, seen once): when the count is off, the
    figure's note names the allocations kubelet does not hold and those sharing a
    container, and the whole ledger and record are dumped to a file it names."""
    import json
    import re

    def row(i, pod):
        return {"id": f"a{i}", "namespace": "full", "pod": pod, "container": "main"}

    rows = [row(0, "p0"), row(1, "p1"), row(2, "p1"), row(3, None)]
    record = {("full", "p0", "main"): {"gpu": ["x"]}, ("full", "p1", "main"): {"gpu": ["y"]}}
    line = restart.describe_mismatch(rows, set(record), record)
    assert "4 allocations for 2 containers" in line
    assert "not held by kubelet [['a3']]" in line
    assert "several for one container [['a1', 'a2']]" in line
    path = re.search(r"dump: (\S+)", line).group(1)
    with open(path) as f:
        dumped = json.load(f)
    assert dumped["allocations"] == rows and dumped["kubelet"]["full/p0/main"] == {"gpu": ["x"]}
    figure = next(
        f
        for f in restart.figures([1.0], [], [0.5], 385, mismatch=line)
        if f.name == "ledger_allocations_after_restarts"
    )
    assert figure.met is False and figure.note == line


def test_the_binder_binds_ahead_in_its_own_thread_and_reports_a_failure():
    """The busy phase's scheduler: pods are created up to the count asked, in order, off the
    admitting loop; wait_bound returns once a pod is bound; a failing bind is raised to
    the loop instead of hanging it; stop() says how many were bound."""
    import threading

    made: list[str] = []

    class Full:
        def create_pod(self, namespace, name, requests):
            assert threading.current_thread().name == "binder"
            made.append(name)

    binder = footprint.Binder(Full(), lead=3)
    binder.wait_bound(2)
    binder.bind_up_to(5)
    binder.wait_bound(4)
    assert binder.stop() == 5
    assert made == [f"churn{i}" for i in range(5)]

    class Broken:
        def create_pod(self, namespace, name, requests):
            raise OSError("API server gone")

    broken = footprint.Binder(Broken(), lead=1)
    with pytest.raises(RuntimeError, match="API server gone"):
        broken.wait_bound(0, timeout_seconds=5)
    assert broken.stop() == 0


def test_settle_outlasts_a_reconcile_and_its_publish_by_default():
    """The fill's last corrections come with the first reconcile after it (owners guessed
    among identical pods, fixed from kubelet's record) and the publish after that: idle
    starts only once a quiet spell longer than both has passed."""
    from nodemgr.config.schema import KubeletSettings
    from nodemgr.kubernetes.sync import MIN_PUBLISH_INTERVAL_SECONDS

    reconcile = KubeletSettings().reconcile_interval_seconds
    assert footprint.SETTLE_QUIET_SECONDS > reconcile + MIN_PUBLISH_INTERVAL_SECONDS


def test_upkeep_names_every_point_and_the_growth_per_card_count():
    """bench/upkeep.py: three figures per point and, per card count, CPU per admission at the
    most allocations over at none."""
    points = [
        upkeep.Point(1, 0, 0.6, 0.1, 0.7),
        upkeep.Point(1, 1000, 0.3, 0.2, 1.4),
        upkeep.Point(8, 0, 1.5, 0.2, 1.6),
    ]
    figures = {f.name: f.value for f in upkeep.figures(points)}
    assert set(figures) == {
        *(f"upkeep_{what}_c1_a0" for what in ("admission_cpu_ms", "reconcile_cpu_ms")),
        *(f"upkeep_{what}_c1_a1000" for what in ("admission_cpu_ms", "reconcile_cpu_ms")),
        *(f"upkeep_{what}_c8_a0" for what in ("admission_cpu_ms", "reconcile_cpu_ms")),
        "upkeep_cpu_ms_per_admission_c1_a0",
        "upkeep_cpu_ms_per_admission_c1_a1000",
        "upkeep_cpu_ms_per_admission_c8_a0",
        "upkeep_growth_c1",
    }
    assert figures["upkeep_growth_c1"] == pytest.approx(2.0)


def test_upkeep_runs_its_point_on_the_real_allocator():
    """A small point for real: the fill is held, and every figure is a time."""
    point = upkeep.measure_point(nodes.h200_cards(1), 20, admissions=8)
    assert (point.cards, point.allocations) == (1, 20)
    assert point.admission_ms > 0 and point.reconcile_ms >= 0 and point.per_admission_ms > 0
