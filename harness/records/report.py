"""A sweep's comparison at a glance: report.md (one row per cell) and report.png (speed vs quality).

Regenerate from a sweep folder or from MLflow:

    python -m harness.report results/<sweep>
    python -m harness.report --mlflow-experiment quantbench [--sweep quant_sweep] [--tracking-uri URI]

Rows come from result dicts (the cell JSON layout of harness.run.result.Result; MLflow runs are converted to
it), so both sources give the same table. The speed ratio compares each cell with the sweep's baseline
cell (quantizer named `sweep.baseline`, default "none") of the same machine, model, strategy, batch size
and context depth (harness/records/rows.py); a cell with no such baseline has no ratio.

The metric columns, their headers, formats and which direction is better come from the metric table
(harness/metrics.py, `Metric.column`): a column shows when it is `always` shown or some cell has the metric.
To add one, give the metric a `Column` there; nothing here changes.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import textwrap
from pathlib import Path

from harness.analysis import crossover, figures, frontier, frontier_plot, gpu_scaling, scaling, task_accuracy
from harness.analysis.roofline import roofline_plot
from harness.config import TrackingConfig
from harness.errors import QuantbenchError
from harness.load import report as serving
from harness.metrics import DIRECTION_MARK, HEADLINE, METRICS, Metric, report_columns
from harness.metrics import value as _num  # a finite float or None
from harness.records import sweeps
from harness.records.results import sweep_baseline
from harness.records.rows import describe, machines, rows_for  # the report's view of a cell
from harness.schema import no_password

log = logging.getLogger("quantbench")


def _fmt(v: float | None, fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


def _machine_line(rows: list[dict]) -> list[str]:
    found = per_cpu(rows)  # one CPU run with two thread counts is one machine (the ratios keep them apart)
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
    # a ratio column only where some cell compares with another: a sweep of `baseline` cells alone (a strategy
    # sweep) would print each cell against itself, 1.00 in every row
    ratios = any(r["quantizer"] != baseline and r["ratio"] is not None for r in rows)
    head = ["cell", "quantizer", "strategy", "batch"]
    for c in cols:
        head.append(c.column.header + DIRECTION_MARK.get(c.better, ""))
        if c.name == HEADLINE and ratios:
            head.append(f"× {baseline}" + DIRECTION_MARK.get(c.better, ""))
    head.append("status")
    speed = (f"Speed ratio against the `{baseline}` cell of the same machine, model, strategy, batch size and "
             "context depth, run with the same threads, tokens, prompts, dtype and cache/compile settings (none where "
             "that cell is missing)"
             if ratios else f"No speed ratio column: no cell has a `{baseline}` cell other than itself to compare with")
    lines = [f"# {title}", "",
             f"{len(rows)} cell(s): " + ", ".join(f"{n} {s}" for s, n in sorted(_counts(rows).items())) + ". "
             f"{speed}; KL and top-1 "
             "against the unquantized reference. ↑ higher is better, ↓ lower is better (harness/metrics.py).", "",
             *_machine_line(rows), "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["cell"].replace("|", "\\|"), r["quantizer"], r["strategy"], str(r["batch"])]
        for c in cols:
            cells.append(_cell(r["metrics"], c))
            if c.name == HEADLINE and ratios:
                cells.append(_fmt(r["ratio"], "{:.2f}"))
        lines.append("| " + " | ".join([*cells, r["status"]]) + " |")
    bad = [r for r in rows if r["status"] not in ("OK", "SKIPPED")]
    if bad:
        lines += ["", "## Cells that did not finish", ""]
        lines += [f"- **{r['cell']}** [{r['status']}]: {r['error'] or 'no message'}" for r in bad]
    warned = [(r, k, v) for r in rows for k, v in sorted(r["tags"].items()) if k.startswith("warning.") and v]
    if warned:  # a cell on a slow or forced path, a wide spread, a floor above its step: read its number with it
        lines += ["", "## Warnings", "", "Tags `warning.*` the run recorded: its numbers stand, read them with these.",
                  ""]
        lines += [f"- **{r['cell']}** `{k}`: {' '.join(str(v).split())}" for r, k, v in warned]
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


def per_cpu(rows: list[dict]) -> list[str]:
    """The machines the cells ran on, one line per CPU (or GPU) with its thread counts: "<cpu>, 1/2 threads"."""
    per: dict[str, list[str]] = {}  # "<cpu>, N threads" -> one line per CPU with its thread counts
    for m in machines(rows):
        cpu, _, threads = m.rpartition(", ")
        per.setdefault(cpu or m, []).append(threads.replace(" threads", "") if cpu else "")
    return [f"{cpu}, {'/'.join(t for t in th if t)} threads" if any(th) else cpu for cpu, th in per.items()]


def on_machines(rows: list[dict]) -> str:
    """A figure title's second line: the CPU (or GPU) every speed in it was measured on."""
    return "".join("\n" + textwrap.shorten(ln, 110) for ln in per_cpu(rows)[:3])


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
    ax.set_title(f"{title}: speed vs quality" + (f" ({bad} cell(s) not OK, see report.md)" if bad else "")
                 + on_machines(rows), fontsize=9)
    ax.grid(True, alpha=0.3)
    return figures.save(fig, path)


def machine_sections(folder: Path, rows: list[dict], baseline: str, title: str) -> tuple[str, list[Path]]:
    """The sections that fit, pair or overlay cells with one another, one machine at a time: crossover (batch
    size / context depth), scaling (model sizes), gpu_scaling (GPU shapes) and serving (load runs). A fit or a
    ratio across two CPUs or GPUs would be made up, so where several machines have such a section, each one's
    sections are titled with it and its figures go in a subfolder named after it."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["machine"], []).append(r)
    texts = {m: crossover.section(part, baseline) + scaling.section(part) + gpu_scaling.section(part)
             + serving.section(part) for m, part in groups.items()}
    shown = [m for m, t in texts.items() if t]  # a machine none of them applies to draws nothing either
    text, paths = "", []
    for machine in shown:
        part, got, sub = groups[machine], texts[machine], folder
        if len(shown) > 1:
            sub = folder / (re.sub(r"[^A-Za-z0-9]+", "-", machine).strip("-").lower() or "machine")
            got = re.sub(r"^## (.+)$", lambda m, on=machine: f"## {m.group(1)} (on {on})", got, flags=re.M)
            got = re.sub(r"\b(\w+\.png)\b", lambda m, d=sub.name: f"{d}/{m.group(1)}", got)
        text += got
        paths += crossover.write(sub, part, baseline, title)  # cells varying batch size / context depth
        paths += scaling.write(sub, part, title)  # cells spanning model sizes (harness/analysis/scaling.py)
        paths += gpu_scaling.write(sub, part, title)  # CUDA cells of model shapes (harness/analysis/gpu_scaling.py)
        paths += serving.write(sub, part, title)  # load runs: latency against throughput (harness/load/report.py)
    return text, paths


def write_report(folder: Path, cells: list[dict], baseline: str = "none", title: str = "sweep",
                 probes: list[dict] | None = None) -> list[Path]:
    """Write report.md and report.png (and the figures that apply) into folder; returns their paths.

    `probes`: the sweep's drift probe(s) (harness/sweep/drift.py), which widen the frontier's speed intervals."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = rows_for(cells, baseline)
    md = folder / "report.md"
    text, figs = machine_sections(folder, rows, baseline, title)
    md.write_text(markdown(rows, baseline, title) + frontier.section(rows, baseline, probes)
                  + task_accuracy.section(rows) + bench_table(rows) + text)
    paths = [md, plot(rows, folder / "report.png", title)]
    paths += frontier_plot.write(folder, rows, baseline, title, probes)  # two or more formats: the frontier figure
    paths += figs
    bound = [{"label": r["cell"], "decode_tokens_per_s": _num(r["metrics"], HEADLINE),
              "roofline_tokens_per_s": _num(r["metrics"], "roofline_tokens_per_s")}
             for r in rows if r["status"] == "OK" and _num(r["metrics"], "roofline_tokens_per_s")]
    if bound:  # achieved vs bound per cell (harness.analysis.roofline)
        paths.append(roofline_plot(bound, folder / "roofline.png", on_machines(rows)))
    return paths


def _check_baseline(baseline: str, found: list[sweeps.Sweep]) -> None:
    """Refuse a --baseline that is no quantizer of every sweep: its ratios would all be missing ("—")."""
    for s in found if baseline else []:
        present = sorted({describe(c)["quantizer"] for c in s.cells})
        if baseline not in present:
            raise QuantbenchError(f"--baseline {baseline!r} is no quantizer of sweep {s.name} ({s.source}); "
                                  f"choose one of: {', '.join(present)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report",
                                 description="Write report.md and report.png for a sweep, from its results folder "
                                             "or from MLflow; with --frontier, the format frontier of several sweeps.")
    ap.add_argument("folder", nargs="*", help="a sweep folder, e.g. results/smoke (--frontier: one or more)")
    ap.add_argument("--mlflow-experiment", default="", help="read the sweep from this MLflow experiment instead")
    ap.add_argument("--sweep", default="", help="with MLflow: the sweep (experiment) name (default: the latest)")
    ap.add_argument("--tracking-uri", default="", help="MLflow URI (default: sqlite store under results/)")
    ap.add_argument("--out", default="", help="where to write (default: the sweep folder)")
    ap.add_argument("--all", action="store_true", help="folder mode: every cell in cells/, not only the latest run")
    ap.add_argument("--baseline", default="", help="quantizer name for the speed ratio (default: the sweep's)")
    ap.add_argument("--frontier", action="store_true", help="the frontier of several sweeps, one panel per machine "
                    "(harness/records/sweeps.py): sweep folders, or MLflow sweeps named --sweep")
    ap.add_argument("--sweep-ids", default="", help="--frontier from MLflow: parent run ids, comma-separated")
    ap.add_argument("--tag", default="", help="--frontier from MLflow: only parent runs with this tag (KEY=VALUE)")
    args = ap.parse_args(argv)
    problems: list[str] = []
    no_password(problems, "--tracking-uri", args.tracking_uri, "set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (an MLflow server), or use ~/.pgpass or PGPASSFILE (a database)")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    uri = args.tracking_uri or TrackingConfig().resolved_uri()
    try:
        if args.frontier:
            if args.folder:
                found = [sweeps.from_folder(Path(f), args.all) for f in args.folder]
            elif args.sweep:
                ids = [i.strip() for i in args.sweep_ids.split(",") if i.strip()]
                found = sweeps.select_from_mlflow(uri, args.mlflow_experiment or TrackingConfig().experiment,
                                                  args.sweep, ids, args.tag)
            else:
                raise QuantbenchError("--frontier needs sweep folders or --sweep NAME (e.g. --sweep quant_sweep)")
            _check_baseline(args.baseline, found)
            out = Path(args.out or Path(TrackingConfig().results_dir) / f"frontier-{args.sweep or 'folders'}")
            print("wrote " + ", ".join(map(str, sweeps.write_frontier(found, out, args.baseline))))
            return 0
        if args.mlflow_experiment:
            sweep = sweeps.latest_from_mlflow(uri, args.mlflow_experiment, args.sweep)
            out = Path(args.out or Path(TrackingConfig().results_dir) / sweep.name)
        elif len(args.folder) == 1:
            sweep = sweeps.from_folder(Path(args.folder[0]), args.all)
            out = Path(args.out or args.folder[0])
        else:
            raise QuantbenchError("pass one sweep folder (results/<sweep>) or --mlflow-experiment NAME "
                                  "(several folders: add --frontier)")
        if not sweep.cells:
            raise QuantbenchError("no cell results found; run the sweep first (python run.py +experiment=<name>)")
        _check_baseline(args.baseline, [sweep])  # before anything is written: a typo would replace report.md
    except QuantbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    baseline = args.baseline or sweep.baseline or sweep_baseline(sweep.cells)
    paths = write_report(out, sweep.cells, baseline=baseline, title=f"sweep {sweep.name}", probes=sweep.probes)
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
