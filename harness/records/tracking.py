"""Recording: the result JSON first (atomic), then MLflow; and re-sending what never reached MLflow.

The JSON is the source of truth (harness/records/results.py): it is written before MLflow is contacted,
so a run whose tracking server is down still leaves its numbers, and

    python -m harness.records.tracking upload results/ --uri <store>

sends such files later (only to the store named on its command line, never to one a result file names).
MLflow runs are created after the work, in one go, with bounded retries (harness/records/mlflow_runs.py);
when the retries run out the failure is reported on the result and the run still finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from harness.config import TrackingConfig
from harness.errors import ConfigError, QuantbenchError
from harness.records import sweep_runs
from harness.records.mlflow_runs import already_sent, log_to_mlflow
from harness.records.results import (
    PARENT_TAG,
    RESULT_KEY_TAG,
    json_path,
    pending,
    read_json,
    result_key,
    save_result,
    write_json_atomic,
)
from harness.run.result import Result
from harness.sweep.resume import hold_folder

log = logging.getLogger("quantbench")
UPLOAD = "python -m harness.records.tracking upload"  # the re-send command, as messages show it


def record(result: Result, tcfg: TrackingConfig, path: Path | None = None, parent_run_id: str | None = None,
           artifacts: dict[str, str] | None = None) -> Path:
    """Write the result JSON, then log to MLflow; a tracking failure is reported, never fatal.

    Returns the file that holds the result: `path`, or its copy in `rescue_dir()` when `path` could not
    be written (disk full: tag WRITE_ERROR_TAG says why; MLflow still gets the numbers)."""
    path = path or json_path(result, tcfg)
    result_key(result)
    if parent_run_id:
        result.tags[PARENT_TAG] = parent_run_id  # so a later `upload` nests it under the same sweep run
    if not tcfg.enabled:
        return save_result(path, result, final=True) or path
    with sending(path, wait=True):  # the JSON looks unsent until its run is logged: no `upload` may take it meanwhile
        save_result(path, result, final=False)
        try:
            result.mlflow_run_id = log_to_mlflow(result, tcfg, parent_run_id, artifacts)
            for child in child_results(result):  # a load run's rates, nested under it
                log_to_mlflow(child, tcfg, result.mlflow_run_id)
        except Exception as exc:  # noqa: BLE001 - the JSON holds the numbers; `upload` sends them later
            result.tags["tracking_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log.error("MLflow logging failed (%s); result kept in %s; re-send with: %s %s --uri %s",
                      result.tags["tracking_error"], path, UPLOAD, path.parent, tcfg.resolved_uri())
        return save_result(path, result, final=True) or path


@contextlib.contextmanager
def sending(path: Path, wait: bool) -> Iterator[bool]:
    """Hold `.<name>.sending` beside a result JSON while it is sent to MLflow; yields whether it is held.

    A result JSON is written before its run is logged, so until `record` ends it looks unsent, and its half-made
    MLflow run is RUNNING: an `upload` at that moment (a store on a server has no store lock) would delete that
    run as a dead attempt and send the result a second time. `upload` takes this lock without waiting and skips
    a result whose sender is alive. A lock file that cannot be made (read-only folder) locks nothing.
    The file goes when the lock does; whoever waited for it checks that the file it holds is still the one on
    disk (else it locked a removed file, and tries again).
    """
    lock = Path(path).with_name(f".{Path(path).name}.sending")
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)  # record's first result in a new folder
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield True
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except OSError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def child_results(result: Result) -> list[Result]:
    """A load run's rates (`result.children`) as results of their own, to log nested under the run."""
    keep = {k: v for k, v in result.tags.items() if k not in (RESULT_KEY_TAG, "error")}
    return [Result(status=c.get("status", "OK"), config=result.config, metrics=dict(c.get("metrics") or {}),
                   tags={**keep, **(c.get("tags") or {}), "status": c.get("status", "OK"),
                         **({"error": c["error"]} if c.get("error") else {})},
                   error=c.get("error", ""), run_name=f"{result.run_name} @ {c.get('label', i)}",
                   config_hash=result.config_hash, started=result.started, ended=result.ended)
            for i, c in enumerate(result.children)]


def upload(folder: Path, tcfg: TrackingConfig, own_experiment: bool = False) -> tuple[int, int]:
    """Send result JSONs that never reached MLflow to `tcfg.uri`; returns (uploaded, failed).

    Only ever to the store the caller names: never to the URI written inside a result file, which, for a
    file copied from elsewhere, could point anywhere. `own_experiment`: each result keeps the experiment
    name its own config gave (else `tcfg.experiment`). A sweep's cells go under its parent run, adopted or
    created and then closed as the sweep ended (`settle_sweep`).
    """
    if not tcfg.uri:
        raise ValueError("upload needs an explicit tracking URI (tcfg.uri)")
    todo = pending(folder)
    done = failed = 0
    for sweep_dir in sweep_runs.unsettled(folder, [p for p, _ in todo]):
        mine = [(p, r) for p, r in todo if sweep_runs.sweep_of(p) == sweep_dir]
        todo = [(p, r) for p, r in todo if sweep_runs.sweep_of(p) != sweep_dir]
        d, f = settle_sweep(sweep_dir, mine, tcfg, own_experiment)
        done, failed = done + d, failed + f
    for path, result in todo:
        ok = _send(path, result, _target(tcfg, result.config.get("tracking"), own_experiment))
        done, failed = done + ok, failed + (not ok)
    return done, failed


def _target(tcfg: TrackingConfig, own: dict | None, own_experiment: bool) -> TrackingConfig:
    name = (own or {}).get("experiment") if own_experiment else None
    return dataclasses.replace(tcfg, experiment=name) if name and isinstance(name, str) else tcfg


def _send(path: Path, result: Result, target: TrackingConfig) -> bool:
    """Log one result (once: `already_sent` finds a run whose JSON update was lost) and note its run id."""
    with sending(path, wait=False) as held:
        if not held:
            log.error("upload of %s skipped: the run that wrote it is sending it to MLflow now; upload again once "
                      "it has ended", path)
            return False
        return _send_held(path, result, target)


def _send_held(path: Path, result: Result, target: TrackingConfig) -> bool:
    try:
        result.tags.pop("tracking_error", None)
        sent = already_sent(result, target)
        if not sent:
            sent = log_to_mlflow(result, target, result.tags.get(PARENT_TAG) or None)
            for child in child_results(result):  # a load run's rates, nested under it as `record` does
                log_to_mlflow(child, target, sent)
        result.mlflow_run_id = sent
        write_json_atomic(path, result.to_dict())
        return True
    except Exception as exc:  # noqa: BLE001
        log.error("upload of %s failed: %s: %s", path, type(exc).__name__, str(exc)[:300])
        return False


def settle_sweep(sweep_dir: Path, cells: list[tuple[Path, Result]], tcfg: TrackingConfig,
                 own_experiment: bool) -> tuple[int, int]:
    """Send a sweep's unsent cells under its parent run and close that run as the sweep ended (sweep.json)."""
    state = read_json(sweep_dir / sweep_runs.SWEEP_FILE) or {}
    target = _target(tcfg, state.get("tracking"), own_experiment)
    try:  # a sweep that is running owns its folder and its parent run: settle it once it has ended
        lock = hold_folder(sweep_dir, state.get("name", sweep_dir.name))
    except QuantbenchError as exc:
        log.error("upload of %s skipped: %s", sweep_dir, exc)
        return 0, len(cells)
    try:
        try:
            parent = sweep_runs.adopt_parent(target, state)
        except Exception as exc:  # noqa: BLE001 - the store is down again: nothing of this sweep is sent
            log.error("upload of %s failed: no parent run (%s: %s)", sweep_dir, type(exc).__name__, str(exc)[:300])
            return 0, len(cells)
        state.update(parent_run_id=parent, parent_closed=False)
        write_json_atomic(sweep_dir / sweep_runs.SWEEP_FILE, state)  # a later resume re-opens this run
        sent = 0
        with contextlib.suppress(Exception):  # best effort: a cell left top-level is still in the store
            if moved := sweep_runs.adopt_cells(target, sweep_dir, parent):
                log.info("upload: %d cell run(s) of %s logged without their sweep's parent run now nest under %s",
                         moved, sweep_dir, parent)
        try:
            for path, result in cells:
                result.tags[PARENT_TAG] = result.tags["sweep.parent_run_id"] = parent
                sent += _send(path, result, target)
        finally:  # end the re-opened run as the sweep ended (KILLED if it never did), whatever was sent: left
            # RUNNING after one refused cell, a FINISHED sweep's run was marked KILLED by the next sweep's start
            state["parent_closed"] = sweep_runs.settle(target, sweep_dir, state, parent, len(cells) - sent)
            write_json_atomic(sweep_dir / sweep_runs.SWEEP_FILE, state)
        return sent, len(cells) - sent
    finally:
        lock.release()


def named_stores(folder: Path, limit: int = 3) -> list[str]:
    """The stores the pending results were meant for (shown to the user, never contacted)."""
    seen: list[str] = []
    for _, result in pending(folder):
        own = result.config.get("tracking") or {}
        try:
            uri = TrackingConfig(**{k: v for k, v in own.items() if k in ("uri", "results_dir")}).resolved_uri()
        except Exception:  # noqa: BLE001 - a malformed section: nothing to suggest
            continue
        if uri not in seen:
            seen.append(uri)
        if len(seen) == limit:
            break
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.records.tracking",
                                 description="Re-send result JSONs that never reached MLflow.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upload", help="upload result JSONs without an mlflow_run_id")
    up.add_argument("folder", nargs="?", default="results")
    up.add_argument("--uri", default="", help="MLflow tracking URI to send to (required: the URI written inside "
                    "a result file is never followed)")
    up.add_argument("--experiment", default=None, help="MLflow experiment (default: each result's own)")
    up.add_argument("--retries", type=int, default=3)
    up.add_argument("--timeout-s", type=float, default=10.0)
    args = ap.parse_args(argv)
    if not Path(args.folder).is_dir():  # else "uploaded 0, failed 0", exit 0: a typo would read as all sent
        print(f"error: {args.folder} is not a folder; pass the results folder that holds the JSONs to send "
              "(e.g. results/)", file=sys.stderr)
        return 2
    if not args.uri:  # a result copied from elsewhere could name any store: the user says where, every time
        named = ", ".join(repr(u) for u in named_stores(Path(args.folder)))
        print("error: upload needs --uri, the MLflow store to send to (e.g. --uri sqlite:///results/mlflow.db or "
              "--uri http://127.0.0.1:5000); the URI inside a result file is never followed"
              + (f" (these results name {named})" if named else ""), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:  # a password in --uri, --retries -1...: one line, not a traceback
        tcfg = TrackingConfig(uri=args.uri, experiment=args.experiment or "quantbench", retries=args.retries,
                              timeout_s=args.timeout_s)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done, failed = upload(Path(args.folder), tcfg, own_experiment=args.experiment is None)
    print(f"uploaded {done}, failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
