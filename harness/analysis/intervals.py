"""The intervals a format comparison is read by: KL's bootstrap, task accuracy's pooled paired difference,
Holm's correction, and the between-cell drift that widens a speed ratio.

numpy only (no torch): the report imports this without loading a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

KL_BLOCK = 32  # tokens per bootstrap block: neighbouring tokens' KLs are correlated (same context, same window)
KL_RESAMPLES = 1000
LEVEL = 0.95
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


def block_bootstrap_mean(values: Sequence[float] | np.ndarray, block: int = KL_BLOCK,
                         resamples: int = KL_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the mean of a series, by a circular block bootstrap.

    Each resample joins ceil(n / block) blocks of `block` consecutive values drawn with replacement (cut to n):
    positions a few tokens apart share their context, so resampling single tokens would treat correlated
    values as independent and give an interval that is too narrow. Circular: a block may start anywhere and
    wraps past the end, so every value is drawn equally often (blocks that must fit inside the series
    under-draw both ends, and with n <= block every resample was the series itself: a zero-wide interval).
    A series shorter than two blocks gets blocks of n // 2.
    """
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return (math.nan, math.nan)
    block = max(1, min(block, n // 2))
    starts = np.random.default_rng(seed).integers(0, n, size=(resamples, math.ceil(n / block)))
    csum = np.concatenate([[0.0], np.cumsum(np.concatenate([x, x[:block]]))])  # wraps: start + block <= n + block
    sums = (csum[starts + block] - csum[starts]).sum(axis=1)  # whole blocks; the overhang is trimmed below
    over = math.ceil(n / block) * block - n
    if over:  # drop the last block's surplus values so every resample has exactly n
        last = starts[:, -1]
        sums -= csum[last + block] - csum[last + block - over]
    means = sums / n
    alpha = (1 - LEVEL) / 2
    return (float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha)))


def kl_interval(per_token_kl: Sequence[float] | np.ndarray) -> dict[str, float]:
    """`kl_div_mean_lo`/`_hi`: the block bootstrap's 95% interval of the mean per-token KL."""
    lo, hi = block_bootstrap_mean(per_token_kl)
    return {"kl_div_mean_lo": lo, "kl_div_mean_hi": hi}


def pooled_paired(right_to_wrong: float, wrong_to_right: float, examples: float) -> tuple[float, float]:
    """(difference, standard error) of accuracy, run - reference, pooled over every example of every task.

    Per example the paired difference d is +1 (wrong -> right), -1 (right -> wrong) or 0, so the flips give
    sum(d) and sum(d^2) exactly: the mean and the paired standard error sd(d) / sqrt(n) follow.
    """
    n = float(examples)
    if n < 2:
        return (math.nan, math.nan)
    mean = (wrong_to_right - right_to_wrong) / n
    var = max((wrong_to_right + right_to_wrong - n * mean * mean) / (n - 1), 0.0)
    return (mean, math.sqrt(var / n))


def paired_interval(right_to_wrong: float, wrong_to_right: float, examples: float,
                    z: float = Z95) -> tuple[float, float]:
    """A 95% interval of the accuracy difference run - reference from the flips: Agresti and Min (2005).

    The Wald interval, difference -/+ z x `pooled_paired`'s standard error, is zero wide when nothing flips
    and excluded 0 at 4 flips one way and none back in 100 (McNemar's exact p = 0.125), so a format looked
    significantly worse on no evidence. Adding 0.5 to each of the four cells (n + 2 examples) fixes both.
    """
    n = float(examples)
    if n < 1:
        return (math.nan, math.nan)
    m = n + 2.0
    p_rw, p_wr = (right_to_wrong + 0.5) / m, (wrong_to_right + 0.5) / m
    d = (wrong_to_right - right_to_wrong) / m
    half = z * math.sqrt(max(p_rw + p_wr - (p_wr - p_rw) ** 2, 0.0) / m)
    return (d - half, d + half)


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (family-wise error over the formats compared with one reference).

    Sorted ascending, the i-th smallest (from 0) of m is multiplied by (m - i), then made monotone and capped
    at 1; a format is significant at level a when its adjusted p <= a. NaNs are left out of the family.
    """
    items = sorted(((p, k) for k, p in pvalues.items() if p is not None and math.isfinite(p)))
    m, out, running = len(items), {}, 0.0
    for i, (p, k) in enumerate(items):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


def log_drift(pairs: Sequence[tuple[float, float]]) -> float | None:
    """The largest |log(a / b)| over pairs of speeds measured for the same configuration in different cells.

    Two cells of one configuration differ only by when they ran: whatever separates them (another process,
    clocks, memory placement) separates any two cells of the sweep too. None when no pair was measured.
    """
    logs = [abs(math.log(a / b)) for a, b in pairs if a and b and a > 0 and b > 0]
    return max(logs) if logs else None
