"""The launching process's progress bar and terminal lines (a cell's line goes above the bar, not through it).

In-process state on purpose: it only drives what the terminal shows; everything a job needs travels
through files (harness/sweep/__init__.py).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

_BAR: dict[str, tqdm] = {}
_COUNTS: dict[str, int] = {}


def start(total: int, name: str) -> None:
    """Show a bar of `total` cells for sweep `name` (none when the total is unknown)."""
    _COUNTS.clear()
    if total:
        _BAR["bar"] = tqdm(total=total, desc=f"sweep {name}", unit="cell", file=sys.stderr, dynamic_ncols=True)


def stop() -> None:
    """Close the bar (the sweep's summary lines follow on a clean terminal)."""
    bar = _BAR.pop("bar", None)
    if bar is not None:
        bar.close()


def tick(status: str) -> None:
    """One more cell done, with this status (the bar shows the counts per status)."""
    bar = _BAR.get("bar")
    if bar is None:
        return
    _COUNTS[status] = _COUNTS.get(status, 0) + 1
    bar.update(1)
    bar.set_postfix(dict(sorted(_COUNTS.items())), refresh=True)


def say(line: str) -> None:
    """Print a line above the bar (or plainly, without one)."""
    bar = _BAR.get("bar")
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)
