"""How the gate measures speed: short blocks of both sides, A B B A, looked at until the answer is clear.

Two loaded sides (harness/gate/sides.py: worker processes, each on its own revision's pipeline) take
turns in blocks. A block is one or more whole generate calls of the side's next prompt batches, until
at least `block_steps` decode tokens (harness/gate/worker.py); its speed is decode tokens / decode wall
clock, the definition of run.py's `decode_tokens_per_s`, so the gate compares what run.py measures.
Blocks come in groups A B B A: pairs (A, B) and (B, A), so the side that goes second, right after a
switch, is A as often as B. One untimed group warms both sides up first.

After `min_pairs` pairs the statistic is looked at (harness/gate/stats.py); while it is undecided the
gate keeps measuring and looks again at 2x, 4x, ... the pairs, up to `max_pairs`, or until
`budget_s` seconds of measuring are spent, when it takes a last look and reports what it has. A look
at fewer than `MIN_DECIDE_PAIRS` pairs never decides (it stays "undecided").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.gate import stats
from harness.gate.errors import GateError

MIN_BUDGET_PAIRS = 8  # a look at the budget needs at least this many pairs (4 groups) to bootstrap
# A look at fewer pairs may say only "undecided": with a handful of A B B A groups the moving-block
# bootstrap has a few distinct resamples and its bounds are far too narrow. On the synthetic noisy host
# of tests/test_gate.py, one A/A look at 5% alarmed in 24 of 200 runs at 8 pairs, 5 at 16, 2 at 32, 1 at 64.
MIN_DECIDE_PAIRS = 32


@dataclass
class Plan:
    """What the sequential measurement does (the CLI options of the same names, docs/gate.md)."""

    block_steps: int = 16  # decode tokens per block, at least (whole generate calls)
    min_pairs: int = 64
    max_pairs: int = 2048
    budget_s: float = 120.0
    threshold: float = 0.05
    confidence: float = 0.95
    resamples: int = 2000
    seed: int = 0
    trim: float = stats.TRIM

    def problems(self) -> list[str]:
        p = []
        if self.block_steps < 1:
            p.append(f"--block-steps {self.block_steps}: at least 1 decode token per block")
        if self.min_pairs < MIN_BUDGET_PAIRS or self.min_pairs % 2:
            p.append(f"--min-blocks {self.min_pairs}: give an even number >= {MIN_BUDGET_PAIRS} (whole A B B A groups)")
        if self.max_pairs < MIN_DECIDE_PAIRS:  # every look would be "undecided": a gate that cannot fail
            p.append(f"--max-blocks {self.max_pairs}: at least {MIN_DECIDE_PAIRS}, the fewest blocks a decision needs")
        elif self.max_pairs < self.min_pairs:
            p.append(f"--max-blocks {self.max_pairs}: must be >= --min-blocks {self.min_pairs}")
        elif self.max_pairs % 2:  # an odd cap rounded down to the last look's size: a second, uncorrected look there
            p.append(f"--max-blocks {self.max_pairs}: give an even number (whole A B B A groups)")
        if not self.budget_s > 0:
            p.append(f"--budget {self.budget_s}: give seconds > 0")
        if not 0 < self.threshold < 1:
            p.append(f"--threshold {self.threshold}: give a fraction, e.g. 0.05 for 5%")
        if not 0.5 <= self.confidence < 1:
            p.append(f"--confidence {self.confidence}: give e.g. 0.95")
        if self.resamples < 1000:
            p.append(f"--resamples {self.resamples}: use >= 1000 for stable bounds")
        if self.seed < 0:  # numpy's generator refuses it, at the first look: after both models loaded and ran
            p.append(f"--seed {self.seed}: give an integer >= 0")
        if not 0 <= self.trim < 0.5:
            p.append(f"trim {self.trim}: a fraction below 0.5")
        return p


def block_tps(reply: dict, label: str) -> float:
    """Decode tokens/s of one block reply (tokens / decode wall clock); what cannot be compared is a GateError."""
    tokens = reply.get("decode_tokens", 0)
    seconds = reply.get("decode_wall_s", float("nan"))
    if not tokens:
        raise GateError(f"{label}: zero decode tokens were generated; use measure.max_new_tokens >= 2")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise GateError(f"{label}: a block's decode time is {seconds!r}")
    return tokens / seconds


def measure_sequential(base: Any, cand: Any, plan: Plan, clock: Callable[[], float] = time.perf_counter,
                       on_look: Callable[[stats.Look], None] | None = None
                       ) -> tuple[list[float], list[float], stats.SpeedStats]:
    """Interleave the two sides in A B B A groups and stop at the first decided look (module docstring).

    Returns the per-block tokens/s of each side (pairs in AB, BA, ... order) and the comparison.
    """
    sizes = stats.look_schedule(plan.min_pairs, plan.max_pairs)
    alpha = stats.look_alpha(tuple(sizes), plan.confidence)
    k = plan.block_steps
    order = ((base, "baseline"), (cand, "candidate"), (cand, "candidate"), (base, "baseline"))
    for side, _ in order:  # one untimed group: first calls allocate, fill caches, size injected work
        side.block(k)
    a: list[float] = []
    b: list[float] = []
    tokens: list[list[int]] = [[], []]  # decode tokens of each block, baseline and candidate
    looks: list[stats.Look] = []
    nxt = 0
    t0 = clock()
    while True:
        replies = [side.block(k) for side, _ in order]
        tps = [block_tps(r, label) for r, (_, label) in zip(replies, order, strict=True)]
        a += [tps[0], tps[3]]
        b += [tps[1], tps[2]]
        tokens[0] += [replies[0]["decode_tokens"], replies[3]["decode_tokens"]]
        tokens[1] += [replies[1]["decode_tokens"], replies[2]["decode_tokens"]]
        spent = clock() - t0
        over = spent >= plan.budget_s and len(a) >= MIN_BUDGET_PAIRS
        if len(a) < sizes[nxt] and not over:
            continue
        lk = stats.look(a, b, plan.threshold, alpha, plan.resamples, plan.seed + len(looks), plan.trim, *tokens)
        few = lk.pairs < MIN_DECIDE_PAIRS
        if few:
            lk.decision = stats.UNDECIDED
        looks.append(lk)
        if on_look is not None:
            on_look(lk)
        if lk.decision == stats.REGRESSION:
            which = ("upper bound below the threshold" if lk.high < math.log(1.0 - plan.threshold) else
                     f"total tokens / total time {math.expm1(lk.totals):+.1%}: its upper bound below the threshold, "
                     "while the trimmed estimate drops the slow blocks as outliers: a slowdown in some blocks only "
                     "(one prompt, periodic stalls)")
            stop = f"decided: regression ({which} at look {len(looks)})"
        elif lk.decision == stats.NO_REGRESSION:
            stop = f"decided: no regression (both lower bounds above the threshold at look {len(looks)})"
        elif over:
            stop = (f"time budget of {plan.budget_s:g} s spent; still undecided (a pass that says so)"
                    + (f"; {lk.pairs} blocks per side, fewer than the {MIN_DECIDE_PAIRS} a decision needs" if few
                       else _vetoed(lk, plan.threshold)))
        elif nxt == len(sizes) - 1:
            stop = (f"--max-blocks {plan.max_pairs} reached; still undecided (a pass that says so)"
                    + _vetoed(lk, plan.threshold))
        else:
            nxt += 1
            continue
        return a, b, stats.summarize(a, b, looks, threshold=plan.threshold, confidence=plan.confidence, stop=stop,
                                     planned_looks=len(sizes), block_steps=k, seconds=clock() - t0)


def _vetoed(lk: stats.Look, threshold: float) -> str:
    """Why a look whose trimmed lower bound clears the threshold is still undecided (stats.decide), or ''."""
    if lk.low > math.log(1.0 - threshold) and lk.decision == stats.UNDECIDED:
        return (f"; the trimmed estimate clears -{threshold:.0%} but total tokens / total time changed "
                f"{math.expm1(lk.totals):+.1%} [{math.expm1(lk.totals_low):+.1%}, {math.expm1(lk.totals_high):+.1%}]: "
                "not a clear pass (a slowdown in some blocks only, or a few very slow blocks)")
    return ""
