"""The frontier's figure (harness/analysis/frontier.py): one column of panels per machine."""

from __future__ import annotations

from pathlib import Path

from harness.analysis import figures, frontier


def _y(p: frontier.Point, kind: str) -> tuple[float, list | None, list[str]]:
    """A point's y, its error bar and who dominates it, on the `kind` axis (task, kl or weight)."""
    if kind == "task" or (kind == "kl" and p.loss_kind == "kl"):
        return p.loss, [[p.loss - p.loss_lo], [p.loss_hi - p.loss]], p.dominated_by
    if kind == "kl":
        lo, hi = (p.kl_lo if p.kl_lo is not None else p.kl), (p.kl_hi if p.kl_hi is not None else p.kl)
        return p.kl, [[p.kl - lo], [hi - p.kl]], p.dominated_by_kl
    return (p.weight_bytes or 0) / 1e6, None, p.dominated_by


YLABEL = {"task": "task accuracy lost vs reference (lower is better)",
          "kl": "KL to the reference, nats (lower is better)", "weight": "weight MB (lower is better)"}


def plot(pts: list[frontier.Point], path: Path, title: str) -> Path:
    """One column of panels per machine: speedup (x, with its interval) against accuracy loss (y: task accuracy,
    and KL in a second row when tasks were scored) or weight MB; point size = weight bytes; dominated formats
    hollow and grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_machine = frontier.panels(pts)
    kinds = ["task", "kl"] if any(p.loss_kind == "task" for p in pts) else \
        ["kl" if any(p.loss_kind == "kl" for p in pts) else "weight"]
    fig, axes = plt.subplots(len(kinds), len(by_machine), figsize=(9 * len(by_machine), 6 * len(kinds)), dpi=100,
                             squeeze=False)
    for col, (machine, members) in enumerate(by_machine.items()):
        big = max((p.weight_bytes or 0) for p in members) or 1.0
        labels = [p.label for p in members]  # a panel holding several groups (batch sizes, settings) or reruns
        twice = {x for x in labels if labels.count(x) > 1}  # of one format: the label gets the group, else the cell
        groups = len({p.group for p in members}) > 1
        for row, kind in enumerate(kinds):
            ax = axes[row][col]
            for i, p in enumerate(q for q in members if kind == "weight" or q.loss_kind or q.kl is not None):
                nth = [q.label for q in members[:i]].count(p.label)  # stack a repeated format's labels
                y, yerr, beaten = _y(p, kind)
                if y is None:
                    continue
                color = "0.6" if beaten else None
                ax.errorbar([p.speedup], [y], xerr=[[p.speedup - p.lo], [p.hi - p.speedup]], yerr=yerr, fmt="none",
                            ecolor=color or "0.3", capsize=3, lw=1)
                ax.scatter([p.speedup], [y], s=30 + 300 * (p.weight_bytes or 0) / big, zorder=3,
                           facecolors="none" if beaten else color, edgecolors=color or "k")
                short = p.label.replace("aten::", "").replace("bitsandbytes::", "")
                if p.label in twice:
                    short += f" [{p.group}]" if groups else f" [{p.cell}]"
                ax.annotate(short + (" (dominated)" if beaten else ""), (p.speedup, y), textcoords="offset points",
                            xytext=(6, 4 - 9 * nth), fontsize=6.5)
            if kind == "kl":
                ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_ylabel(YLABEL[kind])
            ax.set_xlabel("decode speedup over the sweep's baseline cell (higher is better)")
            ax.set_title(machine if row == 0 else f"{machine}: the same formats by KL", fontsize=9)
            ax.grid(True, alpha=0.3)
    fig.suptitle(f"{title}: format frontier (size = weight bytes; hollow = dominated)", fontsize=10)
    return figures.save(fig, path)


def write(folder: Path, rows: list[dict], baseline: str, title: str, probes: list[dict] | None = None) -> list[Path]:
    """frontier.png for a sweep of two or more formats ([] otherwise)."""
    pts = frontier.points(rows, baseline, probes)
    if len({p.fmt for p in pts}) < 2:
        return []
    return [plot(pts, Path(folder) / "frontier.png", title)]
