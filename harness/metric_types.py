"""The types of harness/metrics.py's table: a metric's definition (`Metric`), how the sweep report shows it
(`Column`), the directions (`BETTER`) and the phases of a measurement (`PHASES`). Imports nothing from the project.
"""

from __future__ import annotations

from dataclasses import dataclass

BETTER = ("higher", "lower", "none")

# the phases of a measurement (harness/run/pipeline.py), in the order they run, and what records beside them
PHASES: dict[str, str] = {
    "preflight": "before anything loads: the memory estimate",
    "load": "load the model (+ quantize) and audit what is stored",
    "prepare": "strategy setup and the fast path (compile), untimed",
    "decode": "the timed repetitions: timing summaries, workload, strategy and energy metrics",
    "profile": "the kernel profile of a few decode steps, outside the timing",
    "memory": "the peak memory of the run",
    "roofline": "the memory-bandwidth bound of a decode step and how close the run came",
    "accuracy": "perplexity, and KL and top-1 agreement against the unquantized reference",
    "tasks": "task accuracy (BIG-bench multiple choice through lm-eval), paired with the reference",
    "serving": "a load run (harness/load/): per offered rate (nested runs), and the capacity on the parent",
    "sweep": "added by the sweep to each cell's record",
    "gate": "the record of a `python -m harness.gate` comparison (not of a run)",
}


@dataclass(frozen=True)
class Column:
    """How the sweep report shows a metric: header, format, place (`at`: columns sort by it), scale; an
    `always` column shows even when no cell has the metric, any other only when some cell has it."""

    header: str
    fmt: str
    at: int
    scale: float = 1.0
    always: bool = False
    spread: bool = False  # show the `<name>_p10`–`<name>_p90` spread beside the value


@dataclass(frozen=True)
class Metric:
    """One metric's definition. `gate` is "speed" or "accuracy" for the metrics the gate compares."""

    name: str
    unit: str
    better: str
    phase: str
    meaning: str
    column: Column | None = None
    gate: str = ""

    def __post_init__(self) -> None:
        if self.better not in BETTER or self.phase not in PHASES:
            raise ValueError(f"metric {self.name}: better {self.better!r} not in {BETTER} or phase {self.phase!r} "
                             f"not in {tuple(PHASES)}")
