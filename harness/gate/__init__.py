"""Regression gate for CI: fails on a real slowdown or accuracy loss, not on measurement noise.

    python -m harness.gate --baseline "<hydra overrides>" --candidate "<hydra overrides>"
    python -m harness.gate --baseline "<overrides>" --baseline-rev <git rev> --candidate "<overrides>"
    make gate [BASE=<git rev>]   # CI: this checkout against a baseline revision, smoke experiment

Exit codes: 0 pass, 1 regression, 2 error (docs/gate.md). One file per part, each readable alone:

- `stats.py`: the speed statistic (log ratios of adjacent blocks, trimmed mean, moving-block bootstrap
  bounds) and the sequential rule with its error spending (Pocock);
- `interleave.py`: how the two sides take turns (blocks of whole generate calls, A B B A) and when to look;
- `sides.py`: a side is a worker process on this checkout or on a git revision's worktree, checked for
  the gate protocol before anything starts;
- `worker.py`: the worker (`python -m harness.gate.worker`, protocol `PROTOCOL`), which measures its
  side with that revision's own measurement pipeline (harness/run/pipeline.py), as run.py does;
- `accuracy.py`: deterministic metrics against a committed baseline file;
- `report.py`: the markdown summary, the JSON record and the MLflow run;
- `cli.py`: options, the run, exit codes (`__main__.py` calls `cli.main`).
"""

from harness.gate.accuracy import (
    ACCURACY_METRICS,
    AGREEMENT_DROP,
    KL_RATIO,
    KL_SLACK,
    PPL_RATIO,
    Check,
    check_baseline_config,
    compare_accuracy,
    load_baseline,
    write_baseline,
)
from harness.gate.cli import GateOptions, GateResult, main, parse_args, run_gate
from harness.gate.errors import ERROR, PASS, REGRESSION, GateError
from harness.gate.interleave import Plan, measure_sequential
from harness.gate.report import summary_markdown
from harness.gate.sides import PROTOCOL, WorkerSide, make_side, protocol_problem
from harness.gate.stats import SpeedStats, speed_stats

__all__ = ["ACCURACY_METRICS", "AGREEMENT_DROP", "ERROR", "KL_RATIO", "KL_SLACK", "PASS", "PPL_RATIO", "PROTOCOL",
           "REGRESSION", "Check", "GateError", "GateOptions", "GateResult", "Plan", "SpeedStats", "WorkerSide",
           "check_baseline_config", "compare_accuracy", "load_baseline", "main", "make_side", "measure_sequential",
           "parse_args", "protocol_problem", "run_gate", "speed_stats", "summary_markdown", "write_baseline"]
