"""Fast decode path side by side: eager/dynamic, eager/static, compiled/static, per weight format and batch.

    flock /tmp/qb-heavy.lock python benchmarks/fast_path.py            # the table (~15-25 min on 2 cores)
    flock /tmp/qb-heavy.lock python benchmarks/fast_path.py --formats bf16 --batches 1 --explore

Every cell is one full quantbench run on the embedded SmolLM2-135M (same code path as `run.py`,
accuracy off): warmup, repetitions, compile time outside the timing, compiled == eager tokens checked.
Batch 8 uses the `static_batch` strategy when strategies/ has one, else a left-padded batch of the
prompt set (repeated to 8 rows) through the shared decode loop. The llama.cpp column needs the peer
engine (engine=llama_cpp + llama-cpp-python); without it the column says n/a. `--explore` adds compiled
variant with inductor freezing at bf16 batch 1 (`--explore-more`: max-autotune-no-cudagraphs, 1 thread).
The kernel column is tag `kernel.linear`: the matmul operator that dominated a profiled decode step.
Per-format kernel paths at batch 1 against llama.cpp: benchmarks/cpu_kernels.py. `--smoke`: tiny
model, fp32, eager paths, no llama.cpp (seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import quiet_third_party  # noqa: E402
from harness.measure import Generation  # noqa: E402
from strategies.base import DecodeOptions, Strategy  # noqa: E402
from strategies.decode import greedy_generate  # noqa: E402

# label -> (quantizer option, llama.cpp format of the same weights). int8/int4 rows are kept only
# when the option exists in conf/quantizer/ and its quantizer declares itself compilable.
FORMATS = {
    "fp32": ("fp32", "F32"),
    "bf16": ("bf16", "BF16"),
    "int8": ("int8", "Q8_0"),
    "int4": ("int4", "Q4_0"),
    "torchao_int8": ("torchao_int8", "Q8_0"),
    "torchao_int4": ("torchao_int4", "Q4_0"),
}
PATHS = {  # label -> overrides
    "eager/dynamic": ["measure.cache=dynamic", "measure.compile=false"],
    "eager/static": ["measure.cache=static", "measure.compile=false"],
    "compiled/static": ["measure.cache=static", "measure.compile=true"],
}
EXPLORE = {
    "compiled+freezing": ["measure.cache=static", "measure.compile=true", "measure.compile_freezing=true"],
}
EXPLORE_MORE = {  # --explore-more: each costs another compile (max-autotune benchmarks GEMM templates: minutes)
    "compiled max-autotune-no-cudagraphs": ["measure.cache=static", "measure.compile=true",
                                            "measure.compile_mode=max-autotune-no-cudagraphs"],
    "compiled/static 1 thread": ["measure.cache=static", "measure.compile=true", "measure.threads=1"],
}


@dataclass
class LeftPadBatch(Strategy):
    """The prompt set repeated to `size` rows, decoded as one left-padded batch (fallback for batch 8)."""

    stepwise = True  # capabilities (strategies/base.py): decode.py's loop, several rows per call
    supports_context_depth = True
    batches_rows = True
    size: int = 8

    @property
    def batch_size(self) -> int:
        return self.size

    def batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        rows = (prompts * math.ceil(self.size / len(prompts)))[: self.size]
        return [rows]

    def generate(self, model, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        return greedy_generate(model, batch, opts)


def quantizer_ok(option: str) -> str:
    """'' when conf/quantizer/<option>.yaml exists and its quantizer compiles, else why not."""
    if not (ROOT / "conf" / "quantizer" / f"{option}.yaml").exists():
        return "no such quantizer option"
    from harness.config import build, compose

    try:
        exp = build(compose(["model=smollm2_135m", f"quantizer={option}", "accuracy.enabled=false"]))
        exp.quantizer.preflight("cpu")
    except Exception as exc:  # noqa: BLE001 - reported in the table's notes
        return str(exc).splitlines()[0]
    from harness.measure.fast_path import compile_blocker

    return compile_blocker(exp.quantizer, "cpu")


def batch_strategy(batch: int) -> tuple[list[str], Strategy | None]:
    """Overrides (or a strategy object) that make `batch` rows per generate call."""
    if batch == 1:
        return ["strategy=greedy"], None
    if (ROOT / "conf" / "strategy" / "static_batch.yaml").exists():
        from harness.config import build, compose

        for key in ("batch_size", "size"):
            try:
                build(compose(["model=tiny_random", "strategy=static_batch", f"strategy.{key}={batch}"]))
                return ["strategy=static_batch", f"strategy.{key}={batch}"], None
            except Exception:  # noqa: BLE001,S112 - try the next key name, then fall back
                continue
    return ["strategy=greedy"], LeftPadBatch(size=batch)


def run_cell(quantizer: str, batch: int, path: list[str], common: list[str], engine: str = "transformers",
             model: str = "smollm2_135m") -> dict:
    """One full run; `engine` is "transformers" or a llama.cpp format name (F32, BF16, Q8_0, Q4_0)."""
    from harness.config import build, compose
    from harness.run import runner

    overrides, strategy = batch_strategy(batch)
    # engine=llama_cpp runs llama.cpp's own formats (quantizer=none, engine.format=F32|BF16|Q8_0|Q4_0)
    weights = [f"quantizer={quantizer}"] if engine == "transformers" else ["quantizer=none", f"engine.format={engine}"]
    cfg = compose([f"model={model}", *weights, f"engine={'transformers' if engine == 'transformers' else 'llama_cpp'}",
                   *overrides, *path, *common])
    t0 = time.perf_counter()
    try:
        exp = build(cfg)
        if strategy is not None:
            exp.strategy = strategy
        result = runner.execute(exp)
    except Exception as exc:  # noqa: BLE001 - one failed cell must not lose the table
        return {"error": str(exc).splitlines()[0][:160], "wall_s": time.perf_counter() - t0}
    return {**result.metrics, "fast_path": result.tags.get("fast_path", ""), "wall_s": time.perf_counter() - t0,
            "kernel": result.tags.get("kernel.linear", "")}


def llama_cpp_ok() -> str:
    if not (ROOT / "conf" / "engine" / "llama_cpp.yaml").exists():
        return "no engine=llama_cpp in conf/engine"
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python not installed (peer-engine extra)"
    return ""


def match_cell(r: dict) -> str:
    if "compiled_match" not in r:
        return "-"
    if r["compiled_match"] == 1:
        return "1"
    return f"0 ({r.get('compiled_tie_flips', 0):.0f} near-tie flips, max gap {r.get('compiled_max_gap_ulps', 0):.1f} ulp)"


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp32,bf16,int8,int4", help="of: " + ", ".join(FORMATS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--explore", action="store_true", help="also compiled+freezing at bf16 batch 1")
    ap.add_argument("--explore-more", action="store_true", help="also max-autotune and 1 thread at bf16 batch 1")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--model", default="smollm2_135m", help="model option (tiny_random for a dry run)")
    ap.add_argument("--paths", default=",".join(PATHS), help="subset of: " + ", ".join(PATHS))
    ap.add_argument("--smoke", action="store_true", help="tiny model, fp32, eager paths, no llama.cpp (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.formats, args.batches, args.paths = "tiny_random", "fp32", "1", "eager/dynamic,eager/static"
        args.no_llama_cpp, args.max_new_tokens, args.repetitions = True, 8, 1
    quiet_third_party()
    common = ["accuracy.enabled=false", "tracking.enabled=false", f"measure.max_new_tokens={args.max_new_tokens}",
              f"measure.repetitions={args.repetitions}", "measure.warmup=1"]
    batches = [int(b) for b in args.batches.split(",")]
    notes: list[str] = []
    formats = []
    for label in args.formats.split(","):
        option, gguf = FORMATS[label]
        why = quantizer_ok(option)
        if why:
            notes.append(f"{label} (quantizer={option}) left out: {why}")
        else:
            formats.append((label, option, gguf))
    peer = "" if not args.no_llama_cpp else "--no-llama-cpp"
    peer = peer or llama_cpp_ok()
    if peer:
        notes.append(f"llama.cpp column n/a: {peer}")

    rows = []
    if not peer and any(b != 1 for b in batches):
        notes.append("llama.cpp column at batch > 1: engine=llama_cpp decodes one sequence at a time here, so "
                     "those rows compare aggregate tok/s with llama.cpp's batch-1 tok/s of the same format")
    for label, option, gguf in formats:
        peer_tps = None
        if not peer:  # llama.cpp decodes batch 1 (see notes); measured once per format, next to its rows
            ref = run_cell(option, 1, [], common, engine=gguf, model=args.model)
            peer_tps = ref.get("decode_tokens_per_s")
            if "error" in ref:
                notes.append(f"llama.cpp {gguf}: {ref['error']}")
            else:
                notes.append(f"llama.cpp {gguf} batch 1: {fmt(peer_tps)} tok/s, roofline fraction "
                             f"{fmt(ref.get('roofline_fraction'), '.2f')}")
        for batch in batches:
            paths = {k: PATHS[k] for k in args.paths.split(",")}
            if args.explore and label == "bf16" and batch == 1:
                paths.update(EXPLORE)
            if args.explore_more and label == "bf16" and batch == 1:
                paths.update(EXPLORE_MORE)
            for path_label, path in paths.items():
                r = run_cell(option, batch, path, common, model=args.model)
                rows.append((label, batch, path_label, r, peer_tps))
                print(f"# {label} b{batch} {path_label}: "
                      + (r.get("error") or f"{fmt(r.get('decode_tokens_per_s'))} tok/s "
                                           f"compile {fmt(r.get('compile_s'))} s, wall {r['wall_s']:.0f} s"),
                      file=sys.stderr, flush=True)

    from harness.env import cpu_info

    print(f"\n# CPU: {cpu_info().describe()}")
    print("| format | batch | path | kernel.linear | decode tok/s (p10-p90) | vs eager/dynamic | roofline fraction | "
          "vs llama.cpp | compile_s | compiled_match |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {}
    for label, batch, path_label, r, peer_tps in rows:
        tps = r.get("decode_tokens_per_s")
        if path_label == "eager/dynamic":
            base[(label, batch)] = tps
        if "error" in r:
            print(f"| {label} | {batch} | {path_label} | | FAILED: {r['error']} | | | | | |")
            continue
        b = base.get((label, batch))
        spread = f"{fmt(tps)} ({fmt(r.get('decode_tokens_per_s_p10'))}-{fmt(r.get('decode_tokens_per_s_p90'))})"
        print(f"| {label} | {batch} | {path_label} | {r.get('kernel', '')} | {spread} | "
              f"{fmt(tps / b if b and tps else None, '.2f')}x | {fmt(r.get('roofline_fraction'), '.2f')} | "
              f"{fmt(tps / peer_tps if peer_tps and tps else None, '.2f')} | {fmt(r.get('compile_s'))} | "
              f"{match_cell(r)} |")
    for n in notes:
        print(f"- {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
