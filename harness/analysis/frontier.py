"""The format frontier: each format's speed against its accuracy loss, with intervals; dominated formats marked;
one recommendation line per constraint, or "cannot decide" where the intervals do not separate the candidates.

Speed (x): the speedup of a cell's decode tokens/s over the sweep's baseline cell (`sweep.baseline`, the model
as loaded: its 16-bit format). Its interval is the cell's own p10-p90 spread of per-call tokens/s, widened by
the sweep's **measured between-cell drift** D: the largest |log(a/b)| between two runs of one configuration in
two cells. The drift probe (`sweep.drift_probe=all`, harness/sweep/drift.py) runs every cell again, speed only,
after the last one and in reverse order (A B C ... C B A); a cell that ran twice is drawn at the geometric mean
of its runs, with the union of their spreads. Each end moves by a factor e^(D/2), so two formats' intervals
separate only when log(low_A / high_B) > D: a difference no larger than one configuration showed between two of
its cells in this sweep is never called a difference. Why this and not a block-interleaved pass like the gate's:
a cell is a fresh process, and what separates two of them (other load, clocks, where memory landed, how lucky
one format's process was) is what the rerun of each format sees; it needs no memory for every format at once
(an 8B sweep could not hold them), and the reverse order cancels a drift that grows through the sweep. Where
no drift was measured the report says so: the intervals are then within-cell only.

Accuracy loss (y): with tasks scored, the reference's task accuracy minus the format's, pooled over every
example of every task (paired: the flips give it exactly), +- 1.96 paired standard errors; McNemar's pooled p
beside its Holm-adjusted value over the formats of the sweep. Without tasks: the mean KL to the reference with
its block-bootstrap interval (harness/analysis/intervals.py). Sweeps without an accuracy pass (random-weight
shapes, `scaling`) get speed against weight bytes: random weights have no accuracy to lose.

Points compare within one machine and group: model, strategy, batch size and context depth, and the speed
settings that differ between the sweep's cells (threads, tokens, prompts, dtype: harness/records/rows.py), named
in the group's heading. A format is dominated when another of the same machine and group is better on both axes
beyond both intervals (the intervals do not overlap) and no larger in weight bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from harness.analysis import intervals
from harness.metrics import HEADLINE
from harness.metrics import value as _num
from harness.records.rows import baselines, lookup, setting_labels
from harness.records.rows import group as _group

ALPHA = 0.05  # significance level of the Holm-corrected task-accuracy test
KL_LIMIT = 0.01  # nats: "within KL 0.01" in the recommendation lines


@dataclass
class Point:
    """One format of one sweep on the frontier."""

    cell: str
    fmt: str
    kernel: str
    machine: str
    group: str  # model / strategy / batch (rows.group) and the speed settings that differ: points compare within one
    tps: float
    speedup: float
    lo: float
    hi: float
    weight_bytes: float | None
    loss_kind: str = ""  # "task" (accuracy points lost), "kl" (nats) or "" (no accuracy axis)
    loss: float | None = None
    loss_lo: float | None = None
    loss_hi: float | None = None
    p_raw: float | None = None
    p_holm: float | None = None
    kl: float | None = None
    kl_lo: float | None = None
    kl_hi: float | None = None
    dominated_by: list[str] = field(default_factory=list)
    dominated_by_kl: list[str] = field(default_factory=list)  # by KL instead of task accuracy (task sweeps only)

    @property
    def label(self) -> str:
        return f"{self.fmt} ({self.kernel})" if self.kernel else self.fmt


def _kernel(tags: dict) -> str:
    if tags.get("engine") == "llama_cpp":
        return "llama.cpp " + str(tags.get("kernel_path", "")).split("[", 1)[-1].rstrip("]")
    kernel = tags.get("kernel.linear") or tags.get("kernel_path") or ""
    return f"{kernel}, {tags['fast_path']}" if kernel and tags.get("fast_path") not in (None, "", "eager") else kernel


def replicates(rows: list[dict], probes: list[dict]) -> dict[str, dict]:
    """config hash -> the OK probe's metrics, for every probe that repeats an OK cell of `rows`."""
    ok = {r["tags"].get("config_hash") for r in rows if r["status"] == "OK" and _num(r["metrics"], HEADLINE)}
    out = {}
    for p in probes:
        of = (p.get("tags") or {}).get("drift_probe.of")
        if of in ok and p.get("status", "OK") == "OK" and _num(p.get("metrics") or {}, HEADLINE):
            out[of] = p["metrics"]
    return out


def drift_pairs(rows: list[dict], probes: list[dict]) -> list[tuple[str, float, float]]:
    """(cell, its tok/s, its probe's tok/s) for every probe that repeats an OK cell of `rows`."""
    again = replicates(rows, probes)
    return [(r["cell"], _num(r["metrics"], HEADLINE), _num(again[h], HEADLINE)) for r in rows
            if (h := r["tags"].get("config_hash")) in again and r["status"] == "OK"]


def drift_of(rows: list[dict], probes: list[dict]) -> float | None:
    """D: the largest |log ratio| of a cell's two runs (None when no cell ran twice)."""
    return intervals.log_drift([(a, b) for _, a, b in drift_pairs(rows, probes)])


def _speed(m: dict, again: dict | None) -> tuple[float, float, float]:
    """(tok/s, low, high) of a cell: with a probe, the geometric mean of its two runs and the union of their
    p10-p90 spreads (a drift that grows through the sweep cancels in the mean of A ... A)."""
    runs = [m] if again is None else [m, again]
    tps = [_num(x, HEADLINE) for x in runs]
    lows = [_num(x, f"{HEADLINE}_p10") or v for x, v in zip(runs, tps, strict=True)]
    highs = [_num(x, f"{HEADLINE}_p90") or v for x, v in zip(runs, tps, strict=True)]
    mid = math.exp(sum(math.log(v) for v in tps) / len(tps))
    return mid, min(*lows, mid), max(*highs, mid)


def points(rows: list[dict], baseline: str, probes: list[dict] | None = None) -> list[Point]:
    """The frontier's points: one per OK cell with a speed (rows from harness.records.rows.rows_for), its speed
    merged with its drift probe's where it ran again."""
    again = replicates(rows, probes or [])
    half = math.exp((drift_of(rows, probes or []) or 0.0) / 2)
    ok = [r for r in rows if r["status"] == "OK" and _num(r["metrics"], HEADLINE)]
    base = baselines(ok, baseline, lambda r: _speed(r["metrics"], again.get(r["tags"].get("config_hash")))[0])
    # cells of other threads, tokens, prompts... are other comparisons, not rival formats: their own group
    settings = setting_labels(ok)
    out = []
    for r in ok:
        m, t = r["metrics"], r["tags"]
        (tps, p10, p90), ref = _speed(m, again.get(t.get("config_hash"))), lookup(base, r)
        if not ref:
            continue  # no baseline cell for this model/strategy/batch: no speedup to draw
        grp = _group(r) + (f" / {settings[r.get('setting', '')]}" if settings.get(r.get("setting", "")) else "")
        pt = Point(cell=r["cell"], fmt=r["quantizer"], kernel=_kernel(t), machine=r["machine"], group=grp,
                   tps=tps, speedup=tps / ref, lo=p10 / half / ref, hi=p90 * half / ref,
                   weight_bytes=_num(m, "weight_bytes"), kl=_num(m, "kl_div_mean"), kl_lo=_num(m, "kl_div_mean_lo"),
                   kl_hi=_num(m, "kl_div_mean_hi"))
        n, r2w, w2r = (_num(m, k) for k in ("tasks_examples", "tasks_acc_right_to_wrong", "tasks_acc_wrong_to_right"))
        if n and r2w is not None and w2r is not None:
            diff, _ = intervals.pooled_paired(r2w, w2r, n)
            lo, hi = intervals.paired_interval(r2w, w2r, n)  # not diff -/+ z se: zero wide at no flips
            pt.loss_kind, pt.loss = "task", 0.0 - diff  # 0.0 - : no "-0.0" for a format that changed nothing
            pt.loss_lo, pt.loss_hi = -hi, -lo
            pt.p_raw = _num(m, "tasks_acc_mcnemar_p")
        elif pt.kl is not None:
            pt.loss_kind, pt.loss = "kl", pt.kl
            pt.loss_lo = pt.kl_lo if pt.kl_lo is not None else pt.kl  # records before the interval: a point
            pt.loss_hi = pt.kl_hi if pt.kl_hi is not None else pt.kl
        out.append(pt)
    for grp in {p.group for p in out}:  # the loss axis of a group is one kind: tasks when every point has them
        members = [p for p in out if p.group == grp]
        if any(p.loss_kind == "task" for p in members) and not all(p.loss_kind == "task" for p in members):
            for p in members:
                p.loss_kind, p.loss, p.loss_lo, p.loss_hi = ("kl", p.kl, p.kl_lo, p.kl_hi) if p.kl is not None \
                    else ("", None, None, None)
    adjusted = intervals.holm({p.cell: p.p_raw for p in out if p.loss_kind == "task" and p.p_raw is not None})
    for p in out:
        p.p_holm = adjusted.get(p.cell)
    mark_dominated(out)
    return out


def has_accuracy(pts: list[Point]) -> bool:
    return any(p.loss_kind for p in pts)


def _faster(a: Point, b: Point) -> bool:
    """a is faster than b beyond both intervals."""
    return a.lo > b.hi


def _more_accurate(a: Point, b: Point) -> bool:
    """a lost less accuracy than b beyond both intervals."""
    return a.loss_hi is not None and b.loss_lo is not None and a.loss_hi < b.loss_lo


def _no_larger(a: Point, b: Point) -> bool:
    return a.weight_bytes is not None and b.weight_bytes is not None and a.weight_bytes <= b.weight_bytes


def mark_dominated(pts: list[Point]) -> None:
    """Fill `dominated_by`: within one machine and group, the points better on both axes beyond both intervals
    (speed and accuracy loss; speed and weight bytes where the group has no accuracy axis) and no larger."""
    for a in pts:
        a.dominated_by = []
        for b in pts:
            if b is a or b.machine != a.machine or b.group != a.group or not _faster(b, a) or not _no_larger(b, a):
                continue
            if a.loss_kind and b.loss_kind == a.loss_kind:
                if _more_accurate(b, a):
                    a.dominated_by.append(b.cell)
            elif not a.loss_kind and not b.loss_kind and (b.weight_bytes or 0) < (a.weight_bytes or 0):
                a.dominated_by.append(b.cell)  # no accuracy axis: faster and strictly smaller
        a.dominated_by_kl = [b.cell for b in pts if b is not a and b.machine == a.machine and b.group == a.group
                             and a.loss_kind == "task" and _faster(b, a) and _no_larger(b, a) and _kl_better(b, a)]


def _kl_better(a: Point, b: Point) -> bool:
    """a's KL is below b's beyond both intervals (the second reading where the y axis is task accuracy)."""
    if a.kl is None or b.kl is None:
        return False
    return (a.kl_hi if a.kl_hi is not None else a.kl) < (b.kl_lo if b.kl_lo is not None else b.kl)


# ------------------------------------------------------------------------------------------ text
def speed_text(p: Point) -> str:
    return f"{p.speedup:.2f}x [{p.lo:.2f}-{p.hi:.2f}]"


def loss_text(p: Point) -> str:
    if p.loss_kind == "task":
        return f"{100 * p.loss:+.1f} pts [{100 * p.loss_lo:+.1f}, {100 * p.loss_hi:+.1f}]"
    if p.loss_kind == "kl":
        return f"KL {p.loss:.3g} [{p.loss_lo:.3g}-{p.loss_hi:.3g}]"
    return "—"


def _describe(p: Point) -> str:
    parts = [f"**{p.label}**: speedup {speed_text(p)}"]
    if p.loss_kind:
        parts.append(("task accuracy lost " if p.loss_kind == "task" else "") + loss_text(p))
    if p.kl is not None and p.loss_kind != "kl":
        parts.append(f"KL {p.kl:.3g}" + (f" [{p.kl_lo:.3g}-{p.kl_hi:.3g}]" if p.kl_lo is not None else ""))
    if p.p_raw is not None:
        parts.append(f"McNemar p {p.p_raw:.2g} (Holm {p.p_holm:.2g})" if p.p_holm is not None else
                     f"McNemar p {p.p_raw:.2g}")
    if p.weight_bytes:
        parts.append(f"{p.weight_bytes / 1e6:.1f} MB")
    return ", ".join(parts) + f" (cell `{p.cell}`)"


def _brief(p: Point) -> str:
    kl = f", KL {p.kl:.3g}" if p.kl is not None and p.loss_kind != "kl" else ""
    return f"**{p.label}** {speed_text(p)}" + (f", {loss_text(p)}" if p.loss_kind else "") + kl + f" (`{p.cell}`)"


def _fastest(cands: list[Point], what: str) -> str:
    """The fastest candidate, or "cannot decide" naming every candidate whose speed interval overlaps it."""
    if not cands:
        return f"{what}: no format qualifies."
    best = max(cands, key=lambda p: p.speedup)
    tied = [p for p in cands if p is not best and not _faster(best, p)]
    if tied:
        return f"{what}: **cannot decide** between " + "; ".join(_brief(p) for p in [best, *tied]) + \
            " (their speed intervals overlap)."
    return f"{what}: " + _describe(best) + "."


def recommendations(pts: list[Point]) -> list[str]:
    """One line per constraint, for one machine and group."""
    lines = [_fastest(pts, "Fastest format")]
    if any(p.loss_kind == "task" for p in pts):
        ok = [p for p in pts if p.loss_kind == "task" and (p.loss <= 0 or p.p_holm is None or p.p_holm >= ALPHA)]
        lines.append(_fastest(ok, f"Fastest format whose task accuracy is not significantly lower than the "
                                  f"reference (McNemar, Holm-adjusted p >= {ALPHA})"))
    if any(p.kl is not None for p in pts):
        sure = [p for p in pts if p.kl is not None and (p.kl_hi if p.kl_hi is not None else p.kl) <= KL_LIMIT]
        maybe = [p for p in pts if p.kl is not None and p not in sure and (p.kl_lo or p.kl) <= KL_LIMIT]
        lines.append(_fastest(sure, f"Fastest format within KL {KL_LIMIT} (whole interval below)") +
                     _straddle(maybe, sure, lambda p, q: p.speedup > q.speedup))
        lines.append(_smallest(sure, maybe))
    return lines


def _straddle(maybe: list[Point], sure: list[Point], beats: Any) -> str:
    """Candidates whose KL interval straddles the limit and that would win if they were within it."""
    best = [p for p in maybe if not sure or all(beats(p, q) for q in sure)]
    return "" if not best else " Undecided beside it, KL interval straddling the limit: " + \
        "; ".join(_describe(p) for p in best) + "."


def _smallest(sure: list[Point], maybe: list[Point]) -> str:
    what = f"Smallest format within KL {KL_LIMIT}"
    if not sure:
        return f"{what}: **cannot decide**: " + "; ".join(_describe(p) for p in maybe) + " (KL interval " \
            "straddles the limit)." if maybe else f"{what}: no format's KL interval lies below {KL_LIMIT}."
    best = min(sure, key=lambda p: p.weight_bytes or math.inf)
    smaller = [p for p in maybe if (p.weight_bytes or math.inf) < (best.weight_bytes or math.inf)]
    if smaller:
        return f"{what}: **cannot decide** between " + "; ".join(_describe(p) for p in [best, *smaller]) + \
            f" (a smaller format's KL interval straddles {KL_LIMIT})."
    return f"{what}: " + _describe(best) + "."


def _drift_line(pairs: list[tuple[str, float, float]]) -> str:
    if not pairs:
        return ("**Between-cell drift was not measured** in this sweep (no drift probe: `sweep.drift_probe=all` runs "
                "every cell again after the last one), so the speed intervals are the cells' own p10-p90 spreads "
                "only and may be too narrow.")
    logs = sorted(((abs(math.log(a / b)), c, a, b) for c, a, b in pairs), reverse=True)
    d, cell, a, b = logs[0]
    who = "the baseline cell" if len(pairs) == 1 else f"{len(pairs)} cells"
    return (f"Between-cell drift: {who} ran again, speed only, after the last cell (last first). D = max |log "
            f"ratio| = {d:.3f} ({100 * math.expm1(d):.1f}%, `{cell}`: {a:.1f} then {b:.1f} tok/s); median "
            f"{logs[len(logs) // 2][0]:.3f}. A cell that ran twice is drawn at the geometric mean of its runs; its "
            f"speed interval spans both runs' p10-p90 spreads, each end widened by e^(D/2), so two formats differ "
            f"only by more than D.")


def section(rows: list[dict], baseline: str, probes: list[dict] | None = None, figure: str = "frontier.png") -> str:
    """The report's frontier section ('' for a sweep of fewer than two formats)."""
    pts = points(rows, baseline, probes)
    if len({p.fmt for p in pts}) < 2:
        if len({r["quantizer"] for r in rows}) < 2:
            return ""  # one format: nothing to compare
        return "\n".join(["", "## Frontier: speed against accuracy loss", "",
                          f"No frontier: fewer than two formats have a speedup to draw. {_left_out(rows, pts, baseline)}",
                          ""])
    lines = ["", "## Frontier: speed against accuracy loss", "", _drift_line(drift_pairs(rows, probes or [])), ""]
    if not has_accuracy(pts):
        lines += ["No accuracy axis: these cells scored no accuracy (random-weight shapes have no accuracy to "
                  "lose), so the frontier is speed against weight bytes: a format is dominated by a faster "
                  "(beyond both intervals) and smaller one.", ""]
    lines += [f"![frontier]({figure})", ""]
    for (machine, grp), members in _panels(pts).items():
        lines += [f"### {machine}: {grp}", "", table(members), "", *[f"- {x}" for x in recommendations(members)], ""]
    if (left := _left_out(rows, pts, baseline)):
        lines += [left, ""]
    return "\n".join(lines)


def _left_out(rows: list[dict], pts: list[Point], baseline: str) -> str:
    """The cells the frontier does not draw, and why: a recommendation must not read as complete without them."""
    drawn = {p.cell for p in pts}
    why = [f"{r['cell']} ({r['status']}: {(str(r.get('error') or '').splitlines() or ['no reason recorded'])[0][:120]})"
           if r["status"] != "OK" else f"{r['cell']} (no `{baseline}` cell with its machine, group and settings)"
           for r in rows if r["cell"] not in drawn and (r["status"] != "OK" or r["quantizer"] != baseline)]
    return ("Not on the frontier: " + "; ".join(why) + ".") if why else ""


def table(pts: list[Point]) -> str:
    tasks = any(p.loss_kind == "task" for p in pts)
    head = "| format (kernel) | cell | speedup [interval] | accuracy loss [95%] | McNemar p | Holm p | weight MB " \
           "| dominated by |" + (" KL [95%] | dominated by, reading KL |" if tasks else "")
    rows = [f"| {p.label} | {p.cell} | {speed_text(p)} | {loss_text(p)} | "
            f"{'—' if p.p_raw is None else f'{p.p_raw:.2g}'} | {'—' if p.p_holm is None else f'{p.p_holm:.2g}'} | "
            f"{'—' if not p.weight_bytes else f'{p.weight_bytes / 1e6:.1f}'} | {', '.join(p.dominated_by) or '—'} |"
            + (f" {_kl_text(p)} | {', '.join(p.dominated_by_kl) or '—'} |" if tasks else "")
            for p in sorted(pts, key=lambda p: -p.speedup)]
    return "\n".join([head, "|" + "---|" * head.count(" | ") + "---|", *rows])


def _kl_text(p: Point) -> str:
    if p.kl is None:
        return "—"
    return f"{p.kl:.3g}" + (f" [{p.kl_lo:.3g}-{p.kl_hi:.3g}]" if p.kl_lo is not None else "")


def _panels(pts: list[Point]) -> dict[tuple[str, str], list[Point]]:
    out: dict[tuple[str, str], list[Point]] = {}
    for p in pts:
        out.setdefault((p.machine, p.group), []).append(p)
    return out


def panels(pts: list[Point]) -> dict[str, list[Point]]:
    """Points by machine: one figure panel each (numbers from two machines never share an axis)."""
    out: dict[str, list[Point]] = {}
    for p in pts:
        out.setdefault(p.machine, []).append(p)
    return out
