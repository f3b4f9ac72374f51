"""Greedy decoding, batch 1: the baseline every other strategy is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.measure import Generation
from strategies.base import DecodeOptions, Strategy
from strategies.decode import greedy_generate


@dataclass
class Greedy(Strategy):
    """Batch 1, argmax at every step; the reference output for speculative and compiled paths."""

    stepwise = True
    supports_context_depth = True
    supports_llama_cpp = True

    def generate(self, model: Any, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        return greedy_generate(model, batch, opts)
