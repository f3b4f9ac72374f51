"""A sweep cell's fixed cost: fresh interpreter (`spawn`) vs forked from a pre-imported server (`forkserver`).

    flock -x /tmp/qb-heavy.lock python benchmarks/warm_cells.py            # ~1-2 min on 2 cores
    flock -x /tmp/qb-heavy.lock python benchmarks/warm_cells.py --cells 5
    python benchmarks/warm_cells.py --smoke     # two forkserver cells, no spawn cells: checks it runs

Runs the same tiny-model cell (model=tiny_random, 4 new tokens, 1 repetition, no accuracy, no
tracking) through `harness.sweep.isolated.run_isolated`, `--cells` times with each start method, alternating
spawn / forkserver so both see the same machine load. Per cell it prints the wall time as the sweep sees
it, `cell_start_s` (until the child is ready), the run itself (`runner.run` inside the child: build,
tokenizer, model, generation) and the fixed cost = wall - the run's work as measured on a warm process.
The work of a warm process is measured first, in this process (the median of three warm calls of runner.run,
its range printed beside "fixed"), so "fixed"
holds everything a cell pays that a long-lived process would not: interpreter start, imports (also the
lazy ones inside the run), fork, pipes.

The forkserver's own imports are paid once per sweep, before the first cell (`harness.sweep.isolated.warm_up`,
run when the sweep opens); they are timed and printed separately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after ROOT: benchmarks/strategies.py is not the package

import ab  # noqa: E402

TINY = ["model=tiny_random", "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0",
        "accuracy.enabled=false", "tracking.enabled=false"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", type=int, default=3, help="cells per start method (default 3)")
    ap.add_argument("--smoke", action="store_true",
                    help="two forkserver cells and no spawn cell (a spawned interpreter alone takes 10-20 s): tests")
    args = ap.parse_args(argv)
    methods = ("forkserver",) if args.smoke else ("spawn", "forkserver")
    if args.smoke:
        args.cells = 1  # one warm forkserver cell after the first: the table's row and its metrics run too

    from harness import quiet_third_party
    from harness.config import compose, to_plain
    from harness.env import cpu_info
    from harness.run import runner
    from harness.sweep.isolated import run_isolated, warm_up
    from harness.sweep.settings import SweepSettings

    quiet_third_party()
    config = to_plain(compose(TINY))
    config.pop("hydra", None)
    runner.run(config)  # warm this process: imports, tiny model cache
    works = []
    for _ in range(3):  # one warm run was one noisy number: "fixed" came out negative when it ran slow
        t = time.perf_counter()
        runner.run(config)
        works.append(time.perf_counter() - t)
    warm_work = statistics.median(works)

    t = time.perf_counter()
    warm_up(SweepSettings(start_method="forkserver"))
    first = run_isolated(config, SweepSettings(start_method="forkserver", timeout_s=300))
    first_s = time.perf_counter() - t  # the server's imports, then the first cell
    if first.status != "OK":
        print(f"forkserver: first cell {first.status}: {first.error}")
        return 1
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
    for i in range(args.cells):
        for method in (methods if i % 2 == 0 else methods[::-1]):  # each method as often first as second
            r = run_isolated(config, SweepSettings(start_method=method, timeout_s=300))
            if r.status != "OK":
                print(f"{method}: cell {r.status}: {r.error}")
                return 1
            rows[method].append((r.metrics["cell_wall_s"], r.metrics["cell_start_s"], r.ended - r.started))

    print(f"\nCPU: {cpu_info().describe()}, {len(__import__('os').sched_getaffinity(0))} cores; tiny-model cell "
          f"({' '.join(TINY)})")
    print(f"warm process, runner.run of this cell: {ab.spread(works)}; first forkserver cell of a sweep, "
          f"including the server's start and imports (once per sweep): {first_s:.1f} s\n")
    print(f"| start method | cells | wall s (median) | start s | runner.run s | fixed s = wall - {warm_work:.2f} |")
    print("|---|---|---|---|---|---|")
    for method, vals in rows.items():
        if not vals:
            continue
        wall, start, work = (statistics.median(v[i] for v in vals) for i in range(3))
        # the range from the warm runs' min and max: a range reaching 0 is no fixed cost this run could measure
        lo, hi = wall - max(works), wall - min(works)
        fixed = f"{wall - warm_work:.2f} ({lo:.2f} to {hi:.2f}" + (", undecided because noisy)" if lo <= 0 else ")")
        print(f"| {method} | {len(vals)} | {wall:.2f} | {start:.2f} | {work:.2f} | {fixed} |")
    if rows.get("spawn") and rows["forkserver"]:  # cell i of each method ran side by side (alternated)
        walls = {m: [v[0] for v in vals] for m, vals in rows.items()}
        print(f"\nwall time per cell, {ab.ratio(walls, 'spawn', 'forkserver')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
