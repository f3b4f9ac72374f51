"""MLflow: one run per result, created after the work in one go, with bounded waits.

MLflow calls are retried with bounded exponential backoff (SQLite's "database is locked" under
concurrent writers, a server restarting); MLflow's own HTTP retries are turned off around our calls
(`bounded_http`), and writers of one SQLite store take turns (`store_lock`). A run is never left RUNNING
by a failure: it ends FINISHED (status OK, or SKIPPED: cannot run on this hardware, the reason in tag
`error`), KILLED or FAILED (the message in tag `error`); tag `status` always holds quantbench's status.

mlflow itself is imported where it is used: it takes seconds, and `run.py --help`, the config checks and
a sweep's cells (which log nothing themselves) must not pay for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock
from omegaconf import OmegaConf

from harness.config import TrackingConfig
from harness.records.results import RESULT_KEY_TAG, result_key
from harness.records.server import backend_uri_for
from harness.records.sqlite_seed import seeded
from harness.run.result import Result

log = logging.getLogger("quantbench")
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
CONFIG_ARTIFACT = "config.yaml"  # every run's whole config (`_log`)
CUT_MARK = f"...[cut, full value in artifact {CONFIG_ARTIFACT}]"  # ends a param value cut to MAX_PARAM_CHARS
MAX_TAG_CHARS = 5000  # below MLflow's tag limit (8000 in the pinned 3.x; older servers took 5000)
TAG_CUT_MARK = "...[cut, full value in artifact result.json]"  # ends a tag value cut to MAX_TAG_CHARS
SQLITE_LOCK_WAIT_S = 300.0  # other writers' turns; a wedged holder fails the log, not the run
# MLflow's experiment type: its UI offers "genai_development" (GenAI apps & agents) and
# "custom_model_development" ("Machine learning": the runs table first) and writes this tag itself when a
# person picks one. MLflow 3.17's UI takes the type from its GenAI / Model training switch instead (see
# `runs_url`), older and other clients read the tag.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def param_value(value: Any) -> str:
    """A config value as an MLflow param: whole, or (over MLflow's limit) cut to MAX_PARAM_CHARS ending in CUT_MARK,
    never silently: the run's CONFIG_ARTIFACT holds it whole."""
    text = str(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - len(CUT_MARK)] + CUT_MARK


def tag_value(value: Any) -> str:
    """A tag as MLflow holds it: whole, or cut to MAX_TAG_CHARS ending in TAG_CUT_MARK (result.json holds it whole)."""
    text = str(value)
    return text if len(text) <= MAX_TAG_CHARS else text[:MAX_TAG_CHARS - len(TAG_CUT_MARK)] + TAG_CUT_MARK


def flatten(data: dict, prefix: str = "", cut: bool = True) -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, values as strings (`cut`: as `param_value` logs them)."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + ".", cut))
        else:
            out[name] = param_value(value) if cut else str(value)
    return out


def unflatten(params: dict[str, str]) -> dict:
    """The nested config back from a run's params (`flatten`'s inverse, values kept as strings but "None" as
    None): what a report reads of a cell's config from MLflow (harness/records/sweeps.py) must be what its
    folder's JSON holds, or the speed settings a ratio compares (harness/records/rows.py `setting`) differ.
    A value MLflow holds cut (CUT_MARK) is refused: two settings that differ after the cut would read alike
    (`run_config` reads such a run's CONFIG_ARTIFACT instead)."""
    if cut := sorted(k for k, v in params.items() if v.endswith(CUT_MARK)):
        raise ValueError(f"params {', '.join(cut)} are cut to MLflow's {MAX_PARAM_CHARS} characters; the whole "
                         f"values are in the run's artifact {CONFIG_ARTIFACT} (mlflow_runs.run_config reads it)")
    out: dict = {}
    for key, value in params.items():
        *parents, name = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # "a" and "a.b" both set: keep the leaf, the nested key is lost
                break
            node = child
        else:
            node[name] = None if value == "None" else value
    return out


def run_config(c: Any, run_id: str, params: dict[str, str]) -> dict:
    """A run's config as `unflatten` reads it from `params`; where a value is cut (CUT_MARK), from the run's
    CONFIG_ARTIFACT, flattened and read back the same way so its values read like the params' (strings). An
    artifact that cannot be read leaves each cut value a note naming the run: never taken for the setting, nor
    equal to another run's."""
    cut = [k for k, v in params.items() if v.endswith(CUT_MARK)]
    if not cut:
        return unflatten(params)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            whole = OmegaConf.to_container(OmegaConf.load(c.download_artifacts(run_id, CONFIG_ARTIFACT, tmp)))
        return unflatten(flatten(whole, cut=False))  # type: ignore[arg-type] - a mapping: `_log` wrote a dict
    except Exception as exc:  # noqa: BLE001 - an artifact store out of reach: the report still reads the rest
        log.warning("run %s: %s cut by MLflow and its %s unreadable (%s: %s); read as a note naming the run, "
                    "equal to no other run's", run_id, ", ".join(cut), CONFIG_ARTIFACT, type(exc).__name__,
                    str(exc)[:200])
        return unflatten({**params, **{k: f"[cut by MLflow; {CONFIG_ARTIFACT} of run {run_id} unreadable]"
                                       for k in cut}})


DB_SCHEMES = ("postgresql", "mysql", "mssql")  # MLflow's database stores other than SQLite (`bounded_db`)


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
        with bounded_db(tcfg):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def bounded_db(tcfg: TrackingConfig) -> Iterator[None]:
    """One attempt at a database store's engine per call of ours; `retry` does the rest, within tracking.timeout_s.

    MLflow makes a database store's engine in up to 10 attempts with 0.1 ... 51.1 s of sleep between them (~100 s,
    `mlflow.store.db.utils.MAX_RETRY_COUNT`, read per call), for every client made: a down PostgreSQL cost each run,
    and a sweep's start, each cell and its end, that long whatever tracking.timeout_s said. SQLite (local, and
    serialized by `store_lock`) keeps MLflow's default."""
    if tcfg.resolved_uri().split(":", 1)[0].split("+", 1)[0] not in DB_SCHEMES:
        yield
        return
    from mlflow.store.db import utils as db_utils  # heavy: see `client`

    saved = db_utils.MAX_RETRY_COUNT
    db_utils.MAX_RETRY_COUNT = 1
    try:
        yield
    finally:
        db_utils.MAX_RETRY_COUNT = saved


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
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock", timeout=SQLITE_LOCK_WAIT_S):
        yield


class BoundedClient:
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


def client(tcfg: TrackingConfig) -> BoundedClient:
    """An MLflow client of `tcfg`'s store, every call bounded (`BoundedClient`)."""
    from mlflow.tracking import MlflowClient  # heavy (seconds): only where MLflow is really contacted

    with bounded_http(tcfg):  # a database store's engine is made here, with MLflow's retries (`bounded_db`)
        inner = MlflowClient(tracking_uri=seeded(backend_uri_for(tcfg.resolved_uri())))
    return BoundedClient(inner, tcfg)


def artifacts_beside(uri: str) -> str | None:
    """A local SQLite store's artifact folder: `mlartifacts` beside the database file (the default store's is
    results/mlartifacts), not MLflow's default ./mlruns under whatever folder the run started in. A server or
    a remote database keeps its own default (None)."""
    if not uri.startswith("sqlite:///") or uri in ("sqlite:///", "sqlite:///:memory:"):
        return None
    db = uri[len("sqlite:///"):].split("?", 1)[0]  # sqlite:////abs/m.db -> /abs/m.db; sqlite:///rel.db -> rel.db
    return (Path(os.path.abspath(db)).parent / "mlartifacts").as_uri()


def experiment_id(c: Any, tcfg: TrackingConfig, name: str | None = None) -> str:
    """Id of experiment `name` (default `tcfg.experiment`), created if missing; either way it ends up
    tagged as model development (`ensure_experiment_kind`)."""
    name = name or tcfg.experiment
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        ensure_experiment_kind(c, exp)
        return exp.experiment_id
    location = artifacts_beside(tcfg.resolved_uri())
    try:
        return c.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # noqa: BLE001 - created concurrently by another process
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        ensure_experiment_kind(c, exp)
        return exp.experiment_id


def ensure_experiment_kind(c: Any, exp: Any) -> None:
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
        except BaseException:  # a second Ctrl-C too: no run left RUNNING that `upload` would not replace
            for rid in run_id_box:
                with contextlib.suppress(Exception):  # server down: `upload` finds it RUNNING and replaces it
                    c.delete_run(rid)
            raise


def _log(c: Any, result: Result, tcfg: TrackingConfig, parent_run_id: str | None,
         artifacts: dict[str, str] | None, on_created: Callable[[str], None]) -> str:
    from mlflow.entities import Metric, Param  # heavy: see `client`

    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    tags = {k: tag_value(v) for k, v in result.tags.items()}
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
        files[CONFIG_ARTIFACT] = OmegaConf.to_yaml(OmegaConf.create(result.config))  # params cut: CUT_MARK
        if result.samples:
            files["samples.txt"] = "\n\n".join(f"### prompt\n{s['prompt']}\n### output\n{s['output']}"
                                               for s in result.samples)
        if result.traceback:
            files["traceback.txt"] = result.traceback
        workload = result.tags.get("workload.file")
        if workload and Path(workload).is_file():  # the run's prompts as token ids (harness/measure/workloads.py)
            files["workload.jsonl"] = Path(workload).read_text()
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        retry(lambda: c.log_artifacts(run_id, tmp), tcfg, "mlflow log_artifacts")
    # SKIPPED (cannot run on this hardware) is not a failure: FINISHED, with tag status=SKIPPED and the reason in `error`
    status = "FINISHED" if result.status in ("OK", "SKIPPED") else ("KILLED" if result.status == "KILLED" else "FAILED")
    retry(lambda: c.set_terminated(run_id, status=status, end_time=int(result.ended * 1000)), tcfg,
          "mlflow set_terminated")
    return run_id


def already_sent(result: Result, tcfg: TrackingConfig) -> str:
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
