#!/usr/bin/env python
"""Strategies side by side on the embedded model (SmolLM2-135M), one process, one sitting.

Table 1: static batching, decode tokens/s (aggregate over the batch) for batch 1, 2, 4, 8, 16 in fp32 and
bf16, and the ratio to batch 1: the curve shows decode turning from memory-bound (weights read once per
step, shared by every row) toward compute-bound.
Table 2: speculative decoding (fp32 target, greedy verification, output checked == plain greedy on every
prompt) per draft kind x draft tokens on two prompt sets: `default` (free text) and `edit`
(input-grounded, where prompt lookup can copy spans of the prompt). Speedup is against plain greedy of
the same target on the same prompts, timed alternately in the same run. The batch sizes alternate too (forwards,
then backwards), and bs16 / bs1 is the median of per-repetition pairs with their range (benchmarks/ab.py).

    flock /tmp/qb-heavy.lock python benchmarks/strategies.py [--new-tokens 48] [--reps 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after ROOT: this file is not the `strategies` package

from ab import ratio  # noqa: E402


def batching_table(source, tok, prompts, new_tokens: int, reps: int) -> list[str]:
    from harness import measure
    from harness.models import load_pretrained
    from strategies.base import DecodeOptions
    from strategies.static_batch import StaticBatch

    sizes = (1, 2, 4, 8, 16)
    rows = ["| dtype | " + " | ".join(f"bs {b} tok/s" for b in sizes) + " | bs16 / bs1 | bs16 per-seq tok/s |",
            "|---|" + "---|" * (len(sizes) + 2)]
    opts = DecodeOptions(max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
    notes = []
    for dtype in ("float32", "bfloat16"):
        model = load_pretrained(source, dtype, "cpu")
        strategies = {bs: StaticBatch(batch_size=bs) for bs in sizes}
        batches = {bs: st.batches(prompts)[0] for bs, st in strategies.items()}
        gens: dict[int, list] = {bs: [] for bs in sizes}
        for bs in sizes:
            strategies[bs].generate(model, batches[bs], opts)  # warmup
        # the sizes in turn, forwards then backwards, `reps` times: each bs16/bs1 pair ran seconds apart, under the
        # same load (benchmarks/ab.py), not every repetition of one size before the next size
        for rep in range(reps):
            for bs in (sizes if rep % 2 == 0 else sizes[::-1]):
                gens[bs].append(strategies[bs].generate(model, batches[bs], opts))
        tps = {bs: measure.summarize(g)["decode_tokens_per_s"] for bs, g in gens.items()}
        for bs in sizes:
            print(f"  {dtype} bs {bs}: {tps[bs]:.1f} tok/s "
                  f"(cv {measure.summarize(gens[bs])['decode_tokens_per_s_cv']:.0%})", flush=True)
        per_rep = {f"bs{bs}": [measure.summarize([g])["decode_tokens_per_s"] for g in gens[bs]] for bs in (1, 16)}
        pair = ratio(per_rep, "bs16", "bs1")
        notes.append(f"- {dtype}: {pair}")
        per_seq = strategies[16].metrics(gens[16])["per_sequence_tokens_per_s"]
        rows.append(f"| {dtype} | " + " | ".join(f"{tps[b]:.1f}" for b in sizes)
                    + f" | {pair.split(' = ')[1].split(' (')[0]} | {per_seq:.1f} |")
        del model
    return [*rows, "", "bs16 / bs1, the median of per-repetition pairs:", *notes]


def speculative_table(source, tok, prompt_sets: dict, new_tokens: int, draft_ks: tuple[int, ...]) -> list[str]:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from harness.errors import QuantbenchError
    from harness.models import load_pretrained
    from quantizers.dtype import Dtype
    from strategies.base import DecodeOptions
    from strategies.speculative import Speculative

    # fp32 target: greedy equality is exact there; in bf16 a multi-token verify forward rounds differently
    # from one-token decode and flips near-ties (a mismatch fails the row, see docs/strategies.md)
    target = load_pretrained(source, "float32", "cpu")
    opts = DecodeOptions(max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
    # draft kinds: prompt lookup (no model); int8 and bf16 copies of the target (quarter / half the bytes)
    kinds = [("prompt_lookup", None)]
    for option in ("torchao_int8",):
        try:
            q = instantiate(OmegaConf.load(ROOT / "conf" / "quantizer" / f"{option}.yaml"))
            q.preflight("cpu")
            kinds.append((f"model {option}", q))
        except Exception as exc:  # noqa: BLE001 - a missing backend drops one row, says why
            print(f"  skipping draft {option}: {exc}", flush=True)
    kinds.append(("model bf16 copy", Dtype("bfloat16")))
    rows = ["| prompts | draft | k | acceptance | mean accepted | tokens/step | draft time | speedup vs greedy "
            "| greedy_match |", "|---|---|---|---|---|---|---|---|---|"]
    for kind, quantizer in kinds:
        shared: dict = {}
        for k in draft_ks:
            if quantizer is None:
                strategy = Speculative(draft="prompt_lookup", num_draft_tokens=k)
            else:
                strategy = Speculative(draft="model", num_draft_tokens=k, draft_quantizer=quantizer)
                strategy._target_source = source
            if quantizer is not None and "draft" in shared:
                strategy._drafter = shared["draft"]  # load the draft once, reuse across k
                strategy._drafter.reset()
            else:
                strategy.setup(model=target, tokenizer=tok, opts=opts, experiment=None)
                if quantizer is not None:
                    shared["draft"] = strategy._drafter
            for name, prompts in prompt_sets.items():
                try:
                    strategy.generate(target, [prompts[0]], opts)  # warmup (both loops)
                    gens = [strategy.generate(target, [p], opts) for p in prompts]  # raises on greedy mismatch
                except QuantbenchError as exc:
                    rows.append(f"| {name} | {kind} | {k} | FAILED: {str(exc)[:150]} | | | | | 0 |")
                    print("  " + rows[-1], flush=True)
                    continue
                m = strategy.metrics(gens)
                rows.append(f"| {name} | {kind} | {k} | {m['acceptance_rate']:.2f} | {m['mean_accepted_tokens']:.2f} "
                            f"| {m['tokens_per_verify_step']:.2f} | {m['draft_time_fraction']:.0%} "
                            f"| {m['speedup_vs_greedy']:.2f}x | {m['greedy_match']:.0f} |")
                print("  " + rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--draft-tokens", default="2,4,8")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 4 new tokens, one rep, 2 draft tokens (seconds)")
    ap.add_argument("--tables", default="batching,speculative", help="which tables: batching, speculative or both")
    args = ap.parse_args()
    tables = set(args.tables.split(","))
    if not tables or tables - {"batching", "speculative"}:
        ap.error(f"--tables {args.tables}: give batching, speculative or both (comma-separated)")
    if args.smoke:
        args.new_tokens, args.reps, args.draft_tokens = 4, 1, "2"

    from harness import env, measure, quiet_third_party
    from harness.measure.prompts import PROMPT_SETS
    from harness.models import EmbeddedGGUF, TinyRandom, load_tokenizer
    from harness.run.engines import encode_prompts

    quiet_third_party()
    threads = measure.set_threads(0)
    source = TinyRandom() if args.smoke else EmbeddedGGUF()
    tok = load_tokenizer(source)
    sets = {name: encode_prompts(tok, PROMPT_SETS[name], True) for name in ("default", "edit")}
    print(f"SmolLM2-135M, {threads} threads, {args.new_tokens} new tokens, greedy", flush=True)
    print(f"CPU: {env.cpu_info().describe()}", flush=True)
    if "batching" in tables:
        t1 = batching_table(source, tok, sets["default"], args.new_tokens, args.reps)
        print("\n### Static batching: decode tokens/s (aggregate), default prompts cycled\n")  # printed now: the
        print("\n".join(t1), flush=True)  # speculative table takes ~25 min on 2 loaded cores
    if "speculative" not in tables:
        return
    t2 = speculative_table(source, tok, sets, args.new_tokens, tuple(int(x) for x in args.draft_tokens.split(",")))
    print("\n### Speculative decoding, fp32 target, batch 1 (speedup = greedy wall time / speculative wall time)\n")
    print("\n".join(t2))


if __name__ == "__main__":
    main()
