"""Recording: the result JSON first (atomic), then MLflow.

The JSON is the source of truth: it is written before MLflow is contacted, so a run whose tracking
server is down still leaves its numbers, and `python -m harness.tracking upload results/ --uri <store>`
sends such files later (only to the store named on its command line, never to one a result file
names). MLflow calls are retried with bounded exponential backoff (SQLite's "database is locked" under
concurrent writers, a server restarting); when the retries run out the failure is reported on the
result and the run still finishes.

MLflow runs are created after the work, in one go: a run is never left RUNNING by a failure, and it
ends FINISHED (status OK, or SKIPPED: cannot run on this hardware, the reason in tag `error`) or FAILED
(any other status, with the message in tag `error`); tag `status` always holds quantbench's status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness.config import TrackingConfig
from harness.runner import Result

log = logging.getLogger("quantbench")
MAX_PARAM_CHARS = 6000
RESULT_KEY_TAG = "result_key"
PARENT_TAG = "parent_run_id"
WRITE_ERROR_TAG = "result_write_error"  # the result JSON could not be written where it belongs (and why)
RESCUE_ENV = "QUANTBENCH_RESCUE_DIR"  # where such a result is kept instead (default <tmp>/quantbench-rescue)
SQLITE_LOCK_WAIT_S = 300.0  # other writers' turns; a wedged holder fails the log, not the run
# MLflow's experiment type: its UI offers "genai_development" (GenAI apps & agents) and
# "custom_model_development" ("Machine learning": the runs table first) and writes this tag itself when a
# person picks one. MLflow 3.17's UI takes the type from its GenAI / Model training switch instead (see
# `runs_url`), older and other clients read the tag.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write `path` whole or not at all: a temporary file in the same folder, fsynced, then renamed over it.

    A reader (or a process killed mid-write) sees the old file or the new one, never a part. A failed
    write (disk full) removes its temporary file and raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def rescue_dir() -> Path:
    """Where a result goes when its own folder cannot take it (disk full): $QUANTBENCH_RESCUE_DIR, else
    <tmp>/quantbench-rescue (often another filesystem than results/)."""
    return Path(os.environ.get(RESCUE_ENV) or Path(tempfile.gettempdir()) / "quantbench-rescue")


def _save(path: Path, result: Result, final: bool) -> Path | None:
    """Write the result JSON at `path`; when that fails, keep it in `rescue_dir()` and say so (tag
    WRITE_ERROR_TAG); when that fails too, print it whole on stderr (`final`: the last chance). Returns
    the file written, or None."""
    try:
        write_json_atomic(path, result.to_dict())
        result.tags.pop(WRITE_ERROR_TAG, None)
        return path
    except OSError as exc:
        first = WRITE_ERROR_TAG not in result.tags
        result.tags[WRITE_ERROR_TAG] = f"{path}: {exc.strerror or exc}"
    # one name per result (its result_key), so the writes before and after MLflow land on the same file
    kept = rescue_dir() / f"{path.parent.parent.name}-{path.stem}-{result_key(result)[-8:]}.json"
    try:
        write_json_atomic(kept, result.to_dict())
    except OSError as exc:
        if final:  # nowhere to write: the numbers go to the terminal, one line that can be saved as the file
            print(f"error: could not write the result anywhere ({result.tags[WRITE_ERROR_TAG]}; {kept}: "
                  f"{exc.strerror or exc}); the whole result follows as one JSON line after RESULT", file=sys.stderr)
            print("RESULT " + json.dumps(result.to_dict(), sort_keys=True, default=str), file=sys.stderr, flush=True)
        return None
    if first:
        log.error("could not write the result to %s (%s); kept it in %s: once there is space, cp %s %s", path,
                  result.tags[WRITE_ERROR_TAG].rsplit(": ", 1)[-1], kept, kept, path)
    return kept


def json_path(result: Result, tcfg: TrackingConfig, folder: str = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(result.started or time.time()))
    return Path(tcfg.results_dir) / folder / f"{stamp}-{result.run_name}-{result.config_hash[:8]}.json"


def flatten(data: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)[:MAX_PARAM_CHARS]
    return out


def retry(fn: Callable[[], Any], tcfg: TrackingConfig, what: str) -> Any:
    """Call fn with bounded exponential backoff + jitter.

    At most `tcfg.retries` retries, and none once `tcfg.timeout_s` has passed since the first attempt:
    a refused connection gives up after ~2 s of backoff, a hung server after one request timeout.
    """
    delay = 0.2
    start = time.monotonic()
    for attempt in range(tcfg.retries + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any tracking failure is retried, then reported
            if attempt == tcfg.retries or time.monotonic() - start >= tcfg.timeout_s:
                raise
            log.warning("%s failed (%s: %s); retry %d/%d", what, type(exc).__name__, str(exc)[:200],
                        attempt + 1, tcfg.retries)
            time.sleep(delay + random.random() * delay)
            delay = min(delay * 2, 2.0)


@contextlib.contextmanager
def bounded_http(tcfg: TrackingConfig) -> Iterator[None]:
    """Turn off MLflow's own HTTP retries for the duration of a logging call; `retry` above does it.

    MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) make one call to a down server take
    minutes, multiplied by every retry of ours. The variables are read per request, so setting them
    around our calls (and restoring them after) bounds the wait without changing other MLflow users.
    """
    wanted = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
              "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(round(tcfg.timeout_s))))}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def store_lock(tcfg: TrackingConfig) -> Iterator[None]:
    """Serialize writers of one SQLite store across processes (no-op for servers).

    Concurrent first writers into a fresh SQLite file race on MLflow's schema migration ("table
    _alembic_tmp_runs already exists", "database is locked") and can leave the store half-migrated;
    later writers still hit "database is locked". A file lock beside the database makes the writers
    take turns; waiting for it is progress (another run being logged), so its wait is generous.
    """
    uri = tcfg.resolved_uri()
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock", timeout=SQLITE_LOCK_WAIT_S):
        yield


class _BoundedClient:
    """An MlflowClient whose every call runs under `bounded_http` (for callers outside log_to_mlflow,
    e.g. the sweep's parent run): without it one call to a down server takes minutes."""

    def __init__(self, inner: Any, tcfg: TrackingConfig):
        self._inner, self._tcfg = inner, tcfg

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with bounded_http(self._tcfg):
                return attr(*args, **kwargs)

        return call


def client(tcfg: TrackingConfig):
    from mlflow.tracking import MlflowClient

    return _BoundedClient(MlflowClient(tracking_uri=tcfg.resolved_uri()), tcfg)


def experiment_id(c, tcfg: TrackingConfig, name: str | None = None) -> str:
    """Id of experiment `name` (default `tcfg.experiment`), created if missing; either way it ends up
    tagged as model development (`ensure_experiment_kind`)."""
    name = name or tcfg.experiment
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        ensure_experiment_kind(c, exp)
        return exp.experiment_id
    location = None
    if not tcfg.uri:  # local store: keep artifacts beside the database, not in the cwd
        location = Path(os.path.abspath(os.path.join(tcfg.results_dir, "mlartifacts"))).as_uri()
    try:
        return c.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # noqa: BLE001 - created concurrently by another process
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        ensure_experiment_kind(c, exp)
        return exp.experiment_id


def ensure_experiment_kind(c, exp) -> None:
    """Tag an experiment `custom_model_development` unless it already has a kind (a person's choice
    stays). Covers experiments made before the tag existed; costs nothing once set. Best effort: a
    store that refuses the tag still takes the runs."""
    if (exp.tags or {}).get(EXPERIMENT_KIND_TAG):
        return
    try:
        c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    except Exception as exc:  # noqa: BLE001 - cosmetic for the UI; never fail a run over it
        log.warning("could not tag experiment %s with %s: %s", exp.name, EXPERIMENT_KIND_TAG, str(exc)[:200])


def runs_url(base_url: str, exp_id: str) -> str:
    """Link to an experiment's runs table in the MLflow UI.

    MLflow 3.17's UI opens an experiment on its GenAI overview whatever the experiment's tags say: the
    page kind comes from the GenAI / Model training switch at the top of its sidebar (remembered per
    browser, GenAI at first) or from `workflowType` in the link, which this sets.
    """
    return f"{base_url.rstrip('/')}/#/experiments/{exp_id}/runs?workflowType=machine_learning"


def result_key(result: Result) -> str:
    """A key unique to one result, tagged on its MLflow run so a re-send can find what already arrived."""
    key = result.tags.get(RESULT_KEY_TAG)
    if not key:
        key = f"{result.config_hash[:8]}-{int(result.started * 1000)}-{uuid.uuid4().hex[:8]}"
        result.tags[RESULT_KEY_TAG] = key
    return key


def log_to_mlflow(result: Result, tcfg: TrackingConfig, parent_run_id: str | None = None,
                  artifacts: dict[str, str] | None = None) -> str:
    """Create one MLflow run holding the result; returns its run id.

    Bounded (see `retry`, `bounded_http`), serialized per SQLite store (`store_lock`). A run that fails
    half-way is deleted (best effort) so a later `upload` does not leave a duplicate beside it.
    """
    result_key(result)
    with bounded_http(tcfg), store_lock(tcfg):
        c = client(tcfg)
        run_id_box: list[str] = []
        try:
            return _log(c, result, tcfg, parent_run_id, artifacts, on_created=run_id_box.append)
        except Exception:
            for rid in run_id_box:
                with contextlib.suppress(Exception):  # server down: `upload` finds it RUNNING and replaces it
                    c.delete_run(rid)
            raise


def _log(c, result: Result, tcfg: TrackingConfig, parent_run_id: str | None, artifacts: dict[str, str] | None,
         on_created: Callable[[str], None]) -> str:
    from mlflow.entities import Metric, Param

    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    tags = {k: str(v)[:5000] for k, v in result.tags.items()}
    tags["mlflow.runName"] = result.run_name
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = retry(lambda: c.create_run(exp_id, run_name=result.run_name, tags=tags,
                                     start_time=int(result.started * 1000)), tcfg, "mlflow create_run")
    run_id = run.info.run_id
    on_created(run_id)
    now_ms = int(time.time() * 1000)
    params = [Param(k, v) for k, v in flatten(result.config).items()]
    metrics = [Metric(k, float(v), now_ms, 0) for k, v in result.metrics.items()]
    for i in range(0, max(len(params), len(metrics), 1), 100):  # MLflow caps a batch at 100 params
        p, m = params[i:i + 100], metrics[i:i + 100]
        retry(lambda p=p, m=m: c.log_batch(run_id, metrics=m, params=p), tcfg, "mlflow log_batch")
    with tempfile.TemporaryDirectory() as tmp:
        files = dict(artifacts or {})
        files["result.json"] = json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str)
        from omegaconf import OmegaConf

        files["config.yaml"] = OmegaConf.to_yaml(OmegaConf.create(result.config))
        if result.samples:
            files["samples.txt"] = "\n\n".join(f"### prompt\n{s['prompt']}\n### output\n{s['output']}"
                                               for s in result.samples)
        if result.traceback:
            files["traceback.txt"] = result.traceback
        workload = result.tags.get("workload.file")
        if workload and Path(workload).is_file():  # the run's prompts as token ids (harness/workloads.py)
            files["workload.jsonl"] = Path(workload).read_text()
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        retry(lambda: c.log_artifacts(run_id, tmp), tcfg, "mlflow log_artifacts")
    # SKIPPED (cannot run on this hardware) is not a failure: FINISHED, with tag status=SKIPPED and the reason in `error`
    status = "FINISHED" if result.status in ("OK", "SKIPPED") else ("KILLED" if result.status == "KILLED" else "FAILED")
    retry(lambda: c.set_terminated(run_id, status=status, end_time=int(result.ended * 1000)), tcfg,
          "mlflow set_terminated")
    return run_id


def record(result: Result, tcfg: TrackingConfig, path: Path | None = None, parent_run_id: str | None = None,
           artifacts: dict[str, str] | None = None) -> Path:
    """Write the result JSON, then log to MLflow; a tracking failure is reported, never fatal.

    Returns the file that holds the result: `path`, or its copy in `rescue_dir()` when `path` could not
    be written (disk full: tag WRITE_ERROR_TAG says why; MLflow still gets the numbers)."""
    path = path or json_path(result, tcfg)
    result_key(result)
    if parent_run_id:
        result.tags[PARENT_TAG] = parent_run_id  # so a later `upload` nests it under the same sweep run
    written = _save(path, result, final=not tcfg.enabled)
    if not tcfg.enabled:
        return written or path
    try:
        result.mlflow_run_id = log_to_mlflow(result, tcfg, parent_run_id, artifacts)
    except Exception as exc:  # noqa: BLE001 - the JSON holds the numbers; `upload` sends them later
        result.tags["tracking_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log.error("MLflow logging failed (%s); result kept in %s; re-send with: python -m harness.tracking "
                  "upload %s --uri %s", result.tags["tracking_error"], path, path.parent, tcfg.resolved_uri())
    return _save(path, result, final=True) or path


def _already_sent(result: Result, tcfg: TrackingConfig) -> str:
    """Run id of a complete MLflow run for this result (a re-send whose JSON update was lost), else ''.

    A RUNNING one is a half-logged attempt: it is deleted and the result sent again.
    """
    key = result.tags.get(RESULT_KEY_TAG)
    if not key:
        return ""
    with bounded_http(tcfg), store_lock(tcfg):
        c = client(tcfg)
        exp = retry(lambda: c.get_experiment_by_name(tcfg.experiment), tcfg, "mlflow experiment")
        if exp is None:
            return ""
        runs = retry(lambda: c.search_runs([exp.experiment_id], f"tags.{RESULT_KEY_TAG} = '{key}'"), tcfg,
                     "mlflow search_runs")
        found = ""
        for run in runs:
            if run.info.status == "RUNNING":
                retry(lambda run=run: c.delete_run(run.info.run_id), tcfg, "mlflow delete_run")
            else:
                found = found or run.info.run_id
        return found


def pending(folder: Path) -> Iterator[tuple[Path, Result]]:
    """Result JSONs under `folder` that never reached MLflow (no `mlflow_run_id`)."""
    for path in sorted(Path(folder).rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "status" in data and "config" in data and not data.get("mlflow_run_id"):
            yield path, Result.from_dict(data)


def upload(folder: Path, tcfg: TrackingConfig, own_experiment: bool = False) -> tuple[int, int]:
    """Send result JSONs that never reached MLflow to `tcfg.uri`; returns (uploaded, failed).

    Only ever to the store the caller names: never to the URI written inside a result file, which, for a
    file copied from elsewhere, could point anywhere. `own_experiment`: each result keeps the experiment
    name its own config gave (else `tcfg.experiment`).
    """
    if not tcfg.uri:
        raise ValueError("upload needs an explicit tracking URI (tcfg.uri)")
    done = failed = 0
    for path, result in pending(folder):
        target = tcfg
        if own_experiment:
            own = (result.config.get("tracking") or {}).get("experiment")
            target = dataclasses.replace(tcfg, experiment=own if own and isinstance(own, str) else tcfg.experiment)
        try:
            result.tags.pop("tracking_error", None)
            result.mlflow_run_id = _already_sent(result, target) or log_to_mlflow(
                result, target, result.tags.get(PARENT_TAG) or None)
            write_json_atomic(path, result.to_dict())
            done += 1
        except Exception as exc:  # noqa: BLE001
            log.error("upload of %s failed: %s: %s", path, type(exc).__name__, str(exc)[:300])
            failed += 1
    return done, failed


def _named_stores(folder: Path, limit: int = 3) -> list[str]:
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
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harness.tracking",
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
    if not args.uri:  # a result copied from elsewhere could name any store: the user says where, every time
        named = ", ".join(repr(u) for u in _named_stores(Path(args.folder)))
        print("error: upload needs --uri, the MLflow store to send to (e.g. --uri sqlite:///results/mlflow.db or "
              "--uri http://127.0.0.1:5000); the URI inside a result file is never followed"
              + (f" (these results name {named})" if named else ""), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tcfg = TrackingConfig(uri=args.uri, experiment=args.experiment or "quantbench", retries=args.retries,
                          timeout_s=args.timeout_s)
    done, failed = upload(Path(args.folder), tcfg, own_experiment=args.experiment is None)
    print(f"uploaded {done}, failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
