"""Is a greedy difference a rounding flip of a near-tie, or a bug? One check for every fast path.

Two paths that compute the same logits in a different order (a compiled decode step vs eager; a
k+1-token speculative verify forward vs one-token decode) round differently in low precision: on
SmolLM2 in bf16, by up to ~5 ulps. Where greedy's top two logits lie a few ulps apart, that flips the
chosen token, and from there the two continuations differ entirely, although neither path is wrong. A
real bug (a miscompiled step, a wrong cache slot or mask, a broken acceptance rule) instead picks
tokens far below the reference's maximum.

The check (`replay`): decode once more with the reference path while forcing the other path's tokens,
and at every position where they differ measure the reference's gap, its top logit minus its logit of
the forced token, in units in the last place (`ulp`) of the logits' dtype at the top logit's
magnitude. A difference is explained when every gap is at most NEAR_TIE_ULPS. Users of this module:
harness/measure/fast_path.py (`measure.compile_match`) and strategies/speculative.py (`strategy.match`), both
with the policies in MATCH_POLICIES: `near_tie` fails only on unexplained differences, `strict` on any.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

# A token counts as a rounding flip of a near-tie when the reference scores it within this many units in
# the last place of the reference's top logit (bf16 at logit ~27: 4 x 0.125 = 0.5). Measured on SmolLM2
# bf16: compiled-vs-eager logits differ by up to 5 ulps, and the flips seen (compiled and speculative)
# were at reference gaps of 0-2 ulps.
NEAR_TIE_ULPS = 4.0
MATCH_POLICIES = ("near_tie", "strict")


def ulp(value: float, dtype: torch.dtype) -> float:
    """One unit in the last place of `dtype` at the magnitude of `value`."""
    mag = max(abs(value), torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(mag))


def first_diff(want: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    """(row, token index) of the first difference between two lists of token sequences."""
    row = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
    a, b = want[row], got[row]
    return row, next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def replay(decode: Callable[[], Any], opts: Any, forced: list[list[int]]) -> tuple[int, float]:
    """Run `decode()` (the reference path, reading `opts.choose`) with the tokens of `forced` imposed.

    Returns (flips, largest gap in ulps): a flip is a position where the reference's own argmax is not
    the forced token; its gap is the reference's top logit minus its logit of the forced token, in ulps
    (0 for an exact tie that argmax broke the other way). The hook is removed again afterwards.
    """
    flips, worst = 0, 0.0

    def choose(logits: torch.Tensor, index: int) -> torch.Tensor:
        nonlocal flips, worst
        nxt = logits.argmax(-1)
        for row, seq in enumerate(forced):
            if index >= len(seq):
                continue  # this row stopped (EOS): nothing to force
            token = seq[index]
            if token != int(nxt[row]):
                top = float(logits[row, nxt[row]])
                flips += 1
                worst = max(worst, (top - float(logits[row, token])) / ulp(top, logits.dtype))
            nxt[row] = token
        return nxt

    saved = opts.choose
    opts.choose = choose
    try:
        decode()
    finally:
        opts.choose = saved
    return flips, worst
