"""Every metric a run can record, defined once: name, unit, which direction is better, phase, meaning.

The table `METRICS` is the one home of the metric names. It feeds:
- the result record: `undefined(names)` lists what a run recorded without a definition (tests run real runs
  through it), and `lookup(name)` gives consumers the unit and direction of any recorded metric;
- the sweep report's columns (`report_columns()`, each with its header and format: harness/records/report.py);
- the gate's metric list (`gate_speed_metric()`, `gate_accuracy_metrics()`: harness/gate/);
- README's metrics table (`markdown_table()`, printed by `python -m harness.metrics --markdown`; a test
  keeps README's copy equal to it).

A family is one entry whose name holds a placeholder, e.g. `task_<task>_acc_diff` (one metric per task
scored) or `accepted_len_<n>` (speculative decoding's histogram): `defined` and `lookup` match it.

The types (`Metric`, `Column`, the phases) live in harness/metric_types.py and the serving, sweep and gate
metrics in harness/metrics_load.py; this module and those import nothing else from the project, so any module
may import it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.metric_types import BETTER, PHASES, Column, Metric
from harness.metrics_load import SERVING_SWEEP_GATE

_H, _L, _N = "higher", "lower", "none"
__all__ = ["BETTER", "PHASES", "Column", "Metric", "METRICS", "HEADLINE", "DIRECTION_MARK", "lookup", "defined",
           "undefined", "value", "gate_speed_metric", "gate_accuracy_metrics", "report_columns", "markdown_table"]

_TABLE: list[Metric] = [
    # ---- preflight (harness/measure/memory.py)
    Metric("mem_estimate_mb", "MiB", _N, "preflight", "peak memory the whole run (reference, load, decode, accuracy) was estimated to need, before loading"),
    Metric("mem_available_mb", "MiB", _N, "preflight", "memory free for the run when it was estimated"),
    # ---- load (quantizers' audit and last_metrics, the llama.cpp conversion)
    Metric("load_s", "s", _L, "load", "loading the model, quantization included"),
    Metric("quantize_s", "s", _L, "load", "quantizing the weights (a cached GPTQ model: the time it first took)"),
    Metric("quantize_run_s", "s", _L, "load", "GPTQ: the time this run spent quantizing or reading its cache"),
    Metric("calibration_tokens", "tokens", _N, "load", "GPTQ: calibration tokens the quantizer saw"),
    Metric("gguf_write_s", "s", _L, "load", "llama.cpp: writing the float GGUF of random weights (first use)"),
    Metric("weight_bytes", "bytes", _L, "load", "every stored tensor counted once, scales and zeros included",
           Column("weight MB", "{:.1f}", 30, scale=1e-6, always=True)),
    Metric("bits_per_weight", "bits", _L, "load", "stored bits per weight of the quantized (targeted) layers"),
    Metric("params", "count", _N, "load", "logical parameter count"),
    Metric("linear_layers", "count", _N, "load", "linear layers the quantizer targets"),
    Metric("quantized_layers", "count", _N, "load", "targeted linear layers actually stored quantized"),
    Metric("all_linear_layers", "count", _N, "load", "every linear layer, skipped ones (lm_head) included"),
    Metric("weights_hugepage_share", "ratio", _H, "load", "share of the weight bytes on 2 MiB pages (measure.hugepages)"),
    # ---- prepare (harness/measure/fast_path.py)
    Metric("compile_s", "s", _L, "prepare", "torch.compile of the decode step (fast path), outside the timing"),
    Metric("compiled_match", "flag", _H, "prepare", "1 when compiled greedy tokens equal eager ones, else 0"),
    Metric("compiled_tie_flips", "count", _L, "prepare", "compiled tokens that differ from eager by a near-tie flip"),
    Metric("compiled_max_gap_ulps", "ulps", _L, "prepare", "largest eager score gap of such a flipped token"),
    # ---- decode: timing summaries (harness/measure/__init__.py summarize)
    Metric("decode_tokens_per_s", "tokens/s", _H, "decode",
           "median over generate calls of decode tokens / decode wall clock (host work between steps included)",
           Column("decode tok/s (p10–p90)", "{:.1f}", 10, always=True, spread=True), gate="speed"),
    Metric("decode_tokens_per_s_p10", "tokens/s", _H, "decode", "10th percentile over calls of decode tokens/s"),
    Metric("decode_tokens_per_s_p90", "tokens/s", _H, "decode", "90th percentile over calls of decode tokens/s"),
    Metric("decode_tokens_per_s_cv", "ratio", _L, "decode",
           "run-to-run noise: CV of each prompt batch's decode tokens/s over repetitions (RMS over batches)"),
    Metric("decode_step_tokens_per_s", "tokens/s", _H, "decode",
           "median over calls of decode tokens / sum of step times (host work between steps excluded)"),
    Metric("ttft_ms", "ms", _L, "decode", "median time to first token (prefill + first argmax); continuous batching: "
           "per request, from its arrival (= request_ttft_ms_p50)",
           Column("TTFT ms", "{:.1f}", 20, always=True)),
    Metric("ttft_ms_p90", "ms", _L, "decode", "90th percentile of time to first token"),
    Metric("itl_ms_p50", "ms", _L, "decode", "median inter-token latency over every decode step of every call"),
    Metric("itl_ms_p90", "ms", _L, "decode", "90th percentile inter-token latency"),
    Metric("itl_ms_p99", "ms", _L, "decode", "99th percentile inter-token latency"),
    Metric("itl_samples", "count", _N, "decode", "decode steps the inter-token latency percentiles are taken over"),
    Metric("e2e_ms", "ms", _L, "decode", "median of TTFT + decode wall clock per call"),
    Metric("generated_tokens", "tokens", _N, "decode", "real tokens generated in the timed calls"),
    Metric("prompt_tokens_per_s", "tokens/s", _H, "decode", "median over calls of prompt tokens / prefill time"),
    Metric("timed_generations", "count", _N, "decode", "timed generate calls"),
    # ---- decode: workload (harness/measure/workloads.py, harness/analysis/crossover.py)
    Metric("prompt_len_tokens", "tokens", _N, "decode", "median prompt length"),
    Metric("decode_len_tokens", "tokens", _N, "decode", "median new tokens asked per prompt"),
    Metric("context_depth_tokens", "tokens", _N, "decode", "tokens in the KV cache before the prompt"),
    Metric("prompt_tokens_per_s_mean", "tokens/s", _H, "decode", "mean over calls of prefill tokens/s (llama-bench pp)"),
    Metric("prompt_tokens_per_s_sd", "tokens/s", _L, "decode", "standard deviation of the same"),
    Metric("decode_tokens_per_s_mean", "tokens/s", _H, "decode", "mean over calls of decode tokens/s (llama-bench tg)"),
    Metric("decode_tokens_per_s_sd", "tokens/s", _L, "decode", "standard deviation of the same"),
    Metric("flops_per_token", "FLOP", _N, "decode", "matmul flops per decode token"),
    Metric("attn_flops_per_token_ctx", "FLOP", _N, "decode", "attention flops per token per context position"),
    Metric("prefill_flops_per_s", "FLOP/s", _H, "decode", "flops of the timed prefills / their time"),
    # ---- decode: energy (harness/measure/energy.py), only where a counter is readable
    Metric("energy_j", "J", _L, "decode", "energy of the timed calls (NVML or RAPL)"),
    Metric("energy_j_per_token", "J/token", _L, "decode", "energy per generated token",
           Column("J/token", "{:.3f}", 84)),
    # ---- decode: strategies (strategies/*.py metrics)
    Metric("batch_size", "count", _N, "decode", "prompts decoded together"),
    Metric("decode_tokens_per_step", "tokens", _N, "decode",
           "real tokens a decode step emitted on average: below batch_size when rows finished at EOS early, "
           "or (continuous batching) per decode-only scheduler forward"),
    Metric("aggregate_tokens_per_s", "tokens/s", _H, "decode",
           "batched strategies: all generated tokens / whole call time, prefill included"),
    Metric("per_sequence_tokens_per_s", "tokens/s", _H, "decode", "static batch: median decode tokens/s of one row"),
    Metric("batch_ttft_ms", "ms", _L, "decode", "static batch: median time to the batch's first tokens"),
    Metric("step_ms_p50", "ms", _L, "decode", "static batch: median decode step time"),
    Metric("requests", "count", _N, "decode", "continuous batching: requests per call"),
    Metric("stream_tokens_per_s", "tokens/s", _H, "decode",
           "continuous batching: tokens / time from the first request's arrival to the last token"),
    Metric("request_itl_ms_p50", "ms", _L, "decode", "continuous batching: median gap between one request's tokens"),
    Metric("request_latency_ms_p50", "ms", _L, "decode", "continuous batching: median request latency"),
    Metric("request_latency_ms_p90", "ms", _L, "decode", "continuous batching: 90th percentile request latency"),
    Metric("request_ttft_ms_p50", "ms", _L, "decode", "continuous batching: median request time to first token"),
    Metric("request_ttft_ms_p90", "ms", _L, "decode", "continuous batching: 90th percentile of the same"),
    Metric("num_draft_tokens", "tokens", _N, "decode", "speculative: tokens drafted per step (setting)"),
    Metric("greedy_match", "flag", _H, "decode", "speculative: 1 when every output equals plain greedy's"),
    Metric("spec_tie_flips", "count", _L, "decode", "speculative: tokens that differ from greedy by a near-tie flip"),
    Metric("spec_max_gap_ulps", "ulps", _L, "decode", "speculative: largest score gap of such a flipped token"),
    Metric("acceptance_rate", "ratio", _H, "decode", "speculative: accepted / drafted tokens",
           Column("accept", "{:.2f}", 83)),
    Metric("mean_accepted_tokens", "tokens", _H, "decode", "speculative: accepted tokens per step that drafted"),
    Metric("tokens_per_verify_step", "tokens", _H, "decode", "speculative: tokens emitted per verify forward"),
    Metric("empty_draft_fraction", "ratio", _L, "decode", "speculative: verify steps with nothing drafted"),
    Metric("verify_steps", "count", _N, "decode", "speculative: verify forwards in the timed calls"),
    Metric("draft_ms_per_step", "ms", _L, "decode", "speculative: drafting time per verify step"),
    Metric("verify_ms_per_step", "ms", _L, "decode", "speculative: verify forward time per step"),
    Metric("draft_time_fraction", "ratio", _L, "decode", "speculative: drafting's share of draft + verify time"),
    Metric("greedy_first_fraction", "ratio", _N, "decode", "speculative: calls whose greedy reference ran first"),
    Metric("greedy_decode_tokens_per_s", "tokens/s", _H, "decode",
           "speculative: median decode tokens/s of plain greedy on the same prompts"),
    Metric("speedup_vs_greedy", "ratio", _H, "decode", "speculative: greedy wall time / speculative wall time",
           Column("× greedy", "{:.2f}", 82)),
    Metric("accepted_len_<n>", "ratio", _N, "decode", "speculative: share of drafting steps that accepted n tokens"),
    Metric("draft_load_s", "s", _L, "decode", "speculative: loading the draft model"),
    Metric("draft_bits_per_weight", "bits", _N, "decode", "speculative: stored bits per weight of the draft model"),
    Metric("draft_weight_bytes", "bytes", _L, "decode", "speculative: stored bytes of the draft model"),
    Metric("draft_gemv_layers", "count", _N, "decode", "speculative under measure.gemv=rows8: draft layers whose one-row forward runs the rows8 kernel, as the target's do"),
    # ---- profile (harness/measure/kernels.py, cuda_kernels.py), one row (one_row.py) and the floor row (floor.py)
    Metric("kernel_linear_share", "ratio", _N, "profile", "the body layers' main linear op's share of step time"),
    Metric("kernel_linear_ms_per_step", "ms", _L, "profile", "that op's self time per decode step"),
    Metric("kernel_lm_head_share", "ratio", _N, "profile", "the output projection's op's share of step time"),
    Metric("kernel_lm_head_ms_per_step", "ms", _L, "profile", "that op's self time per decode step"),
    Metric("kernel_stream_gbps", "GB/s", _H, "profile", "each weight matrix once at one row: stored bytes / kernel time"),
    Metric("kernel_stream_ms", "ms", _L, "profile", "the kernels' own time in that pass (profiler self time)"),
    Metric("kernel_stream_wall_ms", "ms", _L, "profile", "that pass by the wall clock, Python and dispatch included"),
    Metric("kernel_stream_gb", "GB", _N, "profile", "stored bytes of the weight matrices in that pass"),
    Metric("linear_floor_ms", "ms", _L, "profile", "own linears once at one row: a CUDA graph replay (GPU), eager (CPU)"),
    Metric("linear_floor_spread_ms", "ms", _L, "profile", "max - min of that pass over the timed replays or passes"),
    Metric("linear_floor_share", "ratio", _N, "profile", "linear_floor_ms / the decode step (batch / decode tokens/s); none for speculative"),
    Metric("step_rest_ms", "ms", _L, "profile", "decode step - linear_floor_ms: attention, norms, sampling, overhead"),
    # ---- memory (harness/measure/__init__.py)
    Metric("peak_mem_mb", "MiB", _L, "memory", "peak RSS on CPU from loading through the timed decode (reset "
           "before loading; the accuracy pass after it is not in it), max allocated on CUDA"),
    # ---- roofline (harness/analysis/roofline.py)
    Metric("bandwidth_gb_per_s", "GB/s", _N, "roofline", "memory bandwidth measured on this machine"),
    Metric("bytes_per_step", "bytes", _L, "roofline", "bytes a decode step reads: stored weights + KV cache "
           "(speculative: a verify step's, with k draft forwards' weights + KV)"),
    Metric("roofline_tokens_per_s", "tokens/s", _N, "roofline",
           "tokens per step (batch; speculative: per verify step) x bandwidth / bytes per step: the bound",
           Column("bound tok/s", "{:.0f}", 81)),
    Metric("roofline_fraction", "ratio", _H, "roofline", "decode tokens/s / the bound = achieved / measured "
           "bandwidth (speculative: of the whole draft + verify step; tag roofline_accounting)",
           Column("roofline", "{:.3f}", 80)),
    Metric("achieved_gb_per_s", "GB/s", _H, "roofline", "bytes per step x decode steps/s"),
    Metric("kv_context_mean", "tokens", _N, "roofline",
           "mean KV context length over the timed steps (speculative: the target's, per verify)"),
    # ---- accuracy (harness/analysis/accuracy.py, harness/run/llama_cpp.py)
    Metric("perplexity", "ppl", _L, "accuracy", "perplexity over accuracy.corpus",
           Column("perplexity", "{:.3f}", 40, always=True), gate="accuracy"),
    Metric("scored_tokens", "tokens", _N, "accuracy", "corpus tokens scored"),
    Metric("reference_perplexity", "ppl", _N, "accuracy", "perplexity of the unquantized reference"),
    Metric("kl_div_mean", "nats", _L, "accuracy", "mean KL divergence from the reference, whole vocabulary",
           Column("KL", "{:.4f}", 50, always=True), gate="accuracy"),
    Metric("kl_div_p99", "nats", _L, "accuracy", "99th percentile of the per-token KL divergence"),
    Metric("kl_div_mean_lo", "nats", _L, "accuracy", "kl_div_mean's 95% interval, low end (block bootstrap)"),
    Metric("kl_div_mean_hi", "nats", _L, "accuracy", "kl_div_mean's 95% interval, high end (block bootstrap)"),
    Metric("top1_agreement", "ratio", _H, "accuracy", "tokens whose argmax equals the reference's",
           Column("top-1", "{:.3f}", 60, always=True), gate="accuracy"),
    Metric("kl_ref_tail_mass", "ratio", _N, "accuracy", "top-k reference: probability outside the kept top k"),
    Metric("kl_div_tail_bound", "nats", _L, "accuracy", "top-k reference: how much the KL can miss"),
    # ---- tasks (harness/analysis/task_accuracy.py): the summary over tasks, then one family per task
    Metric("tasks_s", "s", _L, "tasks", "scoring the run's model on the tasks"),
    Metric("tasks_examples", "count", _N, "tasks", "examples scored over all tasks"),
]


def _task_metrics(m: str, columns: dict[str, Column]) -> list[Metric]:
    """The summary over tasks and the per-task family of one lm-eval metric (`acc`, `acc_norm`)."""
    return [
        Metric(f"tasks_{m}_mean", "ratio", _H, "tasks", f"mean {m} over tasks", columns.get("mean")),
        Metric(f"tasks_{m}_ref_mean", "ratio", _N, "tasks", f"mean reference {m} over tasks"),
        Metric(f"tasks_{m}_diff_mean", "ratio", _H, "tasks", f"mean over tasks of {m} - reference {m}",
               columns.get("diff_mean")),
        Metric(f"tasks_{m}_diff_pooled", "ratio", _H, "tasks",
               f"{m} - reference {m} over all examples pooled: (wrong_to_right - right_to_wrong) / examples",
               columns.get("diff_pooled")),
        Metric(f"tasks_{m}_diff_pooled_se", "ratio", _L, "tasks", "its paired standard error"),
        Metric(f"tasks_{m}_right_to_wrong", "count", _L, "tasks", "answers right in the reference, wrong here",
               columns.get("right_to_wrong")),
        Metric(f"tasks_{m}_wrong_to_right", "count", _N, "tasks", "answers wrong in the reference, right here",
               columns.get("wrong_to_right")),
        Metric(f"tasks_{m}_mcnemar_p", "p", _H, "tasks", "McNemar's exact p on the flips (small: answers changed)",
               columns.get("mcnemar_p")),
        Metric(f"task_<task>_{m}", "ratio", _H, "tasks", f"one task's {m}"),
        Metric(f"task_<task>_{m}_stderr", "ratio", _L, "tasks", "its standard error (lm-eval)"),
        Metric(f"task_<task>_{m}_ref", "ratio", _N, "tasks", f"the reference's {m} on the same examples"),
        Metric(f"task_<task>_{m}_diff", "ratio", _H, "tasks", f"{m} - reference {m} (paired)"),
        Metric(f"task_<task>_{m}_diff_stderr", "ratio", _L, "tasks", "paired standard error of the difference"),
        Metric(f"task_<task>_{m}_right_to_wrong", "count", _L, "tasks", "answers right in the reference, wrong here"),
        Metric(f"task_<task>_{m}_wrong_to_right", "count", _N, "tasks", "answers wrong in the reference, right here"),
        Metric(f"task_<task>_{m}_mcnemar_p", "p", _H, "tasks", "McNemar's exact p on this task's flips"),
    ]


# harness/analysis/task_accuracy.py METRICS; the report shows acc's summary
_TABLE += _task_metrics("acc", {"mean": Column("task acc (mean of tasks)", "{:.3f}", 70),
                                "diff_mean": Column("Δ task acc (mean of tasks)", "{:+.3f}", 71),
                                "right_to_wrong": Column("flips ✓→✗", "{:.0f}", 72),
                                "wrong_to_right": Column("flips ✗→✓", "{:.0f}", 73),
                                "diff_pooled": Column("Δ acc (pooled)", "{:+.3f}", 74),
                                "mcnemar_p": Column("McNemar p (pooled)", "{:.2g}", 75)})
_TABLE += _task_metrics("acc_norm", {})
_TABLE += [
    Metric("task_<task>_examples", "count", _N, "tasks", "examples scored on one task"),
    Metric("task_<task>_chance", "ratio", _N, "tasks", "the accuracy of guessing on those examples"),
]
_TABLE += SERVING_SWEEP_GATE  # harness/metrics_load.py

METRICS: dict[str, Metric] = {m.name: m for m in _TABLE}
if len(METRICS) != len(_TABLE):  # a name defined twice would silently keep the second definition
    raise ValueError("harness/metrics.py defines a metric name twice")

_PLACEHOLDER = re.compile(r"<(\w+)>")
# a family's pattern: <n> is a number, any other placeholder a name (task names hold _ and -, a BIG-bench
# subtask also / : conceptual_combinations/contradictions)
_FAMILIES: list[tuple[re.Pattern[str], Metric]] = sorted(
    ((re.compile("".join((r"\d+" if p == "n" else r"[\w./-]+?") if i % 2 else re.escape(p)
                         for i, p in enumerate(_PLACEHOLDER.split(m.name)))), m)
     for m in _TABLE if _PLACEHOLDER.search(m.name)),
    key=lambda fm: -len(_PLACEHOLDER.sub("", fm[1].name)))  # the most specific (longest literal part) first

HEADLINE = "decode_tokens_per_s"  # the run's headline speed: the report's ratio and plot, the gate's speed
DIRECTION_MARK = {"higher": " ↑", "lower": " ↓"}  # a report column header's mark of the better direction


def lookup(name: str) -> Metric | None:
    """The definition of a recorded metric name (a family's entry for `task_social_iqa_acc`), or None."""
    if name in METRICS:
        return METRICS[name]
    return next((m for pattern, m in _FAMILIES if pattern.fullmatch(name)), None)


def defined(name: str) -> bool:
    """Whether `name` is defined in the table (directly or as a member of a family)."""
    return lookup(name) is not None


def undefined(names: Any) -> list[str]:
    """The names (e.g. a result's metrics) that the table does not define, sorted."""
    return sorted(n for n in names if not defined(n))


def value(metrics: dict, name: str) -> float | None:
    """A metric's value as a finite float, or None when it is missing, not a number, NaN or infinite."""
    try:
        v = float(metrics.get(name))
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def gate_speed_metric() -> str:
    """The metric the gate's speed comparison measures (its blocks' tokens/s have the same definition)."""
    return next(m.name for m in _TABLE if m.gate == "speed")


def gate_accuracy_metrics() -> list[str]:
    """The deterministic metrics the gate compares with a committed baseline, in table order."""
    return [m.name for m in _TABLE if m.gate == "accuracy"]


def report_columns() -> list[str]:
    """The metrics the sweep report shows as columns, in column order (each has `column`)."""
    return sorted((m.name for m in _TABLE if m.column is not None), key=lambda n: METRICS[n].column.at)


def markdown_table() -> str:
    """README's metrics table: every metric by phase, in the order the phases run."""
    lines = ["| metric | unit | better | phase | meaning |", "|---|---|---|---|---|"]
    for phase in PHASES:
        for m in (m for m in _TABLE if m.phase == phase):
            better = "—" if m.better == "none" else m.better
            meaning = m.meaning.replace("|", "\\|")
            lines.append(f"| `{m.name}` | {m.unit} | {better} | {phase} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.metrics",
                                 description="The metric definitions: README's table, JSON, or a check of result files.")
    ap.add_argument("--markdown", action="store_true", help="print README's metrics table")
    ap.add_argument("--json", action="store_true", help="print every definition as JSON")
    ap.add_argument("--check", nargs="+", metavar="RESULT_JSON", help="list metrics in result files with no definition")
    args = ap.parse_args(argv)
    if args.check:
        bad = 0
        for path in args.check:
            try:
                names = json.loads(Path(path).read_text()).get("metrics") or {}
            except (OSError, ValueError, AttributeError) as exc:
                print(f"error: {path}: not a readable result JSON ({exc}); pass results/runs/<run>.json", file=sys.stderr)
                return 2
            for n in undefined(names):
                print(f"{path}: metric {n!r} is not defined in harness/metrics.py")
                bad += 1
        return 1 if bad else 0
    if args.json:
        print(json.dumps([asdict(m) for m in _TABLE], indent=1, ensure_ascii=False))
        return 0
    print(markdown_table(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
