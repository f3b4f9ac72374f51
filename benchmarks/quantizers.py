"""Every quantizer that works here, side by side in one process, on the embedded model (SmolLM2-135M).

Each row is a real quantbench run (`harness.config.compose` + `harness.run.runner.run` with overrides), so
it goes through the same load -> quantize -> audit -> timed decode -> accuracy pipeline as `run.py`.
Prints one markdown table: stored weight MB (all weights, embedding included), bits/weight over the
quantized linears (scales and zeros included), decode tok/s (median of the repetitions, p10-p90
spread) and its ratio to fp32 measured in this same process, perplexity, KL(fp32 || q) and top-1
agreement against the fp32 reference, and quantization time (GPTQ: the time the cached checkpoint took
to make; a cache hit is marked).

    flock /tmp/qb-heavy.lock python benchmarks/quantizers.py [--quick] [--only bf16,int8] [override ...]

Timings on a shared 2-core machine are noisy: read the ratios and the spread, not the third digit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after ROOT: benchmarks/strategies.py is not the package

import ab  # noqa: E402

from harness.env import wikitext_dir  # noqa: E402

QUANTIZERS = ["fp32", "bf16", "fp16", "bnb_int8", "torchao_int8", "torchao_int8_dyn", "quanto_int8",
              "bnb_nf4", "bnb_fp4", "quanto_int4", "torchao_int4", "rtn_int4", "gptq_int4", "int8", "int4"]
WIKITEXT = wikitext_dir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (smoke run)")
    ap.add_argument("--only", default="", help="comma-separated subset of quantizers")
    ap.add_argument("--smoke", action="store_true", help="tiny model, fp32 and int8, few tokens (seconds)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides applied to every row")
    args = ap.parse_args()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

    from harness import quiet_third_party
    from harness.config import compose
    from harness.run.runner import run

    quiet_third_party()
    names = [n for n in args.only.split(",") if n] or (["fp32", "int8"] if args.smoke else QUANTIZERS)
    common = ["model=tiny_random" if args.smoke else "model=smollm2_135m", "tracking.enabled=false", "tracking.results_dir=results/bench-quantizers",
              "measure.threads=2", "accuracy.context_length=512", "accuracy.stride=512"]
    common += (["measure.max_new_tokens=16", "measure.repetitions=1", "accuracy.max_tokens=512"] if args.quick or args.smoke
               else ["measure.max_new_tokens=64", "measure.repetitions=3", "accuracy.max_tokens=2048"])
    calib = WIKITEXT / "valid.txt"
    rows = []
    for name in names:
        extra = []
        if name in ("gptq_int4", "rtn_int4") and calib.is_file():
            extra = [f"quantizer.calibration_corpus={calib}"]  # calibrate on text the perplexity never scores
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        r = run(compose(common + [f"quantizer={name}"] + extra + args.overrides))
        rows.append((name, r))
        if r.status != "OK":
            print(f"[bench] {name} FAILED: {r.error}", file=sys.stderr, flush=True)

    base = next((r.metrics for n, r in rows if n == "fp32" and r.status == "OK"), None)
    from harness.env import cpu_info

    print(f"\nCPU: {cpu_info().describe()}. Each row is its own run, one after another (not alternated): the "
          "vs fp32 column divides speeds measured minutes apart; its range is the two runs' p10-p90, and a range "
          "across 1.00x is marked undecided")
    print("\n| quantizer | backend | weight MB | bits/weight | decode tok/s (p10-p90) | vs fp32 | perplexity | "
          "KL | top-1 agree | quantize s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        m, t = r.metrics, r.tags
        if r.status != "OK":
            print(f"| {name} | FAILED: {r.error[:80]} | | | | | | | | |")
            continue
        tps = m.get("decode_tokens_per_s", float("nan"))
        spread = f"{m.get('decode_tokens_per_s_p10', float('nan')):.1f}-{m.get('decode_tokens_per_s_p90', float('nan')):.1f}"
        ratio = ab.range_ratio(m, base) if base else "n/a"
        q = m.get("quantize_s")
        qs = "-" if q is None else f"{q:.1f}" + (" (cached)" if t.get("quantizer.cache") == "hit" else "")
        print(f"| {name} | {t.get('quantizer.backend', '')} | {m['weight_bytes'] / 1e6:.0f} | "
              f"{m['bits_per_weight']:.2f} | {tps:.1f} ({spread}) | {ratio} | {m.get('perplexity', float('nan')):.2f} | "
              f"{m.get('kl_div_mean', float('nan')):.4f} | {m.get('top1_agreement', float('nan')):.3f} | {qs} |")
    ref = next((r.metrics.get("reference_perplexity") for _, r in rows if r.status == "OK"), None)
    print(f"\nfp32 reference perplexity {ref:.2f}" if ref else "")
    notes = {t["quantizer.storage"] for _, r in rows if (t := r.tags).get("quantizer.storage")}
    for note in sorted(notes):
        print(f"- storage: {note}")


if __name__ == "__main__":
    main()
