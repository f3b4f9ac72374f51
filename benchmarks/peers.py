"""quantbench vs llama.cpp, side by side in one run, with the roofline of every row.

    flock /tmp/qb-heavy.lock python benchmarks/peers.py            # ~6-10 min on 2 cores
    flock /tmp/qb-heavy.lock python benchmarks/peers.py --quantizers fp32,bf16 --formats gguf,BF16

Every row is one full run (same code path as `run.py`, logged to MLflow experiment `peers` and
results/) on the embedded SmolLM2-135M: greedy batch 1 on the default prompt set, and perplexity on
the first 4,096 tokens of WikiText-2 test (read in place from ../shared/data/wikitext-2/test.txt, or
--corpus), 8 x 512 chunks scored by llama-perplexity's second-half rule, so both engines score the same
tokens the same way. quantbench rows: fp32, bf16 and the best int8/int4 quantizers in conf/quantizer/
(the `int8`/`int4` aliases when present; a missing backend is reported, not fatal). llama.cpp rows: the shipped GGUF (Q4_1)
and the F32/BF16/Q8_0/Q4_0 conversions.

Columns: MB/step is what one decode step reads (harness.analysis.roofline: weights as stored, embedding rows,
tied output projection, KV cache at the mean context); prefill tok/s is prompt tokens / TTFT on the
same prompts; "/ llama.cpp" divides by the llama.cpp format closest in MB/step (named in the column
"peer"); "of bound" is decode tok/s / roofline tok/s (bandwidth measured once per host).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import quiet_third_party  # noqa: E402
from harness.env import wikitext_dir  # noqa: E402

FLOAT_QUANTIZERS = ("fp32", "bf16")
LLAMA_FORMATS = ("gguf", "F32", "BF16", "Q8_0", "Q4_0")


def int_quantizers() -> list[str]:
    """The best int8/int4 options in conf/quantizer/: the `int8`/`int4` aliases (best backend per device)
    when they exist, else every option named like an int8/int4 quantizer (--quantizers picks others)."""
    names = sorted(p.stem for p in (ROOT / "conf" / "quantizer").glob("*.yaml"))
    best = [n for n in ("int8", "int4") if n in names]
    return best or [n for n in names if "int8" in n or "int4" in n]


def run_row(overrides: list[str]) -> dict:
    from harness.config import compose
    from harness.records import tracking
    from harness.run import runner

    t0 = time.perf_counter()
    result = runner.run(compose(overrides))
    try:
        from harness.config import TrackingConfig

        tracking.record(result, TrackingConfig(**result.config.get("tracking", {})))
    except Exception as exc:  # noqa: BLE001 - the table matters more than the log
        print(f"# tracking failed: {exc}", file=sys.stderr)
    row = {**result.metrics, "status": result.status, "error": result.error, "wall_s": time.perf_counter() - t0,
           "warning": result.tags.get("warning.slow_kernel", ""), "kernel": result.tags.get("kernel.linear", ""),
           "resolved": result.tags.get("quantizer.resolved", "")}
    return row


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantizers", default=",".join(FLOAT_QUANTIZERS + tuple(int_quantizers())))
    ap.add_argument("--formats", default=",".join(LLAMA_FORMATS))
    ap.add_argument("--corpus", default=str(wikitext_dir() / "test.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model, fp32 only, no llama.cpp (seconds)")
    args = ap.parse_args(argv)
    quiet_third_party()
    from harness.analysis import roofline
    from harness.config import register_configs
    from harness.run import llama_cpp

    register_configs()
    model, tokens, window = "smollm2_135m", 4096, 512
    if args.smoke:
        model, tokens, window, args.corpus, args.formats, args.quantizers = "tiny_random", 256, 64, "builtin", "", "fp32"
        args.max_new_tokens, args.repetitions = 8, 1
    common = [f"model={model}", "strategy=greedy", "measure.device=cpu", f"measure.threads={args.threads}",
              f"measure.max_new_tokens={args.max_new_tokens}", f"measure.repetitions={args.repetitions}",
              f"accuracy.corpus={args.corpus}", f"accuracy.max_tokens={tokens}", f"accuracy.context_length={window}",
              f"accuracy.stride={window}", "accuracy.scoring=second_half", "accuracy.kl=false",
              "tracking.experiment=peers"] + (["tracking.enabled=false"] if args.smoke else [])
    rows: list[tuple[str, str, dict]] = []
    notes: list[str] = []
    for q in [q for q in args.quantizers.split(",") if q]:
        print(f"# quantbench {q} ...", file=sys.stderr, flush=True)
        rows.append(("quantbench", q, run_row(common + [f"quantizer={q}", "engine=transformers"])))
    if llama_cpp.available():
        for f in [f for f in args.formats.split(",") if f]:
            print(f"# llama.cpp {f} ...", file=sys.stderr, flush=True)
            rows.append(("llama.cpp", "Q4_1 (gguf)" if f == "gguf" else f,
                         run_row(common + ["quantizer=none", "engine=llama_cpp", f"engine.format={f}"])))
    else:
        notes.append(f"llama.cpp rows missing: {llama_cpp.INSTALL_HINT}")

    ok = [(e, c, r) for e, c, r in rows if r["status"] == "OK"]
    # over this table's rows only (order-free): a run's own tag compares it with the host's speed cache, which
    # holds other processes' runs of the last hours, not in this table
    table_flags = roofline.slow_kernel_flags([{"group": e, "label": f"{e} {c}", **r} for e, c, r in ok])
    for i, (_, _, r) in enumerate(ok):
        r["warning"] = table_flags.get(i, "")
    peers = [(c, r) for e, c, r in ok if e == "llama.cpp"]
    from harness.env import cpu_info

    print(f"CPU: {cpu_info().describe()}")
    print("| engine | config | kernel.linear | MB/step | decode tok/s | prefill tok/s | ppl | peer | decode / llama.cpp "
          "| prefill / llama.cpp | ppl / llama.cpp | roofline tok/s | of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for engine, config, r in rows:
        if r["status"] != "OK":
            notes.append(f"{engine} {config}: {r['status']} {r['error'][:200]}")
            continue
        step = r["bytes_per_step"]
        peer = min(peers, key=lambda p, step=step: abs(p[1]["bytes_per_step"] - step)) if peers else None

        def ratio(k: str, r: dict = r, peer: tuple | None = peer) -> float:
            return r[k] / peer[1][k] if peer and k in r and k in peer[1] else float("nan")
        name = f"{config} ({r['resolved']})" if r.get("resolved") and r["resolved"] != config else config
        print(f"| {engine} | {name} | {r['kernel'] or ('ggml' if engine == 'llama.cpp' else '')} | {r['bytes_per_step'] / 1e6:.0f} | {fmt(r['decode_tokens_per_s'])} "
              f"| {fmt(r['prompt_tokens_per_s'], '.0f')} | {fmt(r.get('perplexity'), '.2f')} "
              f"| {peer[0] if peer else 'n/a'} | {fmt(ratio('decode_tokens_per_s'), '.2f')} "
              f"| {fmt(ratio('prompt_tokens_per_s'), '.2f')} | {fmt(ratio('perplexity'), '.3f')} "
              f"| {fmt(r['roofline_tokens_per_s'])} | {fmt(r['roofline_fraction'], '.2f')} |")
        if r["warning"]:
            notes.append(f"{engine} {config}: {r['warning']}")
    bw = ok[0][2] if ok else {}
    print()
    print(f"bandwidth {fmt(bw.get('bandwidth_gb_per_s'))} GB/s (measured once per host, see tag bandwidth_method); "
          f"batch 1, {args.max_new_tokens} new tokens x 4 prompts x {args.repetitions} repetitions; "
          f"ppl: WikiText-2 test, 4096 tokens, 8 x 512, second-half scoring")
    for n in notes:
        print(f"- {n}")
    plot = ROOT / "results" / "peers_roofline.png"
    roofline.roofline_plot([{"label": f"{e} {c}", **r} for e, c, r in ok], plot)
    print(f"- plot: {plot.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
