"""The crossover map: where weight quantization stops paying, measured and predicted by the roofline.

Weight-only quantization makes a decode step read fewer bytes, which is what a memory-bound step waits
for; it also adds work (dequantization, slower kernels). A step takes at least

    max(bytes_per_step / bandwidth, flops_per_step / compute_ceiling)

- memory side (harness/analysis/roofline.py): the bytes a step reads (weights as stored + the KV cache at the step's
  context) over the host's measured bandwidth. Batch and depth grow only the KV part, which is the same
  for every weight format, so the byte saving of a quantized format shrinks as batch x depth grows;
- compute side (here): flops per step = batch x (2 x matmul parameters + 4 x layers x heads x head_dim x
  context), over the format's compute ceiling, taken as the best prefill throughput (flop/s) any cell of
  that format reached in the sweep: prefill is the same model at many tokens per weight read, so it shows
  what the format's kernels can compute. A format with slow kernels turns compute-bound at a smaller batch.

The predicted speed ratio of a format to the 16-bit baseline at (batch, depth) is the ratio of those two
bounds; the measured ratio is the ratio of decode tokens/s. `write(folder, rows, baseline)` draws both per
quantizer (crossover.png) and `section(rows, baseline)` lists them in report.md; below 1.0 quantization
costs speed. Used by harness/records/report.py for any sweep whose cells vary batch size or context depth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.analysis import figures
from harness.metrics import value
from harness.records.rows import baselines, lookup, setting_labels


# ------------------------------------------------------------------------------------------ flop model
def model_flops(config: Any, params: float) -> tuple[float, float, float]:
    """(flops per decode token of the matmuls, of the output head alone, attention flops per context position).

    Matmul parameters are all parameters except an untied input embedding (a lookup, not a product); a
    tied one is the output head, used once per token.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    matmul = params - (0.0 if tied else float(vocab * hidden))
    return 2.0 * matmul, 2.0 * vocab * hidden, 4.0 * int(cfg.num_hidden_layers) * heads * head_dim


def flop_metrics(config: Any, params: float, gens: list[Any], depth: int) -> dict[str, float]:
    """`flops_per_token`, `attn_flops_per_token_ctx` and `prefill_flops_per_s` (the timed prefills' flop/s).

    Prefill computes the output head for the last position only (logits_to_keep=1) and attends over the
    depth context plus the prompt so far.
    """
    try:
        per_token, head, attn = model_flops(config, params)
    except (AttributeError, TypeError, ValueError):
        return {}
    flops = secs = 0.0
    for g in gens:
        rows = max(1, len(g.sequences))
        n = g.prompt_tokens / rows
        flops += rows * ((per_token - head) * n + head + attn * (n * depth + n * (n + 1) / 2.0))
        secs += g.prompt_s  # prefill time (harness/measure/__init__.py: TTFT unless a strategy records prefill_s)
    out = {"flops_per_token": per_token, "attn_flops_per_token_ctx": attn}
    if secs > 0:
        out["prefill_flops_per_s"] = flops / secs
    return out


def predicted_tokens_per_s(m: dict, compute_ceiling: float | None) -> float | None:
    """Decode tokens/s a cell can reach under both ceilings (None without the roofline metrics)."""
    step_bytes, bw = value(m, "bytes_per_step"), value(m, "bandwidth_gb_per_s")
    batch = value(m, "batch_size") or 1.0
    if not step_bytes or not bw:
        return None
    t = step_bytes / (bw * 1e9)
    per_token, attn = value(m, "flops_per_token"), value(m, "attn_flops_per_token_ctx")
    ctx = value(m, "kv_context_mean")
    if compute_ceiling and per_token is not None and attn is not None:
        t = max(t, batch * (per_token + attn * (ctx or 0.0)) / compute_ceiling)
    return batch / t


# ----------------------------------------------------------------------------------------------- table
def points(rows: list[dict], baseline: str) -> dict[str, list[dict]]:
    """Per non-baseline quantizer: (batch, depth, measured ratio, predicted ratio) against the baseline cell of
    the same machine, model, strategy, batch and depth. The key is the quantizer, with the model, strategy,
    speed settings (threads, ...) and machine added where the rows hold several, so one curve never mixes them."""
    ok = [r for r in rows if r["status"] == "OK" and value(r["metrics"], "decode_tokens_per_s")]
    models, hosts = {r.get("model") for r in ok}, {r.get("machine") for r in ok}
    # the strategy's kind, not its name: StaticBatch1 and StaticBatch2 are one curve over the batch axis
    kind = {id(r): (r.get("tags") or {}).get("choice.strategy") or r.get("strategy") for r in ok}
    strategies, settings = set(kind.values()), setting_labels(ok)

    def where(r: dict) -> tuple:  # a compute ceiling holds for one machine, model and thread count
        return r.get("machine"), r.get("model"), r.get("setting", "")

    ceiling: dict[tuple, float] = {}  # a format's compute ceiling on one machine and model
    for r in ok:
        f = value(r["metrics"], "prefill_flops_per_s")
        if f:
            ceiling[(*where(r), r["quantizer"])] = max(f, ceiling.get((*where(r), r["quantizer"]), 0.0))
    base = baselines(ok, baseline, lambda r: r)  # the baseline row per key (harness/records/rows.py)
    out: dict[str, list[dict]] = {}
    for r in ok:
        b = lookup(base, r)
        if r["quantizer"] == baseline or b is None:
            continue
        mine = predicted_tokens_per_s(r["metrics"], ceiling.get((*where(r), r["quantizer"])))
        theirs = predicted_tokens_per_s(b["metrics"], ceiling.get((*where(r), baseline)))
        # every axis but batch and depth that differs between cells splits the curve: one key per (batch, depth)
        # point, or the last cell of two thread counts silently replaced the other
        label = r["quantizer"] + (f" @ {r.get('model')}" if len(models) > 1 else "") + \
            (f" ({kind[id(r)]})" if len(strategies) > 1 else "") + \
            (f" [{settings[r.get('setting', '')]}]" if settings.get(r.get("setting", "")) else "") + \
            (f" on {r.get('machine')}" if len(hosts) > 1 else "")
        out.setdefault(label, []).append({
            "batch": r["batch"], "depth": r["depth"],
            "measured": value(r["metrics"], "decode_tokens_per_s") / value(b["metrics"], "decode_tokens_per_s"),
            "predicted": mine / theirs if mine and theirs else None,
            "memory_only": (value(b["metrics"], "bytes_per_step") / value(r["metrics"], "bytes_per_step")
                            if value(r["metrics"], "bytes_per_step") and value(b["metrics"], "bytes_per_step")
                            else None)})
    for q in out:
        out[q].sort(key=lambda p: (p["depth"], p["batch"]))
    return out


def applies(rows: list[dict], baseline: str) -> bool:
    """A crossover map needs a quantizer compared with the baseline at more than one (batch, depth) point."""
    return any(len({(p["batch"], p["depth"]) for p in pts}) > 1 for pts in points(rows, baseline).values())


def section(rows: list[dict], baseline: str) -> str:
    """report.md section: measured (and roofline-predicted) speed ratio per quantizer, depth and batch."""
    if not applies(rows, baseline):
        return ""
    pts = points(rows, baseline)
    batches = sorted({p["batch"] for v in pts.values() for p in v})
    lines = ["", f"## Crossover: decode speed relative to `{baseline}`", "",
             "measured ratio (roofline prediction: max of the memory and compute bounds; harness/analysis/crossover.py). "
             "Below 1.00 the quantized format is slower than the baseline: quantization stops paying.", "",
             "| quantizer | depth | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for q, v in sorted(pts.items()):
        for depth in sorted({p["depth"] for p in v}):
            cells = {p["batch"]: p for p in v if p["depth"] == depth}
            text = []
            for b in batches:
                p = cells.get(b)
                if p is None:
                    text.append("—")
                else:
                    pred = f" ({p['predicted']:.2f})" if p["predicted"] is not None else ""
                    text.append(("**" if p["measured"] < 1 else "") + f"{p['measured']:.2f}"
                                + ("**" if p["measured"] < 1 else "") + pred)
            lines.append(f"| {q} | {depth} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- figure
def write(folder: Path, rows: list[dict], baseline: str, title: str = "crossover") -> list[Path]:
    """crossover.png: per quantizer, speed ratio to the baseline against batch size, one colour per depth;
    solid = measured, dashed = roofline prediction. Returns [] when the sweep is not a crossover map."""
    if not applies(rows, baseline):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(rows, baseline)
    names = sorted(pts)
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.4), dpi=110, squeeze=False,
                             sharey=True)
    depths = sorted({p["depth"] for v in pts.values() for p in v})
    colors = plt.get_cmap("viridis")(
        [i / max(1, len(depths) - 1) * 0.85 for i in range(len(depths))])
    top = max([1.2] + [p[k] for v in pts.values() for p in v for k in ("measured", "predicted")
                       if p[k] is not None]) * 1.1
    for ax, q in zip(axes[0], names, strict=True):
        for color, depth in zip(colors, depths, strict=True):
            sel = [p for p in pts[q] if p["depth"] == depth]
            if not sel:
                continue
            xs = [p["batch"] for p in sel]
            ax.plot(xs, [p["measured"] for p in sel], "o-", color=color, label=f"depth {depth}: measured")
            pred = [(p["batch"], p["predicted"]) for p in sel if p["predicted"] is not None]
            if pred:
                ax.plot(*zip(*pred, strict=True), "s--", color=color, alpha=0.7, markersize=4,
                        label=f"depth {depth}: roofline")
        ax.axhline(1.0, color="firebrick", lw=1)
        ax.text(0.02, 1.0, " break-even: below, quantization costs speed", color="firebrick", fontsize=7,
                va="bottom", transform=ax.get_yaxis_transform())
        ax.set_xscale("log", base=2)
        batches = sorted({p["batch"] for p in pts[q]})
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_ylim(0, top)
        ax.set_xlabel("batch size")
        ax.set_title(f"{q} vs {baseline}")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(f"decode tokens/s relative to {baseline}")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{title}: solid = measured, dashed = roofline (max of memory and compute bounds)", fontsize=9)
    return [figures.save(fig, Path(folder) / "crossover.png")]
