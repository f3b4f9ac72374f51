"""A sweep's MLflow parent run: opened and closed by the sweep itself, or settled later by `upload`.

A sweep (harness/sweep/parent.py) opens one parent run when it starts and closes it when it ends, and it
writes how it ended into `<sweep>/sweep.json` (`status`, `summary`, `reports`, `parent_closed`). When
MLflow was down at either end, `upload` (harness/records/tracking.py) settles the sweep from that file:
`adopt_parent` finds the parent run the sweep had (or had on an earlier invocation) in the store it sends
to, or creates one, so the uploaded cells nest under one parent again; `close_parent` then ends it with the
status the sweep recorded, also when a cell could not be sent (its summary counts them). The adopted id goes
back into sweep.json, so a later resume re-opens that run instead of logging every reused cell a second time
under a new one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from harness.config import TrackingConfig
from harness.records import sweeps
from harness.records.mlflow_runs import client, experiment_id, retry
from harness.records.results import PARENT_TAG, read_json, write_json_atomic

log = logging.getLogger("quantbench")
SWEEP_FILE = "sweep.json"  # <sweep folder>/sweep.json: harness.sweep.settings.SweepState


def parent_tags(name: str, invocation: str, commit: str, owner: str = "", label: str = "") -> dict[str, str]:
    """The tags of a sweep's parent run (reports find the sweep and its latest invocation by them)."""
    return {"quantbench.role": "sweep", "quantbench.sweep": name, "quantbench.invocation": invocation,
            "git_commit": commit, "status": "RUNNING", **({"quantbench.owner": owner} if owner else {}),
            **({"quantbench.label": label} if label else {})}


def open_parent(tcfg: TrackingConfig, tags: dict[str, str], previous: list[str]) -> str:
    """Re-open the first of `previous` that is an active run of this experiment, else create a parent run."""
    c = client(tcfg)
    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    for run_id in [p for p in previous if p]:
        try:
            run = c.get_run(run_id)
        except Exception:  # noqa: BLE001 - gone, or another store's id: try the next, then create
            continue
        if run.info.experiment_id == exp_id and run.info.lifecycle_stage == "active":
            for k, v in tags.items():
                c.set_tag(run_id, k, v)
            if "error" in run.data.tags:  # a stale-run mark (sweep/parent.py mark_stale), not this sweep's error
                c.delete_tag(run_id, "error")
            c.update_run(run_id, status="RUNNING")
            return run_id
    name = tags.get("quantbench.sweep", "sweep")
    run = retry(lambda: c.create_run(exp_id, run_name=f"sweep:{name}", tags=tags), tcfg, "mlflow create_run")
    return run.info.run_id


def close_parent(tcfg: TrackingConfig, rid: str, status: str, summary: str, artifacts: list[Path],
                 probes: list[dict] | None = None, invocation: str = "") -> bool:
    """Log the report files (and the drift probe's metrics) to the parent run and end it with the sweep's
    status. Best effort: returns False (and logs why) when MLflow refused."""
    c = client(tcfg)
    try:
        metrics = sweeps.probe_parent_metrics(probes or [])
        for key, val in metrics.items():
            retry(lambda k=key, v=val: c.log_metric(rid, k, v), tcfg, "mlflow log_metric")
        if probes:  # which of the run's drift_probe.* metrics are this invocation's: an earlier one's stay on it
            retry(lambda: c.set_tag(rid, sweeps.PROBED_HASHES_TAG, sweeps.probed_hashes(metrics)), tcfg,
                  "mlflow set_tag")
            retry(lambda: c.set_tag(rid, sweeps.PROBED_TAG, invocation), tcfg, "mlflow set_tag")
        for path in artifacts:
            if Path(path).exists():
                retry(lambda p=path: c.log_artifact(rid, str(p)), tcfg, "mlflow log_artifact")
        retry(lambda: c.set_tag(rid, "status", status), tcfg, "mlflow set_tag")
        retry(lambda: c.set_tag(rid, "summary", summary[:5000]), tcfg, "mlflow set_tag")
        mlflow_status = {"OK": "FINISHED", "KILLED": "KILLED"}.get(status, "FAILED")
        retry(lambda: c.set_terminated(rid, status=mlflow_status), tcfg, "mlflow set_terminated")
        return True
    except Exception as exc:  # noqa: BLE001 - the report files are on disk whatever MLflow does
        log.error("could not close the sweep's MLflow run %s: %s", rid, exc)
        return False


# ------------------------------------------------------------------------------------------- upload
def sweep_of(path: Path) -> Path | None:
    """The sweep folder a result file belongs to (`<sweep>/cells/<hash>.json` beside `<sweep>/sweep.json`)."""
    path = Path(path)
    if path.parent.name == "cells" and (path.parent.parent / SWEEP_FILE).is_file():
        return path.parent.parent
    return None


def unsettled(folder: Path, pending_paths: list[Path]) -> list[Path]:
    """Sweep folders under `folder` that `upload` must settle: cells never sent, or a parent run never closed."""
    found = {s for s in map(sweep_of, pending_paths) if s is not None}
    for state_file in Path(folder).rglob(SWEEP_FILE):
        if "mlartifacts" in state_file.relative_to(folder).parts:  # MLflow's own copies
            continue
        data = read_json(state_file) or {}
        if data.get("status") and not data.get("parent_closed"):
            found.add(state_file.parent)
    return sorted(found)


def adopt_parent(tcfg: TrackingConfig, state: dict) -> str:
    """The sweep's parent run in `tcfg`'s store (its own, else its earlier invocation's, else a new one)."""
    tags = parent_tags(state.get("name", "sweep"), state.get("invocation", ""), state.get("commit", ""),
                       state.get("owner", ""), (state.get("sweep") or {}).get("label", ""))
    tags["quantbench.uploaded"] = time.strftime("%Y-%m-%d %H:%M:%S")  # settled by `upload`, not by the sweep
    return open_parent(tcfg, tags, [state.get("parent_run_id", ""), state.get("earlier_parent_run_id", "")])


def settle(tcfg: TrackingConfig, folder: Path, state: dict, parent: str, unsent: int = 0) -> bool:
    """End an adopted parent run as the sweep ended (KILLED when it never recorded an end: killed -9); its summary
    counts the `unsent` cells this upload could not send (a later upload re-opens the run for them)."""
    status = state.get("status") or "KILLED"
    summary = state.get("summary") or "the sweep recorded no end (killed, or recorded by an older quantbench); cells uploaded later"
    if unsent:
        summary += f"; {unsent} cell(s) not sent to MLflow by upload (their JSONs are in {folder}/cells; upload again)"
    probes = sweeps.stored_probes(folder, state.get("invocation"))
    reports: list[Any] = [Path(p) for p in state.get("reports") or []]
    return close_parent(tcfg, parent, status, summary, reports, probes, state.get("invocation", ""))


def adopt_cells(tcfg: TrackingConfig, folder: Path, parent: str) -> int:
    """Nest under `parent` the cells of `folder` that reached MLflow with no parent run (the store was down when
    the sweep started, up when they ended: they were logged top-level, and the sweep's report found none of them).
    Only runs that exist in `tcfg`'s store, and only cells that name no parent: a cell nested under an earlier
    invocation's parent stays there. Returns how many were moved; each cell's JSON records its new parent."""
    c, moved = client(tcfg), 0
    for path in sorted((Path(folder) / "cells").glob("*.json")):
        data = read_json(path) or {}
        tags, rid = data.get("tags") or {}, data.get("mlflow_run_id")
        if not rid or tags.get(PARENT_TAG):
            continue
        try:
            c.get_run(rid)  # another store's id (the JSON was logged elsewhere): not ours to move
        except Exception:  # noqa: BLE001
            continue
        retry(lambda r=rid: c.set_tag(r, "mlflow.parentRunId", parent), tcfg, "mlflow set_tag")
        tags[PARENT_TAG] = tags["sweep.parent_run_id"] = parent
        data["tags"] = tags
        write_json_atomic(path, data)
        moved += 1
    return moved
