"""The result JSON: the source of truth, written whole before MLflow is contacted, and read back.

A result is written atomically (`write_json_atomic`); a disk that cannot take it sends it to a rescue
folder, and when that fails too the whole result is printed as one `RESULT` line (`save_result`). A
sweep's cells are read back per invocation from its folder (`invocation_cells`), which is how a sweep's
report and `python -m harness.report` see the same cells whatever the launcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness.config import TrackingConfig
from harness.run.result import Result

log = logging.getLogger("quantbench")
RESULT_KEY_TAG = "result_key"
PARENT_TAG = "parent_run_id"
WRITE_ERROR_TAG = "result_write_error"  # the result JSON could not be written where it belongs (and why)
RESCUE_ENV = "QUANTBENCH_RESCUE_DIR"  # where such a result is kept instead (default <tmp>/quantbench-rescue)
DEFAULT_BASELINE = "none"  # quantizer a sweep report's speed ratio compares with, unless the sweep names one


def _umask() -> int:
    """The process umask, read without setting it (os.umask sets it, for every thread, for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write `path` whole or not at all: a temporary file in the same folder, fsynced, then renamed over it.

    A reader (or a process killed mid-write) sees the old file or the new one, never a part. A failed
    write (disk full) removes its temporary file and raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600 and the rename keeps it: results another user (a report, a CI job) cannot read
        # back; the mode an open() would give under the umask, as the manifest and the lock have
        os.fchmod(fd, 0o666 & ~_umask())
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


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def rescue_dir() -> Path:
    """Where a result goes when its own folder cannot take it (disk full): $QUANTBENCH_RESCUE_DIR, else
    <tmp>/quantbench-rescue (often another filesystem than results/)."""
    return Path(os.environ.get(RESCUE_ENV) or Path(tempfile.gettempdir()) / "quantbench-rescue")


def result_key(result: Result) -> str:
    """A key unique to one result, tagged on its MLflow run so a re-send can find what already arrived."""
    key = result.tags.get(RESULT_KEY_TAG)
    if not key:
        key = f"{result.config_hash[:8]}-{int(result.started * 1000)}-{uuid.uuid4().hex[:8]}"
        result.tags[RESULT_KEY_TAG] = key
    return key


def save_result(path: Path, result: Result, final: bool) -> Path | None:
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
    tail = result_key(result)[-8:]  # json_path's names end with it already
    kept = rescue_dir() / f"{path.parent.parent.name}-{path.stem.removesuffix('-' + tail)}-{tail}.json"
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
    """Where a single run's result JSON goes: results/runs/<time>-<run name>-<config hash>-<key>.json.

    <key> is the end of the result's own key (`result_key`, random): two runs of one config started in the same
    second (a script, two terminals) got the same name, and the second replaced the first's file."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(result.started or time.time()))
    return Path(tcfg.results_dir) / folder / \
        f"{stamp}-{result.run_name}-{result.config_hash[:8]}-{result_key(result)[-8:]}.json"


def pending(folder: Path) -> list[tuple[Path, Result]]:
    """Result JSONs under `folder` that never reached MLflow (no `mlflow_run_id`)."""
    out = []
    for path in sorted(Path(folder).rglob("*.json")):
        if "mlartifacts" in path.relative_to(folder).parts:  # MLflow's own copies of logged results: sent already
            continue
        data = read_json(path)
        if data is not None and "status" in data and "config" in data and not data.get("mlflow_run_id"):
            out.append((path, Result.from_dict(data)))
    return out


# ----------------------------------------------------------------------------------- a sweep's cells
def cell_path(folder: Path, chash: str) -> Path:
    """A sweep cell's result JSON: <sweep folder>/cells/<config hash>.json."""
    return Path(folder) / "cells" / f"{chash}.json"


def manifest_entries(folder: Path, invocation: str | None) -> list[dict]:
    """The manifest lines of one invocation (default: the latest), in launch order: one per job."""
    if invocation is None:
        invocation = (read_json(folder / "sweep.json") or {}).get("invocation")
    try:
        lines = (folder / "manifest.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not invocation or entry.get("invocation") == invocation:
            out.append(entry)
    return out


def reported_jobs(folder: Path, invocation: str | None = None) -> int:
    """The jobs of one invocation whose cell has a result: two jobs of one config hash (cells that differ only in
    sweep.* or tracking.* keys, which the hash leaves out) share one result, and both reported."""
    return sum(cell_path(Path(folder), e["hash"]).is_file() for e in manifest_entries(Path(folder), invocation))


def invocation_cells(folder: Path, invocation: str | None = None) -> list[dict]:
    """The cell results of one invocation (default: the latest), in launch order, one per config hash."""
    folder = Path(folder)
    seen: dict[str, dict] = {}
    for entry in manifest_entries(folder, invocation):
        data = read_json(cell_path(folder, entry["hash"]))
        if data is not None:
            tags = data.setdefault("tags", {})
            # this invocation's name of the cell: a reused one was measured (and named) by an earlier invocation
            tags["sweep.cell"] = entry.get("label") or tags.get("sweep.cell", "")
            seen[entry["hash"]] = data
    return list(seen.values())


def sweep_baseline(cells: list[dict], settings: dict | None = None) -> str:
    """The quantizer the sweep compares speeds with: its own `sweep.baseline` (`settings`, sweep.json's), else the
    cells' (a reused cell keeps the setting of the invocation that measured it: `sweep` is not in the config
    hash), else DEFAULT_BASELINE."""
    if settings and settings.get("baseline"):
        return str(settings["baseline"])
    for c in cells:
        node = (c.get("config") or {}).get("sweep") or {}
        if node.get("baseline"):
            return str(node["baseline"])
    return DEFAULT_BASELINE


def where(tags: dict) -> str:
    """'; measured on <GPU>' or '; measured on <CPU> (<uarch>, family F model M, <isa>), N threads' from a result's
    tags (harness/env.py): a speed is only read right beside the machine that gave it. '' for a result without them."""
    if str(tags.get("device", "")).startswith("cuda") and tags.get("device_name"):
        return f"; measured on {tags['device_name']}"
    if not (tags.get("cpu_model") or tags.get("cpu.family")):
        return ""
    inner = ", ".join(x for x in (tags.get("cpu.uarch"), f"family {tags.get('cpu.family', '?')} model "
                                  f"{tags.get('cpu.model', '?')}", tags.get("cpu.isa")) if x)
    return f"; measured on {tags.get('cpu_model') or 'unknown CPU'} ({inner})" + \
        (f", {tags['threads']} threads" if tags.get("threads") else "")


def summary_line(result: Result) -> str:
    """A result in one line for the terminal: the headline speeds, weights and accuracy, or why it failed."""
    m = result.metrics
    if result.status != "OK":
        return f"[{result.status}] {result.run_name}: {result.error}"
    if result.children:  # a load run (harness/load/run.py): its capacity and the rates behind it
        cap = m.get("capacity_rps")
        return (f"[OK] {result.run_name}: {result.tags.get('load.target', 'load')}, {len(result.children)} rates, "
                + (f"capacity {cap:.2f} req/s under SLO {result.tags.get('load.slo', 'none')} "
                   f"(p90 TTFT {m.get('capacity_ttft_ms_p90', float('nan')):.0f} ms, p90 TPOT "
                   f"{m.get('capacity_tpot_ms_p90', float('nan')):.1f} ms), " if cap is not None else "")
                + f"max {m.get('max_rps', float('nan')):.2f} req/s" + where(result.tags))
    decode = m.get("decode_tokens_per_s", float("nan"))
    if math.isnan(decode) and "prompt_tokens_per_s" in m:  # a prefill-only workload (llama-bench's pp512): no decode
        speed = [f"prefill {m['prompt_tokens_per_s']:.1f} tok/s", *([f"TTFT {m['ttft_ms']:.1f} ms"] if "ttft_ms" in m else [])]
    else:
        speed = [f"decode {decode:.1f} tok/s (p10 {m.get('decode_tokens_per_s_p10', float('nan')):.1f}, "
                 f"p90 {m.get('decode_tokens_per_s_p90', float('nan')):.1f})",
                 f"TTFT {m.get('ttft_ms', float('nan')):.1f} ms", f"ITL p50 {m.get('itl_ms_p50', float('nan')):.1f} ms"]
    parts = [*speed,
             f"weights {m.get('weight_bytes', 0) / 1e6:.1f} MB ({m.get('bits_per_weight', float('nan')):.2f} b/w)"]
    if "perplexity" in m:
        parts.append(f"ppl {m['perplexity']:.3f}")
    if "kl_div_mean" in m:
        parts.append(f"KL {m['kl_div_mean']:.4f} top1 {m['top1_agreement']:.3f}")
    if "tasks_acc_mean" in m:  # harness/analysis/task_accuracy.py: per-task lines were logged as the tasks finished
        pooled = (f"pooled {m['tasks_acc_diff_pooled']:+.3f} ± {m['tasks_acc_diff_pooled_se']:.3f}, "
                  if "tasks_acc_diff_pooled" in m else "")  # the difference the flips and McNemar p are about
        parts.append(f"task acc {m['tasks_acc_mean']:.3f} (mean of tasks {m['tasks_acc_diff_mean']:+.3f} vs "
                     f"reference; {pooled}{m['tasks_acc_right_to_wrong']:.0f} right->wrong, "
                     f"{m['tasks_acc_wrong_to_right']:.0f} wrong->right, McNemar p {m['tasks_acc_mcnemar_p']:.3g})")
    return f"[OK] {result.run_name}: " + ", ".join(parts) + where(result.tags)
