"""Check quantbench's KL divergence against an independent full-vocabulary computation, and measure the
reference records it could keep (issue 17).

    flock -x /tmp/qb-heavy.lock python benchmarks/kl_exact.py [--quantizers bf16,bnb_nf4] [--max-tokens 4096]
                                                              [--records] [--smoke] [override ...]

KL check (per quantizer, embedded model SmolLM2-135M, fp32 reference, the first --max-tokens WikiText-2
test tokens in non-overlapping 512-token windows, every token after a window's first scored): this
script runs the fp32 model and the quantized model (built by quantbench's quantizer) over the windows
itself, keeps the reference's full-vocabulary logits in memory and sums KL over the whole vocabulary in
float64, using no code from harness/analysis/accuracy.py. Printed beside it: quantbench's `kl_div_mean` with the
exact record (default, `accuracy.kl_reference=exact`) and with the top-k record (`topk`, the record
before issue 17), and the ratio of each to the full-vocabulary value. From the same in-memory logits it
also prints the KL the other candidate records would give: top-k + tail bucket for larger k, and
llama.cpp's 16-bit KLD base (uint16 log-probs per vocabulary entry, 16 nats below the max, per-token
scale and offset).

--records: builds each record kind once more into a temporary folder and prints its disk size and
build time (one fp32 reference pass each), and the time quantbench's scoring pass takes without KL, with
the top-k record and with the exact record, for the first quantizer. Name the CPU next to the times.

--smoke: the tiny random model on 256 tokens in 64-token windows (seconds; the docs test runs it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.env import wikitext_dir  # noqa: E402


def chunks(ids: list[int], context: int) -> list[list[int]]:
    """Non-overlapping windows; every token after a window's first is scored."""
    return [ids[i:i + context] for i in range(0, len(ids), context) if len(ids[i:i + context]) > 1]


@torch.no_grad()
def logits_of(model, ids: list[int], context: int) -> torch.Tensor:
    """float32 logits predicting every scored token, all windows concatenated: [n_scored, vocab]."""
    out = [model(input_ids=torch.tensor([w])).logits[0, :-1].float() for w in chunks(ids, context)]
    return torch.cat(out)


def llama_cpp_code(z: torch.Tensor) -> torch.Tensor:
    """llama.cpp perplexity.cpp's KLD base for float32 logits rows, decoded back: uint16 log-probs over
    [max - 16, max] nats with a per-token scale and offset; entries below the range read as the floor."""
    zmax = z.max(-1, keepdim=True).values
    zmin = torch.maximum(z.min(-1, keepdim=True).values, zmax - 16)
    lse = torch.log(torch.exp(z.double() - zmax.double()).sum(-1, keepdim=True)).float()
    min_log_prob = zmin - zmax - lse
    scale = (zmax - zmin) / 65535
    code = torch.where(z > zmin, torch.round((z - zmin) / scale), torch.zeros_like(z)).clamp(0, 65535)
    return scale * code + min_log_prob  # the reader's p_log_base


def kl_rows(ref_logits: torch.Tensor, q_logits: torch.Tensor, ks: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Per token: full KL, the top-k + bucket KL for each k, and llama.cpp's 16-bit-code KL (float64)."""
    out: dict[str, list] = {"full": [], "code16": [], **{f"top{k}": [] for k in ks}}
    for i in range(0, len(ref_logits), 128):
        z, zq = ref_logits[i:i + 128], q_logits[i:i + 128]
        lp, lq = torch.log_softmax(z.double(), -1), torch.log_softmax(zq.double(), -1)
        out["full"].append((lp.exp() * (lp - lq)).sum(-1))
        for k in ks:
            top, idx = lp.topk(k, -1)
            qt = lq.gather(-1, idx)
            pt_tail = (1 - top.exp().sum(-1)).clamp(min=1e-300)
            qt_tail = lq.scatter(-1, idx, float("-inf")).logsumexp(-1)
            out[f"top{k}"].append((top.exp() * (top - qt)).sum(-1) + pt_tail * (pt_tail.log() - qt_tail))
        base = llama_cpp_code(z).double()
        kept = base > -16  # the reader skips the clamped floor
        out["code16"].append(torch.where(kept, base.exp() * (base - lq), torch.zeros_like(base)).sum(-1))
    return {k: torch.cat(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantizers", default="bf16,bnb_nf4", help="comma-separated quantbench quantizers")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--records", action="store_true", help="also measure each record's disk size and build time")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 256 tokens (seconds)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from harness import quiet_third_party
    from harness.analysis import accuracy as acc
    from harness.config import build, compose
    from harness.models import load_tokenizer

    quiet_third_party()
    corpus = wikitext_dir() / "test.txt"
    model_name, context = ("tiny_random", 64) if args.smoke else ("smollm2_135m", 512)
    args.max_tokens = 256 if args.smoke else args.max_tokens
    common = [f"model={model_name}", f"accuracy.corpus={corpus}", f"accuracy.max_tokens={args.max_tokens}",
              f"accuracy.context_length={context}", f"accuracy.stride={context}", *args.overrides]
    exp = build(compose(common))
    tok = load_tokenizer(exp.model)
    ids = tok(corpus.read_text(encoding="utf-8")[: args.max_tokens * 20], add_special_tokens=False)["input_ids"]
    ids = ids[: args.max_tokens]
    assert ids == acc.corpus_tokens(tok, exp.accuracy.corpus, exp.accuracy.max_tokens), "not the same tokens"

    print(f"[kl_exact] fp32 reference, full-vocabulary logits of {args.max_tokens} tokens ...", file=sys.stderr)
    ref = AutoModelForCausalLM.from_pretrained(str(exp.model.local_dir()), dtype=torch.float32).eval()
    ref_logits = logits_of(ref, ids, context)
    n, vocab = ref_logits.shape
    hidden = ref.config.hidden_size
    del ref

    ks = tuple(k for k in (256, 1024, 4096) if k < vocab)
    rows, timing, ppl_only_s = [], {}, None
    for name in [q for q in args.quantizers.split(",") if q]:
        print(f"[kl_exact] {name} ...", file=sys.stderr, flush=True)
        qexp = build(compose([*common, f"quantizer={name}"]))
        model = qexp.quantizer.load(qexp.model, tokenizer=tok, device="cpu", experiment=qexp)
        ours = kl_rows(ref_logits, logits_of(model, ids, context), ks)
        qb = {}
        for mode in ("exact", "topk"):
            cfg = build(compose([*common, f"quantizer={name}", f"accuracy.kl_reference={mode}"])).accuracy
            reference, _ = acc.ensure_reference(qexp.model, tok, cfg, "cpu")
            t0 = time.perf_counter()
            qb[mode] = acc.score(model, ids, cfg, "cpu", reference=reference)
            timing[(name, mode)] = time.perf_counter() - t0
            assert qb[mode]["scored_tokens"] == n, (qb[mode]["scored_tokens"], n)
        if args.records and ppl_only_s is None:
            t0 = time.perf_counter()
            acc.score(model, ids, qexp.accuracy, "cpu")
            ppl_only_s = time.perf_counter() - t0
        rows.append((name, ours, qb))
        del model

    full_line = "| quantizer | full-vocab KL (here) | quantbench exact | ratio | quantbench top-256 (before) | ratio | " \
                "tail bound (top-256) | top-1 agree | perplexity |"
    from harness.env import cpu_info

    print(f"\nCPU: {cpu_info().describe()} (the times below are single passes, each record timed once)")
    print(f"\nKL(fp32 || quantized), {model_name}, {n} scored tokens of WikiText-2 test, {context}-token windows\n")
    print(full_line)
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ours, qb in rows:
        full = float(ours["full"].mean())
        e, t = qb["exact"], qb["topk"]
        print(f"| {name} | {full:.6f} | {e['kl_div_mean']:.6f} | {e['kl_div_mean'] / full:.4f} | "
              f"{t['kl_div_mean']:.6f} | {t['kl_div_mean'] / full:.4f} | {t['kl_div_tail_bound']:.4f} | "
              f"{e['top1_agreement']:.4f} | {e['perplexity']:.3f} |")

    print("\nOther records, from the same logits: KL / full-vocabulary KL, and disk for these tokens\n")
    sizes = {f"top{k}": n * k * 8 for k in ks}
    sizes["code16"] = n * (vocab * 2 + 8)
    print("| record | disk MB | " + " | ".join(name for name, _, _ in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for key in [f"top{k}" for k in ks] + ["code16"]:
        label = f"top-{key[3:]} + tail bucket" if key.startswith("top") else "llama.cpp 16-bit log-probs"
        ratios = " | ".join(f"{float(o[key].mean()) / float(o['full'].mean()):.4f}" for _, o, _ in rows)
        print(f"| {label} | {sizes[key] / 1e6:.1f} | {ratios} |")
    print(f"| exact (hidden state, {hidden} x fp32) | {n * (hidden * 4 + 8) / 1e6:.1f} | "
          + " | ".join("1 (exact)" for _ in rows) + " |")

    if args.records:
        print("\nReference record, built once per sweep (one fp32 pass over the tokens), and scoring cost per cell\n")
        print("| record | file MB | build s |")
        print("|---|---|---|")
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("topk", "exact"):
                cfg = build(compose([*common, f"accuracy.kl_reference={mode}"])).accuracy
                t0 = time.perf_counter()
                tensors, meta = acc.build_reference(exp.model, tok, cfg, "cpu")
                path = Path(tmp) / f"{mode}.safetensors"
                acc.save_reference(path, tensors, meta)
                built = time.perf_counter() - t0
                label = "top-256 + tail (before)" if mode == "topk" else "exact (hidden state)"
                print(f"| {label} | {path.stat().st_size / 1e6:.2f} | {built:.1f} |")
        first = rows[0][0]
        print(f"\nscoring pass of {first} ({n} tokens): perplexity only {ppl_only_s:.1f} s, with KL from the "
              f"top-256 record {timing[(first, 'topk')]:.1f} s, from the exact record {timing[(first, 'exact')]:.1f} s")


if __name__ == "__main__":
    main()
