"""The metric table (harness/metrics.py) is the one home of metric names: every metric a run records is defined
there, the report's columns and the gate's metric list come from it, and README's table is generated from it."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from conftest import FAST, ROOT

from harness import metrics
from harness.analysis import task_accuracy as ta
from harness.analysis import tasks as T
from harness.gate.report import speed_metrics
from harness.gate.stats import SpeedStats
from harness.measure import Generation, summarize
from harness.records import report
from harness.run import runner

README_TABLE = re.compile(r"<!-- metrics table:[^\n]*-->\n(.*?)<!-- end of metrics table -->", re.S)


# ------------------------------------------------------------------------------------------ the table
def test_families_match_their_members_and_nothing_else():
    assert metrics.lookup("task_social_iqa_acc_norm_diff_stderr").name == "task_<task>_acc_norm_diff_stderr"
    assert metrics.lookup("task_social_iqa_acc").name == "task_<task>_acc"  # not the acc_norm family
    assert metrics.lookup("task_emoji_movie_acc_norm").name == "task_<task>_acc_norm"
    # a BIG-bench subtask is named task/subtask (harness/analysis/tasks.py accepts it)
    assert metrics.lookup("task_conceptual_combinations/contradictions_acc").name == "task_<task>_acc"
    assert not metrics.undefined(["task_conceptual_combinations/contradictions_acc_diff"])
    assert metrics.lookup("accepted_len_3").name == "accepted_len_<n>"
    assert metrics.lookup("decode_tokens_per_s").unit == "tokens/s"
    for name in ("accepted_len_x", "task__acc", "decode_tokens_per_sec", "task_social_iqa_accuracy"):
        assert not metrics.defined(name), name
    assert metrics.undefined(["ttft_ms", "made_up", "task_a_chance"]) == ["made_up"]


def test_every_definition_is_complete():
    for m in metrics.METRICS.values():
        assert m.better in metrics.BETTER and m.phase in metrics.PHASES, m
        assert m.unit and m.meaning and "\n" not in m.meaning, m
    with pytest.raises(ValueError, match="better"):
        metrics.Metric("x", "s", "faster", "decode", "not a direction")


def test_value_is_a_finite_float_or_none():
    m = {"a": 2, "b": "3.5", "c": float("nan"), "d": "x", "e": None, "f": float("inf")}
    assert [metrics.value(m, k) for k in "abcdefg"] == [2.0, 3.5, None, None, None, None, None]


def test_the_gate_compares_the_headline_speed_and_the_deterministic_accuracy_metrics():
    assert metrics.gate_speed_metric() == metrics.HEADLINE == "decode_tokens_per_s"
    assert metrics.gate_accuracy_metrics() == ["perplexity", "kl_div_mean", "top1_agreement"]
    assert metrics.METRICS["kl_div_mean"].better == "lower" and metrics.METRICS["top1_agreement"].better == "higher"


def test_readme_table_is_the_generated_one():
    found = README_TABLE.search((ROOT / "README.md").read_text())
    assert found, "README.md lost its metrics table markers"
    assert found.group(1) == metrics.markdown_table(), \
        "README's metrics table differs from harness/metrics.py: paste `python -m harness.metrics --markdown`"
    printed = subprocess.run([sys.executable, "-m", "harness.metrics", "--markdown"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    assert printed == metrics.markdown_table()
    assert printed.count("\n") == len(metrics.METRICS) + 2  # header, rule, one row per definition


def test_check_lists_undefined_metrics_of_a_result_file(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text('{"metrics": {"ttft_ms": 1.0, "task_x_acc": 0.5}}')
    bad.write_text('{"metrics": {"ttft_ms": 1.0, "tokens_per_joule": 3.0}}')
    assert metrics.main(["--check", str(good)]) == 0
    assert metrics.main(["--check", str(good), str(bad)]) == 1
    assert metrics.main(["--check", str(tmp_path / "missing.json")]) == 2


# ------------------------------------------------------------------------------------------ producers
def test_summarize_and_the_gate_record_only_produce_defined_metrics():
    gens = [Generation(sequences=[[1, 2, 3]], prompt_tokens=4, ttft_s=0.01, step_s=[0.02, 0.03], decode_tokens=2,
                       decode_wall_s=0.06)]
    assert metrics.undefined(summarize(gens)) == []
    assert "decode_step_tokens_per_s" in summarize(gens)
    stats = SpeedStats(pairs=4, baseline_tps=10.0, candidate_tps=9.0, change=-0.1, ci_low=-0.2, ci_high=0.0,
                       alpha=0.01, confidence=0.95, threshold=0.05, verdict="undecided", stop="budget")
    names = [*speed_metrics(stats), "exit_code", "gate_seconds",
             *(f"candidate_{k}" for k in metrics.gate_accuracy_metrics())]
    assert metrics.undefined(names) == []


def test_task_accuracy_produces_defined_metrics_for_any_task_name():
    pytest.importorskip("statsmodels", reason="tasks extra (McNemar's test): scripts/setup.sh --tasks")
    ex = [T.Example(input="q", choices=("a", "b"), gold=(0,)) for _ in range(3)]
    tasks = [T.Task(name=n, examples=ex, sha256="0") for n in ("social_iqa", "emoji-movie.v2")]

    def answers(acc: list[int]) -> ta.Answers:
        return ta.Answers(indices=[0, 1, 2], lls=[[0.0, 0.0]] * 3, acc=acc, acc_norm=acc,
                          stderr={"acc": 0.1, "acc_norm": 0.1})

    plan = ta.Plan(tasks=tasks, picks={t.name: [0, 1, 2] for t in tasks},
                   reference={t.name: answers([1, 1, 0]) for t in tasks}, cache_hit=True)
    out = ta.compare(plan, {t.name: answers([1, 0, 1]) for t in tasks})
    assert metrics.undefined(out) == []
    assert metrics.lookup("task_emoji-movie.v2_acc_norm_mcnemar_p").name == "task_<task>_acc_norm_mcnemar_p"


RUNS = {  # a few tiny-model runs that between them reach most producers
    "greedy": ["quantizer=bf16"],  # accuracy (KL, top-1), quantize, kernel profile, roofline, workload
    "static_batch": ["strategy=static_batch", "strategy.batch_size=2", "accuracy.enabled=false"],
    "speculative": ["strategy=speculative", "accuracy.enabled=false"],
    "continuous_batch": ["strategy=continuous_batch", "strategy.requests=4", "accuracy.enabled=false"],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_every_metric_a_run_records_is_defined(compose, results_overrides, name):
    result = runner.run(compose([*FAST, "measure.repetitions=1", *RUNS[name], *results_overrides]))
    assert result.status == "OK", result.error
    assert metrics.undefined(result.metrics) == [], "define these in harness/metrics.py"
    assert math.isfinite(result.metrics[metrics.HEADLINE])
    if name == "greedy":
        assert {"kl_div_mean", "top1_agreement", "perplexity", "roofline_fraction"} <= set(result.metrics)


# ------------------------------------------------------------------------------------------ the report
def _cell(label: str, quantizer: str, tps: float, **extra: float) -> dict:
    m = {"decode_tokens_per_s": tps, "decode_tokens_per_s_p10": tps - 1, "decode_tokens_per_s_p90": tps + 1,
         "ttft_ms": 12.0, "ttft_ms_p90": 15.0, "weight_bytes": 3e6, "perplexity": 9.5, **extra}
    return {"status": "OK", "metrics": m, "tags": {"sweep.cell": label, "quantizer.name": quantizer,
                                                    "strategy.name": "Greedy"}}


def test_report_columns_and_directions_come_from_the_table():
    rows = report.rows_for([_cell("a", "none", 20.0), _cell("b", "int8", 30.0, energy_j_per_token=0.25)], "none")
    md = report.markdown(rows, "none")
    header = next(line for line in md.splitlines() if line.startswith("| cell |"))
    assert header == ("| cell | quantizer | strategy | batch | decode tok/s (p10–p90) ↑ | × none ↑ | TTFT ms ↓ | "
                      "weight MB ↓ | perplexity ↓ | KL ↓ | top-1 ↑ | J/token ↓ | status |")
    assert "| b | int8 | Greedy | 1 | 30.0 (29.0–31.0) | 1.50 | 12.0 | 3.0 | 9.500 | — | — | 0.250 | OK |" in md
    assert "| a | none | Greedy | 1 | 20.0 (19.0–21.0) | 1.00 | 12.0 | 3.0 | 9.500 | — | — | — | OK |" in md
    shown = [c.name for c in report.columns(rows)]
    assert shown == [n for n in metrics.report_columns() if metrics.METRICS[n].column.always or
                     n == "energy_j_per_token"]
    assert "roofline" not in md and "accept" not in md  # no cell has them


def test_a_sweep_of_baseline_cells_alone_has_no_ratio_column():
    """A strategy sweep (every cell `none`) would compare each cell with itself: 1.00 in every row says nothing."""
    cells = [{**_cell(k, "none", tps), "tags": {"sweep.cell": k, "quantizer.name": "none", "strategy.name": k}}
             for k, tps in (("Speculative-model2", 40.0), ("Speculative-prompt_lookup2", 47.0))]
    md = report.markdown(report.rows_for(cells, "none"), "none")
    assert "× none" not in md and "| 1.00 |" not in md and "No speed ratio column" in md
    assert "| Speculative-model2 | none | Speculative-model2 | 1 | 40.0 (39.0–41.0) | 12.0 |" in md


def test_a_ratio_compares_within_the_same_threads_and_invocation_and_names_llama_cpp_formats():
    """rows.rows_for: the baseline of a cell is the `none` cell with its thread count (not the first `none` found),
    from its own invocation where it has one; a llama.cpp cell is its format, never a second `none` baseline."""
    def cell(q: str, tps: float, threads: int, inv: str = "i1", **tags: str) -> dict:
        c = _cell(f"{tags.get('engine', q)}@{threads}", q, tps)
        c["tags"].update({"threads": str(threads), "quantbench.invocation": inv, **tags})
        c["config"] = {"measure": {"threads": threads, "max_new_tokens": 8}}
        return c

    rows = report.rows_for([cell("none", 100.0, 1), cell("none", 180.0, 2), cell("bf16", 90.0, 1),
                            cell("bf16", 198.0, 2), cell("none", 120.0, 1, inv="i2"), cell("int8", 60.0, 1, inv="i2"),
                            cell("none", 40.0, 2, engine="llama_cpp", **{"engine.format": "Q8_0"})], "none")
    ratio = {(r["cell"], r["invocation"]): r["ratio"] for r in rows}
    assert ratio[("none@1", "i1")] == ratio[("none@2", "i1")] == ratio[("none@1", "i2")] == 1.0
    assert ratio[("bf16@1", "i1")] == pytest.approx(0.9) and ratio[("bf16@2", "i1")] == pytest.approx(1.1)
    assert ratio[("int8@1", "i2")] == pytest.approx(0.5)  # its own invocation's none (120), not i1's (100)
    llama = next(r for r in rows if r["tags"].get("engine") == "llama_cpp")
    assert llama["quantizer"] == "llama_cpp:Q8_0" and llama["ratio"] == pytest.approx(40.0 / 180.0)


def test_a_ratio_compares_within_the_same_kv_cache_and_compile_settings_but_across_a_formats_own_path():
    """A sweep of quantizer=none,bf16 x measure.cache=dynamic,static had two `none` cells with one key: the first
    was every row's baseline (bf16 on a static cache over none on a dynamic one; the static none over the dynamic
    none). measure.path is the format's own (conf/format's `*_eager`): an eager int8 still compares with none."""
    def cell(q: str, tps: float, **measure) -> dict:
        c = _cell(f"{q}/{measure}", q, tps)
        c["config"] = {"measure": {"threads": 1, "max_new_tokens": 8, "cache": "dynamic", "path": "best", **measure}}
        return c

    rows = report.rows_for([cell("none", 1228.0), cell("none", 1081.0, cache="static"),
                            cell("bf16", 1055.0, cache="static"), cell("bf16", 1100.0),
                            cell("int8", 614.0, path="eager"), cell("int8", 500.0, compile=True)], "none")
    ratio = {r["cell"]: r["ratio"] for r in rows}
    assert ratio["none/{'cache': 'static'}"] == 1.0  # its own baseline, not 1081 / 1228
    assert ratio["bf16/{'cache': 'static'}"] == pytest.approx(1055 / 1081)
    assert ratio["bf16/{}"] == pytest.approx(1100 / 1228)
    assert ratio["int8/{'path': 'eager'}"] == pytest.approx(614 / 1228)
    assert ratio["int8/{'compile': True}"] is None  # no compiled none cell: no ratio, not one against eager


def test_a_figure_names_the_cpu_its_speeds_ran_on():
    cpu = {"cpu_model": "AMD EPYC", "cpu.family": "25", "cpu.model": "17", "cpu.isa": "avx512_bf16", "cpu.bf16": "native"}
    cells = [_cell("a", "none", 20.0), _cell("b", "int8", 30.0)]
    for c, threads in zip(cells, ("1", "2"), strict=True):
        c["tags"].update(cpu, threads=threads)
    line = report.on_machines(report.rows_for(cells, "none"))
    assert line == "\nAMD EPYC (family 25 model 17, avx512_bf16, bf16 native), 1/2 threads"
    assert report.on_machines(report.rows_for([_cell("a", "none", 20.0)], "none")) == ""  # no CPU recorded: no line
