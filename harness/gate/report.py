"""What a gate run leaves behind: a markdown summary, a JSON record and an MLflow run.

The summary is printed, appended to $GITHUB_STEP_SUMMARY when set and written to `--summary PATH`; the
JSON record goes under `<tracking.results_dir>/gate/` (or `--output PATH`); the MLflow run (experiment
`<tracking.experiment>-gate`) holds the bounds, the threshold, how many blocks it took and the verdict.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import env, metrics
from harness.config import TrackingConfig, build, compose
from harness.gate.accuracy import ACCURACY_METRICS
from harness.gate.stats import TRIM, UNDECIDED
from harness.records import results, tracking
from harness.run.result import Result

SPEED = metrics.gate_speed_metric()  # decode_tokens_per_s: what a block's tokens/s is (harness/metrics.py)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _describe(overrides: list[str], rev: str) -> str:
    text = " ".join(overrides) or "(defaults)"
    return f"`{text}` at `{rev}`" if rev else f"`{text}` (this checkout)"


def summary_markdown(res: Any) -> str:
    o = res.options
    icon = {"pass": "PASS", "regression": "FAIL (regression)", "error": "ERROR"}[res.verdict]
    s = res.speed
    if res.verdict == "pass" and s is not None and s.verdict == UNDECIDED:
        icon = "PASS (speed undecided)"
    lines = [f"## quantbench gate: {icon}", "",
             f"- baseline: {_describe(o['baseline'], o['baseline_rev'])}",
             f"- candidate: {_describe(o['candidate'], o['candidate_rev'])}"]
    if res.wrote_baseline:
        lines.append(f"- wrote accuracy baseline `{res.wrote_baseline}`")
    if res.error:
        lines += ["", f"**error:** {res.error}"]
    if s is not None:
        level = 1 - s.alpha
        lines += ["", f"| speed (decode tok/s, blocks of >= {s.block_steps} decode tokens) | baseline | candidate | change | "
                  f"bounds ({level:.1%} each side) | fails below | blocks per side | verdict |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| A B B A interleaved | {s.baseline_tps:.1f} | {s.candidate_tps:.1f} | {_pct(s.change)} | "
                  f"[{_pct(s.ci_low)}, {_pct(s.ci_high)}] | {_pct(-s.threshold)} | {s.pairs} "
                  f"({len(s.looks)} of {s.planned_looks} looks, {s.seconds:.1f} s) | {s.verdict} |",
                  f"| total tokens / total time | | | {_pct(s.change_totals)} | [{_pct(s.ci_low_totals)}, "
                  f"{_pct(s.ci_high_totals)}] | {_pct(-s.threshold)} | | |", "",
                  f"Stopped: {s.stop}.", "", f"Measured on: {env.cpu_info(with_torch=False).describe()}."]
        if s.verdict == UNDECIDED:
            after = ("so this passes without a decision" if res.verdict == "pass" else
                     "so speed neither passed nor failed; the verdict above comes from the "
                     + ("error" if res.verdict == "error" else "accuracy check"))
            lines.append(f"**Undecided:** no decision yet (see *Stopped*: the bounds straddle {_pct(-s.threshold)}, or "
                         f"too few blocks for one), {after}; raise `--budget`, or run on a quieter machine.")
        lines += ["", f"Change = trimmed mean ({TRIM:.0%} each tail) of log(candidate / baseline tokens/s) over "
                  "adjacent block pairs (robust to a preempted block); total tokens / total time is untrimmed (it "
                  "sees a slowdown in some blocks only). Either upper bound below the threshold fails; no regression "
                  "needs both lower bounds above it. Moving-block bootstrap bounds at the per-look level of a Pocock "
                  f"boundary (overall one-sided {s.confidence:.0%} over {s.planned_looks} planned looks, half of "
                  "the error to each statistic). Noise seen: robust "
                  f"CV of the block tokens/s {s.cv_baseline:.1%} / {s.cv_candidate:.1%} (baseline / candidate), of "
                  f"the pair ratios {s.cv_ratio:.1%}; order effect (AB - BA pairs) {_pct(s.order_effect)}, "
                  "cancelled by the A B B A order."]
    if res.accuracy:
        lines += ["", "| accuracy vs committed baseline | result | detail |", "|---|---|---|"]
        lines += [f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {c.detail} |" for c in res.accuracy]
    lines += ["", f"exit code {res.code} ({res.seconds:.1f} s). Speed fails only when the upper bound lies below "
              "-threshold; rules: docs/gate.md."]
    return "\n".join(lines) + "\n"


def _tracking_config(opts: Any):
    for overrides, rev in ((opts.baseline, opts.baseline_rev), (opts.candidate, opts.candidate_rev)):
        if not rev:
            try:
                return build(compose(overrides)).tracking
            except Exception:  # noqa: BLE001 - an invalid config is reported by the gate itself
                continue
    return TrackingConfig()


def speed_metrics(s: Any) -> dict[str, float]:
    """The MLflow / JSON metrics of a speed comparison (names are a contract: docs/gate.md)."""
    return {"speed_change": s.change, "speed_ci_low": s.ci_low, "speed_ci_high": s.ci_high,
            "speed_threshold": s.threshold, "speed_effective_threshold": s.threshold,
            "speed_alpha_look": s.alpha, "speed_looks": float(len(s.looks)), "speed_seconds": s.seconds,
            "speed_block_steps": float(s.block_steps), "repetitions": float(s.pairs),
            f"baseline_{SPEED}": s.baseline_tps, f"candidate_{SPEED}": s.candidate_tps,
            "speed_cv_ratio": s.cv_ratio, "baseline_cv": s.cv_baseline, "candidate_cv": s.cv_candidate,
            "baseline_cv_classic": s.cv_baseline_classic, "candidate_cv_classic": s.cv_candidate_classic,
            "speed_lag1": s.lag1, "speed_order_effect": s.order_effect, "speed_change_totals": s.change_totals,
            "speed_totals_ci_low": s.ci_low_totals, "speed_totals_ci_high": s.ci_high_totals}


def record(res: Any, opts: Any, markdown: str) -> str:
    """Result JSON (atomic) + one MLflow run with the bounds and the verdict; returns the JSON path."""
    tcfg = _tracking_config(opts)
    tcfg = dataclasses.replace(tcfg, experiment=f"{tcfg.experiment}-gate", enabled=tcfg.enabled and opts.mlflow)
    metrics: dict[str, float] = {"exit_code": float(res.code), "gate_seconds": res.seconds}
    if res.speed is not None:
        metrics.update(speed_metrics(res.speed))
    metrics.update({f"candidate_{k}": float(v) for k, v in res.accuracy_metrics.items()
                    if isinstance(v, (int, float)) and k in ACCURACY_METRICS})
    tags = {"gate.verdict": res.verdict, "gate.speed_verdict": res.speed.verdict if res.speed else "not measured",
            "gate.speed_stop": res.speed.stop if res.speed else "",
            "gate.baseline": " ".join(res.options["baseline"]), "gate.candidate": " ".join(res.options["candidate"]),
            "gate.baseline_rev": opts.baseline_rev, "gate.candidate_rev": opts.candidate_rev,
            "git_commit": env.git_commit(), "cpu_model": env.cpu_model(),
            **env.cpu_info(with_torch=False).tags()}
    tags.update({f"gate.accuracy.{c.name}": ("ok " if c.ok else "FAIL ") + c.detail for c in res.accuracy})
    now = time.time()
    result = Result(status="OK" if res.code != 2 else "FAILED", config={"gate": res.options},
                    metrics={k: v for k, v in metrics.items() if math.isfinite(v)}, tags=tags, error=res.error,
                    run_name=f"gate-{res.verdict}", config_hash="gate", started=now - res.seconds, ended=now)
    result.samples = []
    path = Path(opts.output) if opts.output else results.json_path(result, tcfg, folder="gate")
    data_artifacts = {"gate_summary.md": markdown,
                      "gate_samples.json": json.dumps({"samples": res.samples, "speed": asdict(res.speed)
                                                       if res.speed else None}, indent=1)}
    tracking.record(result, tcfg, path=path, artifacts=data_artifacts)
    return str(path)


def emit(markdown: str, summary_path: str) -> None:
    print(markdown)
    targets = [p for p in (os.environ.get("GITHUB_STEP_SUMMARY", ""), summary_path) if p]
    for i, target in enumerate(targets):
        try:
            with open(target, "a" if i == 0 and os.environ.get("GITHUB_STEP_SUMMARY") else "w") as fh:
                fh.write(markdown)
        except OSError as exc:
            print(f"warning: could not write the summary to {target}: {exc}", file=sys.stderr)
