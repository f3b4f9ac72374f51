"""The format frontier (harness/analysis/frontier.py) on faked sweep results: dominance beyond intervals,
"cannot decide", Holm, one panel per machine, the between-cell drift; its statistics (intervals.py); and one real
tiny sweep whose drift probe reruns the baseline cell."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_sweep import run_cli

from harness.analysis import frontier, frontier_plot, intervals
from harness.records import report, sweeps

ZEN4 = {"cpu.vendor": "AuthenticAMD", "cpu.family": "25", "cpu.model": "17"}
ZEN3 = {"cpu.vendor": "AuthenticAMD", "cpu.family": "25", "cpu.model": "1"}


def cell(q: str, tps: float, *, spread: float = 0.01, mb: float = 100.0, kl: float | None = None,
         kl_ci: float = 0.001, flips: tuple[int, int] | None = None, p: float | None = None, n: int = 1000,
         machine: dict | None = None) -> dict:
    """A cell's result dict as the sweep writes it: tok/s with its p10-p90 spread, weight bytes, KL or tasks."""
    m = {"decode_tokens_per_s": tps, "decode_tokens_per_s_p10": tps * (1 - spread),
         "decode_tokens_per_s_p90": tps * (1 + spread), "weight_bytes": mb * 1e6}
    if kl is not None:
        m.update(kl_div_mean=kl, kl_div_mean_lo=kl - kl_ci, kl_div_mean_hi=kl + kl_ci)
    if flips is not None:
        m.update(tasks_examples=n, tasks_acc_right_to_wrong=flips[0], tasks_acc_wrong_to_right=flips[1],
                 tasks_acc_mcnemar_p=p)
    return {"status": "OK", "metrics": m, "config": {"sweep": {"baseline": "none"}},
            "tags": {"sweep.cell": f"quantizer={q}", "quantizer.name": q, "strategy.name": "Greedy",
                     "model.name": "m", "config_hash": f"h-{q}", "kernel.linear": f"k-{q}", **(machine or ZEN4)}}


def pts(cells: list[dict], probes: list[dict] | None = None) -> dict[str, frontier.Point]:
    return {p.fmt: p for p in frontier.points(report.rows_for(cells, "none"), "none", probes)}


def probe(of: str, tps: float) -> dict:
    return {"status": "OK", "metrics": {"decode_tokens_per_s": tps}, "tags": {sweeps.OF_TAG: of}}


def test_a_format_beaten_on_both_axes_beyond_the_intervals_is_dominated():
    cells = [cell("none", 20.0, mb=270, kl=0.0005), cell("int8", 30.0, mb=140, kl=0.002),
             cell("bad4", 25.0, mb=140, kl=0.20), cell("near8", 29.5, mb=140, kl=0.0021)]
    got = pts(cells)
    # slower and worse beyond both intervals, same size: by int8 and by near8
    assert got["bad4"].dominated_by == ["quantizer=int8", "quantizer=near8"]
    assert got["near8"].dominated_by == []  # inside int8's intervals on both axes: not dominated
    assert got["none"].dominated_by == []  # more accurate than int8 beyond the intervals
    # larger weights never dominate: the same faster, more accurate formats at 150 MB leave bad4 alone
    cells[1]["metrics"]["weight_bytes"] = cells[3]["metrics"]["weight_bytes"] = 150e6
    assert pts(cells)["bad4"].dominated_by == []
    text = frontier.section(report.rows_for(cells, "none"), "none")
    assert "| bad4 (k-bad4) |" in text and "Frontier" in text


def test_the_section_names_the_cells_it_does_not_draw_and_why():
    crashed = {**cell("fp16", 0.0), "status": "CRASHED", "error": "killed by signal 9\ntraceback"}
    other = cell("int4", 40.0, machine=ZEN3)  # no none cell on that machine
    text = frontier.section(report.rows_for([cell("none", 20.0), cell("int8", 30.0), crashed, other], "none"), "none")
    assert ("Not on the frontier: quantizer=fp16 (CRASHED: killed by signal 9); quantizer=int4 (no `none` cell "
            "with its machine, group and settings).") in text
    # no baseline at all: the section says so instead of vanishing
    text = frontier.section(report.rows_for([cell("bf16", 20.0), cell("int8", 30.0)], "none"), "none")
    assert "No frontier: fewer than two formats have a speedup to draw." in text and "quantizer=bf16 (no `none`" in text
    assert frontier.section(report.rows_for([cell("none", 20.0)], "none"), "none") == ""  # one format: nothing


def test_overlapping_intervals_give_cannot_decide_and_separated_ones_a_pick():
    cells = [cell("none", 20.0, kl=0.0005), cell("a", 30.0, spread=0.05, kl=0.004),
             cell("b", 31.0, spread=0.05, kl=0.005)]
    lines = frontier.recommendations(list(pts(cells).values()))
    fastest = lines[0]
    assert "**cannot decide**" in fastest and "**b (k-b)**" in fastest and "**a (k-a)**" in fastest
    cells[2]["metrics"].update(decode_tokens_per_s=40.0, decode_tokens_per_s_p10=39.6, decode_tokens_per_s_p90=40.4)
    fastest = frontier.recommendations(list(pts(cells).values()))[0]
    assert fastest.startswith("Fastest format: **b (k-b)**") and "cannot decide" not in fastest
    # a KL interval straddling the limit: the smallest format within KL 0.01 cannot be decided
    cells = [cell("none", 20.0, mb=270, kl=0.0005), cell("int8", 30.0, mb=140, kl=0.004),
             cell("int4", 35.0, mb=80, kl=0.009, kl_ci=0.003)]
    smallest = frontier.recommendations(list(pts(cells).values()))[-1]
    assert smallest.startswith("Smallest format within KL 0.01: **cannot decide**") and "int4" in smallest \
        and "int8" in smallest


def test_holm_changes_a_borderline_verdict():
    # three formats against the reference; gptq's raw p = 0.03 is "significant" alone, not after Holm (3 x 0.03)
    cells = [cell("none", 20.0, flips=(10, 9), p=0.9), cell("int8", 30.0, flips=(12, 10), p=0.8),
             cell("gptq", 45.0, spread=0.01, flips=(30, 15), p=0.03)]
    got = pts(cells)
    assert got["gptq"].p_raw == 0.03 and got["gptq"].p_holm == pytest.approx(0.09)
    assert intervals.holm({"a": 0.03, "b": 0.8, "c": 0.9}) == pytest.approx({"a": 0.09, "b": 1.0, "c": 1.0})
    line = next(x for x in frontier.recommendations(list(got.values())) if "not significantly lower" in x)
    assert "**gptq (k-gptq)**" in line  # uncorrected, p = 0.03 < 0.05 would have ruled it out
    assert "McNemar p 0.03 (Holm 0.09)" in line
    # the same format with p = 0.01: Holm 0.03 < 0.05, out; int8 is the fastest left
    cells[2]["metrics"]["tasks_acc_mcnemar_p"] = 0.01
    line = next(x for x in frontier.recommendations(list(pts(cells).values())) if "not significantly lower" in x)
    assert "**int8 (k-int8)**" in line and "gptq" not in line
    # the task axis: loss = reference - run accuracy, pooled over examples; its interval is Agresti-Min's
    diff, se = intervals.pooled_paired(30, 15, 1000)
    d = np.array([-1] * 30 + [1] * 15 + [0] * 955, dtype=float)
    assert diff == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / math.sqrt(1000))
    lo, hi = intervals.paired_interval(30, 15, 1000)
    assert got["gptq"].loss == pytest.approx(0.015) and got["gptq"].loss_hi == pytest.approx(-lo)
    assert -hi < 0.015 < -lo and -lo == pytest.approx(0.015 + 1.96 * se, abs=2e-3)  # ~Wald with many flips


def test_few_task_flips_dominate_nothing_mcnemar_does_not_reject():
    # 4 answers lost, none gained in 100 (McNemar's exact p 0.125) against a faster format that flipped none:
    # the Wald interval (zero wide at no flips, [+0.001, +0.079] at 4/0) called the slower one dominated
    assert intervals.paired_interval(4, 0, 100) == pytest.approx((-0.0815, 0.0031), abs=2e-4)
    lo, hi = intervals.paired_interval(0, 0, 100)
    assert lo < 0 < hi and hi - lo > 0.03  # no flips in 100 is not an exact zero difference
    def cells(lost: int, p: float) -> list[dict]:
        return [cell("none", 10.0, flips=(0, 0), p=1.0, n=100), cell("slow4", 14.0, flips=(lost, 0), p=p, n=100),
                cell("fast0", 18.0, flips=(0, 0), p=1.0, n=100)]

    got = pts(cells(4, 0.125))
    assert got["slow4"].loss_kind == "task" and got["slow4"].loss == pytest.approx(0.04)
    assert got["slow4"].loss_lo < 0 < got["fast0"].loss_hi and got["slow4"].dominated_by == []
    assert pts(cells(30, 1e-9))["slow4"].dominated_by == ["quantizer=fast0"]  # a real loss still is


def test_runs_from_two_cpus_never_share_a_panel(tmp_path, monkeypatch):
    for name, machine, tps in (("a", ZEN4, 30.0), ("b", ZEN3, 12.0)):
        folder = tmp_path / name
        (folder / "cells").mkdir(parents=True)
        for c in (cell("none", tps / 1.5, kl=0.0005, machine=machine), cell("int8", tps, kl=0.002, machine=machine)):
            (folder / "cells" / f"{c['tags']['config_hash']}.json").write_text(json.dumps(c))
    found = [sweeps.from_folder(tmp_path / n, all_cells=True) for n in ("a", "b")]
    points = sweeps.frontier_points(found)
    panels = frontier.panels(points)
    assert sorted(panels) == ["AuthenticAMD family 25 model 1", "AuthenticAMD family 25 model 17"]
    assert all(len({p.machine for p in members}) == 1 for members in panels.values())
    assert report.main(["--frontier", str(tmp_path / "a"), str(tmp_path / "b"), "--all",
                        "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "frontier.png").stat().st_size > 10_000
    drawn = []
    monkeypatch.setattr(frontier_plot.figures, "save", lambda fig, path: drawn.append(fig) or path)
    md, _ = sweeps.write_frontier(found, tmp_path / "out")
    axes = drawn[0].axes
    assert len(axes) == 2 and {ax.get_title() for ax in axes} == set(panels)
    for ax in axes:  # each panel holds its own machine's two formats only
        assert len([t for t in ax.texts if "(k-" in t.get_text()]) == 2
    text = md.read_text()
    assert text.count("## AuthenticAMD family 25 model") == 2


def test_a_speed_difference_inside_the_measured_drift_is_not_a_difference():
    cells = [cell("none", 20.0, kl=0.0005), cell("int8", 23.0, kl=0.0006)]  # 1.15x, tight within-cell spreads
    without = pts(cells)
    assert without["int8"].lo > without["none"].hi  # no drift measured: 1.15x looks real
    assert "drift was not measured" in frontier.section(report.rows_for(cells, "none"), "none")
    with_drift = pts(cells, [probe("h-none", 25.0)])  # the baseline's rerun ran 1.25x faster than its cell
    assert not with_drift["int8"].lo > with_drift["none"].hi
    assert "cannot decide" in frontier.recommendations(list(with_drift.values()))[0]
    # a difference beyond the drift (and both runs of the baseline) still separates
    cells[1]["metrics"].update(decode_tokens_per_s=40.0, decode_tokens_per_s_p10=39.6, decode_tokens_per_s_p90=40.4)
    beyond = pts(cells, [probe("h-none", 25.0)])
    assert beyond["int8"].lo > beyond["none"].hi
    assert beyond["none"].tps == pytest.approx(math.sqrt(20.0 * 25.0))  # a cell that ran twice: the geometric mean
    text = frontier.section(report.rows_for(cells, "none"), "none", [probe("h-none", 25.0)])
    assert "D = max |log ratio| = 0.223 (25.0%, `quantizer=none`: 20.0 then 25.0 tok/s)" in text


def test_the_drift_of_any_format_widens_every_interval():
    # b's process was 1.38x luckier the second time; the baseline's rerun alone (drift_probe=baseline) misses it
    cells = [cell("none", 20.0, kl=0.0005), cell("a", 30.0, kl=0.002), cell("b", 26.0, kl=0.002)]
    base_only = pts(cells, [probe("h-none", 20.2)])
    assert base_only["a"].lo > base_only["b"].hi  # a "faster than b": the drift of b's own runs was never seen
    every = pts(cells, [probe("h-none", 20.2), probe("h-a", 30.3), probe("h-b", 36.0)])
    assert not every["a"].lo > every["b"].hi and not every["b"].lo > every["a"].hi  # cannot decide a vs b
    assert every["a"].lo > every["none"].hi  # 1.5x over the baseline is still beyond a 1.38x drift
    assert intervals.log_drift([(26.0, 36.0), (30.0, 30.3)]) == pytest.approx(math.log(36 / 26))


def test_block_bootstrap_is_wider_on_correlated_series():
    rng = np.random.default_rng(1)
    iid = rng.exponential(size=4096)
    runs = np.repeat(rng.exponential(size=128), 32)  # 32 equal neighbours: like KL along one context
    lo, hi = intervals.block_bootstrap_mean(iid)
    assert lo < iid.mean() < hi
    lo1, hi1 = intervals.block_bootstrap_mean(runs, block=1)
    lo32, hi32 = intervals.block_bootstrap_mean(runs, block=32)
    assert (hi32 - lo32) > 3 * (hi1 - lo1)  # treating correlated tokens as independent is ~sqrt(32) too narrow
    assert intervals.block_bootstrap_mean(runs, block=32) == intervals.block_bootstrap_mean(runs, block=32)


def test_block_bootstrap_of_a_short_series_is_not_zero_wide_and_holds_its_mean():
    # blocks that had to fit inside the series: n <= 32 gave lo == hi == mean; n = 40 under-drew both ends
    rng = np.random.default_rng(2)
    for n in (2, 10, 30, 40, 64):
        x = rng.exponential(size=n)
        lo, hi = intervals.block_bootstrap_mean(x)
        assert lo < x.mean() < hi, n
    outside = 0
    for seed in range(100):  # AR(0.8) series of 40: the mean fell outside its own interval in 71 of 300
        e = np.random.default_rng(seed).normal(size=40)
        for i in range(1, 40):
            e[i] = 0.8 * e[i - 1] + e[i]
        lo, hi = intervals.block_bootstrap_mean(np.exp(e / 3))
        outside += not lo <= np.exp(e / 3).mean() <= hi
    assert outside <= 3


def test_scaling_sweeps_get_speed_against_weight_bytes():
    cells = [cell("none", 10.0, mb=2000), cell("int8", 18.0, mb=1000), cell("slow", 9.0, mb=1500)]
    got = pts(cells)
    assert not frontier.has_accuracy(list(got.values()))
    assert got["slow"].dominated_by == ["quantizer=int8"]
    assert "No accuracy axis" in frontier.section(report.rows_for(cells, "none"), "none")


def test_drift_probe_reruns_every_cell_last_first_in_a_real_sweep(tmp_path):
    done = run_cli(["name=dp", "quantizer=fp32,bf16", "sweep.baseline=fp32", "sweep.drift_probe=all",
                    "sweep.label=lab-a"], tmp_path, warm_start=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "drift probe (all): 2 cell(s) again" in done.stdout
    probed = json.loads((tmp_path / "dp" / sweeps.DRIFT_FILE).read_text())["probes"]
    cells = {c["tags"]["quantizer.name"]: c for c in sweeps.from_folder(tmp_path / "dp").cells}
    # last first: bf16 (the last cell) ran again before fp32, each a speed-only rerun of its own cell
    assert [p["tags"][sweeps.OF_TAG] for p in probed] == [cells[q]["tags"]["config_hash"] for q in ("bf16", "fp32")]
    assert all(p["status"] == "OK" and p["metrics"]["decode_tokens_per_s"] > 0 for p in probed)
    assert "kl_div_mean" not in probed[0]["metrics"] and probed[0]["tags"]["quantizer.name"] == "bf16"
    text = (tmp_path / "dp" / "report.md").read_text()
    assert "Between-cell drift: 2 cells ran again" in text and "No accuracy axis" in text
    assert (tmp_path / "dp" / "frontier.png").exists()
    # the parent MLflow run keeps the probes: the frontier from MLflow, selected by the label, sees the same drift
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    found = sweeps.select_from_mlflow(uri, "drill", "dp", [], "quantbench.label=lab-a")
    assert len(found) == 1
    assert {p["tags"][sweeps.OF_TAG]: p["metrics"]["decode_tokens_per_s"] for p in found[0].probes} == pytest.approx(
        {p["tags"][sweeps.OF_TAG]: p["metrics"]["decode_tokens_per_s"] for p in probed})
    assert report.main(["--frontier", "--sweep", "dp", "--mlflow-experiment", "drill", "--tracking-uri", uri,
                        "--tag", "quantbench.label=lab-b", "--out", str(tmp_path / "none")]) == 2
    # probes of an older invocation of a resumed sweep (one parent run) are not read as this one's
    parent = found[0].source
    metrics = {f"drift_probe.h.{k}": 1.0 for k in sweeps.PROBE_KEYS}
    assert sweeps.probe_from_parent(metrics, {sweeps.PROBED_TAG: "inv1", "quantbench.invocation": "inv1"})
    assert sweeps.probe_from_parent(metrics, {sweeps.PROBED_TAG: "inv1", "quantbench.invocation": "inv2"}) == []
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(parent)
    assert run.data.tags[sweeps.PROBED_TAG] == run.data.tags["quantbench.invocation"]


def test_cells_of_other_thread_counts_are_other_groups_not_rival_formats():
    """A sweep over threads (the `scaling` experiment's -t1 model) compares formats per thread count: each group
    names its threads, and no recommendation offers one format twice (once per thread count)."""
    cells = []
    for threads, scale in ((1, 1.0), (2, 1.8)):
        for c in (cell("none", 20.0 * scale, kl=0.0005), cell("int8", 30.0 * scale, spread=0.2, kl=0.002),
                  cell("int4", 31.0 * scale, spread=0.2, kl=0.003)):
            c["tags"].update({"threads": threads, "sweep.cell": f"{c['tags']['sweep.cell']},threads={threads}"})
            cells.append(c)
    got = frontier.points(report.rows_for(cells, "none"), "none")
    groups = {p.group for p in got}
    assert groups == {"m / Greedy / batch 1 / threads 1", "m / Greedy / batch 1 / threads 2"}
    for grp in groups:
        members = [p for p in got if p.group == grp]
        assert sorted(p.fmt for p in members) == ["int4", "int8", "none"]
        for line in frontier.recommendations(members):
            assert all(line.count(f"**{f} (k-{f})**") <= 1 for f in ("none", "int8", "int4")), line
    text = frontier.section(report.rows_for(cells, "none"), "none")
    assert "### AuthenticAMD family 25 model 17: m / Greedy / batch 1 / threads 2" in text
