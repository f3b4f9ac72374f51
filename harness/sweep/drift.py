"""The drift probe: the sweep's baseline cell, run again (speed only) after the last cell.

Two cells of one configuration differ only by when they ran, so their speed ratio is the sweep's own measure of
the drift between cells (harness/analysis/frontier.py widens every speed interval by it). The baseline runs
first in a sweep's list, the probe after the last cell: the pair spans the whole sweep. The probe scores no
accuracy (it changes nothing about the timed decode, which runs before any scoring) and is kept out of the
cells: `results/<sweep>/drift.json`, and the parent MLflow run's `drift_probe_*` metrics.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from harness.metrics import HEADLINE
from harness.records.results import write_json_atomic
from harness.records.sweeps import DRIFT_FILE, OF_TAG
from harness.sweep.isolated import run_isolated

log = logging.getLogger("quantbench")


def baseline_cell(cells: list[dict], baseline: str) -> dict | None:
    """The OK baseline cell the probe repeats, when the sweep compared at least two formats."""
    ok = [c for c in cells if c.get("status") == "OK" and (c.get("metrics") or {}).get(HEADLINE)]
    formats = {(c.get("tags") or {}).get("quantizer.name") for c in ok}
    if len(formats) < 2:
        return None
    return next((c for c in ok if (c.get("tags") or {}).get("quantizer.name") == baseline and c.get("config")), None)


def probe_config(cell: dict) -> dict:
    """The baseline cell's config, speed only and untracked (the probe is not a cell of its own)."""
    config = copy.deepcopy(cell["config"])
    config.setdefault("accuracy", {})["enabled"] = False
    config["accuracy"]["tasks"] = []
    config.setdefault("tracking", {})["enabled"] = False
    return config


def run_probe(cells: list[dict], baseline: str, settings: Any, folder: Path, invocation: str) -> dict | None:
    """Run the probe and write drift.json; returns the probe's result dict (None when there is nothing to probe)."""
    cell = baseline_cell(cells, baseline)
    if cell is None or not settings.drift_probe:
        return None
    print(f"drift probe: the baseline cell {cell['tags'].get('sweep.cell', '')!r} again, speed only", flush=True)
    result = run_isolated(probe_config(cell), settings).to_dict()
    result["tags"][OF_TAG] = cell["tags"].get("config_hash") or cell.get("config_hash", "")
    result["invocation"] = invocation
    keep = {k: result[k] for k in ("status", "error", "metrics", "tags", "invocation", "started", "ended")}
    try:
        write_json_atomic(Path(folder) / DRIFT_FILE, keep)
    except OSError as exc:
        log.warning("could not write %s: %s", Path(folder) / DRIFT_FILE, exc)
    a, b = cell["metrics"].get(HEADLINE), result["metrics"].get(HEADLINE)
    print(f"drift probe: [{result['status']}] " + (f"{a:.2f} then {b:.2f} tok/s" if a and b else result["error"]),
          flush=True)
    return keep
