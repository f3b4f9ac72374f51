"""Every weight format's CPU paths side by side, with the kernel that really ran and llama.cpp next to it.

    flock -x /tmp/qb-heavy.lock python benchmarks/cpu_kernels.py --max-new-tokens 32 --repetitions 2  # ~19 min idle (Zen 3)
    flock -x /tmp/qb-heavy.lock python benchmarks/cpu_kernels.py --formats int4 --paths compiled

One run, one table. The header names the CPU (model, family/model, ISA, whether bf16 is native) and
the thread count. Per format (fp32, bf16, int8, int4) llama.cpp decodes the same prompts in the same
format (F32, BF16, Q8_0, Q4_0) right before quantbench's paths of that format, so each ratio is taken
minutes apart, not across the whole run. Every quantbench row is a full run (the code path of
`run.py`, accuracy off): decode tok/s at batch 1, TTFT and prefill tok/s on the same prompts, and tag
`kernel.linear` (the matmul operator that dominated a profiled decode step, harness/measure/kernels.py). The
last row is the default run (`python run.py`, quantizer=none resolved for this CPU), whose TTFT is
compared with llama.cpp's in the format it resolved to.

Below the table: each format's best path against the best 16-bit path and against llama.cpp, and a
profile line per format (the dominant kernel's ms per step against llama.cpp's whole step) that says
where a remaining gap is. `--smoke` runs two tiny-model eager rows (bf16, int4) and no llama.cpp (seconds).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import quiet_third_party  # noqa: E402

EAGER = ["measure.path=eager"]
COMPILED = ["measure.path=compiled"]
# inductor freezing: weights become graph constants, so a quantized tensor subclass is unwrapped once at
# compile time instead of at every call (Zen 3: int4 40 -> 53 tok/s); for plain float weights it prepacks
# for oneDNN. Which of the two compiled rows wins differs by format and CPU, so both are measured.
FROZEN = ["measure.path=freezing"]
# format -> (llama.cpp format of the same weights, [(path label, overrides)])
PATHS: dict[str, tuple[str, list[tuple[str, list[str]]]]] = {
    "fp32": ("F32", [("eager", ["quantizer=fp32", *EAGER]),
                     ("compiled", ["quantizer=fp32", *COMPILED]),
                     ("compiled+freezing", ["quantizer=fp32", *FROZEN])]),
    "bf16": ("BF16", [("eager oneDNN GEMV", ["quantizer=bf16", *EAGER, "measure.gemv=onednn"]),
                      ("eager", ["quantizer=bf16", *EAGER]),
                      # fp32 matmuls from 12 rows (the emulated-bf16 rule) forced where bf16 is native: a forced-slow
                      # finding there (harness/measure/slow_settings.py NATIVE_PREFILL)
                      ("eager fp32 prefill", ["quantizer=bf16", *EAGER, "quantizer.prefill_matmul=fp32"]),
                      ("compiled", ["quantizer=bf16", *COMPILED]),
                      ("compiled+freezing", ["quantizer=bf16", *FROZEN])]),
    # int8 resolves to torchao_int8 kernel=int8pack on CPU; the `torchao subclass` rows keep torchao's own
    # Int8Tensor (eager: dequantize + mm per call; compiled: inductor's int8pack rewrite), for comparison
    "int8": ("Q8_0", [("eager", ["quantizer=int8", *EAGER]),
                      # rows8 off (torchao's int8pack op at one row): a forced-slow finding with AVX512_VNNI
                      ("eager ATen GEMV", ["quantizer=int8", *EAGER, "measure.gemv=aten"]),
                      ("eager torchao subclass", ["quantizer=torchao_int8", "quantizer.kernel=torchao", *EAGER]),
                      ("eager quanto", ["quantizer=quanto_int8", "model.dtype=bfloat16", *EAGER]),
                      ("compiled", ["quantizer=int8", *COMPILED]),
                      ("compiled torchao subclass", ["quantizer=torchao_int8", "quantizer.kernel=torchao", *COMPILED]),
                      ("compiled+freezing", ["quantizer=int8", *FROZEN]),
                      # the output projection in int8 too, as llama.cpp's Q8_0 file stores it
                      ("eager int8 head", ["quantizer=int8", "quantizer.head=int8", *EAGER]),
                      ("compiled int8 head", ["quantizer=int8", "quantizer.head=int8", *COMPILED]),
                      ("compiled+freezing int8 head", ["quantizer=int8", "quantizer.head=int8", *FROZEN])]),
    "int4": ("Q4_0", [("eager", ["quantizer=int4", *EAGER]),
                      # rows8 off (torchao's int4pack op at one row): a forced-slow finding with AVX512_VNNI
                      ("eager ATen GEMV", ["quantizer=int4", *EAGER, "measure.gemv=aten"]),
                      ("eager oneDNN GEMV", ["quantizer=int4", *EAGER, "measure.gemv=onednn"]),
                      ("compiled", ["quantizer=int4", *COMPILED]),
                      ("compiled+freezing", ["quantizer=int4", *FROZEN]),
                      # llama.cpp's Q4_0 file stores its head in Q6_K; an int8 head is the nearest torch kernel
                      ("eager int8 head", ["quantizer=int4", "quantizer.head=int8", *EAGER]),
                      ("compiled int8 head", ["quantizer=int4", "quantizer.head=int8", *COMPILED]),
                      ("compiled+freezing int8 head", ["quantizer=int4", "quantizer.head=int8", *FROZEN])]),
}
# opt-in (--variants): more inductor options on the bf16 compiled path, each a row (minutes of compile each)
VARIANTS = [("compiled max-autotune", ["quantizer=bf16", *COMPILED, "measure.compile_mode=max-autotune-no-cudagraphs"]),
            ("compiled cpp_wrapper", ["quantizer=bf16", *COMPILED, "measure.compile_cpp_wrapper=true"]),
            ("compiled fp16", ["quantizer=fp16", *COMPILED])]
SIXTEEN = ("bf16",)  # the 16-bit formats the int formats must beat (fp32 is 32-bit)


def run_cell(overrides: list[str], common: list[str]) -> dict:
    """One full run; its metrics plus the tags this table shows (an error becomes a row, not a crash)."""
    from harness.config import build, compose
    from harness.run import runner

    t0 = time.perf_counter()
    try:
        result = runner.execute(build(compose([*common, *overrides])))
    except Exception as exc:  # noqa: BLE001 - one failed cell must not lose the table
        return {"error": str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                "wall_s": time.perf_counter() - t0}
    keep = ("kernel.linear", "kernel.linear_share", "quantizer.resolved", "quantizer.backend", "fast_path", "kernel.gemv",
            "quantizer.prefill_matmul", "warning.slow_kernel", "cpu.isa")
    row = {**result.metrics, **{k: result.tags[k] for k in keep if k in result.tags}, "wall_s": time.perf_counter() - t0}
    print(f"#   {row.get('decode_tokens_per_s', float('nan')):.1f} tok/s, TTFT {row.get('ttft_ms', float('nan')):.0f} ms, "
          f"{row.get('kernel.linear', 'ggml')}, wall {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return row


def one_row_table(threads: int, small: bool = False) -> int:
    """GB/s of each one-row kernel on the same shape (14336 x 4096, 6 matrices: beyond the caches), interleaved
    rounds, median: what `measure.gemv` and `quantizer=auto16` choose between (harness/measure/paths.py)."""
    import importlib.util
    import statistics

    import torch

    from harness.env import cpu_info
    from harness.measure import set_threads
    from quantizers import rows8

    n_threads = set_threads(threads)
    n, k, mats = (1024, 1024, 2) if small else (14336, 4096, 6)
    torch.manual_seed(0)
    bf = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for _ in range(mats)]
    half = [w.half() for w in bf]
    x, xh = torch.randn(1, k, dtype=torch.bfloat16), torch.randn(1, k, dtype=torch.float16)
    i8 = [torch.randint(-127, 127, (n, k), dtype=torch.int8) for _ in range(mats)]
    i8s = torch.rand(n, dtype=torch.bfloat16)
    q4 = [torch.randint(0, 16, (n, k), dtype=torch.int32) for _ in range(mats)]
    i4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8) for q in q4]
    i4s = torch.rand(k // 64, n, 2, dtype=torch.bfloat16)

    def aten(ws: list, inp: torch.Tensor) -> None:
        with torch.backends.mkldnn.flags(enabled=False):
            for w in ws:
                torch.nn.functional.linear(inp, w)

    cands = {  # label -> (function, bytes per call)
        "bf16 oneDNN (torch's default dispatch)": (lambda: [torch.nn.functional.linear(x, w) for w in bf], 2.0),
        "bf16 ATen GEMV (measure.gemv=aten)": (lambda: aten(bf, x), 2.0),
        "fp16 ATen GEMV": (lambda: [torch.nn.functional.linear(xh, w) for w in half], 2.0),
        "int8 _weight_int8pack_mm": (lambda: [torch.ops.aten._weight_int8pack_mm(x, w, i8s) for w in i8], 1.0),
        "int4 _weight_int4pack_mm_for_cpu (g64)": (
            lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 64, i4s) for w in i4], 0.5 + 4 / 64),
    }
    if rows8.available(cpu_info())[0]:  # quantbench's own 8-row kernel (quantizers/rows8.py)
        rows8.load()
        cands["bf16 rows8 (row-major, 8 rows)"] = (lambda: [rows8.gemv16(x, w) for w in bf], 2.0)
        if "avx512_bf16" in cpu_info().flags:  # bf16 in tiles of 4 rows (Bf16RowsLinear, what rows8 installs)
            t16 = [rows8.relayout16(w) for w in bf]
            cands["bf16 gemv16t (tiles of 4 rows, measure.gemv=rows8)"] = (
                lambda: [torch.ops.quantbench.gemv16t(x, w) for w in t16], 2.0)
        cands["fp16 rows8"] = (lambda: [rows8.gemv16(xh, w) for w in half], 2.0)
        cands["int8 rows8 (Int8PackLinear, one row)"] = (lambda: [rows8.gemv8(x, w, i8s) for w in i8], 1.0)
    if rows8.available(cpu_info())[0] and "avx512_vnni" in cpu_info().flags:  # integer dot products (vnni.py)
        from quantizers import vnni

        t8 = [vnni.relayout8(w) for w in i8]
        cands["int8 gemv8t (Int8RowsLinear, VNNI)"] = (
            lambda: [torch.ops.quantbench.gemv8t(x, w, i8s) for w in t8], 1.0)
        t4 = [vnni.relayout(q.to(torch.uint8), i4s[..., 0], i4s[..., 1], 64) for q in q4]
        cands["int4 gemv4 (g64, Int4RowsLinear, VNNI)"] = (
            lambda: [torch.ops.quantbench.gemv4(x, w, 64) for w in t4], 0.5 + 4 / 64)
    del q4
    if importlib.util.find_spec("zentorch") is not None:
        import zentorch  # noqa: F401 - registers torch.ops.zentorch

        cands["bf16 zentorch linear"] = (lambda: [torch.ops.zentorch.zentorch_linear_unary(x, w) for w in bf], 2.0)
    res: dict[str, list[float]] = {c: [] for c in cands}
    for r in range(7):
        for label, (f, per) in (cands.items() if r % 2 else reversed(list(cands.items()))):
            t0 = time.perf_counter()
            f()
            if r:  # round 0 warms up
                res[label].append(mats * n * k * per / (time.perf_counter() - t0) / 1e9)
    print(f"# CPU: {cpu_info().describe()}; {n_threads} threads; torch {torch.__version__}; one row x "
          f"{mats} weights of {n} x {k}, 6 interleaved rounds")
    print("\n| kernel | GB/s median (min-max) | vs bf16 oneDNN |\n|---|---|---|")
    base = statistics.median(res["bf16 oneDNN (torch's default dispatch)"])
    for label, v in res.items():
        print(f"| {label} | {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) | {statistics.median(v) / base:.2f} |")
    return 0


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(PATHS), help="of: " + ", ".join(PATHS))
    ap.add_argument("--paths", default="", help="only these path labels (comma-separated, e.g. eager,compiled,compiled+freezing)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-default", action="store_true", help="skip the default-run row")
    ap.add_argument("--variants", action="store_true", help="add bf16 rows: max-autotune, cpp_wrapper")
    ap.add_argument("--smoke", action="store_true", help="tiny model, two rows, no llama.cpp (seconds)")
    ap.add_argument("--arch", default="", help="a random-weight preset (model.arch, e.g. llama-3.2-1b) instead of SmolLM2")
    ap.add_argument("--one-row", action="store_true", help="only the one-row kernel table (seconds): GB/s per kernel")
    args = ap.parse_args(argv)
    quiet_third_party()
    import torch

    from harness.env import cpu_info
    from harness.measure import set_threads
    from harness.run import llama_cpp

    if args.one_row:  # --smoke: small weights (seconds), the same kernels
        return one_row_table(args.threads, small=args.smoke)
    model = "tiny_random" if args.smoke else "smollm2_135m"
    formats = ["bf16", "int4"] if args.smoke else [f for f in args.formats.split(",") if f]
    if args.smoke:  # eager rows only: a compile takes tens of seconds even for the tiny model
        args.max_new_tokens, args.repetitions, args.no_llama_cpp, args.no_default, args.paths = 8, 1, True, True, "eager"
    sized = ([f"model.arch={args.arch}", "measure.prompts=synthetic:1", "measure.prompt_tokens=32"]
             if args.arch else [])
    if args.arch:
        model = "random"
    common = [f"model={model}", *sized, "strategy=greedy", "measure.device=cpu", f"measure.threads={args.threads}",
              f"measure.max_new_tokens={args.max_new_tokens}", f"measure.repetitions={args.repetitions}",
              "measure.warmup=1", "accuracy.enabled=false", "tracking.enabled=false"]
    threads = set_threads(args.threads)
    peer_ok = not args.no_llama_cpp and llama_cpp.available()
    print(f"# CPU: {cpu_info().describe()}; {threads} threads; torch {torch.__version__}; model {model}; "
          f"batch 1, {args.max_new_tokens} new tokens x 4 prompts x {args.repetitions} repetitions", flush=True)

    rows: list[tuple[str, str, dict]] = []
    peers: dict[str, dict] = {}
    for f in formats:
        gguf, paths = PATHS[f]
        paths = paths + (VARIANTS if args.variants and f == "bf16" else [])
        if peer_ok:
            print(f"# llama.cpp {gguf} ...", file=sys.stderr, flush=True)
            peers[f] = run_cell(["quantizer=none", "engine=llama_cpp", f"engine.format={gguf}"], common)
            rows.append((f, f"llama.cpp {gguf}", peers[f]))
        for label, overrides in paths:
            if args.paths and label not in args.paths.split(","):
                continue
            print(f"# {f} {label} ...", file=sys.stderr, flush=True)
            rows.append((f, label, run_cell(overrides, common)))
    default = None
    if not args.no_default:
        print("# default run ...", file=sys.stderr, flush=True)
        default = run_cell([], common)
        rows.append(("default", "python run.py (quantizer=none)", default))

    def tps(r: dict) -> float:
        return r.get("decode_tokens_per_s", float("nan")) if "error" not in r else float("nan")

    ours = [(f, label, r) for f, label, r in rows if not label.startswith("llama.cpp") and f != "default"]
    best: dict[str, tuple[str, dict]] = {}
    for f, label, r in ours:
        if math.isfinite(tps(r)) and (f not in best or tps(r) > tps(best[f][1])):
            best[f] = (label, r)
    best16 = max((tps(best[f][1]) for f in SIXTEEN if f in best), default=float("nan"))

    print("\n| format | path | resolved | kernel.linear (share of decode) | decode tok/s (p10-p90) | vs best 16-bit "
          "| vs llama.cpp | kernel GB/s (ms) | TTFT ms | prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f, label, r in rows:
        if "error" in r:
            print(f"| {f} | {label} | | FAILED: {r['error']} | | | | | |")
            continue
        # the default row's peer is the format it resolved to (as its summary line below), not always BF16
        peer = peers.get(f) if f != "default" else peers.get({"fp32": "fp32"}.get(r.get("quantizer.resolved", ""), "bf16"))
        is_peer = label.startswith("llama.cpp")
        resolved = r.get("quantizer.resolved", "") or ("" if is_peer else r.get("quantizer.backend", ""))
        kernel = "ggml" if is_peer else f"{r.get('kernel.linear', '?')} ({r.get('kernel.linear_share', '?')})"
        spread = f"{fmt(tps(r))} ({fmt(r.get('decode_tokens_per_s_p10'))}-{fmt(r.get('decode_tokens_per_s_p90'))})"
        vs_peer = "1" if is_peer else fmt(tps(r) / tps(peer) if peer else None, ".2f")
        stream = (f"{fmt(r.get('kernel_stream_gbps'))} ({fmt(r.get('kernel_stream_ms'))})"
                  if "kernel_stream_gbps" in r else "")
        print(f"| {f} | {label} | {resolved} | {kernel} | {spread} | {fmt(tps(r) / best16, '.2f')} | {vs_peer} "
              f"| {stream} | {fmt(r.get('ttft_ms'), '.0f')} | {fmt(r.get('prompt_tokens_per_s'), '.0f')} |")

    print()
    for f in formats:
        if f not in best:
            continue
        label, r = best[f]
        peer = peers.get(f)
        step = 1e3 / tps(r)
        # the profiler slows every op, so its milliseconds are not the timed step's: take its share of the timed step
        kernel_ms = r.get("kernel_linear_share", float("nan")) * step
        line = (f"- {f}: best path {label}, {fmt(tps(r))} tok/s = {step:.1f} ms/step, {r.get('kernel.linear')} "
                f"~{fmt(kernel_ms)} ms/step ({r.get('kernel.linear_share', '?')} of the profiled step)")
        if f in ("int8", "int4"):
            line += f"; vs best 16-bit {fmt(tps(r) / best16, '.2f')}x"
        if peer and "error" not in peer:
            ratio = tps(r) / tps(peer)
            # the ratio's range from both runs' p10-p90: a range across 0.75 decides nothing
            lo = (r.get("decode_tokens_per_s_p10") or tps(r)) / (peer.get("decode_tokens_per_s_p90") or tps(peer))
            hi = (r.get("decode_tokens_per_s_p90") or tps(r)) / (peer.get("decode_tokens_per_s_p10") or tps(peer))
            verdict = ("undecided because noisy" if lo < 0.75 <= hi else "meets" if ratio >= 0.75 else "below")
            line += (f"; vs llama.cpp {PATHS[f][0]} {fmt(tps(peer))} tok/s ({1e3 / tps(peer):.1f} ms/step): "
                     f"{ratio:.2f}x [{lo:.2f}-{hi:.2f}] ({verdict} 0.75)")
            if ratio < 0.75:
                line += (f"; profile: the {r.get('kernel.linear')} calls alone take {fmt(kernel_ms)} ms, "
                         f"{kernel_ms / (1e3 / tps(peer)):.1f}x llama.cpp's whole step; the other "
                         f"{fmt(step - kernel_ms)} ms are attention, norms, guards and dispatch")
        print(line)
    if default is not None and "error" not in default:
        resolved = default.get("quantizer.resolved", "?")
        peer = peers.get({"fp32": "fp32"}.get(resolved, "bf16"))
        line = (f"- default run: quantizer=none resolved to {resolved} ({default.get('quantizer.prefill_matmul', '')}); "
                f"TTFT {fmt(default.get('ttft_ms'), '.0f')} ms, decode {fmt(tps(default))} tok/s")
        if peer and "error" not in peer:
            ratio = default["ttft_ms"] / peer["ttft_ms"]
            line += (f"; llama.cpp {PATHS['fp32' if resolved == 'fp32' else 'bf16'][0]} TTFT on the same prompts "
                     f"{fmt(peer.get('ttft_ms'), '.0f')} ms: {ratio:.2f}x ({'within' if ratio <= 2 else 'above'} 2x)")
        print(line)
    # over this table's rows only: a run's own tag compares it with whatever the host's speed cache holds (other
    # processes' runs of the last hours), which is not in this table
    from harness.analysis import roofline

    ok = [(f, label, r) for f, label, r in rows if "error" not in r and "roofline_fraction" in r]
    flags = roofline.slow_kernel_flags([{"group": "llama.cpp" if label.startswith("llama.cpp") else "quantbench",
                                         "label": f"{f} {label}", "kernel": r.get("kernel.linear", ""), **r}
                                        for f, label, r in ok])
    warnings = [f"{f} {label}: {flags[i]}" for i, (f, label, _) in enumerate(ok) if i in flags]
    for w in warnings:
        print(f"- warning: {w}")
    if args.smoke:
        return 0 if all("error" not in r for _, _, r in rows) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
