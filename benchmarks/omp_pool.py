"""What freeing the main thread's OpenMP pool buys transformers' continuous batching (harness/measure/omp.py).

    flock -x /tmp/qb-heavy.lock python benchmarks/omp_pool.py       # ~2 min on 2 cores
    python benchmarks/omp_pool.py --smoke                           # one pair on a small model: checks it runs

transformers' `generate_batch` decodes on its own thread. Once the main thread has run a parallel op (loading
the model does), libgomp counts both threads' workers, finds more than the CPUs and stops spinning at its
barriers. In one process, this times (1) one row through one bf16 576x1536 linear, 3000 times, on a second
thread, and (2) `generate_batch` over `--requests` requests of a SmolLM2-135M-shaped model (random bf16 weights,
paged attention as strategy=continuous_batch runs it), each `--pairs` times with the main thread's pool kept and
freed, alternating (kept, freed, freed, kept, ...), the main thread running one forward before each so that
both start from a pool. Prints the medians, min-max and the ratio, with the CPU and the thread count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # after ROOT: benchmarks/strategies.py is not the package

from ab import alternating, ratio, spread  # noqa: E402

from harness.env import cpu_info  # noqa: E402
from harness.measure.omp import free_omp_pool  # noqa: E402
from strategies.continuous_batch import PAGED  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256)


def on_a_thread(fn) -> float:
    """fn's seconds, run on a new thread (as transformers' batcher runs)."""
    out: list[float] = []

    def go() -> None:
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)

    th = threading.Thread(target=go)
    th.start()
    th.join()
    return out[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3, help="runs each way (default 3)")
    ap.add_argument("--requests", type=int, default=4, help="requests per generate_batch (default 4)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--smoke", action="store_true", help="one pair, a 2-layer model, 4 tokens: tests")
    args = ap.parse_args(argv)
    pairs, shape, new, calls = (1, SMALL, 4, 50) if args.smoke else (args.pairs, SMOLLM2, args.new_tokens, 3000)

    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16).eval()
    model.set_attn_implementation(PAGED)
    prompts = [[(7 * i + j) % shape["vocab_size"] for j in range(64)] for i in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=32, num_blocks=args.requests * (-(-(64 + new) // 32) + 1),
                                  max_batch_tokens=512, max_requests_per_batch=args.requests,
                                  auto_switch_to_flash=False)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(1, 1, 576, dtype=torch.bfloat16)

    def linears() -> None:
        with torch.no_grad():
            for _ in range(calls):
                torch.nn.functional.linear(x, w)

    def batch() -> None:
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False, warmup=False)
        assert sum(len(r.generated_tokens) for r in out.values()) == new * len(prompts)

    ab = ("kept", "freed")
    order = alternating(pairs, ab)
    times: dict[str, dict[str, list[float]]] = {"linear": {m: [] for m in ab}, "batch": {m: [] for m in ab}}
    for what, fn in (("linear", linears), ("batch", batch)):
        on_a_thread(fn)  # warm: first-call costs on both sides
        for mode in order:
            with torch.no_grad():
                model(torch.tensor([prompts[0]]))  # the main thread computes first: it has a pool
            if mode == "freed":
                assert free_omp_pool(), "no libgomp here: nothing to compare"
            times[what][mode].append(on_a_thread(fn))
    print(f"CPU: {cpu_info().describe()}; torch threads {torch.get_num_threads()}")
    tokens = new * len(prompts)
    for what, per in times.items():
        for mode, ts in per.items():
            med = statistics.median(ts)
            unit = (f"{med / calls * 1e6:.1f} us per call" if what == "linear"
                    else f"{tokens / med:.1f} tok/s ({len(prompts)} requests x {new} tokens)")
            print(f"{what:6s} on a second thread, main pool {mode:5s}: {spread(ts, '{:.3f}')}: {unit}")
        print(f"{what:6s}: {ratio(per, 'kept', 'freed')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
