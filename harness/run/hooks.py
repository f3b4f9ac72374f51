"""What an engine supplies to the pipeline (harness/run/pipeline.py), and what a run returns.

An engine (the `engine` config group: harness/run/engines.py, harness/run/llama_cpp.py) is a small config object with
`preflight`, `memory_estimate`, `check_with` and `open(exp, device, threads) -> Session`. The `Session` holds
one run's loaded state and answers the pipeline's hooks; everything else (the order of the phases, warm-up,
the timed repetitions and the energy meter, summaries, workload and strategy metrics, peak memory, roofline,
samples, task accuracy) is the pipeline's, written once for every engine.

Hooks that produce numbers return `(metrics, tags)`; the pipeline records them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.measure import Generation

Record = tuple[dict[str, float], dict[str, str]]  # (metrics, tags) a hook adds to the run's record


@dataclass
class Outcome:
    """What a run measured: metrics, tags and sample generations."""

    metrics: dict
    tags: dict
    samples: list[dict]
    children: list[dict] = field(default_factory=list)  # a load run's rates: nested runs (harness/load/run.py)


class Session:
    """One run's engine state (a loaded model, its caches) and the hooks the pipeline calls, in this order.

    Defaults do nothing, so an engine overrides only what it has.
    """

    label: str = ""  # how the roofline's slow-kernel check names this run among its group
    model_config: Any = None  # the model's HF config, for the workload's FLOP metrics (None: not available)

    def references(self, tokenizer: Any) -> Record:
        """Before the model loads: references the scoring compares with (the KL reference's logits)."""
        return {}, {}

    def load(self, tokenizer: Any, workload: Any, log_file: Path) -> Record:
        """Load (and quantize) the model; the metrics and tags of the load and of its audit."""
        raise NotImplementedError

    def prepare(self, opts: Any, workload: Any, batches: list, log_file: Path) -> Record:
        """After the load, before the warm-up: strategy setup, depth context, compiled fast path."""
        return {}, {}

    def timing(self) -> contextlib.AbstractContextManager:
        """The context every timed generate call runs in (e.g. a recompile fails the run)."""
        return contextlib.nullcontext()

    def generate(self, batch: list[list[int]], opts: Any) -> Generation:
        """One generate call of a batch of prompt ids, timed inside (harness/measure/__init__.py `Generation`)."""
        raise NotImplementedError

    def after_timing(self, batches: list, opts_for: Callable[[list], Any], gens: list[Generation]) -> Record:
        """Checks of the timed generations that need the engine (compiled vs eager tokens); `opts_for(batch)`: the
        options the batch was timed with."""
        return {}, {}

    def kernel_profile(self, batch: list[list[int]], opts: Any, log_file: Path) -> Record:
        """Which kernels ran (measure.kernel_profile), outside the timing; nothing where not supported."""
        return {}, {}

    def end_decoding(self) -> None:
        """Decoding is over: free what the strategy set up (the model stays for scoring). Idempotent."""

    def shape(self) -> Any:
        """The model's shape for the roofline (harness/analysis/roofline.py `ModelShape`)."""
        raise NotImplementedError

    def score(self, tokenizer: Any) -> dict[str, float]:
        """Perplexity (and KL / top-1 agreement where the engine has the reference) on accuracy.corpus."""
        return {}

    def task_lm(self, tokenizer: Any) -> Any:
        """An lm-eval LM for task accuracy (harness/analysis/task_accuracy.py); the last hook before `close`."""
        raise NotImplementedError

    def close(self) -> None:
        """Free everything the session holds. Idempotent."""
