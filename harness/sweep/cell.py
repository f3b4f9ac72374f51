"""One Hydra job of a sweep: resume-or-run the cell in isolation, record it, never raise for a failed cell.

`run_cell(cfg)` never loads a model itself: it validates the cell, reuses an OK result for the same
config hash and resume key (harness/sweep/resume.py), else runs it in a child process
(harness/sweep/isolated.py), then writes `results/<sweep>/cells/<hash>.json` and a nested MLflow run
under the sweep's parent run (harness/records/).
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from harness import env
from harness.config import TrackingConfig, build, to_plain
from harness.errors import QuantbenchError, Unsupported
from harness.measure import resolve_device
from harness.records import tracking
from harness.records.mlflow_runs import client
from harness.records.results import WRITE_ERROR_TAG, cell_path, read_json, summary_line, write_json_atomic
from harness.run.result import SUCCESS, Result, config_hash
from harness.run.runner import identity_tags
from harness.sweep import progress, resume
from harness.sweep.isolated import fault_for, finish, measuring_turn, run_isolated
from harness.sweep.launchers import LOCAL_LAUNCHERS, launcher_name
from harness.sweep.settings import (
    DEFAULT_NAME,
    SweepState,
    cell_label,
    find_state,
    owner_id,
    settings_from,
    sweep_folder,
)

log = logging.getLogger("quantbench")


def append_manifest(state: SweepState, chash: str, label: str) -> None:
    """Add this cell to the sweep's manifest (which invocation launched which config hash, under what name)."""
    line = json.dumps({"invocation": state.invocation, "hash": chash, "label": label}) + "\n"
    path = Path(state.folder) / "manifest.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())  # one small O_APPEND write: atomic between concurrent jobs
        finally:
            os.close(fd)
    except OSError as exc:  # disk full: the cell still runs; the report will miss it and say so
        log.error("could not add cell %s to %s (%s); the report will count it as never reported", label, path,
                  exc.strerror or exc)


def distinct_label(folder: Path, label: str, chash: str) -> str:
    """`label`, or `label #<hash>` when the sweep's manifest already gives that name to another config (two
    invocations that vary different keys both name a cell `quantizer=none`): names under one parent stay apart."""
    try:
        lines = (Path(folder) / "manifest.jsonl").read_text().splitlines()
    except OSError:
        return label
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("label") == label and entry.get("hash") != chash:
            return f"{label} #{chash[:7]}"
    return label


def _hydra_job() -> tuple[list[str], dict, str]:
    try:
        hc = HydraConfig.get()
        return list(hc.overrides.task), dict(hc.runtime.choices), launcher_name(hc.launcher)
    except ValueError:  # not under Hydra (a test calling run_cell directly)
        return [], {}, ""


def run_cell(cfg: Any) -> int:
    """One Hydra job of a sweep: resume-or-run the cell in isolation and record it. Returns 0 if OK.

    Cells on this machine (a local launcher, or an unknown one: a direct call) take turns for the whole cell, its
    preflight and its MLflow record included, not only its child's timing: a submitit_local job recording its
    cell must not load the cores under the next cell's timing (harness/sweep/isolated.py `measuring_turn`)."""
    overrides, choices, launcher = _hydra_job()
    with measuring_turn(launcher in LOCAL_LAUNCHERS + ("",)):
        return _run_cell(cfg, overrides, choices, launcher)


def _run_cell(cfg: Any, overrides: list[str], choices: dict, launcher: str) -> int:
    config = to_plain(cfg)
    config.pop("hydra", None)
    state = find_state(config)
    if state is None:  # no callback ran (hydra.callbacks cleared): a standalone sweep without parent run
        folder = sweep_folder(config)
        state = SweepState(name=config.get("name") or DEFAULT_NAME, folder=str(folder), invocation="standalone",
                           commit=env.git_commit(), owner=owner_id(), tracking=dict(config.get("tracking") or {}),
                           code=resume.code_version())
        log.warning("no sweep state found (is harness.sweep.callback.SweepCallback in hydra.callbacks?); cells "
                    "are recorded without an MLflow parent run")
    chash = config_hash(config)
    label = distinct_label(Path(state.folder), cell_label(overrides, state.varying, state.planned > 0), chash)
    path = cell_path(Path(state.folder), chash)
    append_manifest(state, chash, label)
    tcfg = state.tcfg
    previous = read_json(path)
    key: dict[str, str] = {}
    rerun_why = ""
    exp = None  # the built experiment, once its config has passed

    try:
        settings = settings_from(config)
        exp = build(config)  # a config error fails the cell here, in a second, with no child at all
        exp.model.preflight()
        device = resolve_device(exp.measure.device)
        exp.quantizer.preflight(device)  # "needs CUDA" here: SKIPPED, no child started
        exp.strategy.preflight()  # a draft's quantizer too (its library is part of the key)
        side = exp.strategy.side_model()
        key = resume.cell_key(state.code, exp.quantizer, exp.engine.name,  # code, CPU (GPU), threads, libraries
                              exp.measure.threads, side[1] if side else None, device.startswith("cuda"))
        if settings.resume and previous and previous.get("status") == "OK":
            why = resume.differences(previous.get("tags") or {}, key)
            if not why:
                _reuse(previous, path, state, label, chash, key)
                return 0
            rerun_why = "; ".join(why)
            progress.say(f"[rerun] {label}: the OK result for config {chash} is not reused: {rerun_why}")
        result = run_isolated(config, settings, fault_for(config), exclusive=False)  # the turn is run_cell's
    except QuantbenchError as exc:
        skipped = isinstance(exc, Unsupported)  # cannot run on this machine: recorded SKIPPED, the sweep goes on
        result = finish(Result(status="SKIPPED" if skipped else "FAILED", config=config, error=str(exc),
                               traceback="" if skipped else traceback.format_exc(),
                               tags=env.failure_tags(exp)), config, time.time())
    except Exception as exc:  # noqa: BLE001 - a bug in a preflight must not lose the cell (nor stop the sweep)
        why = f"{type(exc).__name__}: {exc}"
        if type(exc).__module__.startswith("submitit"):  # its signal before the job limit, raised in this job
            why += " (the launcher's job limit ended the cell: raise hydra.launcher.timeout_min)"
        result = finish(Result(status="FAILED", config=config, error=why,
                               traceback=traceback.format_exc(), tags=env.failure_tags(exp)), config, time.time())
    except KeyboardInterrupt as exc:
        result = finish(Result(status="KILLED", config=config,
                               error=f"sweep interrupted ({getattr(exc, 'signame', 'SIGINT')}) while this cell ran"),
                        config, time.time())
        record_cell(named(result, exp), path, state, label, choices, previous, tcfg)
        progress.say(summary_line(result))
        raise  # run.py catches it, calls abort() (report + parent run KILLED) and exits 130/143
    named(result, exp)
    if key:
        result.tags[resume.KEY_TAG] = json.dumps(key)
    if launcher:
        result.tags["sweep.launcher"] = launcher
    if rerun_why:
        result.tags[resume.RERUN_TAG] = rerun_why
    written = record_cell(result, path, state, label, choices, previous, tcfg)
    progress.say(summary_line(result))
    progress.tick(result.status)
    if written != path:  # disk full (or read-only): the numbers are elsewhere; this cell is not in the folder
        why = result.tags.get(WRITE_ERROR_TAG, "?").rsplit(": ", 1)[-1]
        progress.say(f"  [{result.status}] {label}: result NOT written to {path} ({why}); "
                     + (f"kept in {written}: once there is space, cp {written} {path} (a resumed sweep then reuses "
                        "it)" if written else "printed above as a RESULT line: save it as that file once there is "
                        "space"))
        return 1
    return 0 if result.status in SUCCESS else 1


def named(result: Result, exp: Any) -> Result:
    """`result` naming what it ran as an OK cell does (strategy.name "Greedy", not choice.strategy's "greedy"),
    also when the child sent no result (TIMEOUT, CRASHED, KILLED) or the cell failed before it started one."""
    if exp is not None:  # None: the config itself was refused; nothing was built to name
        for tag, value in identity_tags(exp).items():
            result.tags.setdefault(tag, value)
    return result


def _cell_tags(result: Result, state: SweepState, label: str, choices: dict) -> None:
    result.tags.setdefault("git_commit", state.commit)
    result.tags["status"] = result.status  # the MLflow tag `status` always equals the JSON's
    result.tags.update({"quantbench.role": "cell", "quantbench.sweep": state.name, "quantbench.owner": state.owner,
                        "quantbench.invocation": state.invocation, "sweep.cell": label,
                        "sweep.parent_run_id": state.parent_run_id})
    for group in ("model", "quantizer", "strategy", "engine"):
        if choices.get(group):
            result.tags[f"choice.{group}"] = str(choices[group])


def record_cell(result: Result, path: Path, state: SweepState, label: str, choices: dict, previous: dict | None,
                tcfg: TrackingConfig) -> Path | None:
    """Record a cell (JSON, then MLflow); returns the file holding it (not `path` when the disk was full)."""
    result.run_name = label
    _cell_tags(result, state, label, choices)
    written: Path | None = tracking.record(result, tcfg, path=path, parent_run_id=state.parent_run_id or None)
    if WRITE_ERROR_TAG in result.tags and written == path:
        written = None  # not at `path`, and nowhere else either: the result was printed (RESULT line)
    old = (previous or {}).get("mlflow_run_id")
    if old and old != result.mlflow_run_id and tcfg.enabled:
        try:  # the rerun replaces it; the old run stays for history, marked so the UI can filter it
            client(tcfg).set_tag(old, "superseded_by", result.mlflow_run_id or "rerun")
        except Exception:  # noqa: BLE001
            pass
    return written


def _reuse(previous: dict, path: Path, state: SweepState, label: str, chash: str, key: dict[str, str]) -> None:
    """Keep a done cell: say why on the terminal and in tag `resume.reused` (JSON; MLflow best effort)."""
    why = resume.describe(key)
    previous.setdefault("tags", {})[resume.REUSED_TAG] = f"{state.invocation}: {why}"
    previous["tags"]["sweep.cell"] = label  # this invocation's name (quantizer=none, not an earlier run's default)
    if not _relink(previous, path, state):
        try:
            write_json_atomic(path, previous)
        except OSError as exc:  # the stored result is intact; only the note is missing
            log.warning("could not note the reuse in %s: %s", path, exc)
        if state.tcfg.enabled and previous.get("mlflow_run_id"):
            try:
                c = client(state.tcfg)
                for tag in (resume.REUSED_TAG, "sweep.cell"):
                    c.set_tag(previous["mlflow_run_id"], tag, previous["tags"][tag])
            except Exception:  # noqa: BLE001 - a note only; the JSON has it
                pass
    progress.say(f"[skip] {label}: reusing the OK result for config {chash} ({why}): {path}")
    progress.tick("resumed")  # a resumed OK cell (not status SKIPPED: that one cannot run here)


def _relink(previous: dict, path: Path, state: SweepState) -> bool:
    """A reused cell belongs to this sweep's parent run too: log a copy if its run hangs elsewhere (True)."""
    if not state.parent_run_id or previous.get("tags", {}).get("sweep.parent_run_id") == state.parent_run_id:
        return False
    result = Result.from_dict(previous)
    result.tags["resumed_from"] = previous.get("mlflow_run_id", "")
    result.tags["sweep.parent_run_id"] = state.parent_run_id
    tracking.record(result, state.tcfg, path=path, parent_run_id=state.parent_run_id)
    return True
