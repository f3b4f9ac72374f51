"""The strategy interface (see strategies/__init__.py for how to add one)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

from harness.measure import Generation


@dataclass
class DecodeOptions:
    """Per-run decode settings the runner hands to every strategy."""

    device: str = "cpu"
    max_new_tokens: int = 64
    eos_token_id: int | None = None
    pad_token_id: int = 0
    stop_at_eos: bool = False
    inject_slowdown: float = 0.0  # test-only (gate power calibration): stretch each timed step
    inject_work: float = 0.0  # test-only: real extra matrix work in each step, ~this fraction of a step
    cache: str = "dynamic"
    fast_path: Any = None  # harness.measure.fast_path.FastPath: compiled decode step + fixed static caches
    choose: Any = None  # check-only hook (logits, token index) -> next tokens; None = greedy argmax
    context: Any = None  # strategies.decode.DepthContext: measure.context_depth tokens in the cache before a prompt
    gemv_aten: bool = False  # measure.gemv=aten: batch-1 decode steps run with oneDNN off (harness/measure/paths.py)
    unmetered: Any = None  # () -> context: the energy meter pauses inside (harness/run/pipeline.py); None: no meter

    def off_meter(self) -> contextlib.AbstractContextManager:
        """Run work beside what a strategy measures (speculative's greedy reference) in this: not metered."""
        return self.unmetered() if self.unmetered is not None else contextlib.nullcontext()


@dataclass
class Strategy:
    """Base class: one prompt per generate call, no setup, no extra metrics.

    Capabilities (class attributes; core code asks these and never names a strategy class or name):
    - `stepwise`: `generate()` is the plain greedy loop of strategies/decode.py (so the compiled fast
      path, the kernel profile's decode-step hook, context depth and the gate's block decoder apply).
    - `supports_context_depth`: `measure.context_depth` tokens can sit in the cache before a prompt.
    - `batches_rows`: several prompts per generate call (`batches()` groups them).
    - `supports_llama_cpp`: the llama.cpp engine can run it (greedy, batch 1).
    - `schedules_rows`: each row of a call runs on its own schedule (continuous batching), so `step_s` pools
      the rows' gaps and the roofline takes every row with its own prompt and steps.
    - `weight_dependent`: what it measures that depends on the weight values ("" = nothing);
      model=random refuses a strategy that sets it.
    """

    stepwise: ClassVar[bool] = False
    supports_context_depth: ClassVar[bool] = False
    batches_rows: ClassVar[bool] = False
    supports_llama_cpp: ClassVar[bool] = False
    schedules_rows: ClassVar[bool] = False
    weight_dependent: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def batch_size(self) -> int:
        return 1

    def kv_positions(self, positions: int) -> int:
        """KV-cache positions a generate call allocates when each row holds `positions` tokens (the memory
        estimate's KV cache): one cache of `batch_size` rows by default."""
        return self.batch_size * positions

    def batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Group the prompt set into generate calls (default: one prompt per call)."""
        return [[p] for p in prompts]

    def workload_problem(self, prompts: int) -> str | None:
        """One line when this strategy cannot decode a workload of `prompts` prompts as its metrics describe it."""
        return None

    def preflight(self) -> None:
        """Cheap checks before any model loads (e.g. draft tokenizer compatibility)."""

    def side_model(self) -> tuple[Any, Any] | None:
        """(model source or None for the target's, quantizer) of a model `setup` loads beside the target (e.g. a
        draft model), for the memory estimate before anything loads (harness/measure/memory.py); None: none."""
        return None

    def setup(self, *, model: Any, tokenizer: Any, opts: DecodeOptions, experiment: Any) -> None:
        """Load what the strategy needs besides the target (e.g. a draft model)."""

    def generate(self, model: Any, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        raise NotImplementedError

    def metrics(self, generations: list[Generation]) -> dict[str, float]:
        """Strategy-specific metrics over the timed generations."""
        return {"batch_size": float(self.batch_size)}

    def roofline_step(self, generations: list[Generation]) -> Any:
        """None: a decode step is one target forward per batch row, emitting `batch_size` tokens (the roofline's
        own accounting). A strategy whose step is more (speculative: draft forwards + a verify) returns a
        `harness.analysis.roofline.StepWork` measured over the timed generations."""
        return None

    def teardown(self) -> None:
        """Free what setup loaded."""
