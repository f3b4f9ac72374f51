"""The report's view of a sweep's cells: one row per result dict, with its speed ratio to the baseline cell.

A ratio only compares like with like: the baseline cell of the same machine, model, strategy, batch size and
context depth (`group`). A cell with no such baseline gets no ratio rather than one against another shape's
or another machine's speed (a gpu_scaling sweep runs three model shapes; a merged report can hold two CPUs)."""

from __future__ import annotations

from typing import Any

from harness.metrics import HEADLINE
from harness.metrics import value as _num  # a finite float or None


def describe(cell: dict) -> dict[str, Any]:
    """The report's view of one result dict."""
    tags, m, config = cell.get("tags") or {}, cell.get("metrics") or {}, cell.get("config") or {}
    batch = _num(m, "batch_size") or _num(config.get("strategy") or {}, "batch_size") or 1.0
    depth = _num(m, "context_depth_tokens") or _num(config.get("measure") or {}, "context_depth") or 0.0
    return {
        "cell": tags.get("sweep.cell") or cell.get("run_name") or "?",
        "model": tags.get("model.name") or "?",
        "machine": machine_key(tags),
        "quantizer": tags.get("quantizer.name") or tags.get("choice.quantizer") or "?",
        "strategy": tags.get("strategy.name") or tags.get("choice.strategy") or "?",
        "batch": int(batch),
        "depth": int(depth),  # measure.context_depth: tokens in the KV cache before the prompt
        "tags": tags,
        "status": cell.get("status", "?"),
        "error": cell.get("error", ""),
        "metrics": m,
        "children": cell.get("children") or [],  # a load run's rates (harness/load/report.py)
    }


def machine_key(tags: dict) -> str:
    """The machine a cell ran on: the GPU's name on CUDA, else the CPU's vendor, family and model."""
    if str(tags.get("device", "")).startswith("cuda") and tags.get("device_name"):
        return str(tags["device_name"])
    return f"{tags.get('cpu.vendor') or tags.get('cpu_model') or '?'} family {tags.get('cpu.family', '?')} " \
           f"model {tags.get('cpu.model', '?')}"


def group(r: dict) -> str:
    """The cells of one machine a speed ratio may compare: same model, strategy, batch size and context depth."""
    return f"{r['model']} / {r['strategy']} / batch {r['batch']}" + (f" / depth {r['depth']}" if r.get("depth") else "")


def _baseline_speed(rows: list[dict], baseline: str) -> dict[tuple[str, str], float]:
    speeds: dict[tuple[str, str], float] = {}
    for r in rows:
        tps = _num(r["metrics"], HEADLINE)
        if r["status"] == "OK" and r["quantizer"] == baseline and tps:
            speeds.setdefault((r["machine"], group(r)), tps)
    return speeds


def rows_for(cells: list[dict], baseline: str = "none") -> list[dict]:
    rows = [describe(c) for c in cells]
    speeds = _baseline_speed(rows, baseline)
    for r in rows:
        base = speeds.get((r["machine"], group(r)))
        tps = _num(r["metrics"], HEADLINE)
        r["ratio"] = tps / base if (tps and base and r["status"] == "OK") else None
    return rows


def machines(rows: list[dict]) -> list[str]:
    """The distinct machines the cells ran on (CPU model, ISA tags, threads; GPU name when one ran)."""
    seen: dict[str, None] = {}
    for r in rows:
        t = r["tags"]
        if not t.get("cpu.isa") and not t.get("device_name"):
            continue
        cpu = f"{t.get('cpu_model', '?')} (family {t.get('cpu.family', '?')} model {t.get('cpu.model', '?')}, " \
              f"{t.get('cpu.isa', '?')}, bf16 {t.get('cpu.bf16', '?')}), {t.get('threads', '?')} threads"
        gpu = t.get("device_name", "") if str(t.get("device", "")).startswith("cuda") else ""
        seen[f"{gpu} on {cpu}" if gpu else cpu] = None
    return list(seen)
