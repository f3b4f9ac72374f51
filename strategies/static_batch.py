"""Static batching: `batch_size` prompts of different lengths decoded together, greedy.

Batching reads the weights once per step for every row, so tokens/s grows with the batch until the
step turns compute-bound. The loop is strategies/decode.py's (left padding, attention mask, position
ids restarting after the pads), so a row computes what it would alone; padding and tokens after a
row's EOS are never counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.errors import ConfigError
from harness.measure import Generation, percentile
from strategies.base import DecodeOptions, Strategy
from strategies.decode import greedy_generate


def row_rates(gen: Generation) -> list[float]:
    """Decode tokens/s of each row while it ran: a row that stopped at EOS after n tokens was in the batch for
    its first n steps only, so its time is that share of the decode wall clock (host work pro rata), not all of
    it (a stopped row is not a slow row)."""
    total = sum(gen.step_s)
    if not total > 0 or not gen.decode_s > 0:
        return []
    return [n / (gen.decode_s * sum(gen.step_s[:n]) / total) for n in gen.stats.get("row_decode_tokens", []) if n > 0]


@dataclass
class StaticBatch(Strategy):
    """Greedy decoding of fixed batches built by cycling the prompt set."""

    stepwise = True
    supports_context_depth = True
    batches_rows = True

    batch_size: int = 4  # type: ignore[assignment]  # a field here, a property on the base

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError([f"strategy.batch_size={self.batch_size!r} must be an integer >= 1"])

    @property
    def name(self) -> str:
        return f"StaticBatch{self.batch_size}"

    def batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Enough batches to cover every prompt once; the prompt set is cycled to fill the last one."""
        if not prompts:
            return []
        n_batches = -(-len(prompts) // self.batch_size)
        flat = [prompts[i % len(prompts)] for i in range(n_batches * self.batch_size)]
        return [flat[i: i + self.batch_size] for i in range(0, len(flat), self.batch_size)]

    def generate(self, model: Any, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        gen = greedy_generate(model, batch, opts)
        # per-row decode tokens: a row's first token comes from prefill (TTFT), the rest from decode steps
        gen.stats["row_decode_tokens"] = [len(s) - 1 for s in gen.sequences]
        return gen

    def metrics(self, generations: list[Generation]) -> dict[str, float]:
        per_seq = [r for g in generations for r in row_rates(g)]
        e2e = sum(g.e2e_s for g in generations)
        return {
            "batch_size": float(self.batch_size),
            # decode_tokens_per_s (summarize) is already aggregate over the batch; this one includes prefill
            "aggregate_tokens_per_s": sum(g.generated_tokens for g in generations) / e2e if e2e else float("nan"),
            "per_sequence_tokens_per_s": percentile(per_seq, 50),
            "batch_ttft_ms": percentile([g.ttft_s for g in generations], 50) * 1000.0,
            "step_ms_p50": percentile([s for g in generations for s in g.step_s], 50) * 1000.0,
        }
