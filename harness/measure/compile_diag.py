"""What a compile did to a run's decode step, recorded as tags: dynamo's graph breaks and the graphs inductor kept
out of CUDA graphs. Both are the first suspects when a compiled format is slower than its bytes say (issue #29:
on the H200, int8 and int4 compiled with reduce-overhead ran at 0.69x and 0.78x of fp16), and neither shows in
the timing itself. harness/run/engines.py snapshots them around the compile warmup (harness/measure/fast_path.py).
"""

from __future__ import annotations

import logging
from typing import Any

# torch._dynamo is imported where used: the counters live there, and importing it costs ~1 s (tests/test_layout.py).


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason (a snapshot: compare two)."""
    from torch._dynamo.utils import counters

    return {str(k): int(v) for k, v in counters["graph_break"].items()}


def graph_break_tags(before: dict[str, int], after: dict[str, int]) -> dict[str, str]:
    """Tags `compile.graph_breaks` (count while this run compiled) and `compile.graph_break` (the most frequent
    reason). Why: each break splits the step into more graphs, and under CUDA graphs every piece is a separate
    replay with eager code between them, so a quantized format whose tensor subclass breaks the graph pays
    launch time per layer: the first suspect when a compiled format is slower than its bytes say."""
    new = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
    tags = {"compile.graph_breaks": str(sum(new.values()))}
    if new:
        reason, n = max(new.items(), key=lambda kv: kv[1])
        tags["compile.graph_break"] = f"{n}x {(reason.strip().splitlines() or [''])[0][:200]}"
    return tags


CUDAGRAPH_LOG = "torch._inductor.cudagraph_utils.__cudagraphs"  # where inductor says "skipping cudagraphs due to ..."


class CudagraphSkips(logging.Handler):
    """While a run compiles: how many compiled graphs inductor kept out of CUDA graphs, and why.

    Why it matters: under `reduce-overhead` a graph that inductor will not capture (a CPU tensor in the step,
    a mutated input, an op it marks incompatible) still runs compiled, but with every kernel launched from
    the host at every step: the launch-bound regime the mode exists to remove. A format that lands there
    reads slower than its bytes say (the H200's int8 and int4 rows at 7.9-8.8 ms/token against fp16's 6.1
    are in that range), and nothing else in the record would say so. Tags `compile.cudagraph_skips` and
    `compile.cudagraph_skip` (the first reason), on CUDA only (on CPU every graph is "skipped"). The same logger
    also warns when a function was recorded for too many input sizes: not a skip, but re-recording costs too,
    so the first such warning is tagged apart, `compile.cudagraph_warning`.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []  # "skipping cudagraph(s) due to ...": a graph left out
        self.warnings: list[str] = []  # anything else the logger says (distinct input sizes recorded)
        self.before = self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(record.getMessage().split())[:300]
        (self.reasons if text.startswith("skipping cudagraph") else self.warnings).append(text)

    def __enter__(self) -> CudagraphSkips:
        from torch._dynamo.utils import counters

        self.before = int(counters["inductor"]["cudagraph_skips"])
        logging.getLogger(CUDAGRAPH_LOG).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch._dynamo.utils import counters

        logging.getLogger(CUDAGRAPH_LOG).removeHandler(self)
        self.count = int(counters["inductor"]["cudagraph_skips"]) - self.before

    def tags(self) -> dict[str, str]:
        out = {"compile.cudagraph_skips": str(self.count)}
        if self.reasons:
            out["compile.cudagraph_skip"] = self.reasons[0]
        if self.warnings:
            out["compile.cudagraph_warning"] = self.warnings[0]
        return out
