"""A sweep read back whole, from its folder or from MLflow (cells + drift probe), and the frontier across sweeps.

    python -m harness.report --frontier --sweep quant_sweep                       # every such sweep in MLflow
    python -m harness.report --frontier --sweep quant_sweep --sweep-ids ID,ID     # parent run ids
    python -m harness.report --frontier --sweep quant_sweep --tag quantbench.label=lab-a
    python -m harness.report --frontier results/quant_sweep other/quant_sweep     # sweep folders

write `frontier.md` and `frontier.png`: one panel per machine (CPU vendor, family and model, or the GPU's name).
Each sweep's points are computed against its own baseline and drift; numbers from two machines never share an
axis, and recommendations and dominance compare formats of one sweep only.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness import secret_uri
from harness.analysis import frontier, frontier_plot
from harness.config import TrackingConfig
from harness.errors import QuantbenchError
from harness.metrics import HEADLINE
from harness.records.mlflow_runs import client, run_config
from harness.records.results import (
    cell_path,
    invocation_cells,
    manifest_entries,
    read_json,
    reported_jobs,
    sweep_baseline,
)
from harness.records.rows import rows_for
from harness.records.sqlite_seed import missing_store
from harness.secret_uri import redact
from harness.sweep.resume import REUSED_TAG

log = logging.getLogger("quantbench")
DRIFT_FILE = "drift.json"  # results/<sweep>/drift.json: the drift probe (harness/sweep/drift.py)
OF_TAG = "drift_probe.of"  # the probe's tag: the config hash of the cell it repeats
PROBED_TAG = "drift_probe.invocation"  # the parent run's tag: the invocation whose probes its metrics hold
PROBED_HASHES_TAG = "drift_probe.hashes"  # and the config hashes that invocation probed, comma-separated
NOT_REPORTED = "NOT REPORTED"  # report.md's status of a planned job that left no result


@dataclass
class Sweep:
    name: str
    cells: list[dict]
    probes: list[dict] = field(default_factory=list)
    source: str = ""  # the folder, or the MLflow parent run id
    baseline: str = ""  # the invocation's own sweep.baseline (sweep.json), over the stored cells'


def from_folder(folder: Path, all_cells: bool = False) -> Sweep:
    folder = Path(folder)
    if not folder.is_dir():
        raise QuantbenchError(f"{folder} is not a sweep folder; pass results/<sweep> (run one with: "
                              "python run.py +experiment=smoke)")
    if all_cells:
        cells = []
        for path in sorted((folder / "cells").glob("*.json")):
            if (data := read_json(path)) is None:  # a truncated or foreign file: one line, not a traceback
                log.warning("skipped %s: not a readable result JSON (truncated, or not a cell result)", path)
            else:
                cells.append(data)
        return Sweep(folder.name, cells, stored_probes(folder), str(folder))
    state = read_json(folder / "sweep.json") or {}
    invocation = state.get("invocation")
    cells = invocation_cells(folder)
    if state.get("status") in ("OK", "FAILED"):  # ended, not killed: its report listed the jobs that never reported
        cells += unreported(folder, invocation, int(state.get("planned") or 0) - reported_jobs(folder, invocation))
    return Sweep(folder.name, cells, stored_probes(folder, invocation), str(folder),
                 baseline=str((state.get("sweep") or {}).get("baseline") or ""))


def unreported(folder: Path, invocation: str | None, missing: int) -> list[dict]:
    """Result dicts (status NOT_REPORTED) for the `missing` jobs of an invocation that left no result, so that the
    report lists and counts them: its manifest entries with no cell file, by name, then one per job that never
    wrote even its manifest line (it never started, or died first)."""
    folder = Path(folder)
    named = [e for e in manifest_entries(folder, invocation) if not cell_path(folder, e["hash"]).is_file()]
    out = [{"status": NOT_REPORTED, "tags": {"sweep.cell": e.get("label") or e["hash"]},
            "error": f"the job died, or could not write its result (no cells/{e['hash']}.json)"}
           for e in named[:max(0, missing)]]
    return out + [{"status": NOT_REPORTED, "tags": {"sweep.cell": f"unnamed job {i + 1}"},
                   "error": "the job never started, or died before adding itself to manifest.jsonl"}
                  for i in range(max(0, missing) - len(out))]


@contextlib.contextmanager
def _reading(tracking_uri: str) -> Iterator[None]:
    """MLflow's own errors (a refused connection, a broken store) as one line that names the store, its password
    masked: they come as tracebacks whose messages can hold the URI."""
    try:
        yield
    except QuantbenchError:
        raise
    except Exception as exc:  # noqa: BLE001 - requests, SQLAlchemy, MlflowException: whatever the store raised
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        for secret in secret_uri.secrets(tracking_uri):  # the driver's errors can quote any of them
            text = text.replace(secret, "***").replace(urllib.parse.quote(secret, safe=""), "***")
        raise QuantbenchError(f"cannot read MLflow at {redact(tracking_uri)}: {type(exc).__name__}: {text}; check "
                              "--tracking-uri and that the store (or server) is up") from None


def _client(tracking_uri: str, experiment: str):  # noqa: ANN202 - a BoundedClient (mlflow_runs.client)
    if (db := missing_store(tracking_uri)) is not None:  # MLflow would create an empty store (and its folders)
        raise QuantbenchError(f"no MLflow store at {db}; pass --tracking-uri with the store the sweep logged to "
                              "(e.g. sqlite:///results/mlflow.db, or http://127.0.0.1:5000), or report from "
                              "its folder: python -m harness.report results/<sweep>")
    # bounded: MLflow's own HTTP retries would keep a report waiting for minutes on a server that is down
    c = client(TrackingConfig(uri=tracking_uri))
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise QuantbenchError(f"no MLflow experiment {experiment!r} at {redact(tracking_uri)}; check --mlflow-experiment "
                              "and --tracking-uri")
    return c, exp.experiment_id


def _from_parent(c, exp_id: str, parent) -> Sweep:  # noqa: ANN001 - mlflow objects
    children = c.search_runs([exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                             order_by=["attributes.start_time ASC"], max_results=5000)
    latest: dict[str, dict] = {}
    now = parent.data.tags.get("quantbench.invocation", "")  # the latest invocation (a resumed sweep has several)
    for run in children:
        tags = dict(run.data.tags)
        if tags.get("superseded_by"):
            continue
        # as the folder's report: the latest invocation's cells, measured by it or reused by it (resume.reused)
        if now and tags.get("quantbench.invocation", now) != now and \
                not tags.get(REUSED_TAG, "").startswith(f"{now}:"):
            continue
        params = run.data.params
        status = tags.get("status") or {"FINISHED": "OK", "KILLED": "KILLED"}.get(run.info.status, "FAILED")
        cell = {"status": status, "metrics": dict(run.data.metrics), "tags": tags,
                "run_name": run.info.run_name, "error": tags.get("error", ""), "mlflow_run_id": run.info.run_id,
                "config": run_config(c, run.info.run_id, params)}  # whole: rows.setting() compares tokens, prompts...
        latest[tags.get("config_hash") or run.info.run_id] = cell  # ascending start: the rerun wins
    return Sweep(parent.data.tags.get("quantbench.sweep", "sweep"), list(latest.values()),
                 probe_from_parent(dict(parent.data.metrics), dict(parent.data.tags)), parent.info.run_id)


def _filter(sweep: str, tag: str = "") -> str:
    """MLflow's search filter for the sweeps' parent runs; a quote in a name is refused (MLflow's filter has no
    escape for it: it failed with a 30-line parse error)."""
    for option, text in (("--sweep", sweep), ("--tag", tag)):
        if "'" in text or "`" in text:
            raise QuantbenchError(f"{option} {text!r} holds a quote (' or `), which no sweep name or tag has here "
                                  "(MLflow's search cannot match one); give the name without it")
    filt = "tags.`quantbench.role` = 'sweep'" + (f" and tags.`quantbench.sweep` = '{sweep}'" if sweep else "")
    if tag:
        if "=" not in tag:
            raise QuantbenchError(f"--tag {tag!r}: write KEY=VALUE, e.g. --tag quantbench.label=lab-a")
        key, val = tag.split("=", 1)
        filt += f" and tags.`{key}` = '{val}'"
    return filt


def latest_from_mlflow(tracking_uri: str, experiment: str, sweep: str = "") -> Sweep:
    """The latest sweep (or the latest of the named one) as cells + drift probe, from MLflow runs."""
    filt = _filter(sweep)  # before MLflow is contacted: a bad name costs nothing
    with _reading(tracking_uri):
        c, exp_id = _client(tracking_uri, experiment)
        parents = c.search_runs([exp_id], filter_string=filt, order_by=["attributes.start_time DESC"], max_results=1)
        if not parents:
            raise QuantbenchError(f"no sweep run{' named ' + repr(sweep) if sweep else ''} in experiment "
                                  f"{experiment!r}; run one with: python run.py +experiment=smoke")
        return _from_parent(c, exp_id, parents[0])


def select_from_mlflow(tracking_uri: str, experiment: str, sweep: str, ids: list[str], tag: str) -> list[Sweep]:
    """Sweeps named `sweep`, restricted to the parent run ids `ids` and/or the parent-run tag `tag` (KEY=VALUE)."""
    _filter(sweep, tag)  # before MLflow is contacted: a bad name or tag costs nothing
    with _reading(tracking_uri):
        return _select(*_client(tracking_uri, experiment), experiment, sweep, ids, tag)


def _select(c, exp_id: str, experiment: str, sweep: str, ids: list[str], tag: str) -> list[Sweep]:  # noqa: ANN001
    parents = c.search_runs([exp_id], filter_string=_filter(sweep, tag), order_by=["attributes.start_time ASC"],
                            max_results=5000)
    if ids:
        missing = set(ids) - {p.info.run_id for p in parents}
        if missing:
            raise QuantbenchError(f"no sweep {sweep!r} parent run with id(s) {', '.join(sorted(missing))} in "
                                  f"experiment {experiment!r}" + (f" with tag {tag}" if tag else "")
                                  + "; the ids are printed when a sweep starts (MLflow parent run ...)")
        parents = [p for p in parents if p.info.run_id in ids]
    if not parents:
        raise QuantbenchError(f"no sweep {sweep!r} in experiment {experiment!r}" + (f" with tag {tag}" if tag else "")
                              + "; run one with: python run.py +experiment=" + (sweep or "quant_sweep"))
    return [_from_parent(c, exp_id, p) for p in parents]


def stored_probes(folder: Path, invocation: str | None = None) -> list[dict]:
    """The folder's drift probes (of `invocation` when given) as result dicts."""
    data = read_json(Path(folder) / DRIFT_FILE)
    if not data or (invocation and data.get("invocation") != invocation):
        return []
    return list(data.get("probes") or [])


PROBE_KEYS = (HEADLINE, f"{HEADLINE}_p10", f"{HEADLINE}_p90")


def probe_parent_metrics(probes: list[dict]) -> dict[str, float]:
    """What the parent MLflow run keeps of the OK probes: `drift_probe.<config hash>.<metric>` (read back by
    probe_from_parent)."""
    out = {}
    for p in probes:
        m, of = p.get("metrics") or {}, (p.get("tags") or {}).get(OF_TAG)
        if p.get("status") == "OK" and of:
            out.update({f"drift_probe.{of}.{k}": float(m[k]) for k in PROBE_KEYS if k in m})
    return out


def probed_hashes(parent_metrics: dict[str, float]) -> str:
    """PROBED_HASHES_TAG's value for `probe_parent_metrics`' output (cut to MLflow's tag limit: a hash cut off is
    not read back, which says "not measured" rather than reuse an older invocation's probe)."""
    return ",".join(sorted({k.split(".", 2)[1] for k in parent_metrics}))[:5000]


def probe_from_parent(metrics: dict, tags: dict) -> list[dict]:
    """The probes as result dicts, from the parent run's metrics: only when they come from the run's latest
    invocation (a resumed sweep keeps one parent run; an older invocation's probes say nothing of this one), and
    only those of the config hashes it probed (the metrics of the others stay on the run from an earlier one)."""
    if not tags.get(PROBED_TAG) or tags.get(PROBED_TAG) != tags.get("quantbench.invocation"):
        return []
    mine = tags.get(PROBED_HASHES_TAG)  # None: a run closed before this tag was written, which keeps them all
    keep = None if mine is None else set(mine.split(","))
    found: dict[str, dict] = {}
    for key, val in metrics.items():
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[0] == "drift_probe" and parts[2] in PROBE_KEYS:
            found.setdefault(parts[1], {})[parts[2]] = val
    return [{"status": "OK", "metrics": m, "tags": {OF_TAG: of}} for of, m in found.items()
            if HEADLINE in m and (keep is None or of in keep)]


def frontier_points(sweeps: list[Sweep], baseline: str = "") -> list[frontier.Point]:
    """Every sweep's points against its own baseline (`baseline` when given, else the sweep's) and drift; groups
    carry the sweep when there are several."""
    out: list[frontier.Point] = []
    for s in sweeps:
        base = baseline or s.baseline or sweep_baseline(s.cells)
        rows = rows_for(s.cells, base)
        pts = frontier.points(rows, base, s.probes)
        if len(sweeps) > 1:
            for p in pts:
                p.group = f"{s.name} [{s.source}]: {p.group}"
        out += pts
    return out


def write_frontier(sweeps: list[Sweep], out: Path, baseline: str = "") -> list[Path]:
    """frontier.md and frontier.png for several sweeps, one panel (and one section) per machine."""
    pts = frontier_points(sweeps, baseline)
    if not pts:
        raise QuantbenchError("no OK cell with a speed and a baseline cell in the selected sweep(s): nothing to draw")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Format frontier", "", f"{len(sweeps)} sweep(s): " + ", ".join(f"{s.name} ({s.source})" for s in sweeps)
             + ". One panel per machine; formats are compared within one sweep only.", "", "![frontier](frontier.png)",
             ""]
    for machine, members in frontier.panels(pts).items():
        lines += [f"## {machine}", ""]
        for grp in dict.fromkeys(p.group for p in members):
            group = [p for p in members if p.group == grp]
            lines += [f"### {grp}", "", frontier.table(group), "",
                      *[f"- {x}" for x in frontier.recommendations(group)], ""]
    md = out / "frontier.md"
    md.write_text("\n".join(lines))
    return [md, frontier_plot.plot(pts, out / "frontier.png", "frontier")]
