"""Open and close a sweep in the launching process: folder lock, MLflow parent run, report, exit code.

`start_sweep` runs once before the first cell (SweepCallback.on_multirun_start), `finish_sweep` once
after the last (on_multirun_end) or on an interruption (`abort`). The exit code run.py returns after a
multirun is set here (`exit_code`): non-zero when any cell was not OK, or when none was OK.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import env
from harness.config import TrackingConfig
from harness.errors import QuantbenchError
from harness.records import report, sweep_runs, sweeps
from harness.records.mlflow_runs import client, experiment_id, retry
from harness.records.results import invocation_cells, read_json, reported_jobs, sweep_baseline
from harness.records.tracking import UPLOAD
from harness.run.result import SUCCESS
from harness.sweep import drift, progress, resume
from harness.sweep.isolated import warm_up
from harness.sweep.settings import (
    DEFAULT_NAME,
    STATE_ENV,
    SweepState,
    owner_alive,
    owner_id,
    plain_without_hydra,
    planned_cells,
    settings_from,
    sweep_folder,
    varying_keys,
)

log = logging.getLogger("quantbench")

# In-process state of the launching process only (harness/sweep/__init__.py): its exit code, the sweep it
# opened and has not closed (for abort()), and that sweep's folder lock (resume.hold_folder).
_EXIT = {"code": 0}
_OPEN: dict[str, SweepState] = {}
_HELD: dict[str, resume.FolderLock] = {}


# ---------------------------------------------------------------------------------------------- mlflow
def mark_stale(tcfg: TrackingConfig) -> list[str]:
    """End as KILLED every RUNNING run of the experiment whose owning sweep process is gone."""
    c = client(tcfg)
    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    runs = retry(lambda: c.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=5000),
                 tcfg, "mlflow search_runs")
    killed = []
    for run in runs:
        owner = run.data.tags.get("quantbench.owner", "")
        if not owner or owner_alive(owner) is not False:
            continue  # not ours, still running, or on another host
        c.set_tag(run.info.run_id, "status", "KILLED")
        c.set_tag(run.info.run_id, "error", f"sweep process {owner} ended without closing this run "
                                            "(interrupted or killed); marked KILLED on the next start")
        c.set_terminated(run.info.run_id, status="KILLED")
        killed.append(run.info.run_id)
    return killed


def open_parent_run(state: SweepState, previous: str) -> str:
    """Re-open the sweep's previous parent run (resume keeps one run per sweep) or create one."""
    tags = sweep_runs.parent_tags(state.name, state.invocation, state.commit, state.owner,
                                  state.sweep.get("label", ""))
    return sweep_runs.open_parent(state.tcfg, tags, [previous])


def close_parent_run(state: SweepState, status: str, summary: str, artifacts: list[Path],
                     probes: list[dict] | None = None) -> bool:
    """Log the report files (and the drift probe) to the parent run and end it with the sweep's status (best
    effort: False when MLflow refused; `upload` closes it later from sweep.json)."""
    if not state.parent_run_id or not state.tcfg.enabled:
        return False
    return sweep_runs.close_parent(state.tcfg, state.parent_run_id, status, summary, artifacts, probes,
                                   state.invocation)


# ----------------------------------------------------------------------------------------------- sweep
def start_sweep(config_with_hydra: Any) -> SweepState:
    """Open a sweep (the callback's on_multirun_start). Raises ConfigError for bad settings."""
    config = plain_without_hydra(config_with_hydra)
    hydra_cfg = config_with_hydra.hydra if "hydra" in config_with_hydra else None
    settings = settings_from(config)
    tcfg = TrackingConfig(**(config.get("tracking") or {}))
    folder = sweep_folder(config)
    name = config.get("name") or DEFAULT_NAME
    try:  # one sweep per folder at a time: a second would run the same cells again (resume.py)
        _HELD["lock"] = resume.hold_folder(folder, name)
    except OSError as exc:
        raise QuantbenchError(f"cannot use the sweep folder {folder}: {exc.strerror or exc}") from None
    if (partial := resume.remove_partial_writes(folder)):  # a killed sweep's unfinished writes
        log.warning("removed %d unfinished result write(s) a killed sweep left in %s (temporary files, never "
                    "results)", len(partial), folder)
    warm_up(settings)  # the forkserver imports torch & co. while the sweep opens its MLflow run
    cells = None
    if hydra_cfg is not None:
        try:
            cells = planned_cells(hydra_cfg)
        except Exception as exc:  # noqa: BLE001 - only the progress total and cell names depend on it
            log.warning("could not list the sweep's cells in advance: %s", exc)
    old = read_json(folder / "sweep.json") or {}
    state = SweepState(name=name, folder=str(folder),
                       invocation=f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}", commit=env.git_commit(),
                       owner=owner_id(), tracking=asdict(tcfg), planned=len(cells or []),
                       varying=varying_keys(cells) if cells else (), started=time.time(),
                       code=resume.code_version(), sweep=asdict(settings))
    if tcfg.enabled:
        try:
            stale = mark_stale(tcfg)
            if stale:
                log.warning("marked %d stale run(s) KILLED (a sweep was interrupted): %s", len(stale),
                            ", ".join(stale))
            state.parent_run_id = open_parent_run(state, old.get("parent_run_id", ""))
        except Exception as exc:  # noqa: BLE001 - cells still write their JSON; upload later
            state.earlier_parent_run_id = old.get("parent_run_id") or old.get("earlier_parent_run_id", "")
            log.error("MLflow unavailable for the sweep's parent run (%s: %s); cells keep their JSON",
                      type(exc).__name__, str(exc)[:300])
    try:
        state.save()
    except OSError as exc:
        raise QuantbenchError(f"cannot write {folder}/sweep.json ({exc.strerror or exc}): free space in "
                              f"{folder.parent} or set tracking.results_dir") from None
    _OPEN["state"] = state
    os.environ[STATE_ENV] = str(Path(state.folder).resolve() / "sweep.json")
    _EXIT["code"] = 0
    progress.start(state.planned, state.name)
    print(f"sweep {state.name}: {state.planned or '?'} cell(s) -> {folder}/  (MLflow parent run "
          f"{state.parent_run_id or '-'})", flush=True)
    return state


def finish_sweep(state: SweepState, interrupted: bool = False, probe: bool = True) -> int:
    """Close a sweep (on_multirun_end, or an interruption): drift probe, report, parent run, exit code."""
    progress.stop()
    folder = Path(state.folder)
    cells = invocation_cells(folder, state.invocation)
    probes: list[dict] = []
    if not interrupted and probe:  # an interruption during the probes comes back here through abort() (_OPEN set)
        probes = drift.run_probes(cells, sweep_baseline(cells, state.sweep), settings_from({"sweep": state.sweep}),
                                  folder, state.invocation)
    _OPEN.pop("state", None)
    # jobs, not distinct cells: two jobs of one config hash (a sweep of sweep.* keys) share one result
    missing = max(0, state.planned - reported_jobs(folder, state.invocation)) if not interrupted else 0
    unreported = sweeps.unreported(folder, state.invocation, missing)  # in report.md too, as NOT REPORTED
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.get("status", "?")] = counts.get(c.get("status", "?"), 0) + 1
    bad = sum(v for k, v in counts.items() if k not in SUCCESS) + missing  # SKIPPED: cannot run here, not a failure
    nothing = not interrupted and not counts.get("OK")  # all SKIPPED (or none recorded): nothing was measured
    status = "KILLED" if interrupted else ("OK" if bad == 0 and not nothing else "FAILED")
    paths: list[Path] = []
    try:
        paths = report.write_report(folder, cells + unreported, baseline=sweep_baseline(cells, state.sweep),
                                    title=f"sweep {state.name}", probes=probes)
    except Exception as exc:  # noqa: BLE001 - a report problem must not hide the sweep's outcome
        log.error("could not write the sweep report: %s", exc)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no cells"
    if missing:
        summary += f", {missing} never reported (the job died, or could not write its result)"
    state.parent_closed = close_parent_run(state, status, summary, paths, probes)
    state.status, state.summary, state.reports = status, summary, [str(p) for p in paths]
    try:  # how it ended, for `upload` when MLflow missed the end (harness/records/sweep_runs.py)
        state.save()
    except OSError as exc:
        log.error("could not record the sweep's end in %s/sweep.json: %s", folder, exc.strerror or exc)
    _EXIT["code"] = 1 if bad or interrupted or nothing else 0
    lock = _HELD.pop("lock", None)
    if lock is not None:
        lock.release()
    where = paths[0] if paths else folder
    print(f"sweep {state.name}: {len(cells)} cell(s): {summary}; report: {where}", flush=True)
    for c in cells + unreported:  # every cell that is not OK (failed, skipped, never reported), with its reason
        if c.get("status") != "OK":
            print(f"  [{c.get('status')}] {c.get('tags', {}).get('sweep.cell', c.get('run_name'))}: "
                  f"{c.get('error', '')}", flush=True)
    unsent = [c for c in cells if c.get("tags", {}).get("tracking_error") and not c.get("mlflow_run_id")]
    if unsent and state.tcfg.enabled:
        uri = state.tcfg.resolved_uri()
        print(f"sweep {state.name}: {len(unsent)} cell(s) not in MLflow (logging to {uri} failed); their results are "
              f"in {folder}/cells; re-send with: {UPLOAD} {folder} --uri {uri}", flush=True)
    if nothing:  # all SKIPPED: "nothing ran"; with failures among them the lines above say what failed
        print(f"sweep {state.name}: {'no cell ran OK' if bad else 'nothing ran'}: {why_nothing(cells)}; exit 1",
              flush=True)
    return _EXIT["code"]


def why_nothing(cells: list[dict]) -> str:
    """'all 2 cell(s) SKIPPED (needs CUDA: ...)': why a sweep measured nothing, in one line."""
    if not cells:
        return "no cell recorded a result"
    statuses = sorted({str(c.get("status")) for c in cells})
    reasons = list(dict.fromkeys(str(c.get("error") or "") for c in cells if c.get("error")))
    what = f"all {len(cells)} cell(s) {statuses[0]}" if len(statuses) == 1 else \
        f"no cell OK ({', '.join(statuses)})"
    shown = " | ".join(reasons[:3]) + (f" | {len(reasons) - 3} more reasons" if len(reasons) > 3 else "")
    return what + (f" ({shown})" if shown else "")


def launcher_failed(exc: Exception) -> str | None:
    """After an error raised out of Hydra's sweep (the callback's on_multirun_end never ran): close the open sweep
    as it stands (report and sweep.json; no drift probe; cells not recorded count as never reported, status FAILED).
    Returns one line when the launcher gave up on a job (submitit's UncompletedJobError at its job limit), None for
    another error (the caller re-raises it) or when no sweep is open."""
    state = _OPEN.get("state")
    if state is None:
        return None
    finish_sweep(state, probe=False)
    if not type(exc).__module__.startswith("submitit"):
        return None
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return (f"the launcher stopped the sweep ({type(exc).__name__}: {first}); the sweep was closed with the cells "
            "recorded so far, and jobs still running go on recording theirs: rerun the sweep to resume (raise "
            "hydra.launcher.timeout_min if a job hit it)")


def abort() -> None:
    """After Ctrl-C/SIGTERM in the launching process: close the open sweep as KILLED (no run left RUNNING)."""
    state = _OPEN.get("state")
    if state is not None:
        finish_sweep(state, interrupted=True)


def exit_code() -> int:
    """What run.py exits with after a multirun: 1 when any cell was not OK, or no cell was OK."""
    return _EXIT["code"]

