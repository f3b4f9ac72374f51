"""The gate's speed statistic: log ratios of adjacent blocks, a moving-block bootstrap bound, sequential looks.

Pure numpy, no model: everything here can be checked on synthetic samples (tests/test_gate.py).

The unit. The two sides run in alternating blocks of a few decode steps, A B B A, A B B A, ...
(harness/gate/interleave.py). Each A block and the B block next to it form a pair; its value is

    x = log(tokens/s of B / tokens/s of A)        (negative: the candidate B is slower)

Adjacent blocks run milliseconds apart, so a slow phase of the host (seconds to minutes on a shared VM)
slows both and cancels in x. Within a group A B B A the first pair has A first and the second has B
first, so an order effect (the block right after a switch pays for cold caches) enters the two pairs
with opposite signs and cancels in their mean (bias handled by design; see docs/gate.md for the A/A
measurement that checks it).

The estimate. The trimmed mean of the x (TRIM of each tail dropped): a block hit by a preemption gives
one wild x, which a plain mean would follow and a median would waste data to ignore.

The bound. A moving-block bootstrap: neighbouring groups still share some of the host's state (the
lag-1 correlation of x measured here is 0.1-0.3), so resampling single pairs would understate the
spread. Resamples are built from runs of L consecutive groups (L ~ n^(1/3), the usual rate), each run
starting anywhere, concatenated to the original length; the estimate is recomputed on each, and
estimate -/+ t x their standard deviation bounds it (`bound`). Seeded: the same samples give the same bounds.

Beside it, the untrimmed throughput: total tokens / total time of each side, their log ratio
(`totals_log_ratio`), bounded on the same resamples. It sees what the trimmed mean drops as outliers
when the slowdown itself sits in some blocks only (one prompt of the cycle, a stall every k-th call).

The decision, against `limit = log(1 - threshold)`:
- regression when either upper bound lies below the limit (even the optimistic end is too slow);
- no regression when both lower bounds lie above it (even the pessimistic end is fast enough);
- otherwise undecided: measure more (`sequential plan`), or report "undecided" when the budget ends.
Each statistic gets half of the error (`look_alpha`), so together they say "regression" at a true drop
equal to the threshold at most 1 - confidence of the time.

Sequential looks and their error spending. The bounds are computed at looks after n_1 < n_2 < ... pairs
(doubling from a minimum), and the first decided look stops the gate. Looking K times at a growing
sample raises the chance that some look crosses by luck, so each look uses the same stricter one-sided
level alpha' (Pocock's constant boundary): the one with P(any of the K looks crosses) = alpha for a
Gaussian random walk observed at those sample sizes, computed by seeded Monte Carlo (`pocock_alpha`;
the default 6 looks, 64 to 2048 pairs, give alpha' = 1.14% for alpha = 5%). Stopping at the time budget only
removes looks, which can only lower that chance; a final look taken at the budget instead of at the
next planned size stands in for that planned look.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.special import stdtrit

from harness.gate.errors import GateError

TRIM = 0.2  # fraction of the pair log ratios dropped at each tail by the trimmed mean
REGRESSION, NO_REGRESSION, UNDECIDED = "regression", "no regression", "undecided"


def check_samples(name: str, values) -> np.ndarray:
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        raise GateError(f"{name}: no speed measurements")
    bad = [v for v in arr.tolist() if not (math.isfinite(v) and v > 0)]
    if bad:
        raise GateError(f"{name}: decode tokens/s {bad[0]!r} is not a positive number (NaN or zero decode "
                         "tokens: the run produced nothing to time); check measure.max_new_tokens >= 2")
    return arr


def log_ratios(baseline, candidate) -> np.ndarray:
    """Per-pair log(candidate / baseline) of tokens/s; pairs in order (AB, BA, AB, BA, ...)."""
    a, b = check_samples("baseline", baseline), check_samples("candidate", candidate)
    if a.size != b.size:
        raise GateError(f"unpaired samples: {a.size} baseline vs {b.size} candidate blocks")
    if a.size < 4 or a.size % 2:
        raise GateError(f"{a.size} block pairs: the statistic needs whole A B B A groups, at least 2")
    return np.log(b / a)


def trimmed_mean(x: np.ndarray, trim: float = TRIM, axis: int = -1) -> np.ndarray:
    """Mean of the values left after dropping floor(trim x n) at each end (along `axis`)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[axis]
    g = int(math.floor(trim * n))
    if g == 0:
        return x.mean(axis=axis)
    part = np.partition(x, [g, n - g - 1], axis=axis)
    return np.take(part, np.arange(g, n - g), axis=axis).mean(axis=axis)


def block_length(n_groups: int) -> int:
    """Moving-block length in groups: ~n^(1/3), at least 1."""
    return max(1, round(n_groups ** (1 / 3)))


def _resampled_groups(n: int, resamples: int, seed: int, chunk: int = 500):
    """Moving-block resamples of `n` groups: (first, index array of shape (m, n)) per chunk of `m` resamples.

    Runs of `block_length(n)` consecutive groups, each starting anywhere, joined to the original length.
    Seeded: the trimmed mean and the totals (`totals_bootstrap`) are recomputed on the same resamples.
    """
    length = block_length(n)
    runs = -(-n // length)
    rng = np.random.default_rng(seed)
    offsets = np.arange(length)
    for lo in range(0, resamples, chunk):
        m = min(chunk, resamples - lo)
        starts = rng.integers(0, n - length + 1, size=(m, runs))
        yield lo, (starts[:, :, None] + offsets).reshape(m, -1)[:, :n]


def moving_block_bootstrap(x: np.ndarray, resamples: int, seed: int, trim: float = TRIM,
                           chunk: int = 500) -> np.ndarray:
    """Bootstrap distribution of the trimmed mean of pair values `x` (AB, BA, ... order).

    A/B B/A groups (2 consecutive pairs) stay together, and runs of `block_length` consecutive groups are
    drawn with replacement from anywhere in the series (moving blocks), then joined to the original length.
    """
    groups = np.asarray(x, dtype=np.float64).reshape(-1, 2)
    out = np.empty(resamples)
    for lo, idx in _resampled_groups(groups.shape[0], resamples, seed, chunk):
        out[lo:lo + idx.shape[0]] = trimmed_mean(groups[idx].reshape(idx.shape[0], -1), trim)
    return out


def totals_bootstrap(baseline, candidate, baseline_tokens=None, candidate_tokens=None, *, resamples: int,
                     seed: int, chunk: int = 500) -> np.ndarray:
    """Bootstrap distribution of `totals_log_ratio` over the same moving-block resamples of A B B A groups."""
    sums = []
    for tps, tokens in ((baseline, baseline_tokens), (candidate, candidate_tokens)):
        v = np.asarray(tps, dtype=np.float64)
        t = np.ones_like(v) if tokens is None else np.asarray(tokens, dtype=np.float64)
        sums.append((t.reshape(-1, 2).sum(axis=1), (t / v).reshape(-1, 2).sum(axis=1)))  # per group: tokens, s
    (ta, sa), (tb, sb) = sums
    out = np.empty(resamples)
    for lo, idx in _resampled_groups(ta.size, resamples, seed, chunk):
        out[lo:lo + idx.shape[0]] = (np.log(tb[idx].sum(1) / sb[idx].sum(1))
                                     - np.log(ta[idx].sum(1) / sa[idx].sum(1)))
    return out


@dataclass
class Look:
    """One look at the data: the two estimates and their bounds at this look's one-sided level."""

    pairs: int
    estimate: float  # trimmed mean of the pair log ratios
    low: float  # lower bound of the estimate (log scale) at one-sided level `alpha`
    high: float  # upper bound
    alpha: float
    decision: str  # regression | no regression | undecided
    totals: float = 0.0  # untrimmed log ratio of total tokens / total time (`totals_log_ratio`)
    totals_low: float = 0.0  # its bounds, at the same level
    totals_high: float = 0.0


def t_ppf(p: float, df: int) -> float:
    """Quantile of Student's t with `df` degrees of freedom (scipy, which mlflow already installs)."""
    return float(stdtrit(df, p))


def bound_df(pairs: int) -> int:
    """Degrees of freedom of the bound: the number of independent moving blocks (groups / L) less one."""
    groups = pairs // 2
    return max(1, groups // block_length(groups) - 1)


def bound(x: np.ndarray, alpha: float, resamples: int, seed: int, trim: float = TRIM) -> tuple[float, float, float]:
    """(estimate, low, high): the trimmed mean -/+ t(df, 1 - alpha) x its moving-block bootstrap sd.

    Not the bootstrap's own quantiles: with tens of moving blocks those are too narrow at the small
    per-look levels (an audit's simulation missed the true value at ~2x the stated level at 64-256 pairs,
    pushing the error at the threshold to 6-8% instead of 5%). The bootstrap gives the standard error;
    Student's t with (groups / L - 1) degrees of freedom, the number of independent blocks it resampled
    less one, widens it for how few they are (docs/gate.md, "Bounds").
    """
    boot = moving_block_bootstrap(x, resamples, seed, trim)
    est = float(trimmed_mean(x, trim))
    half = t_ppf(1.0 - alpha, bound_df(int(np.asarray(x).size))) * float(boot.std(ddof=1))
    return est, est - half, est + half


def totals_log_ratio(baseline, candidate, baseline_tokens=None, candidate_tokens=None) -> float:
    """log((candidate total tokens / total time) / (baseline's)): throughput over all blocks, untrimmed.

    Per-block tokens/s and decode tokens; without token counts every block counts as the same tokens.
    """
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    ta = np.ones_like(a) if baseline_tokens is None else np.asarray(baseline_tokens, dtype=np.float64)
    tb = np.ones_like(b) if candidate_tokens is None else np.asarray(candidate_tokens, dtype=np.float64)
    return float(math.log(tb.sum() / (tb / b).sum()) - math.log(ta.sum() / (ta / a).sum()))


def look_alpha(sizes: tuple[int, ...], confidence: float) -> float:
    """The one-sided level of each bound at each look: Pocock's level for (1 - confidence) / 2.

    Two statistics can say "regression" (`decide`), so each gets half of the error (Bonferroni): across all
    looks, each crosses below a true drop equal to the threshold with probability at most (1 - confidence) / 2,
    and the gate's false "regression" at most 1 - confidence. "No regression" needs both lower bounds above
    the limit (an intersection-union test), which each level already bounds.
    """
    return pocock_alpha(tuple(sizes), (1.0 - confidence) / 2)


def decide(low: float, high: float, threshold: float, totals_low: float | None = None,
           totals_high: float | None = None) -> str:
    """The look's decision from the bounds of the trimmed estimate and of total tokens / total time.

    Both sides cycle the same prompts in lockstep, so a slowdown confined to some blocks (one prompt of the
    cycle, a stall every k-th call) lands in the same pairs every cycle, and the trimmed mean drops those
    pairs as outliers (an audit: one prompt of 4 1.5x slower, throughput -11%, trimmed estimate ~0). The
    untrimmed throughput keeps them: its upper bound below the limit is a regression too, and "no regression"
    needs both lower bounds above it. The trimmed bound stays because a preempted block moves a mean of
    log ratios, not a trimmed one: it decides the common case of a slowdown in every step, with narrower bounds.
    """
    limit = math.log(1.0 - threshold)
    totals = [] if totals_low is None else [totals_low, totals_high]
    if high < limit or (totals and totals[1] < limit):
        return REGRESSION
    if low > limit and (not totals or totals[0] > limit):
        return NO_REGRESSION
    return UNDECIDED


def look(baseline, candidate, threshold: float, alpha: float, resamples: int, seed: int, trim: float = TRIM,
         baseline_tokens=None, candidate_tokens=None) -> Look:
    """One look at the per-block tokens/s of both sides (pairs in AB, BA, ... order) and their decode tokens."""
    x = log_ratios(baseline, candidate)
    est, lo, hi = bound(x, alpha, resamples, seed, trim)
    tot = totals_log_ratio(baseline, candidate, baseline_tokens, candidate_tokens)
    boot = totals_bootstrap(baseline, candidate, baseline_tokens, candidate_tokens, resamples=resamples, seed=seed)
    half = t_ppf(1.0 - alpha, bound_df(int(x.size))) * float(boot.std(ddof=1))
    return Look(pairs=int(x.size), estimate=est, low=lo, high=hi, alpha=alpha,
                decision=decide(lo, hi, threshold, tot - half, tot + half), totals=tot,
                totals_low=tot - half, totals_high=tot + half)


# ------------------------------------------------------------------------------------ sequential plan


def look_schedule(min_pairs: int, max_pairs: int) -> list[int]:
    """Pair counts at which to look: min, 2 min, 4 min, ... and max (all even: whole A B B A groups)."""
    if min_pairs < 4 or min_pairs % 2 or max_pairs < min_pairs:
        raise GateError(f"look schedule {min_pairs}..{max_pairs}: need an even minimum >= 4 and max >= min")
    sizes = [min_pairs]
    while sizes[-1] * 2 < max_pairs:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_pairs:
        sizes.append(max_pairs - max_pairs % 2)
    return sizes


@functools.lru_cache(maxsize=32)
def pocock_alpha(sizes: tuple[int, ...], alpha: float, paths: int = 200_000, seed: int = 12345) -> float:
    """The one-sided level each look uses so that K looks together cross with probability `alpha`.

    Under no effect the running sum of pair values is a Gaussian random walk; its z-score at look k is
    S(n_k) / sqrt(n_k). Pocock's boundary is the constant c with P(max_k z_k > c) = alpha; the per-look
    level is 1 - Phi(c). Computed by seeded Monte Carlo (exact to ~0.1% of alpha; the same every call).
    """
    if len(sizes) == 1:
        return alpha
    rng = np.random.default_rng(seed)
    n = np.asarray(sizes, dtype=np.float64)
    steps = rng.standard_normal((paths, len(sizes))) * np.sqrt(np.diff(n, prepend=0.0))
    z = np.cumsum(steps, axis=1) / np.sqrt(n)
    c = float(np.quantile(z.max(axis=1), 1.0 - alpha))
    return 0.5 * math.erfc(c / math.sqrt(2.0))


@dataclass
class SpeedStats:
    """The speed comparison: the last look, every look, and why the gate stopped."""

    pairs: int  # A-B block pairs (= blocks per side) measured
    baseline_tps: float  # median tokens/s over the baseline's blocks
    candidate_tps: float
    change: float  # exp(trimmed mean log ratio) - 1: the relative tokens/s change
    ci_low: float  # the last look's bounds of that change (one-sided level `alpha` each)
    ci_high: float
    alpha: float  # one-sided level of each look (Pocock), e.g. 0.011
    confidence: float  # overall one-sided confidence across all looks, e.g. 0.95
    threshold: float
    verdict: str  # regression | no regression | undecided
    stop: str  # why it stopped, one sentence
    looks: list[Look] = field(default_factory=list)
    planned_looks: int = 0
    block_steps: int = 0
    seconds: float = 0.0  # time spent measuring
    cv_ratio: float = 0.0  # robust CV of the pair ratios (descriptive)
    cv_baseline: float = 0.0  # robust CV of the per-block tokens/s of each side (descriptive: host phases)
    cv_candidate: float = 0.0
    cv_baseline_classic: float = 0.0  # std / mean of the same (outlier-sensitive, for reference)
    cv_candidate_classic: float = 0.0
    lag1: float = 0.0  # lag-1 autocorrelation of the pair log ratios (why the bootstrap uses blocks)
    order_effect: float = 0.0  # mean x of AB pairs minus mean x of BA pairs (what ABBA cancels)
    change_totals: float = 0.0  # total tokens / total time, candidate over baseline, - 1 (untrimmed: a slowdown
    # in some blocks only shows here, stats.decide)
    ci_low_totals: float = 0.0  # the last look's bounds of that change (the same level)
    ci_high_totals: float = 0.0


def robust_cv(x: np.ndarray) -> float:
    """1.4826 x MAD / median: the CV of well-behaved data, blind to a few preemption outliers."""
    med = float(np.median(x))
    return float(1.4826 * np.median(np.abs(x - med)) / med) if x.size > 1 and med > 0 else 0.0


def classic_cv(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / x.mean()) if x.size > 1 and x.mean() > 0 else 0.0


def summarize(baseline, candidate, looks: list[Look], *, threshold: float, confidence: float, stop: str,
              planned_looks: int, block_steps: int = 0, seconds: float = 0.0) -> SpeedStats:
    """The SpeedStats record of a finished sequential run (the verdict is the last look's decision)."""
    a, b = check_samples("baseline", baseline), check_samples("candidate", candidate)
    x = np.log(b / a)
    last = looks[-1]
    lag1 = float(np.corrcoef(x[:-1], x[1:])[0, 1]) if x.size > 2 and x.std() > 0 else 0.0
    return SpeedStats(
        pairs=int(a.size), baseline_tps=float(np.median(a)), candidate_tps=float(np.median(b)),
        change=math.expm1(last.estimate), ci_low=math.expm1(last.low), ci_high=math.expm1(last.high),
        change_totals=math.expm1(last.totals), ci_low_totals=math.expm1(last.totals_low),
        ci_high_totals=math.expm1(last.totals_high),
        alpha=last.alpha, confidence=confidence, threshold=threshold, verdict=last.decision, stop=stop,
        looks=looks, planned_looks=planned_looks, block_steps=block_steps, seconds=seconds,
        cv_ratio=robust_cv(b / a), cv_baseline=robust_cv(a), cv_candidate=robust_cv(b),
        cv_baseline_classic=classic_cv(a), cv_candidate_classic=classic_cv(b), lag1=lag1,
        order_effect=float(x[0::2].mean() - x[1::2].mean()))


def speed_stats(baseline, candidate, threshold: float = 0.05, resamples: int = 2000, seed: int = 0,
                confidence: float = 0.95, looks: int = 1, trim: float = TRIM) -> SpeedStats:
    """One look at complete samples (pairs in AB, BA, ... order) with the level of a `looks`-look plan.

    `looks` > 1 uses the per-look level of that many doubling looks ending at this sample size, as the
    sequential gate would at its last look; 1 is a single fixed-size test, each statistic at (1 - confidence) / 2.
    """
    if not 0.5 <= confidence < 1:
        raise GateError(f"confidence={confidence} must be in [0.5, 1)")
    if resamples < 1000:
        raise GateError(f"resamples={resamples} is too few for a 95% bound; use >= 1000")
    x = log_ratios(baseline, candidate)
    sizes = tuple(x.size // 2 ** (looks - 1 - k) for k in range(looks))
    last = look(baseline, candidate, threshold, look_alpha(sizes, confidence), resamples, seed, trim)
    return summarize(baseline, candidate, [last], threshold=threshold, confidence=confidence,
                     stop=f"fixed sample of {x.size} pairs: {last.decision}", planned_looks=looks)
