"""What the side-by-side benchmarks share (own_heap.py, omp_pool.py): the alternating order of two modes (so
both see the same machine load), a list of timings as its median and spread, and the ratio of two modes."""

from __future__ import annotations

import statistics


def alternating(pairs: int, ab: tuple[str, str]) -> list[str]:
    """`pairs` runs of each mode: a b, b a, a b, ... (each mode as often first as second)."""
    return [m for i in range(pairs) for m in (ab if i % 2 == 0 else ab[::-1])]


def spread(ts: list[float], fmt: str = "{:.2f}") -> str:
    """'median M s (min A, max B, n=N)'."""
    f = fmt.format
    return f"median {f(statistics.median(ts))} s (min {f(min(ts))}, max {f(max(ts))}, n={len(ts)})"


def ratio(times: dict[str, list[float]], num: str, den: str) -> str:
    """'NUM / DEN = R.RRx (pairs A-B, n=N)': the median of the per-pair ratios, pair i being the i-th run of each
    mode (`alternating`: adjacent in time, under the same load), and their range. When the pairs fall on both sides
    of 1 the ratio is reported as undecided because noisy, never as a finding."""
    pairs = [a / b for a, b in zip(times[num], times[den], strict=False)]
    if not pairs:
        return f"{num} / {den}: no pairs measured"
    text = f"{num} / {den} = {statistics.median(pairs):.2f}x (pairs {min(pairs):.2f}-{max(pairs):.2f}, n={len(pairs)})"
    if min(pairs) <= 1.0 <= max(pairs):
        text += ": undecided because noisy (the pairs fall on both sides of 1.00x)"
    return text


def range_ratio(num: dict, den: dict, key: str = "decode_tokens_per_s") -> str:
    """'R.RRx (lo-hi)' of two runs' medians, lo-hi from their p10-p90 (num's p10 over den's p90, and back), for rows
    measured one after the other (not alternated): a range across 1.00x is undecided because noisy, said so."""
    mid, lo, hi = num[key] / den[key], num[f"{key}_p10"] / den[f"{key}_p90"], num[f"{key}_p90"] / den[f"{key}_p10"]
    return f"{mid:.2f}x ({lo:.2f}-{hi:.2f}" + (", undecided because noisy)" if lo <= 1.0 <= hi else ")")
