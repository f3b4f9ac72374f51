"""The report's view of a sweep's cells: one row per result dict, with its speed ratio to the baseline cell."""

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


def _baseline_speed(rows: list[dict], baseline: str) -> dict[tuple, float]:
    speeds: dict[tuple, float] = {}
    for r in rows:
        tps = _num(r["metrics"], HEADLINE)
        if r["status"] == "OK" and r["quantizer"] == baseline and tps:
            speeds.setdefault((r["strategy"], r["batch"], r["depth"]), tps)
            speeds.setdefault((r["strategy"], r["batch"]), tps)
            speeds.setdefault((r["strategy"],), tps)
            speeds.setdefault((), tps)
    return speeds


def rows_for(cells: list[dict], baseline: str = "none") -> list[dict]:
    rows = [describe(c) for c in cells]
    speeds = _baseline_speed(rows, baseline)
    for r in rows:
        base = (speeds.get((r["strategy"], r["batch"], r["depth"])) or speeds.get((r["strategy"], r["batch"]))
                or speeds.get((r["strategy"],)) or speeds.get(()))
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
