"""How the cost of a decode step grows with model size: the `scaling` experiment's table and figure.

A memory-bound decode step reads every weight once, so its time should be `bytes_per_step / bandwidth`
plus whatever a step costs beyond reading bytes (attention, norms, sampling, Python dispatch, thread
wake-ups). Fitting `ms/token = fixed + bytes / effective bandwidth` by least squares over the sizes of one
engine gives that fixed cost per step (the intercept) and the bandwidth the engine really streams at (the
inverse slope). At 135M the fixed cost rivals the weight traffic and every format looks alike; at 8B the
weights are almost all of a step and the format's byte saving should show in full.

`section(rows)` (report.md) lists per cell: bytes read per step, ms/token, the roofline ms (bytes /
measured bandwidth) and fraction, the speedup over the same engine's 16-bit format at the same size, the
ratio to llama.cpp's matching format (bf16 : BF16, int8 : Q8_0, int4 : Q4_0), the peak memory beside its
estimate, and the load (+ quantize) time; then the fit per engine and per engine x format, and the sizes
at which each quantized format first reaches 1.5x and 2x of its 16-bit format. `write(folder, rows)` draws
scaling.png: ms/token against GB read per step, log-log, with the roofline line and the fitted lines.
Used by harness/records/report.py for any sweep whose OK cells span at least two model sizes.
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.analysis import figures
from harness.metrics import value

MIB = 2**20  # peak_mem_mb and mem_estimate_mb are MiB (harness/measure/memory.py); the tables print GB (1e9)

PAIRS = {"bf16": "BF16", "fp16": "F16", "int8": "Q8_0", "int4": "Q4_0"}  # quantbench format : llama.cpp format
SIXTEEN = {"transformers": ("bf16", "none", "fp16", "auto16"), "llama_cpp": ("BF16", "F16")}
TARGET = 0.75  # each format's best path against llama.cpp in the same format (#30)


def _format(r: dict) -> str:
    """The format a quantbench row stored: auto16/none read as what they resolved to (bf16 or fp16)."""
    q, resolved = r["quantizer"], r["tags"].get("quantizer.resolved", "")
    return f"{q}:{resolved}" if q in ("auto16", "none") and resolved else q


def _pair(fmt: str) -> str:
    return PAIRS.get(fmt.split(":")[-1], "")


def points(rows: list[dict]) -> list[dict]:
    """One point per OK cell with a speed and a roofline: size, engine, format and the numbers to plot."""
    out = []
    for r in rows:
        m, t = r["metrics"], r["tags"]
        tps, step = value(m, "decode_tokens_per_s"), value(m, "bytes_per_step")
        if r["status"] != "OK" or not tps or not step:
            continue
        engine = t.get("engine", "transformers")
        fmt = _format(r)
        if engine == "llama_cpp":  # kernel_path llama.cpp[Q8_0:file] in results older than tag engine.format
            fmt = t.get("engine.format") or t.get("kernel_path", "[?:").split("[", 1)[-1].split(":", 1)[0]
        bw = value(m, "bandwidth_gb_per_s")
        out.append({"size": t.get("model.arch") or t.get("model.name", "?"), "engine": engine, "format": fmt,
                    "params": value(m, "params") or 0.0, "gb": step / 1e9, "ms": 1e3 / tps,
                    "roofline_ms": step / (bw * 1e9) * 1e3 if bw else None,
                    "fraction": value(m, "roofline_fraction"), "peak_gb": (value(m, "peak_mem_mb") or 0) * MIB / 1e9,
                    "est_gb": (value(m, "mem_estimate_mb") or 0) * MIB / 1e9 or None, "load_s": value(m, "load_s"),
                    "cached": t.get("gguf_cache") == "hit", "bw": bw,
                    "path": "ggml" if engine == "llama_cpp" else t.get("decode_path") or t.get("fast_path", "eager"),
                    "threads": str(t.get("threads", "?")),
                    # the one-row kernel's own rate (harness/measure/one_row.py); llama.cpp: bytes / its whole step
                    "kernel_gbps": (step / 1e9) * tps if engine == "llama_cpp" else value(m, "kernel_stream_gbps"),
                    "linear": t.get("kernel.linear_share", "")})  # the profile: the linear kernel's share of a step
    sizes = {p["size"]: p["params"] for p in out}
    order = sorted(sizes, key=lambda s: sizes[s])
    out.sort(key=lambda p: (order.index(p["size"]), p["threads"], p["engine"] != "transformers", -p["gb"],
                            p["path"] == "eager"))
    return out


def applies(rows: list[dict]) -> bool:
    return len({p["size"] for p in points(rows)}) >= 2


def fit(pts: list[dict]) -> tuple[float, float] | None:
    """(fixed ms per step, effective GB/s) of ms = fixed + GB / bandwidth by least squares; None under two sizes."""
    xs, ys = [p["gb"] for p in pts], [p["ms"] for p in pts]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, (1e3 / slope if slope > 0 else float("inf"))  # ms per GB -> GB per s


def decided(got: tuple[float, float]) -> bool:
    """A fit that means something: a positive bandwidth and a fixed cost that is not negative."""
    return math.isfinite(got[1]) and got[1] > 0 and got[0] >= 0


def _label(engine: str) -> str:
    return "llama.cpp" if engine == "llama_cpp" else "quantbench" if engine == "transformers" else engine


def _key(p: dict) -> tuple[str, str]:
    return p["size"], p["threads"]


def _speedups(pts: list[dict]) -> dict[int, float]:
    """Index -> speed over the same engine's fastest 16-bit row (any path) at the same size and threads."""
    base: dict[tuple, float] = {}
    for p in pts:
        if p["format"].split(":")[0] in SIXTEEN.get(p["engine"], ()):
            k = (*_key(p), p["engine"])
            base[k] = min(base.get(k, p["ms"]), p["ms"])
    return {i: base[(*_key(p), p["engine"])] / p["ms"] for i, p in enumerate(pts) if (*_key(p), p["engine"]) in base}


def _peer(pts: list[dict], p: dict) -> dict | None:
    """llama.cpp's row in the format matching quantbench row `p`, at the same size and threads."""
    want = _pair(p["format"])
    return next((q for q in pts if q["engine"] == "llama_cpp" and _key(q) == _key(p) and q["format"] == want), None)


def _vs_llama(pts: list[dict]) -> dict[int, float]:
    """Index of a quantbench row -> its speed over llama.cpp's matching format at the same size and threads."""
    out = {}
    for i, p in enumerate(pts):
        if p["engine"] == "transformers" and (peer := _peer(pts, p)) is not None:
            out[i] = peer["ms"] / p["ms"]
    return out


def verdicts(pts: list[dict]) -> list[str]:
    """Per size, threads and format: the best path against llama.cpp (>= TARGET?) and, below it, whether the
    one-row kernel alone streams below TARGET of llama.cpp's implied rate (a slow kernel, not a slow step)."""
    lines = []
    best: dict[tuple, dict] = {}
    for p in pts:
        if p["engine"] == "transformers" and _pair(p["format"]):
            k = (*_key(p), p["format"])
            if k not in best or p["ms"] < best[k]["ms"]:
                best[k] = p
    for (size, threads, fmt), p in best.items():
        peer = _peer(pts, p)
        if peer is None:
            continue
        ratio = peer["ms"] / p["ms"]
        line = (f"- {size}, {threads} threads, {fmt} ({p['path']}): {p['ms']:.1f} ms/token vs llama.cpp "
                f"{peer['format']} {peer['ms']:.1f}: **{ratio:.2f}x** ({'meets' if ratio >= TARGET else 'below'} "
                f"{TARGET})")
        if p.get("kernel_gbps") and peer.get("kernel_gbps"):
            k_ratio = p["kernel_gbps"] / peer["kernel_gbps"]
            line += (f"; its one-row kernel streams {p['kernel_gbps']:.1f} GB/s alone = {k_ratio:.2f} of llama.cpp's "
                     f"implied {peer['kernel_gbps']:.1f} GB/s")
            if ratio < TARGET:
                line += (" (the kernel is the gap)" if k_ratio < TARGET else
                         " (the kernel keeps up: the rest of the step is the gap)")
        lines.append(line + ".")
    return lines


def reading(pts: list[dict]) -> list[str]:
    """Where each quantized format first reaches 1.5x and 2x of its engine's 16-bit format."""
    ups = _speedups(pts)
    lines = []
    for engine, fmt in sorted({(p["engine"], p["format"]) for p in pts}):
        if fmt.split(":")[0] in SIXTEEN.get(engine, ()):
            continue
        by_size: dict[str, float] = {}  # the best path's speedup per size (pts are in size order)
        for i in sorted(ups):
            if (pts[i]["engine"], pts[i]["format"]) == (engine, fmt):
                by_size[pts[i]["size"]] = max(by_size.get(pts[i]["size"], 0.0), ups[i])
        mine = list(by_size.items())
        if not mine:
            continue
        parts = []
        for goal in (1.5, 2.0):
            hit = next((s for s, u in mine if u >= goal), None)
            parts.append(f"{goal:g}x at {hit}" if hit else f"{goal:g}x not reached")
        best = max(mine, key=lambda su: su[1])
        lines.append(f"- {_label(engine)} {fmt} vs its 16-bit format: {', '.join(parts)} (best {best[1]:.2f}x at "
                     f"{best[0]}).")
    return lines


def section(rows: list[dict]) -> str:
    if not applies(rows):
        return ""
    pts = points(rows)
    ups, peers = _speedups(pts), _vs_llama(pts)

    def f(v: float | None, fmt: str) -> str:
        return "—" if v is None else fmt.format(v)

    lines = ["", "## Scaling: decode cost against bytes read per step", "",
             "ms/token at batch 1; path = the decode path that ran (tag decode_path: best paths and eager series; "
             "llama.cpp: ggml); roofline = bytes per step / measured bandwidth; kernel GB/s = the format's one-row "
             "kernel streaming every weight matrix once, timed alone (metric kernel_stream_gbps), beside llama.cpp's "
             "bytes per step / its whole step (implied); × best 16-bit = speed over the same engine's fastest 16-bit "
             "row at that size and thread count; × llama.cpp = quantbench's speed over llama.cpp's matching format "
             "(bf16 : BF16, fp16 : F16, int8 : Q8_0, int4 : Q4_0); linear = the profiled share of a decode step spent "
             "in the linear kernel (tag kernel.linear_share); peak memory measured (estimated before loading); load = "
             "build/read + quantize (llama.cpp: GGUF write + llama_model_quantize unless cached). Figure: "
             "scaling.png.", "",
             "| model | threads | engine | format | path | params | GB/step | ms/token | roofline ms | fraction | "
             "kernel GB/s | × best 16-bit | × llama.cpp | linear | peak GB (est.) | load s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(pts):
        load = f(p["load_s"], "{:.1f}") + (" (cached)" if p["cached"] else "")
        params = f"{p['params'] / 1e9:.2f} B" if p["params"] >= 1e9 else f"{p['params'] / 1e6:.2f} M"
        kernel = f(p["kernel_gbps"], "{:.1f}") + (" (implied)" if p["engine"] == "llama_cpp" and p["kernel_gbps"] else "")
        lines.append(f"| {p['size']} | {p['threads']} | {_label(p['engine'])} | {p['format']} | {p['path']} | {params} | "
                     f"{p['gb']:.3f} | {p['ms']:.1f} | {f(p['roofline_ms'], '{:.1f}')} | "
                     f"{f(p['fraction'], '{:.2f}')} | {kernel} | {f(ups.get(i), '{:.2f}')} | {f(peers.get(i), '{:.2f}')} | "
                     f"{p['linear'] or '—'} | {p['peak_gb']:.1f} ({f(p['est_gb'], '{:.1f}')}) | {load} |")
    lines += ["", "### Fixed cost per step (least squares over sizes: ms/token = fixed + GB/step / bandwidth)", "",
              "| threads | engine | format | path | points | fixed ms/step | effective GB/s |",
              "|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for p in pts:
        groups.setdefault((p["threads"], p["engine"], "all formats", p["path"]), []).append(p)
        groups.setdefault((p["threads"], p["engine"], p["format"], p["path"]), []).append(p)
    for (threads, engine, fmt, path), sel in sorted(groups.items(), key=lambda kv: (kv[0][:2], kv[0][2] != "all formats",
                                                                                    kv[0][2:])):
        got = fit(sel)
        if got is None:
            continue
        if decided(got):
            lines.append(f"| {threads} | {_label(engine)} | {fmt} | {path} | {len(sel)} | {got[0]:.1f} | {got[1]:.1f} |")
        else:  # sizes too close (or noise too large) for a line through them: say so, print no number
            lines.append(f"| {threads} | {_label(engine)} | {fmt} | {path} | {len(sel)} | undecided | undecided: "
                         "ms/token does not grow with GB/step over these sizes |")
    if (found := verdicts(pts)):
        lines += ["", f"Each format's best path against llama.cpp in the same format (target {TARGET}x; the kernel "
                      "rate beside llama.cpp's bytes / whole step):", "", *found]
    found = reading(pts)
    if found:
        lines += ["", "Where the formats pay:", "", *found]
    return "\n".join(lines) + "\n"


def fit_lines(pts: list[dict]) -> list[tuple[str, str, str, tuple[float, float]]]:
    """(threads, engine, path, fit) of the figure's lines: the table's "all formats" groups that decided. One line
    over every engine's rows mixed thread counts and paths (62.7 ms + bytes / 31 GB/s for rows that follow
    5 ms + bytes / 20 GB/s, plus one 1-thread row)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for p in pts:
        groups.setdefault((p["threads"], p["engine"], p["path"]), []).append(p)
    return [(*k, got) for k, sel in sorted(groups.items()) if (got := fit(sel)) is not None and decided(got)]


def write(folder: Path, rows: list[dict], title: str = "scaling") -> list[Path]:
    """scaling.png (see module docstring); [] when the cells span fewer than two sizes."""
    if not applies(rows):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(rows)
    fig, ax = plt.subplots(figsize=(8.5, 6), dpi=110)
    keys = sorted({(p["engine"], p["format"], p["path"], p["threads"]) for p in pts})
    marks = {"transformers": "o", "llama_cpp": "s"}
    colors = plt.get_cmap("tab10")
    for k, (engine, fmt, path, threads) in enumerate(keys):
        sel = [p for p in pts if (p["engine"], p["format"], p["path"], p["threads"]) == (engine, fmt, path, threads)]
        ax.plot([p["gb"] for p in sel], [p["ms"] for p in sel], marks.get(engine, "^"), color=colors(k % 10),
                fillstyle="none" if path == "eager" else "full", label=f"{_label(engine)} {fmt} {path} {threads}t")
        for p in sel:
            ax.annotate(p["size"], (p["gb"], p["ms"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    xs = sorted(p["gb"] for p in pts)
    grid = [xs[0] * 0.8 * (xs[-1] * 1.25 / (xs[0] * 0.8)) ** (i / 50) for i in range(51)]
    bws = sorted(p["bw"] for p in pts if p["bw"])
    if bws:
        bw = bws[len(bws) // 2]
        ax.plot(grid, [g / bw * 1e3 for g in grid], color="black", lw=1.2,
                label=f"roofline: bytes / {bw:.0f} GB/s (measured)")
    for k, line in enumerate(fit_lines(pts)):
        threads, engine, path, got = line
        ax.plot(grid, [got[0] + g / got[1] * 1e3 for g in grid], ls=("--", ":", "-.")[k % 3], lw=1,
                color="grey" if engine == "transformers" else "tab:brown",
                label=f"{_label(engine)} {path} {threads}t fit: {got[0]:.1f} ms + bytes / {got[1]:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GB read per decode step (weights as stored + KV cache)")
    ax.set_ylabel("decode ms/token (batch 1)")
    ax.set_title(f"{title}: decode cost vs bytes per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return [figures.save(fig, Path(folder) / "scaling.png")]

