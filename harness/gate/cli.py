"""`python -m harness.gate`: options, the run (load, measure, check accuracy, decide) and the exit code.

    python -m harness.gate --baseline "<hydra overrides>" --candidate "<hydra overrides>"
    python -m harness.gate --baseline "<overrides>" --baseline-rev <git rev> --candidate "<overrides>"  # code
    make gate [BASE=<git rev>]   # CI: this checkout against a baseline revision on the smoke experiment

Exit codes: 0 pass, 1 regression, 2 error. Anything that makes a comparison impossible (a side that
fails to load or run, NaN, zero decode tokens, a metric missing on either side, a baseline file that
does not exist or was written for another config) is an error, never a pass. An undecided speed
comparison (the time budget ran out first) passes, and the summary says so.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import quiet_third_party
from harness.config import group_choice_problem
from harness.errors import QuantbenchError
from harness.gate import accuracy, interleave, report
from harness.gate.errors import ERROR, PASS, REGRESSION, GateError
from harness.gate.sides import make_side, self_comparison
from harness.gate.stats import REGRESSION as SPEED_REGRESSION
from harness.gate.stats import SpeedStats
from harness.interrupts import sigterm_interrupts
from harness.secret_uri import redact_overrides

log = logging.getLogger("quantbench")
DEFAULT = interleave.Plan()  # the speed defaults live in one place


@dataclass
class GateOptions:
    """Everything a gate run needs; validated before any work (one GateError listing every problem)."""

    baseline: list[str]
    candidate: list[str]
    baseline_rev: str = ""
    candidate_rev: str = ""
    threshold: float = DEFAULT.threshold
    block_steps: int = DEFAULT.block_steps
    min_blocks: int = DEFAULT.min_pairs
    max_blocks: int = DEFAULT.max_pairs
    budget_s: float = DEFAULT.budget_s
    resamples: int = DEFAULT.resamples
    seed: int = DEFAULT.seed
    confidence: float = DEFAULT.confidence
    accuracy_baseline: str = ""
    write_baseline: bool = False
    greedy_tokens: int = 0
    skip_speed: bool = False
    allow_same: bool = False  # an A/A noise check on purpose: the same code and config on both sides
    summary: str = ""
    output: str = ""
    mlflow: bool = True
    timeout_s: float = 900.0

    def plan(self) -> interleave.Plan:
        return interleave.Plan(block_steps=self.block_steps, min_pairs=self.min_blocks, max_pairs=self.max_blocks, budget_s=self.budget_s,
                               threshold=self.threshold, confidence=self.confidence, resamples=self.resamples,
                               seed=self.seed)

    def __post_init__(self) -> None:
        problems = self.plan().problems()
        if self.write_baseline and not self.accuracy_baseline:
            problems.append("--write-baseline needs --accuracy-baseline PATH (where to write it)")
        if self.greedy_tokens < 0:
            problems.append("--greedy-tokens must be >= 0 (0 = all tokens)")
        if self.skip_speed and not self.accuracy_baseline:  # PASS on nothing compared: a gate that cannot fail
            problems.append("--skip-speed needs --accuracy-baseline PATH: without speed and without an accuracy "
                            "baseline the gate checks nothing")
        if problems:
            raise GateError("; ".join(problems))


@dataclass
class GateResult:
    code: int
    verdict: str  # pass | regression | error
    options: dict
    speed: SpeedStats | None = None
    samples: dict = field(default_factory=dict)  # per-block tokens/s of each side, pairs in AB, BA, ... order
    accuracy: list[accuracy.Check] = field(default_factory=list)
    accuracy_metrics: dict = field(default_factory=dict)
    error: str = ""
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    wrote_baseline: str = ""


def together(sides: list, call) -> list:
    """`call(side)` for every side at once (a thread each: a side is a worker process behind a pipe); the
    results in `sides` order. A failure is raised after all have returned, the first side's first."""
    if len(sides) == 1:
        return [call(sides[0])]
    out: list = [None] * len(sides)
    errors: list = [None] * len(sides)

    done = [threading.Event() for _ in sides]  # not Thread.join: a join interrupted by a signal (3.11) can leave
    # the thread marked stopped, and a second join then returns at once while it still runs

    def one(i: int) -> None:
        try:
            out[i] = call(sides[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in side order
            errors[i] = exc
        finally:
            done[i].set()

    for i in range(len(sides)):
        threading.Thread(target=one, args=(i,), daemon=True).start()
    try:
        for d in done:
            d.wait()
    except BaseException:  # Ctrl-C or SIGTERM: stop the sides' work, let the threads end, then the caller cleans up
        for side in sides:  # (a thread still starting a side would make its worktree after that cleanup)
            side.stop()
        for d in done:
            d.wait()
        raise
    for exc in errors:
        if exc is not None:
            raise exc
    return out


def run_gate(opts: GateOptions) -> GateResult:
    """Measure, compare and decide. Never raises for a failed comparison: the result carries code 2.

    Both sides are worker processes (harness/gate/sides.py); the baseline is not started when only
    the candidate is needed (--write-baseline, --skip-speed).
    """
    t0 = time.perf_counter()
    # the record repeats the options (summary, JSON, MLflow): a password in an override is masked there too
    res = GateResult(code=ERROR, verdict="error", options={**asdict(opts), "baseline": redact_overrides(opts.baseline),
                                                           "candidate": redact_overrides(opts.candidate)})
    base = make_side("baseline", opts.baseline, opts.baseline_rev, opts.timeout_s)
    cand = make_side("candidate", opts.candidate, opts.candidate_rev, opts.timeout_s)
    sides = [cand] if (opts.write_baseline or opts.skip_speed) else [base, cand]
    try:
        data = {}
        if opts.accuracy_baseline and not opts.write_baseline:  # a missing or broken file: refused first
            data = accuracy.load_baseline(Path(opts.accuracy_baseline))
        for side in sides:  # git checks (revision, protocol): nothing started yet
            side.validate()
        if len(sides) == 2 and not opts.allow_same and (same := self_comparison(base, cand)):
            raise GateError(same)
        # both workers start and check their configs (each by its own code, before any model loads) at once,
        # then load at once: each is its own process, so their imports and loads overlap on the cores
        # instead of queueing (~4 s of a tiny-model gate on 2 cores); measuring starts after both are loaded
        configs = dict(zip([s.label for s in sides], together(sides, lambda side: (side.start(), side.check())[1]),
                           strict=True))
        if opts.write_baseline:
            res.info["candidate"] = cand.load()
            res.wrote_baseline = accuracy.write_baseline(Path(opts.accuracy_baseline), cand, res.info["candidate"])
            res.code, res.verdict = PASS, "pass"
            return res
        if opts.accuracy_baseline:  # a baseline file written for another config: refused before loading
            accuracy.check_baseline_config(configs["candidate"], data, Path(opts.accuracy_baseline))
        for side, info in zip(sides, together(sides, lambda side: side.load()), strict=True):
            res.info[side.label] = info
        if not opts.skip_speed:
            a, b, res.speed = interleave.measure_sequential(base, cand, opts.plan())
            res.samples = {"baseline": a, "candidate": b}
        if opts.accuracy_baseline:
            res.accuracy_metrics = cand.accuracy()
            res.accuracy = accuracy.compare_accuracy(res.accuracy_metrics, data, opts.greedy_tokens)
        failed = ((res.speed is not None and res.speed.verdict == SPEED_REGRESSION)
                  or any(not c.ok for c in res.accuracy))
        res.code, res.verdict = (REGRESSION, "regression") if failed else (PASS, "pass")
    except Exception as exc:  # noqa: BLE001 - any failure is exit 2 with one line, never a pass
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        res.error = text if isinstance(exc, QuantbenchError) else f"{type(exc).__name__}: {text}"
        res.code, res.verdict = ERROR, "error"
    finally:
        def close(side) -> None:
            try:
                side.close()
            except Exception as exc:  # noqa: BLE001 - cleanup must not hide the verdict
                log.warning("closing %s failed: %s", side.label, exc)

        together(sides, close)  # each worker's exit (~1.5 s of interpreter teardown) overlaps the other's
        res.seconds = time.perf_counter() - t0
    return res


def parse_args(argv: list[str] | None) -> GateOptions:
    ap = argparse.ArgumentParser(prog="python -m harness.gate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Exit codes: 0 pass, 1 regression, 2 error. Details: docs/gate.md")
    ap.add_argument("--baseline", default="", help="Hydra overrides of the baseline, in one string")
    ap.add_argument("--candidate", default=None, help="Hydra overrides of the candidate (default: the baseline's)")
    ap.add_argument("--candidate-rev", default="", help="measure the candidate with this git revision's code")
    ap.add_argument("--baseline-rev", default="", help="measure the baseline with this git revision's code")
    d = DEFAULT
    ap.add_argument("--threshold", type=float, default=d.threshold,
                    help=f"smallest tokens/s drop that fails (fraction; {d.threshold})")
    ap.add_argument("--block-steps", type=int, default=d.block_steps,
                    help=f"decode tokens per block, at least: whole generate calls ({d.block_steps})")
    ap.add_argument("--min-blocks", "--repetitions", dest="min_blocks", type=int, default=d.min_pairs,
                    help=f"blocks per side at the first look (even, >= 8; {d.min_pairs})")
    ap.add_argument("--max-blocks", type=int, default=d.max_pairs,
                    help=f"blocks per side at the last planned look ({d.max_pairs})")
    ap.add_argument("--budget", type=float, default=d.budget_s,
                    help=f"seconds of speed measuring, then a last look ({d.budget_s:g})")
    ap.add_argument("--resamples", type=int, default=d.resamples, help=f"bootstrap resamples ({d.resamples})")
    ap.add_argument("--seed", type=int, default=d.seed, help="bootstrap seed")
    ap.add_argument("--confidence", type=float, default=d.confidence,
                    help=f"overall one-sided confidence over all looks ({d.confidence})")
    ap.add_argument("--accuracy-baseline", default="", help="committed baseline file results/baselines/<name>.json")
    ap.add_argument("--write-baseline", action="store_true", help="write the candidate's metrics to that file")
    ap.add_argument("--greedy-tokens", type=int, default=0, help="compare only the first N greedy tokens (0=all)")
    ap.add_argument("--skip-speed", action="store_true", help="accuracy check only")
    ap.add_argument("--allow-same", action="store_true",
                    help="allow the same code and config on both sides (an A/A noise check; refused otherwise: "
                         "such a gate cannot fail)")
    ap.add_argument("--summary", default="", help="also write the markdown summary here")
    ap.add_argument("--output", default="", help="gate JSON record (default: <results_dir>/gate/...)")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the comparison to MLflow")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a side's worker may take per request")
    args = ap.parse_args(argv)
    baseline = _split("--baseline", args.baseline)
    candidate = baseline if args.candidate is None else _split("--candidate", args.candidate)
    if args.candidate is None and not (args.candidate_rev or args.write_baseline or args.skip_speed):
        raise GateError("give --candidate \"<overrides>\" and/or --candidate-rev <git rev>")
    for side, overrides, rev in (("baseline", baseline, args.baseline_rev), ("candidate", candidate, args.candidate_rev)):
        if not rev and (problem := group_choice_problem(overrides)):  # a revision's options: its worker checks
            raise GateError(f"{side} (this checkout): {problem}")
    return GateOptions(baseline=baseline, candidate=candidate, baseline_rev=args.baseline_rev,
                       candidate_rev=args.candidate_rev, threshold=args.threshold, block_steps=args.block_steps,
                       min_blocks=args.min_blocks, max_blocks=args.max_blocks,
                       budget_s=args.budget, resamples=args.resamples, seed=args.seed, confidence=args.confidence,
                       accuracy_baseline=args.accuracy_baseline, write_baseline=args.write_baseline,
                       greedy_tokens=args.greedy_tokens, skip_speed=args.skip_speed, allow_same=args.allow_same,
                       summary=args.summary,
                       output=args.output, mlflow=not args.no_mlflow, timeout_s=args.timeout)


def _split(flag: str, text: str) -> list[str]:
    """A side's overrides as the shell would split them; a bad quote is an error (2), not Python's exit 1, which
    reads as "regression"."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise GateError(f"{flag} {text!r}: {exc} (quote each override as a shell would)") from exc


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party()
    try:
        opts = parse_args(argv)
    except GateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ERROR
    previous = sigterm_interrupts()  # SIGTERM (a CI job cancelled or timed out): Ctrl-C's stop, so run_gate's
    try:  # `finally` stops the workers and removes the revision worktrees (git's list keeps no stale entry)
        res = run_gate(opts)
    except KeyboardInterrupt as exc:
        print(f"error: the gate was stopped ({getattr(exc, 'signame', 'SIGINT')}) before a verdict; its workers and "
              "worktrees are removed", file=sys.stderr)
        return ERROR
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    markdown = report.summary_markdown(res)
    report.emit(markdown, opts.summary)
    try:
        where = report.record(res, opts, markdown)
        print(f"gate record: {where}")
    except Exception as exc:  # noqa: BLE001 - the verdict stands without the record
        print(f"warning: could not record the gate result: {exc}", file=sys.stderr)
    if res.error:
        print(f"error: {res.error}", file=sys.stderr)
    return res.code
