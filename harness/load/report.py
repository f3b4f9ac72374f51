"""The serving section of a sweep's report: the capacity table and the latency-throughput figure (serving.png).

One line per format and target (in-process: the quantizer; llama-server or a URL: the GGUF format). The
figure draws each line's offered rates as p90 TTFT and p90 TPOT against the request throughput they achieved
(the sweep's synchronous run a hollow circle, its maximum-throughput run an x), with the SLO limits as
horizontal lines: where a curve bends up is where the format runs out of room.
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.analysis import figures

SWEEP_ENDS = ("synchronous", "throughput")  # the sweep's two closed runs: drawn as markers, not as rates
CAP_COLS = ("capacity_ttft_ms_p50", "capacity_ttft_ms_p90", "capacity_ttft_ms_p99",
            "capacity_tpot_ms_p50", "capacity_tpot_ms_p90", "capacity_tpot_ms_p99")


def applies(rows: list[dict]) -> bool:
    return any(r.get("children") for r in rows)


def label(row: dict) -> str:
    t = row["tags"]
    target = t.get("load.target", "?")
    fmt = t.get("engine.format") if target != "in-process" else t.get("quantizer.name")
    return f"{fmt or row['quantizer']} ({target})"


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def single_stream(row: dict) -> float | None:
    """Decode tokens/s of one request alone: 1000 / the synchronous run's median TPOT."""
    sync = next((c for c in row.get("children") or [] if c["tags"].get("load.point") == "synchronous"), None)
    tpot = sync and sync["metrics"].get("serve_tpot_ms_p50")
    return 1000.0 / tpot if tpot and not math.isnan(tpot) else None


def capacity_cell(row: dict) -> str:
    """The capacity, or "< lowest rate" when no offered rate met the SLO share."""
    cap = row["metrics"].get("capacity_rps")
    if cap == 0.0:
        offered = [c["metrics"].get("offered_rps") for c in row.get("children") or []]
        lowest = min((o for o in offered if o is not None and not math.isnan(o)), default=None)
        return f"< {lowest:.2f}" if lowest is not None else "0"
    return ("≥ " if row["tags"].get("load.capacity_bound", "").startswith("at least") else "") + _f(cap, "{:.2f}")


def section(rows: list[dict]) -> str:
    rows = [r for r in rows if r.get("children")]
    if not rows:
        return ""
    slo = rows[0]["tags"].get("load.slo", "none")
    lines = ["", "## Serving: capacity under the SLO", "",
             f"SLO per request: {slo}. Capacity: the knee, the highest offered rate whose goodput (requests meeting "
             "every limit) is at least load.goodput_share of it with every lower rate passing too (≥: every rate "
             "offered passed, so the SLO did not bind up to there; <: the lowest rate failed); TTFT and TPOT "
             "percentiles at that rate. single-stream: 1000 / the synchronous run's median TPOT. open loop: every "
             "rate's p99 send lag within load.max_send_lag_ms.", "",
             "| format (target) | capacity req/s | TTFT ms p50 / p90 / p99 | TPOT ms p50 / p90 / p99 | max req/s | "
             "single-stream tok/s | open loop | status |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -(r["metrics"].get("capacity_rps") or 0.0)):
        m = r["metrics"]
        ttft = " / ".join(_f(m.get(k), "{:.0f}") for k in CAP_COLS[:3])
        tpot = " / ".join(_f(m.get(k), "{:.1f}") for k in CAP_COLS[3:])
        lines.append(f"| {label(r)} | {capacity_cell(r)} | {ttft} | {tpot} | "
                     f"{_f(m.get('max_rps'), '{:.2f}')} | {_f(single_stream(r), '{:.1f}')} | "
                     f"{r['tags'].get('load.open_loop', '?')} | {r['status']} |")
    order_cap = [label(r) for r in sorted(rows, key=lambda r: -(r["metrics"].get("capacity_rps") or 0.0))]
    order_one = [label(r) for r in sorted(rows, key=lambda r: -(single_stream(r) or 0.0))]
    lines += ["", f"Order by capacity: {' > '.join(order_cap)}.", f"Order by single-stream speed: {' > '.join(order_one)}."]
    return "\n".join(lines) + "\n"


def write(folder: Path, rows: list[dict], title: str = "serving") -> list[Path]:
    rows = [r for r in rows if r.get("children")]
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), dpi=110)
    colors = plt.get_cmap("tab10")
    limits = {}
    for part in rows[0]["tags"].get("load.slo", "").split(", "):
        if "<=" in part:
            key, value = part.split("<=")
            limits[key.strip()] = float(value)
    for k, r in enumerate(sorted(rows, key=label)):
        done = [c for c in r["children"] if c["metrics"].get("requests_ok")]
        rates = sorted((c for c in done if c["tags"].get("load.point") not in SWEEP_ENDS),
                       key=lambda c: c["metrics"]["offered_rps"])
        style = "-o" if r["tags"].get("load.target") == "in-process" else "--s"
        for ax, key in zip(axes, ("ttft", "tpot"), strict=True):
            ax.plot([c["metrics"]["request_throughput_rps"] for c in rates],
                    [c["metrics"][f"serve_{key}_ms_p90"] for c in rates], style, color=colors(k % 10), ms=4,
                    label=label(r))
            for c in done:  # the sweep's synchronous (hollow) and maximum-throughput (x) runs, not joined
                if (point := c["tags"].get("load.point")) in SWEEP_ENDS:
                    ax.plot(c["metrics"]["request_throughput_rps"], c["metrics"][f"serve_{key}_ms_p90"],
                            "x" if point == "throughput" else "o", fillstyle="none", color=colors(k % 10), ms=6)
    for ax, key, name in zip(axes, ("ttft_ms", "tpot_ms"), ("p90 TTFT (ms)", "p90 TPOT (ms)"), strict=True):
        if key in limits:
            ax.axhline(limits[key], color="black", lw=1, ls=":", label=f"SLO {key} <= {limits[key]:g}")
        ax.set_yscale("log")
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel(name)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: latency against throughput, per format and target")
    return [figures.save(fig, Path(folder) / "serving.png")]
