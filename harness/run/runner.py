"""One experiment in, one Result out: `run(cfg) -> Result`.

`run` never raises for a failed experiment: it returns a Result whose `status` says what happened
(OK, FAILED, OOM) with the error message and traceback, so a sweep records it and goes on. SKIPPED
means the run cannot run on this machine (errors.Unsupported from a preflight check, e.g. "needs
CUDA"): nothing loaded, the reason is the one-line `error`, and a sweep counts it as a success. Seeds and
thread counts are set inside `run`, which touches no other process-wide state, so a sweep can call it
in a child process per cell. Ctrl-C (or SIGTERM, where the caller turned it into a KeyboardInterrupt:
harness/cli.py) is not a failure: `run` re-raises it, carrying the run as it stood (`exc.result`, status
KILLED) for the caller to record.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from harness import env, measure
from harness.config import Experiment, build, to_plain
from harness.errors import QuantbenchError, Unsupported
from harness.load.run import LoadFailed, LoadRun, ran_tags
from harness.run.hooks import Outcome
from harness.run.pipeline import Pipeline, run_name
from harness.run.result import Result, config_hash

log = logging.getLogger("quantbench")


def execute(exp: Experiment) -> Result:
    """Run a validated experiment through the pipeline (harness/run/pipeline.py). Raises on failure (use `run`
    for the never-raising wrapper)."""
    m = exp.measure
    device = measure.resolve_device(m.device)
    if exp.load.enabled:  # serving load: open-loop arrivals against a target (harness/load/)
        load = LoadRun(exp, device)
        try:
            outcome, threads = load.run(), load.threads
        except KeyboardInterrupt as exc:  # the rates it finished, summarized (LoadRun.run), are kept
            exc.phase = "the serving load run"
            if load.threads:  # it got past the preflight, as a pipeline's partial result below
                exc.partial = _result(exp, device, load.threads, load.outcome(), "KILLED")
            raise
    else:
        pipe = Pipeline(exp, device)
        try:
            outcome = pipe.run()  # preflight (files, libraries, device, corpus, memory) first: nothing loads before it
        except KeyboardInterrupt as exc:  # where it stopped, and the metrics of the phases it finished (`killed`)
            exc.phase = pipe.phase
            if pipe.threads:  # it got past the preflight (nothing measured before that)
                exc.partial = _result(exp, device, pipe.threads, Outcome(metrics=pipe.metrics, tags=pipe.tags,
                                                                         samples=[]), "KILLED")
            raise
        threads = pipe.threads
    return _result(exp, device, threads, outcome)


def _result(exp: Experiment, device: str, threads: int, outcome: Any, status: str = "OK") -> Result:
    m = exp.measure
    tags = {**env.machine_tags(device, threads), **exp.model.tags(), **outcome.tags}
    tags.update({"measure.cache": m.cache, "measure.compile": str(m.compile).lower(),
                 "stop_at_eos": str(m.stop_at_eos).lower()})
    tags.update(identity_tags(exp))
    metrics = {k: float(v) for k, v in outcome.metrics.items() if isinstance(v, (int, float))}
    return Result(status=status, config=exp.config, metrics=metrics, tags=tags, samples=outcome.samples,
                  children=outcome.children)


def identity_tags(exp: Experiment) -> dict[str, str]:
    """What a run measured, named as its objects name themselves (strategy.name "Greedy", not the option name
    "greedy"): the same tags on an OK run and on a failed, timed-out or crashed one (harness/sweep/cell.py), so a
    report table or an MLflow column holds one spelling of each."""
    tags = {"quantizer.backend": getattr(exp.quantizer, "backend", ""), "quantizer.name": exp.quantizer.name,
            "strategy.name": exp.strategy.name, "model.name": exp.model.name, "engine": exp.engine.name}
    if exp.load.enabled:  # the target's own scheduler ran, not the strategy or decode path of the config
        tags.update(ran_tags(exp))
    return tags


def classify(exc: BaseException) -> str:
    import torch

    if isinstance(exc, Unsupported):
        return "SKIPPED"
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return "OOM"
    return "FAILED"


def killed(exp: Experiment | None, config: dict, exc: KeyboardInterrupt) -> Result:
    """The KILLED result of a run stopped by Ctrl-C or SIGTERM: the error names the signal and the phase it stopped
    (when known), the metrics are those of the phases it finished (`execute`), none when it stopped earlier."""
    signame = getattr(exc, "signame", "SIGINT")  # harness.interrupts.Interrupted: SIGTERM
    phase = getattr(exc, "phase", "")
    result = getattr(exc, "partial", None) or Result(status="KILLED", config=config, tags={
        **env.failure_tags(exp), **(identity_tags(exp) if exp is not None else {})})
    result.error = (f"interrupted ({'SIGINT, Ctrl-C' if signame == 'SIGINT' else signame})"
                    + (f" during {phase}" if phase else ""))
    return result


def run(cfg: Any) -> Result:
    """Build, validate and execute one experiment; never raises for a failed run. A KeyboardInterrupt (Ctrl-C,
    SIGTERM) is re-raised with `exc.result`, the run recorded KILLED as it stood (`killed`)."""
    started = time.time()
    config = to_plain(cfg)
    config.pop("hydra", None)
    exp = None
    try:
        exp = build(config)
        with measure.own_heap():  # its collections between phases scan what the run made, not every module
            result = execute(exp)
    except KeyboardInterrupt as exc:
        exc.result = _finish(killed(exp, config, exc), exp, config, started)
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded FAILED/OOM run
        status = classify(exc)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if status == "OOM":
            message = (f"out of memory: {message}; use a smaller model, batch or context, or a lower-bit "
                       "quantizer")
        if not isinstance(exc, QuantbenchError):
            message = f"{type(exc).__name__}: {message}"
        if status == "SKIPPED":
            log.warning("run skipped: %s", message)
        else:
            log.error("run failed: %s", message)
        if isinstance(exc, LoadFailed) and exp is not None:  # the rates answered before the target died are kept
            device = measure.resolve_device(exp.measure.device)
            result = _result(exp, device, exc.threads, exc.outcome, status)
            result.error, result.traceback = message, traceback.format_exc()
        else:
            result = Result(status=status, config=config, error=message,
                            traceback="" if status == "SKIPPED" else traceback.format_exc(),
                            tags={**env.failure_tags(exp), **(identity_tags(exp) if exp is not None else {})})
    return _finish(result, exp, config, started)


def _finish(result: Result, exp: Experiment | None, config: dict, started: float) -> Result:
    """Name, hash, status tags and times of a result `run` returns (or attaches to an interruption)."""
    result.run_name = run_name(exp, config)
    result.config_hash = config_hash(config)
    result.tags.update({"config_hash": result.config_hash, "status": result.status})
    if result.error:
        result.tags["error"] = result.error  # MLflow holds it cut, marked (records/mlflow_runs.tag_value)
    result.started, result.ended = started, time.time()
    return result
