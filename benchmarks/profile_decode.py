"""Where the milliseconds of one decode step go (torch.profiler), eager and compiled.

    flock /tmp/qb-heavy.lock python benchmarks/profile_decode.py [--dtype bfloat16] [--steps 16] [--batch 8]
        [--no-compile] [--freezing] [--arch llama-3.2-1b] [--rows8] [--cpp-wrapper]

Loads the embedded SmolLM2-135M, prefills one prompt into a static cache, then profiles `--steps`
decode steps. Prints wall ms per step, the top operators by self CPU time, and the step split into
matmul (linear/mm/addmm/bmm/gemm), attention (sdpa), and everything else (norms, rotary, elementwise,
cache copies, Python and dispatch), eager and compiled. The answer feeds docs/fast_path.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from harness import quiet_third_party  # noqa: E402

MATMUL = ("linear", "mm", "addmm", "bmm", "matmul", "gemm", "mkldnn", "onednn", "woq", "_weight_int")
ATTN = ("scaled_dot_product", "sdpa", "flash_attention", "attention")


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTN):
        return "attention"
    if any(k in low for k in MATMUL):
        return "matmul"
    return "other ops"


def profile(step, n: int, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    wall = (time.perf_counter() - t0) / n * 1e3
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    events = prof.key_averages()
    # self CPU time of leaf-ish ops; compiled graphs show as one "Torch-Compiled Region" plus its kernels
    split: dict[str, float] = {}
    for e in events:
        split[classify(e.key)] = split.get(classify(e.key), 0.0) + e.self_cpu_time_total / 1e3 / n
    total = sum(split.values())
    print(f"\n## {label}: {wall:.2f} ms/step wall ({1e3 / wall:.1f} tok/s); profiled self-CPU {total:.2f} ms/step "
          "(summed over threads' main op stream)")
    for k, v in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"- {k}: {v:.2f} ms/step ({v / total:.0%})")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--freezing", action="store_true")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (the prompt repeated)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, eager only, 2 steps (seconds)")
    ap.add_argument("--arch", default="", help="a random-weight preset (e.g. llama-3.2-1b) instead of SmolLM2")
    ap.add_argument("--rows8", action="store_true", help="one-row matmuls through quantizers/rows8.py (AVX-512)")
    ap.add_argument("--no-eager", action="store_true", help="profile the compiled step only")
    ap.add_argument("--cpp-wrapper", action="store_true", help="inductor calls its kernels from generated C++")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.no_compile = 2, True
    quiet_third_party()
    from harness.config import build, compose
    from harness.measure import fast_path, set_threads
    from harness.models import load_pretrained, load_tokenizer

    threads = set_threads(0)
    model_arg = "model=tiny_random" if args.smoke else f"+size={args.arch}" if args.arch else "model=smollm2_135m"
    exp = build(compose([model_arg, "accuracy.enabled=false"]))
    model = load_pretrained(exp.model, args.dtype, "cpu")
    if args.arch:  # random weights: any token ids will do
        ids = torch.arange(100, 132)[None].repeat(args.batch, 1)
    else:
        tok = load_tokenizer(exp.model)
        ids = torch.tensor([tok("The capital of France is", add_special_tokens=False)["input_ids"]]).repeat(args.batch, 1)
    if args.rows8:
        from quantizers import rows8

        print(f"# rows8: {rows8.install(model)} layers")
    bsz = args.batch
    width = ids.shape[1]
    max_len = width + 3 + 2 * (args.steps + 3) + 8
    from harness.env import cpu_info

    print(f"# CPU: {cpu_info().describe()}")
    print(f"# {args.dtype}, batch {bsz}, {threads} threads, torch {torch.__version__}, prompt {width} tokens, cache {max_len}")

    fast = None if args.no_compile else fast_path.FastPath(model, device="cpu", max_cache_len=max_len,
                                                          freezing=args.freezing, cpp_wrapper=args.cpp_wrapper,
                                                          skip_guards=True)  # as measure.path=compiled runs
    from transformers import StaticCache

    for label in ([] if args.no_eager else ["eager"]) + ([] if fast is None else ["compiled"]):
        with torch.inference_mode():
            cache = StaticCache(config=model.config, max_cache_len=max_len)
            mask = torch.ones((bsz, width), dtype=torch.long)
            model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(width)[None].repeat(bsz, 1), cache=cache,
                  use_cache=True, logits_to_keep=1)
            state = {"n": width, "tok": ids[:, -1:]}

            def step(label=label, cache=cache, state=state):
                n = state["n"]
                m = torch.ones((bsz, n + 1), dtype=torch.long)
                pos = torch.tensor([[n]]).repeat(bsz, 1)
                if label == "compiled":
                    logits = fast.step(model, state["tok"], m, pos, cache, torch.tensor([n]))
                else:
                    m = torch.cat([m, torch.zeros((bsz, max_len - n - 1), dtype=torch.long)], dim=1)
                    logits = model(input_ids=state["tok"], attention_mask=m, position_ids=pos, cache=cache,
                                   use_cache=True, logits_to_keep=1).logits[:, -1, :]
                state["tok"] = logits.argmax(-1, keepdim=True)
                state["n"] = n + 1

            if label == "compiled":
                t0 = time.perf_counter()
                for _ in range(3):  # dynamo may compile again on the second step (a value it then marks dynamic)
                    step()
                print(f"# compile (first steps): {time.perf_counter() - t0:.1f} s")
            with fast.timing() if label == "compiled" else contextlib.nullcontext():  # guards skipped, as runs do
                profile(step, args.steps, f"{label} {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
