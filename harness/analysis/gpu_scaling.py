"""GPU scaling (issue #29 item 5): weight formats on a CUDA GPU across model shapes and batch sizes.

The cells are conf/experiment/gpu_scaling.yaml ({Llama-3.2-1B, 3.2-3B, 3.1-8B shapes} x {fp16, int8, int4,
gptq_int4, awq_int4, bnb_nf4, bnb_int8} at batch 1) and gpu_scaling_batch.yaml (the 8B shape, fp16 / int8 /
int4 at batch 1, 4, 16, 64), run as a sweep or as benchmarks/gpu_check.py's `--suite gpu_scaling` parts.

`section(rows)` (report.md) gives, per shape at batch 1: tok/s, ms/token and the speed over fp16 of the same
shape, the linears' floor (`linear_floor_ms`: every linear of the loaded model once at one row, in one CUDA
graph), its share of the step (`linear_floor_share`) and the rest (`step_rest_ms`: attention, norms, sampling,
launch), the decode path and the kernel tag (`kernel.linear`); each present only when the run recorded it.
Then the done-when lines of issue #29 (best 4-bit >= 1.8x fp16, best 8-bit >= 1.45x, fp16's floor share >=
0.85, a kernel named in every row) and, over batch, each format's tok/s and x fp16 with the batch where it
stops beating fp16: interpolated linearly in the ratio between the two measured batches around 1.0x, on a
log2 batch axis, or "not within 1-64". `write(folder, rows)` draws gpu_scaling.png: tok/s against batch
(log-log) at the batch shape, and x fp16 per shape at batch 1. Used by harness/records/report.py for any sweep
with CUDA rows of a random-weight shape, and by gpu_check's suite; merging several parts' folders:

    python -m harness.analysis.gpu_scaling OUT1 OUT2 ... [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from harness.analysis import figures
from harness.metrics import value
from harness.records.rows import describe

SHAPES = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")  # smallest first
FORMATS = ("fp16", "int8", "int4", "gptq_int4", "awq_int4", "bnb_nf4", "bnb_int8")
BATCH_SHAPE = "llama-3.1-8b"
BATCHES = (1, 4, 16, 64)
BATCH_FORMATS = ("fp16", "int8", "int4")
BASELINE = "fp16"
FOUR_BIT = ("int4", "torchao_int4", "gptq_int4", "awq_int4", "bnb_nf4")  # torchao_int4: gpu_check's tinygemm hedge
EIGHT_BIT = ("int8", "bnb_int8")
TARGETS = {"4-bit": 1.8, "8-bit": 1.45, "floor": 0.85}  # issue #29's done-when, at the 8B shape
H200_FLOOR = ("llama-3.1-8b", 4.65)  # ms: ../shared/FACTS.md, every 8B fp16 matrix at one row, one CUDA graph
NO_KERNEL = ("", "none", "not visible", "?", "no cuda kernels", "profile failed")  # tag prefixes that name no kernel


def points(rows: list[dict]) -> list[dict]:
    """One point per OK CUDA row of a named shape with a speed; a later row of the same cell replaces an earlier."""
    found: dict[tuple, dict] = {}
    for r in rows:
        t, m = r["tags"], r["metrics"]
        tps, arch = value(m, "decode_tokens_per_s"), t.get("model.arch")
        if r["status"] != "OK" or not tps or not arch or not str(t.get("device", "")).startswith("cuda"):
            continue
        batch = int(r["batch"])
        peak = value(m, "peak_mem_mb")
        found[(arch, r["quantizer"], batch)] = {
            "shape": arch, "format": r["quantizer"], "batch": batch, "tps": tps, "ms_token": 1e3 / tps,
            "step_ms": batch * 1e3 / tps, "floor_ms": value(m, "linear_floor_ms"),
            "floor_share": value(m, "linear_floor_share"), "rest_ms": value(m, "step_rest_ms"),
            "kernel": str(t.get("kernel.linear") or t.get("kernel_path") or ""),
            "path": str(t.get("fast_path") or t.get("decode_path") or ""), "params": value(m, "params") or 0.0,
            "peak_gb": peak * 2**20 / 1e9 if peak else None,  # MiB -> GB
            "load_s": value(m, "load_s"), "gpu": t.get("device_name", "")}
    return sorted(found.values(), key=lambda p: (_shape_key(p["shape"], found), _format_key(p["format"]), p["batch"]))


def _shape_key(shape: str, found: dict) -> tuple:
    params = max((p["params"] for p in found.values() if p["shape"] == shape), default=0.0)
    return (SHAPES.index(shape) if shape in SHAPES else len(SHAPES), params, shape)


def _format_key(fmt: str) -> tuple:
    return (FORMATS.index(fmt) if fmt in FORMATS else len(FORMATS), fmt)


def applies(rows: list[dict]) -> bool:
    pts = points(rows)
    return len(pts) >= 2 and any(p["format"] == BASELINE for p in pts)


def ratio(pts: list[dict], p: dict) -> float | None:
    """`p`'s tok/s over fp16's at the same shape and batch (None without that fp16 row)."""
    base = next((q for q in pts if (q["shape"], q["batch"], q["format"]) == (p["shape"], p["batch"], BASELINE)), None)
    return p["tps"] / base["tps"] if base else None


def crossover(ratios: list[tuple[int, float]]) -> tuple[float | None, str]:
    """(batch, words) where a format's speed over fp16 first drops below 1.0, from (batch, ratio) pairs.

    Between the last batch at or above 1.0x and the next one below, the crossing is interpolated linearly in
    the ratio on a log2 batch axis; None when the format never beats fp16 or never stops beating it."""
    pts = sorted(ratios)
    if not pts:
        return None, "—"
    if pts[0][1] < 1.0:
        return None, f"never ahead: {pts[0][1]:.2f}x at batch {pts[0][0]}"
    for (b0, r0), (b1, r1) in zip(pts, pts[1:], strict=False):
        if r0 >= 1.0 > r1:
            x = math.log2(b0) + (r0 - 1.0) / (r0 - r1) * (math.log2(b1) - math.log2(b0))
            return 2 ** x, f"~{2 ** x:.1f} (between {b0}: {r0:.2f}x and {b1}: {r1:.2f}x)"
    return None, f"not within {pts[0][0]}-{pts[-1][0]} (still {pts[-1][1]:.2f}x at {pts[-1][0]})"


def batch_series(pts: list[dict]) -> tuple[str, dict[str, list[dict]]]:
    """(shape, format -> its points by batch) at the shape measured at the most batch sizes (8B preferred)."""
    shapes = {p["shape"] for p in pts}
    if not shapes:
        return "", {}
    shape = max(shapes, key=lambda s: (len({p["batch"] for p in pts if p["shape"] == s}), s == BATCH_SHAPE))
    series: dict[str, list[dict]] = {}
    for p in pts:
        if p["shape"] == shape:
            series.setdefault(p["format"], []).append(p)
    series = {f: sorted(sel, key=lambda p: p["batch"]) for f, sel in series.items() if len(sel) >= 2}
    return shape, series if BASELINE in series else {}  # formats measured at one batch size are the shape table's


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


def _names_kernel(tag: str) -> bool:
    return not any(tag.strip().lower().startswith(bad) for bad in NO_KERNEL if bad) and bool(tag.strip())


def verdicts(pts: list[dict]) -> list[str]:
    """Per shape at batch 1, issue #29's done-when: best 4-bit and 8-bit over fp16, fp16's floor share, kernels."""
    lines = []
    for shape in dict.fromkeys(p["shape"] for p in pts):
        mine = [p for p in pts if p["shape"] == shape and p["batch"] == 1]
        base = next((p for p in mine if p["format"] == BASELINE), None)
        if base is None:
            continue
        parts = []
        for label, group in (("4-bit", FOUR_BIT), ("8-bit", EIGHT_BIT)):
            got = [(p["tps"] / base["tps"], p["format"]) for p in mine if p["format"] in group]
            if got:
                best = max(got)
                parts.append(f"best {label} {best[1]} **{best[0]:.2f}x** fp16 ("
                             f"{'meets' if best[0] >= TARGETS[label] else 'below'} {TARGETS[label]}x)")
        share = base["floor_share"]
        parts.append("fp16 floor share " + (f"**{share:.2f}** ({'meets' if share >= TARGETS['floor'] else 'below'} "
                                            f"{TARGETS['floor']})" if share is not None else "not recorded"))
        if shape == H200_FLOOR[0] and "H200" in str(base["gpu"]) and base["floor_ms"] is not None:
            # the reference: every weight matrix of this shape at one row in one CUDA graph, 4.65 ms on an H200
            off = base["floor_ms"] / H200_FLOOR[1] - 1
            parts.append(f"fp16 floor {base['floor_ms']:.2f} ms vs {H200_FLOOR[1]} ms measured before "
                         f"({off:+.0%}: {'within' if abs(off) <= 0.10 else 'outside'} 10%)")
        unnamed = [p["format"] for p in mine if not _names_kernel(p["kernel"])]
        parts.append(f"kernel named in {len(mine) - len(unnamed)}/{len(mine)} rows"
                     + (f" (not: {', '.join(unnamed)})" if unnamed else ""))
        lines.append(f"- {shape}, batch 1: " + "; ".join(parts) + ".")
    return lines


def section(rows: list[dict]) -> str:
    if not applies(rows):
        return ""
    pts = points(rows)
    gpus = sorted({p["gpu"] for p in pts if p["gpu"]})
    lines = ["", "## GPU scaling: weight formats by shape and batch" + (f" on {', '.join(gpus)}" if gpus else ""), "",
             "Batch 1, per shape. × fp16 = tok/s over fp16 of the same shape and batch; linear floor = every linear of "
             "the loaded model once at one row in one CUDA graph (metric linear_floor_ms), floor share = floor / decode "
             "step, rest = step − floor (attention, norms, sampling, launch); path = the decode path that ran (tag "
             "fast_path: compiled, or eager when the format could not be compiled); kernel = tag kernel.linear. "
             "— = not recorded by the run. Figure: gpu_scaling.png.", "",
             "| shape | format | tok/s | ms/token | × fp16 | linear floor ms | floor share | rest ms | path | kernel "
             "| peak GB | load s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in (q for q in pts if q["batch"] == 1):
        lines.append(f"| {p['shape']} | {p['format']} | {p['tps']:.1f} | {p['ms_token']:.2f} | "
                     f"{_f(ratio(pts, p), '{:.2f}x')} | {_f(p['floor_ms'], '{:.2f}')} | "
                     f"{_f(p['floor_share'], '{:.2f}')} | {_f(p['rest_ms'], '{:.2f}')} | {p['path'] or '—'} | "
                     f"{p['kernel'].replace('|', '/') or '—'} | {_f(p['peak_gb'], '{:.1f}')} | "
                     f"{_f(p['load_s'], '{:.0f}')} |")
    found = verdicts(pts)
    if found:
        lines += ["", "Issue #29's targets (at the 8B shape): best 4-bit ≥ 1.8x fp16, best 8-bit ≥ 1.45x, fp16 at ≥ "
                      "0.85 of its floor (floor share), a CUDA kernel named in every row:", "", *found]
    shape, series = batch_series(pts)
    if series:
        batches = sorted({p["batch"] for sel in series.values() for p in sel})
        lines += ["", f"### Batch: where each weight-only format stops beating fp16 ({shape})", "",
                  "Aggregate decode tok/s (× fp16 at the same batch); the crossing is interpolated linearly in the "
                  "ratio on a log2 batch axis between the two measured batches around 1.0x.", "",
                  "| format | " + " | ".join(f"batch {b}" for b in batches) + " | stops beating fp16 at batch |",
                  "|---|" + "---|" * (len(batches) + 1)]
        for fmt, sel in sorted(series.items(), key=lambda kv: _format_key(kv[0])):
            by = {p["batch"]: p for p in sel}
            cells = []
            for b in batches:
                p = by.get(b)
                r = ratio(pts, p) if p else None
                cells.append("—" if p is None else f"{p['tps']:.0f}" + (f" ({r:.2f}x)" if r is not None else ""))
            pairs = [(p["batch"], r) for p in sel if (r := ratio(pts, p)) is not None]
            where = "(baseline)" if fmt == BASELINE else crossover(pairs)[1]
            lines.append(f"| {fmt} | " + " | ".join(cells) + f" | {where} |")
    return "\n".join(lines) + "\n"


def write(folder: Path, rows: list[dict], title: str = "gpu_scaling") -> list[Path]:
    """gpu_scaling.png: tok/s against batch (left, when several batches ran) and x fp16 per shape at batch 1."""
    if not applies(rows):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(rows)
    shape, series = batch_series(pts)
    shapes = list(dict.fromkeys(p["shape"] for p in pts if p["batch"] == 1))
    panels = (["batch"] if series else []) + (["shape"] if shapes else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), dpi=110, squeeze=False)
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(sorted({p["format"] for p in pts},
                                                                            key=_format_key))}
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "batch":
            for fmt, sel in sorted(series.items(), key=lambda kv: _format_key(kv[0])):
                ax.plot([p["batch"] for p in sel], [p["tps"] for p in sel], "o-", color=colors[fmt], label=fmt,
                        lw=2.2 if fmt == BASELINE else 1.2)
                where = crossover([(p["batch"], r) for p in sel if (r := ratio(pts, p)) is not None])[0]
                if fmt != BASELINE and where is not None:  # x in data, y in axes fraction: any scale
                    ax.axvline(where, color=colors[fmt], ls=":", lw=1)
                    ax.annotate(f"{fmt} = fp16 at ~{where:.0f}", (where, 0.03), xycoords=ax.get_xaxis_transform(),
                                fontsize=7, rotation=90, xytext=(2, 0), textcoords="offset points", color=colors[fmt])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            batches = sorted({p["batch"] for sel in series.values() for p in sel})
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_xlabel("batch size (static batch)")
            ax.set_ylabel("decode tokens/s, all rows (higher is better)")
            ax.set_title(f"{shape}: tok/s vs batch (dotted: where a format meets fp16)", fontsize=9)
        else:
            xs = range(len(shapes))
            for fmt in sorted({p["format"] for p in pts}, key=_format_key):
                got = [(i, ratio(pts, p)) for i, s in enumerate(shapes) for p in pts
                       if (p["shape"], p["format"], p["batch"]) == (s, fmt, 1)]
                got = [(i, r) for i, r in got if r is not None]
                if got:
                    ax.plot([i for i, _ in got], [r for _, r in got], "o-", color=colors[fmt], label=fmt)
            ax.axhline(1.0, color="black", lw=1)
            for label in ("8-bit", "4-bit"):
                ax.axhline(TARGETS[label], color="grey", ls="--", lw=0.8)
                ax.annotate(f"{label} target {TARGETS[label]}x", (0, TARGETS[label]), fontsize=7, color="grey",
                            xytext=(2, 2), textcoords="offset points")
            ax.set_xticks(list(xs), shapes)
            ax.set_ylabel("speed over fp16 of the same shape, batch 1")
            ax.set_title("× fp16 per shape (batch 1)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: weight formats on the GPU", fontsize=10)
    return [figures.save(fig, Path(folder) / "gpu_scaling.png")]


def read_results(folders: list[Path]) -> list[dict]:
    """Every result JSON under `folders` (a sweep's cells/, gpu_check's cells/<cell>/runs/), oldest first."""
    found = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and {"status", "tags", "metrics"} <= set(data):
                found.append(data)
    return sorted(found, key=lambda c: str(c.get("ended") or c.get("started") or ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.analysis.gpu_scaling",
                                 description="gpu_scaling.md and gpu_scaling.png from the result JSONs under folders "
                                             "(a sweep folder, or the OUT folders of gpu_check's suite parts)")
    ap.add_argument("folders", nargs="+", help="folders to read result JSONs from (recursively)")
    ap.add_argument("--out", default="", help="where to write (default: the first folder)")
    args = ap.parse_args(argv)
    rows = [describe(c) for c in read_results([Path(f) for f in args.folders])]
    if not applies(rows):
        print(f"error: no OK CUDA results of a model shape (with an fp16 row) under {', '.join(args.folders)}",
              file=sys.stderr)
        return 2
    out = Path(args.out or args.folders[0])
    out.mkdir(parents=True, exist_ok=True)
    md = out / "gpu_scaling.md"
    md.write_text(f"# GPU scaling: {len(points(rows))} measured cell(s) from {', '.join(args.folders)}\n"
                  + section(rows))
    try:
        paths = [md, *write(out, rows, "gpu_scaling")]
    except ImportError as exc:  # a machine without matplotlib still gets the table
        print(f"gpu_scaling: no figure ({exc})", file=sys.stderr)
        paths = [md]
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
