"""What run.py does with a composed config (kept out of run.py so tests can call it in-process)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from harness.config import build
from harness.errors import QuantbenchError


def summary_line(result) -> str:
    m = result.metrics
    if result.status != "OK":
        return f"[{result.status}] {result.run_name}: {result.error}"
    parts = [f"decode {m.get('decode_tokens_per_s', float('nan')):.1f} tok/s "
             f"(p10 {m.get('decode_tokens_per_s_p10', float('nan')):.1f}, "
             f"p90 {m.get('decode_tokens_per_s_p90', float('nan')):.1f})",
             f"TTFT {m.get('ttft_ms', float('nan')):.1f} ms",
             f"ITL p50 {m.get('itl_ms_p50', float('nan')):.1f} ms",
             f"weights {m.get('weight_bytes', 0) / 1e6:.1f} MB ({m.get('bits_per_weight', float('nan')):.2f} b/w)"]
    if "perplexity" in m:
        parts.append(f"ppl {m['perplexity']:.3f}")
    if "kl_div_mean" in m:
        parts.append(f"KL {m['kl_div_mean']:.4f} top1 {m['top1_agreement']:.3f}")
    return f"[OK] {result.run_name}: " + ", ".join(parts)


def run_one(cfg: DictConfig) -> int:
    """Validate, run, record one experiment. Returns the exit code."""
    from harness import runner, tracking

    try:
        exp = build(cfg)  # every config problem, at once, before anything heavy
        exp.model.preflight()
    except QuantbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = runner.run(cfg)
    path = tracking.record(result, exp.tracking)
    print(summary_line(result))
    if result.samples:
        print(f"sample: {result.samples[0]['prompt'][-60:]!r} -> {result.samples[0]['output'][:120]!r}")
    where = exp.tracking.resolved_uri() if exp.tracking.enabled else "(MLflow disabled)"
    print(f"result: {path}  mlflow: {where} run {result.mlflow_run_id or '-'}")
    return 0 if result.status == "OK" else 1
