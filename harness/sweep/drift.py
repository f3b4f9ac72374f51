"""The drift probe: cells of the sweep run again (speed only) after the last cell, in reverse order.

Two runs of one configuration in two cells differ only by when (and in which process) they ran, so their speed
ratio is the sweep's own measure of the drift between cells (harness/analysis/frontier.py widens every speed
interval by the largest one). `sweep.drift_probe`:
- `all`: every OK cell again, last cell first. With the sweep's own order that is A B C ... C B A, the cell-level
  form of the gate's A B B A: a drift that grows through the sweep cancels in the mean of a format's two runs,
  and every format gets its own pair (one format's process can be luckier than another's: a probe of the
  baseline alone missed a 1.7x swing of rtn_int4 between two quant_sweeps on one host).
- `baseline`: the baseline cell only (one pair: cheaper, and says less).
- `none`: no probe; the report says the drift was not measured.
A probe scores no accuracy (nothing of the timed decode changes: it runs before any scoring) and is kept out of
the cells: `results/<sweep>/drift.json`, and the parent MLflow run's `drift_probe.<config hash>.*` metrics.
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


def probe_cells(cells: list[dict], baseline: str, mode: str) -> list[dict]:
    """The OK cells to run again, last first (`all`) or the baseline only; none for a sweep of one format."""
    ok = [c for c in cells if c.get("status") == "OK" and (c.get("metrics") or {}).get(HEADLINE) and c.get("config")]
    if mode == "none" or len({(c.get("tags") or {}).get("quantizer.name") for c in ok}) < 2:
        return []
    if mode == "baseline":
        return [c for c in ok if (c.get("tags") or {}).get("quantizer.name") == baseline][:1]
    return ok[::-1]


def probe_config(cell: dict) -> dict:
    """The baseline cell's config, speed only and untracked (the probe is not a cell of its own)."""
    config = copy.deepcopy(cell["config"])
    config.setdefault("accuracy", {})["enabled"] = False
    config["accuracy"]["tasks"] = []
    config.setdefault("tracking", {})["enabled"] = False
    return config


def run_probes(cells: list[dict], baseline: str, settings: Any, folder: Path, invocation: str) -> list[dict]:
    """Run the probes and write drift.json; returns the probes' result dicts ([] when there is nothing to probe)."""
    todo = probe_cells(cells, baseline, settings.drift_probe)
    if todo:
        print(f"drift probe ({settings.drift_probe}): {len(todo)} cell(s) again, speed only, last first", flush=True)
    probes = []
    for cell in todo:
        result = run_isolated(probe_config(cell), settings).to_dict()
        result["tags"][OF_TAG] = cell["tags"].get("config_hash") or cell.get("config_hash", "")
        probes.append({k: result[k] for k in ("status", "error", "metrics", "tags", "started", "ended")})
        a, b = cell["metrics"].get(HEADLINE), result["metrics"].get(HEADLINE)
        print(f"drift probe: [{result['status']}] {cell['tags'].get('sweep.cell', '')}: "
              + (f"{a:.2f} then {b:.2f} tok/s" if a and b else result["error"]), flush=True)
    if probes:
        try:
            write_json_atomic(Path(folder) / DRIFT_FILE, {"invocation": invocation, "probes": probes})
        except OSError as exc:
            log.warning("could not write %s: %s", Path(folder) / DRIFT_FILE, exc)
    return probes
