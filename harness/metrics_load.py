"""The metrics of a load run, a sweep cell and a gate comparison (harness/metrics.py's table, split for size):
serving (harness/load/stats.py, harness/load/run.py), sweep (harness/sweep/) and gate (harness/gate/report.py;
names are a contract, docs/gate.md). Imports only harness/metric_types.py.
"""

from __future__ import annotations

from harness.metric_types import Column, Metric

_H, _L, _N = "higher", "lower", "none"

SERVING_SWEEP_GATE: list[Metric] = [
    # ---- serving (harness/load/stats.py, harness/load/run.py): per rate, then the parent's summary
    Metric("offered_rps", "req/s", _N, "serving", "the offered request rate (open-loop arrivals)"),
    Metric("offered_actual_rps", "req/s", _N, "serving", "the rate the drawn arrivals offered: (n - 1) / their span"),
    Metric("request_throughput_rps", "req/s", _H, "serving", "requests answered / the rate's duration"),
    Metric("output_tokens_per_s", "tokens/s", _H, "serving", "output tokens of answered requests / duration"),
    Metric("goodput_rps", "req/s", _H, "serving", "offered rate x goodput_share (no rate offered: SLO-met requests / duration)"),
    Metric("goodput_share", "ratio", _H, "serving", "share of the rate's requests that met every SLO (load.slo.*)"),
    Metric("requests_sent", "count", _N, "serving", "requests sent"),
    Metric("requests_ok", "count", _N, "serving", "requests answered in full"),
    Metric("failed_requests", "count", _L, "serving", "requests that ended in an error"),
    Metric("unfinished_requests", "count", _L, "serving", "requests unanswered at load.request_timeout_s"),
    Metric("short_outputs", "count", _L, "serving", "answered requests with fewer output tokens than asked"),
    Metric("load_duration_s", "s", _N, "serving", "first send to the last token (or an unfinished one's deadline)"),
    Metric("send_lag_ms_p99", "ms", _L, "serving", "99th percentile of actual minus scheduled send time"),
    Metric("open_loop", "flag", _H, "serving", "1 when that lag stayed within load.max_send_lag_ms (NaN: closed loop)"),
    Metric("concurrency", "count", _N, "serving", "requests kept in flight (closed loop)"),
    Metric("serve_<measure>_ms_p<n>", "ms", _L, "serving", "percentile n of per-request ttft, tpot, itl or e2e"),
    Metric("sync_rps", "req/s", _H, "serving", "sweep: requests/s one at a time (synchronous)"),
    Metric("sync_output_tokens_per_s", "tokens/s", _H, "serving", "sweep: output tokens/s one request at a time"),
    Metric("max_rps", "req/s", _H, "serving", "the highest request throughput any rate reached"),
    Metric("capacity_rps", "req/s", _H, "serving",
           "the knee: highest offered rate with goodput >= load.goodput_share of it, every lower rate passing too",
           Column("capacity req/s", "{:.2f}", 85)),
    Metric("capacity_<measure>_ms_p<n>", "ms", _L, "serving", "percentile n of ttft or tpot at the capacity rate"),
    Metric("load_points", "count", _N, "serving", "rates (and concurrencies) offered"),
    # ---- sweep (harness/sweep.py)
    Metric("cell_start_s", "s", _L, "sweep", "until the cell's child process was ready (fork or start, imports)"),
    Metric("cell_wall_s", "s", _L, "sweep", "the whole cell as the sweep sees it"),
    # ---- gate (harness/gate/report.py: names are a contract, docs/gate.md)
    Metric("exit_code", "code", _N, "gate", "0 pass, 1 regression, 2 error"),
    Metric("gate_seconds", "s", _L, "gate", "the whole gate run"),
    Metric("speed_change", "ratio", _H, "gate",
           "candidate vs baseline tokens/s: exp(trimmed mean of the block pairs' log ratio) - 1"),
    Metric("speed_ci_low", "ratio", _H, "gate", "lower bootstrap bound of the change at the last look"),
    Metric("speed_ci_high", "ratio", _H, "gate", "upper bootstrap bound of the change at the last look"),
    Metric("speed_threshold", "ratio", _N, "gate", "the slowdown that fails the gate"),
    Metric("speed_effective_threshold", "ratio", _N, "gate", "the threshold as applied"),
    Metric("speed_alpha_look", "p", _N, "gate", "the per-look error level of the sequential design"),
    Metric("speed_looks", "count", _N, "gate", "looks taken before stopping"),
    Metric("speed_seconds", "s", _L, "gate", "time spent on the speed comparison"),
    Metric("speed_block_steps", "count", _N, "gate", "decode steps per block"),
    Metric("repetitions", "count", _N, "gate", "blocks per side"),
    Metric("baseline_decode_tokens_per_s", "tokens/s", _H, "gate", "the baseline's median block tokens/s"),
    Metric("candidate_decode_tokens_per_s", "tokens/s", _H, "gate", "the candidate's median block tokens/s"),
    Metric("speed_cv_ratio", "ratio", _L, "gate", "robust CV of the pair ratios"),
    Metric("baseline_cv", "ratio", _L, "gate", "robust CV of the baseline's block tokens/s"),
    Metric("candidate_cv", "ratio", _L, "gate", "robust CV of the candidate's block tokens/s"),
    Metric("baseline_cv_classic", "ratio", _L, "gate", "std / mean of the baseline's block tokens/s"),
    Metric("candidate_cv_classic", "ratio", _L, "gate", "std / mean of the candidate's block tokens/s"),
    Metric("speed_lag1", "ratio", _N, "gate", "lag-1 autocorrelation of the pair log ratios"),
    Metric("speed_order_effect", "ratio", _N, "gate", "AB - BA pairs: what the A B B A order cancels"),
    Metric("speed_change_totals", "ratio", _H, "gate",
           "total tokens / total time, candidate over baseline, - 1 (untrimmed: sees a slowdown in some blocks)"),
    Metric("speed_totals_ci_low", "ratio", _H, "gate", "lower bootstrap bound of speed_change_totals"),
    Metric("speed_totals_ci_high", "ratio", _H, "gate", "upper bootstrap bound of speed_change_totals"),
    Metric("candidate_perplexity", "ppl", _L, "gate", "the candidate's perplexity"),
    Metric("candidate_kl_div_mean", "nats", _L, "gate", "the candidate's mean KL divergence"),
    Metric("candidate_top1_agreement", "ratio", _H, "gate", "the candidate's top-1 agreement"),
]
