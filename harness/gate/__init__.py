"""Regression gate for CI: fails on a real slowdown or accuracy loss, not on measurement noise.

    python -m harness.gate --baseline "<hydra overrides>" --candidate "<hydra overrides>"
    python -m harness.gate --baseline "<overrides>" --candidate-rev <git rev>   # compare code

Exit codes: 0 pass, 1 regression, 2 error (docs/gate.md). One file per part, each readable alone:

- `stats.py`: the speed statistic (log ratios of adjacent blocks, trimmed mean, moving-block bootstrap
  bounds) and the sequential rule with its error spending (Pocock);
- `interleave.py`: how the two sides take turns (blocks of k decode steps, A B B A) and when to look;
- `sides.py`: a side in this process, or a git revision in a worker process (harness/gate_worker.py,
  which also holds the step-wise block decoder both kinds use);
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
from harness.gate.sides import InProcessSide, WorktreeSide, make_side
from harness.gate.stats import SpeedStats, speed_stats

__all__ = ["ACCURACY_METRICS", "AGREEMENT_DROP", "ERROR", "KL_RATIO", "KL_SLACK", "PASS", "PPL_RATIO", "REGRESSION",
           "Check", "GateError", "GateOptions", "GateResult", "InProcessSide", "Plan", "SpeedStats", "WorktreeSide",
           "check_baseline_config", "compare_accuracy", "load_baseline", "main", "make_side", "measure_sequential",
           "parse_args", "run_gate", "speed_stats", "summary_markdown", "write_baseline"]
