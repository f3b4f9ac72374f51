"""A sweep's comparison at a glance: report.md (one row per cell) and report.png (speed vs quality).

Regenerate from a sweep folder or from MLflow:

    python -m harness.report results/<sweep>
    python -m harness.report --mlflow-experiment quantbench [--sweep quant_sweep] [--tracking-uri URI]

Rows come from result dicts (the cell JSON layout of harness.run.runner.Result; MLflow runs are converted to
it), so both sources give the same table. The speed ratio compares each cell with the sweep's baseline
cell (quantizer named `sweep.baseline`, default "none") of the same strategy and batch size.

The metric columns, their headers, formats and which direction is better come from the metric table
(harness/metrics.py, `Metric.column`): a column shows when it is `always` shown or some cell has the metric.
To add one, give the metric a `Column` there; nothing here changes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from harness.analysis import crossover, figures, scaling, task_accuracy
from harness.analysis.roofline import roofline_plot
from harness.config import TrackingConfig
from harness.errors import QuantbenchError
from harness.metrics import HEADLINE, METRICS, Metric, direction_mark, report_columns
from harness.metrics import value as _num  # a finite float or None
from harness.records.results import invocation_cells, sweep_baseline

log = logging.getLogger("quantbench")


def _fmt(v: float | None, fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


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


def _machine_line(rows: list[dict]) -> list[str]:
    found = machines(rows)
    if len(found) == 1:
        return [f"Measured on {found[0]}.", ""]
    if found:  # speeds from different CPUs are not comparable: say so before the table
        return [f"**Cells ran on {len(found)} different machines; compare speeds only within one:** "
                + "; ".join(found) + ".", ""]
    return []


def columns(rows: list[dict]) -> list[Metric]:
    """The metric columns of this table: the `always` ones and those some cell has, in table order."""
    return [METRICS[n] for n in report_columns()
            if METRICS[n].column.always or any(_num(r["metrics"], n) is not None for r in rows)]


def _cell(m: dict, metric: Metric) -> str:
    """One metric's cell (with its p10–p90 spread where the column asks for it)."""
    col, v = metric.column, _num(m, metric.name)
    if v is None:
        return "—"
    text = col.fmt.format(v * col.scale)
    if col.spread:
        lo, hi = (_num(m, f"{metric.name}_{q}") for q in ("p10", "p90"))
        text += f" ({_fmt(lo, col.fmt)}–{_fmt(hi, col.fmt)})"
    return text


def markdown(rows: list[dict], baseline: str, title: str = "sweep") -> str:
    cols = columns(rows)
    head = ["cell", "quantizer", "strategy", "batch"]
    for c in cols:
        head.append(c.column.header + direction_mark(c.better))
        if c.name == HEADLINE:
            head.append(f"× {baseline}" + direction_mark(c.better))
    head.append("status")
    lines = [f"# {title}", "",
             f"{len(rows)} cell(s): " + ", ".join(f"{n} {s}" for s, n in sorted(_counts(rows).items())) + ". "
             f"Speed ratio against the `{baseline}` cell of the same strategy and batch size; KL and top-1 "
             "against the unquantized reference. ↑ higher is better, ↓ lower is better (harness/metrics.py).", "",
             *_machine_line(rows), "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["cell"].replace("|", "\\|"), r["quantizer"], r["strategy"], str(r["batch"])]
        for c in cols:
            cells.append(_cell(r["metrics"], c))
            if c.name == HEADLINE:
                cells.append(_fmt(r["ratio"], "{:.2f}"))
        lines.append("| " + " | ".join([*cells, r["status"]]) + " |")
    bad = [r for r in rows if r["status"] not in ("OK", "SKIPPED")]
    if bad:
        lines += ["", "## Cells that did not finish", ""]
        lines += [f"- **{r['cell']}** [{r['status']}]: {r['error'] or 'no message'}" for r in bad]
    skipped = [r for r in rows if r["status"] == "SKIPPED"]
    if skipped:  # not failures: the cell cannot run on this hardware (the sweep still succeeds)
        lines += ["", "## Cells skipped on this machine", ""]
        lines += [f"- **{r['cell']}** [SKIPPED]: {r['error'] or 'no reason given'}" for r in skipped]
    return "\n".join(lines) + "\n"


def _mean_sd(m: dict, key: str) -> str:
    mean, sd = _num(m, f"{key}_mean"), _num(m, f"{key}_sd")
    return "—" if mean is None else f"{mean:.2f} ± {sd or 0.0:.2f}"


def bench_table(rows: list[dict]) -> str:
    """llama-bench's table (one row per test: pp = prompt processing, tg = generation; t/s as mean ± sd
    over the timed calls) for the cells that ran fixed-length synthetic prompts (harness/measure/workloads.py)."""
    lines = []
    for r in rows:
        m, tags = r["metrics"], r["tags"]
        if r["status"] != "OK" or tags.get("workload.kind") != "synthetic":
            continue
        engine = tags.get("engine", "?")
        fmt = (f"llama.cpp {tags.get('kernel_path', '').split('[', 1)[-1].split(':', 1)[0]}" if engine == "llama_cpp"
               else f"quantbench {r['quantizer']}" + (f" ({tags['quantizer.backend']})"
                                                      if tags.get("quantizer.backend") else ""))
        size, params = _num(m, "weight_bytes"), _num(m, "params")
        head = [tags.get("model.name", "?"), fmt, _fmt(size / 2**20 if size else None, "{:.2f} MiB"),
                _fmt(params / 1e6 if params else None, "{:.2f} M"), str(tags.get("threads", "?")),
                str(r["batch"])]
        if (_num(m, "prompt_len_tokens") or 0) > 1 and _num(m, "prompt_tokens_per_s_mean"):
            lines.append("| " + " | ".join([*head, tags.get("workload.pp", "?"),
                                            _mean_sd(m, "prompt_tokens_per_s")]) + " |")
        if _num(m, "decode_tokens_per_s_mean"):
            lines.append("| " + " | ".join([*head, tags.get("workload.tg", "?"),
                                            _mean_sd(m, "decode_tokens_per_s")]) + " |")
    if not lines:
        return ""
    return "\n".join(["", "## Prompt processing and generation (llama-bench's table)", "",
                       "pp = prefill tokens/s (TTFT), tg = decode tokens/s, mean ± sd over the timed calls, on "
                       "the same seeded token ids for every engine (`workload.hash` tag).", "",
                       "| model | engine | size | params | threads | batch | test | t/s |",
                       "|---|---|---|---|---|---|---|---|", *lines]) + "\n"


def _counts(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


def plot(rows: list[dict], path: Path, title: str = "sweep") -> Path:
    """Tokens/s against KL divergence, one labelled point per OK cell (p10–p90 as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    ok = [r for r in rows if r["status"] == "OK" and _num(r["metrics"], HEADLINE)]
    for r in ok:
        m = r["metrics"]
        tps = _num(m, HEADLINE)
        kl = _num(m, "kl_div_mean")
        lo, hi = _num(m, f"{HEADLINE}_p10") or tps, _num(m, f"{HEADLINE}_p90") or tps
        ax.errorbar([kl or 0.0], [tps], yerr=[[max(tps - lo, 0)], [max(hi - tps, 0)]], fmt="o" if kl is not None
                    else "x", capsize=3)
        ax.annotate(r["cell"], (kl or 0.0, tps), textcoords="offset points", xytext=(5, 5), fontsize=7)
    kls = [_num(r["metrics"], "kl_div_mean") or 0.0 for r in ok]
    if kls and max(kls) > 0:
        ax.set_xscale("symlog", linthresh=max(min([k for k in kls if k > 0]), 1e-6))
    ax.set_xlabel("KL divergence to the reference (mean, lower is better; x = not measured)")
    ax.set_ylabel("decode tokens/s (higher is better)")
    bad = len(rows) - len(ok)
    ax.set_title(f"{title}: speed vs quality" + (f" ({bad} cell(s) not OK, see report.md)" if bad else ""))
    ax.grid(True, alpha=0.3)
    return figures.save(fig, path)


def write_report(folder: Path, cells: list[dict], baseline: str = "none", title: str = "sweep") -> list[Path]:
    """Write report.md and report.png into folder; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = rows_for(cells, baseline)
    md = folder / "report.md"
    md.write_text(markdown(rows, baseline, title) + task_accuracy.section(rows) + bench_table(rows)
                  + crossover.section(rows, baseline) + scaling.section(rows))
    paths = [md, plot(rows, folder / "report.png", title)]
    paths += crossover.write(folder, rows, baseline, title)  # cells varying batch size / context depth
    paths += scaling.write(folder, rows, title)  # cells spanning model sizes (harness/analysis/scaling.py)
    bound = [{"label": r["cell"], "decode_tokens_per_s": _num(r["metrics"], HEADLINE),
              "roofline_tokens_per_s": _num(r["metrics"], "roofline_tokens_per_s")}
             for r in rows if r["status"] == "OK" and _num(r["metrics"], "roofline_tokens_per_s")]
    if bound:  # achieved vs bound per cell (harness.analysis.roofline)
        paths.append(roofline_plot(bound, folder / "roofline.png"))
    return paths


def cells_from_mlflow(tracking_uri: str, experiment: str, sweep: str = "") -> tuple[str, list[dict]]:
    """The latest sweep's (or the named sweep's) cells as result dicts, from MLflow runs."""
    from mlflow.tracking import MlflowClient  # slow to import: only this path reads MLflow

    c = MlflowClient(tracking_uri=tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise QuantbenchError(f"no MLflow experiment {experiment!r} at {tracking_uri}; check --mlflow-experiment "
                              "and --tracking-uri")
    filt = "tags.`quantbench.role` = 'sweep'" + (f" and tags.`quantbench.sweep` = '{sweep}'" if sweep else "")
    parents = c.search_runs([exp.experiment_id], filter_string=filt, order_by=["attributes.start_time DESC"],
                            max_results=1)
    if not parents:
        raise QuantbenchError(f"no sweep run{' named ' + repr(sweep) if sweep else ''} in experiment "
                              f"{experiment!r}; run one with: python run.py +experiment=smoke")
    parent = parents[0]
    children = c.search_runs([exp.experiment_id],
                             filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                             order_by=["attributes.start_time ASC"], max_results=5000)
    latest: dict[str, dict] = {}
    for run in children:
        tags = dict(run.data.tags)
        if tags.get("superseded_by"):
            continue
        params = run.data.params
        status = tags.get("status") or {"FINISHED": "OK", "KILLED": "KILLED"}.get(run.info.status, "FAILED")
        cell = {"status": status, "metrics": dict(run.data.metrics), "tags": tags,
                "run_name": run.info.run_name, "error": tags.get("error", ""), "mlflow_run_id": run.info.run_id,
                "config": {"sweep": {"baseline": params.get("sweep.baseline", "")},
                           "strategy": {"batch_size": params.get("strategy.batch_size")}}}
        latest[tags.get("config_hash") or run.info.run_id] = cell  # ascending start: the rerun wins
    return parent.data.tags.get("quantbench.sweep", sweep or "sweep"), list(latest.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report",
                                 description="Write report.md and report.png for a sweep, from its results folder "
                                             "or from MLflow.")
    ap.add_argument("folder", nargs="?", help="a sweep folder, e.g. results/smoke")
    ap.add_argument("--mlflow-experiment", default="", help="read the sweep from this MLflow experiment instead")
    ap.add_argument("--sweep", default="", help="with --mlflow-experiment: the sweep name (default: the latest)")
    ap.add_argument("--tracking-uri", default="", help="MLflow URI (default: sqlite store under results/)")
    ap.add_argument("--out", default="", help="where to write (default: the sweep folder)")
    ap.add_argument("--all", action="store_true", help="folder mode: every cell in cells/, not only the latest run")
    ap.add_argument("--baseline", default="", help="quantizer name for the speed ratio (default: the sweep's)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.mlflow_experiment:
            uri = args.tracking_uri or TrackingConfig().resolved_uri()
            name, cells = cells_from_mlflow(uri, args.mlflow_experiment, args.sweep)
            out = Path(args.out or Path(TrackingConfig().results_dir) / name)
        elif args.folder:
            folder = Path(args.folder)
            if not folder.is_dir():
                raise QuantbenchError(f"{folder} is not a sweep folder; pass results/<sweep> (run one with: "
                                      "python run.py +experiment=smoke)")
            if args.all:
                cells = [json.loads(p.read_text()) for p in sorted((folder / "cells").glob("*.json"))]
            else:
                cells = invocation_cells(folder)
            name, out = folder.name, Path(args.out or folder)
        else:
            raise QuantbenchError("pass a sweep folder (results/<sweep>) or --mlflow-experiment NAME")
        if not cells:
            raise QuantbenchError("no cell results found; run the sweep first (python run.py +experiment=<name>)")
    except QuantbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    baseline = args.baseline or sweep_baseline(cells)
    paths = write_report(out, cells, baseline=baseline, title=f"sweep {name}")
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
