"""What a run's garbage collections cost with and without `measure.own_heap` (harness/measure/__init__.py).

    flock -x /tmp/qb-heavy.lock python benchmarks/own_heap.py            # ~30 s on 2 cores
    python benchmarks/own_heap.py --smoke                               # one pair: checks it runs

A run calls gc.collect() between its phases (to hand the reference model, the profiler's tables and the model back
before the next phase). Without own_heap each collection scans every object of every imported module (torch,
transformers, MLflow, Hydra: ~640k objects); inside it, only what the run made. In one process with the modules a
sweep's forkserver preloads, this times one full collection, then the same tiny-model run (model=tiny_random, 4 new
tokens, no accuracy, no tracking) `--pairs` times each way, alternating (on, off, off, on, ...) so both see the same
machine load, and prints the medians, their spread and the ratio, with the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ab import alternating, ratio, spread  # noqa: E402
from warm_cells import TINY  # noqa: E402 - the same tiny-model run as the cell benchmark


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=6, help="runs each way (default 6)")
    ap.add_argument("--smoke", action="store_true", help="one run each way: tests")
    args = ap.parse_args(argv)
    pairs = 1 if args.smoke else args.pairs

    import harness.sweep.preload  # noqa: F401 - the modules a sweep cell or a documented command starts with
    from harness import measure, quiet_third_party
    from harness.config import compose
    from harness.env import cpu_info
    from harness.run import runner

    quiet_third_party()
    cfg = compose(TINY)
    assert runner.run(cfg).status == "OK"  # warm: lazy imports, the tiny model's files
    t = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - t
    real, times = measure.own_heap, {"own_heap": [], "no own_heap": []}
    ab = ("own_heap", "no own_heap")
    order = alternating(pairs, ab)  # on off, off on, ...
    try:
        for mode in order:
            measure.own_heap = real if mode == "own_heap" else contextlib.nullcontext
            t = time.perf_counter()
            res = runner.run(cfg)
            times[mode].append(time.perf_counter() - t)
            assert res.status == "OK", res.error
    finally:
        measure.own_heap = real
    print(f"CPU: {cpu_info().describe()}")
    print(f"one full gc.collect() with {len(gc.get_objects())} objects tracked: {full * 1e3:.0f} ms")
    for mode, ts in times.items():
        print(f"tiny run, {mode:12s}: {spread(ts)}")
    print(f"tiny run: {ratio(times, 'no own_heap', 'own_heap')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
