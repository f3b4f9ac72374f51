"""Which matmul kernel really ran: a short torch.profiler pass over decode steps, outside the timing.

The speed of a weight format on CPU is mostly the speed of the kernel its linear layers reach, and the
same quantizer can reach very different ones (torchao int8 weight-only dequantizes and calls `aten::mm`
in eager mode, but runs `aten::_weight_int8pack_mm` once inductor rewrites it). So after the timed
region each run decodes a few more tokens of its first batch under torch.profiler, starting after the
prefill (the `choose` hook of the decode loop fires after every forward), and records the linear-like
operator with the most self CPU time as tag `kernel.linear` (e.g. `aten::_weight_int4pack_mm_for_cpu`),
with its share of the profiled decode time (`kernel.linear_share`, also metric `kernel_linear_share`)
and its calls per step. A strategy that never calls the hook (its own loop) is profiled whole, prefill
included (tag `kernel.profiled=whole generation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

log = logging.getLogger("quantbench")

PROFILE_TOKENS = 4  # decode steps profiled (after one untimed prefill)
# substrings of operator names that do a linear layer's matmul (ATen, quantization libraries, ZenDNN)
LINEAR_OPS = ("mm", "linear", "gemm", "gemv", "matmul", "int8pack", "int4pack", "woq", "qlinear", "bitsandbytes",
              "quanto", "zentorch", "mkldnn", "onednn")
NOT_LINEAR = ("bmm", "attention", "sdpa", "Torch-Compiled", "CompiledFxGraph", "## ", "cache", "Lookup")


def is_linear_op(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in LINEAR_OPS) and not any(k.lower() in low for k in NOT_LINEAR)


def dominant_linear(events: list[tuple[str, float, int]], steps: int) -> dict[str, Any]:
    """From (name, self CPU us, calls) rows: the linear op with the most self time, and its share."""
    total = sum(t for _, t, _ in events)
    linear = [e for e in events if is_linear_op(e[0])]
    if not linear or total <= 0:
        return {"kernel.linear": "none found"}
    name, self_us, calls = max(linear, key=lambda e: e[1])
    return {"kernel.linear": name, "kernel.linear_share": f"{self_us / total:.0%}",
            "kernel.linear_calls_per_step": str(round(calls / max(steps, 1))),
            "kernel_linear_share": self_us / total, "kernel_linear_ms_per_step": self_us / 1e3 / max(steps, 1)}


def profile_linear(strategy: Any, model: Any, batch: list[list[int]], opts: Any,
                   tokens: int = PROFILE_TOKENS) -> tuple[dict[str, str], dict[str, float]]:
    """Profile `tokens` decode steps of one generation of `batch`; returns (tags, metrics)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    state = {"started": False, "steps": 0}

    def choose(logits: Any, index: int) -> Any:
        if index == 0 and not state["started"]:  # the prefill forward is done: decode steps from here
            prof.start()
            state["started"] = True
        elif state["started"]:
            state["steps"] += 1
        return logits.argmax(-1)

    try:
        short = dataclasses.replace(opts, max_new_tokens=tokens + 1, choose=choose)
        strategy.generate(model, batch, short)
        whole = not state["started"]
        if whole:  # the strategy runs its own loop: profile the whole (short) generation
            short = dataclasses.replace(opts, max_new_tokens=tokens + 1)
            prof.start()
            strategy.generate(model, batch, short)
            state["steps"] = tokens
        prof.stop()
    except Exception as exc:  # noqa: BLE001 - a profile that fails must not fail the measured run
        with contextlib.suppress(Exception):
            prof.stop()
        log.warning("kernel profile failed: %s", exc)
        return {"kernel.linear": f"profile failed: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"}, {}
    events = [(e.key, float(e.self_cpu_time_total), int(e.count)) for e in prof.key_averages()]
    if log.isEnabledFor(logging.DEBUG):  # the whole profile table: run.py ... hydra.verbose=quantbench
        log.debug("decode-step profile:\n%s", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    found = dominant_linear(events, state["steps"] or tokens)
    tags = {k: v for k, v in found.items() if k.startswith("kernel.")}
    tags["kernel.profiled"] = "whole generation" if whole else f"{state['steps'] or tokens} decode steps"
    metrics = {k: v for k, v in found.items() if not k.startswith("kernel.")}
    log.info("kernel.linear=%s (%s of profiled decode time)", tags["kernel.linear"], tags.get("kernel.linear_share", "?"))
    return tags, metrics
