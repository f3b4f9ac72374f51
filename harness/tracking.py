"""Recording: the result JSON first (atomic), then MLflow.

The JSON is the source of truth: it is written before MLflow is contacted, so a run whose tracking
server is down still leaves its numbers, and `python -m harness.tracking upload results/` sends such
files later. MLflow calls are retried with bounded exponential backoff (SQLite's "database is locked"
under concurrent writers, a server restarting); when the retries run out the failure is reported on
the result and the run still finishes.

MLflow runs are created after the work, in one go: a run is never left RUNNING by a failure, and it
ends FINISHED (status OK) or FAILED (any other status, with the message in tag `error`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from harness.config import TrackingConfig
from harness.runner import Result

log = logging.getLogger("quantbench")
MAX_PARAM_CHARS = 6000


def write_json_atomic(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


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
    """Call fn with bounded exponential backoff + jitter (total wait stays within seconds)."""
    delay = 0.2
    for attempt in range(tcfg.retries + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any tracking failure is retried, then reported
            if attempt == tcfg.retries:
                raise
            log.warning("%s failed (%s: %s); retry %d/%d", what, type(exc).__name__, str(exc)[:200],
                        attempt + 1, tcfg.retries)
            time.sleep(delay + random.random() * delay)
            delay = min(delay * 2, 2.0)


def client(tcfg: TrackingConfig):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(tcfg.timeout_s)))
    return MlflowClient(tracking_uri=tcfg.resolved_uri())


def experiment_id(c, tcfg: TrackingConfig, name: str | None = None) -> str:
    name = name or tcfg.experiment
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not tcfg.uri:  # local store: keep artifacts beside the database, not in the cwd
        location = Path(os.path.abspath(os.path.join(tcfg.results_dir, "mlartifacts"))).as_uri()
    try:
        return c.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - created concurrently by another process
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def log_to_mlflow(result: Result, tcfg: TrackingConfig, parent_run_id: str | None = None,
                  artifacts: dict[str, str] | None = None) -> str:
    """Create one MLflow run holding the result; returns its run id."""
    from mlflow.entities import Metric, Param, RunTag

    c = client(tcfg)
    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    tags = {k: str(v)[:5000] for k, v in result.tags.items()}
    tags["mlflow.runName"] = result.run_name
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = retry(lambda: c.create_run(exp_id, run_name=result.run_name, tags=tags,
                                     start_time=int(result.started * 1000)), tcfg, "mlflow create_run")
    run_id = run.info.run_id
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
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        retry(lambda: c.log_artifacts(run_id, tmp), tcfg, "mlflow log_artifacts")
    status = "FINISHED" if result.status == "OK" else ("KILLED" if result.status == "KILLED" else "FAILED")
    retry(lambda: c.set_terminated(run_id, status=status, end_time=int(result.ended * 1000)), tcfg,
          "mlflow set_terminated")
    return run_id


def record(result: Result, tcfg: TrackingConfig, path: Path | None = None, parent_run_id: str | None = None,
           artifacts: dict[str, str] | None = None) -> Path:
    """Write the result JSON, then log to MLflow; a tracking failure is reported, never fatal."""
    path = path or json_path(result, tcfg)
    write_json_atomic(path, result.to_dict())
    if not tcfg.enabled:
        return path
    try:
        result.mlflow_run_id = log_to_mlflow(result, tcfg, parent_run_id, artifacts)
    except Exception as exc:  # noqa: BLE001 - the JSON holds the numbers; `upload` sends them later
        result.tags["tracking_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log.error("MLflow logging failed (%s); result kept in %s; re-send with: python -m harness.tracking "
                  "upload %s", result.tags["tracking_error"], path, path.parent)
    write_json_atomic(path, result.to_dict())
    return path


def upload(folder: Path, tcfg: TrackingConfig) -> tuple[int, int]:
    """Send result JSONs that never reached MLflow; returns (uploaded, failed)."""
    done = failed = 0
    for path in sorted(Path(folder).rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or "status" not in data or "config" not in data or data.get("mlflow_run_id"):
            continue
        result = Result.from_dict(data)
        try:
            result.mlflow_run_id = log_to_mlflow(result, tcfg)
            result.tags.pop("tracking_error", None)
            write_json_atomic(path, result.to_dict())
            done += 1
        except Exception as exc:  # noqa: BLE001
            log.error("upload of %s failed: %s", path, exc)
            failed += 1
    return done, failed


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harness.tracking",
                                 description="Re-send result JSONs that never reached MLflow.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upload", help="upload result JSONs without an mlflow_run_id")
    up.add_argument("folder", nargs="?", default="results")
    up.add_argument("--uri", default="", help="MLflow tracking URI (default: sqlite store under results/)")
    up.add_argument("--experiment", default="quantbench")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    done, failed = upload(Path(args.folder), TrackingConfig(uri=args.uri, experiment=args.experiment))
    print(f"uploaded {done}, failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
