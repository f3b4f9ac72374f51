"""Timing, statistics and memory: the parts every strategy shares.

Rules kept here so no strategy can forget them:
- Timed regions are bracketed by `sync(device)`: CUDA kernels are asynchronous, so a host clock read
  without a synchronize measures the launch, not the work.
- Warmup generations are run and discarded by the runner; only timed repetitions reach `summarize`.
- Spread is always reported next to the centre (percentiles and coefficient of variation).
- Peak memory is the process's peak RSS on CPU (VmHWM, reset through /proc/self/clear_refs before the
  model loads) and `max_memory_allocated` on CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from harness import cgroup
from harness.errors import Unsupported


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise Unsupported("needs CUDA: measure.device=cuda but no CUDA device is visible; use measure.device=cpu")
    return name


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def now() -> float:
    return time.perf_counter()


def grad_mode(*models: object) -> contextlib.AbstractContextManager:
    """torch.inference_mode, or no_grad when any of `models` asks for it (None entries are skipped).

    A quantizer sets `model.quantbench_grad_mode = "no_grad"` when its backend breaks under
    inference_mode (optimum-quanto int4: "Cannot set version_counter for inference tensor"); a loop that
    runs several models (speculative: target and draft) needs no_grad if one of them does.
    """
    import torch

    no_grad = any(getattr(m, "quantbench_grad_mode", "inference") == "no_grad" for m in models if m is not None)
    return torch.no_grad() if no_grad else torch.inference_mode()


def model_grad_mode(fn):
    """Run `fn(model, ...)` under `grad_mode(model)`: inference_mode, or no_grad when the model asks for it."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with grad_mode(model):
            return fn(model, *args, **kwargs)

    return wrapper


@dataclass
class Generation:
    """What one generate call produced and how long it took.

    `sequences` hold only real generated tokens (no padding, nothing after a stop at EOS).
    `decode_tokens` counts the real tokens produced by decode steps (the first token of each sequence
    comes from prefill and is part of TTFT instead). `stats` carries strategy-specific counts, e.g.
    speculative acceptance.

    Times (seconds, host clock after a device synchronize):
    - `ttft_s`: from the start of the call to the first token on the host (prefill + first argmax).
    - `step_s`: one entry per decode step (per token for a strategy that emits several per step): the
      per-step latency that ITL percentiles are taken over.
    - `decode_wall_s`: the wall clock of the whole decode phase, from the first token on the host to the
      last one, host work between steps included (mask and position updates, row bookkeeping, a
      speculative rollback). None for a loop that does not record it: then the sum of `step_s` stands in.
    - `prefill_s`: the time spent on the prompt alone, where it differs from TTFT (continuous batching
      schedules requests, so its first token comes after queueing); None = `ttft_s`.
    """

    sequences: list[list[int]]
    prompt_tokens: int
    ttft_s: float
    step_s: list[float]
    decode_tokens: int
    stats: dict = field(default_factory=dict)
    decode_wall_s: float | None = None
    prefill_s: float | None = None

    @property
    def decode_s_steps(self) -> float:
        """The sum of the decode steps' own times (host work between steps not included)."""
        return float(sum(self.step_s))

    @property
    def decode_s(self) -> float:
        """The decode phase's wall clock (`decode_wall_s`), or the sum of step times where not recorded."""
        return float(self.decode_wall_s) if self.decode_wall_s is not None else self.decode_s_steps

    @property
    def prompt_s(self) -> float:
        """Prefill time: `prefill_s` where recorded, else TTFT."""
        return float(self.prefill_s) if self.prefill_s is not None else self.ttft_s

    @property
    def generated_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def e2e_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens over the decode phase's wall clock (`decode_s`)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def decode_step_tokens_per_s(self) -> float:
        """Decode tokens over the sum of step times: the loop's own speed, without host work between steps."""
        return self.decode_tokens / self.decode_s_steps if self.decode_s_steps > 0 else float("nan")

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else float("nan")


def percentile(values, q: float) -> float:
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


def cv(values) -> float:
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size < 2 or arr.mean() == 0:
        return 0.0
    return float(arr.std(ddof=1) / arr.mean())


def repeat_cv(rates: list[float], batches: int) -> float:
    """Run-to-run noise: the CV of each batch's rate over its repetitions, root-mean-squared over batches.

    Generations come repetition by repetition, batch by batch (`batches` per repetition). The default prompt
    set mixes lengths on purpose, so the CV over all calls would count the prompts' differences as noise
    (a quiet machine, 3- and 923-token prompts: 78%) and more repetitions could never clear the warning."""
    n = max(batches, 1)
    groups = [[r for r in rates[b::n] if not math.isnan(r)] for b in range(n)]  # nan: a call with no decode
    cvs = [cv(g) for g in groups if len(g) >= 2]
    return float(np.sqrt(np.mean(np.square(cvs)))) if cvs else 0.0


def summarize(generations: list[Generation], batches: int = 1) -> dict[str, float]:
    """Speed metrics over the timed generations (names are a contract: see README).

    Definitions (each generate call is one sample; medians over calls unless said otherwise):
    - `decode_tokens_per_s` (+ `_p10`, `_p90`): per call, decode tokens / decode wall clock
      (`Generation.decode_s`); calls without decode tokens are left out. The percentiles span the prompts too.
    - `decode_tokens_per_s_cv`: the noise, repetitions of one batch against each other (`repeat_cv`; the
      generations are `batches` per repetition).
    - `decode_step_tokens_per_s`: the same over the sum of step times (host work between steps excluded).
    - `ttft_ms`, `ttft_ms_p90`: percentiles of TTFT over calls.
    - `itl_ms_p50/p90/p99`: percentiles over every decode step of every call (pooled, not per call);
      `itl_samples` says how many: a p99 of fewer than ~100 steps is the largest step, not a tail.
    - `e2e_ms`: median of TTFT + decode wall clock.
    - `prompt_tokens_per_s`: median over calls of prompt tokens / prefill time (`Generation.prompt_s`).
    """
    decoding = [g for g in generations if g.decode_tokens > 0]
    tps = [g.decode_tokens_per_s for g in decoding]
    by_batch = [g.decode_tokens_per_s if g.decode_tokens > 0 else math.nan for g in generations]
    steps = [s for g in generations for s in g.step_s]
    ttft = [g.ttft_s for g in generations]
    ms = 1000.0
    return {
        "decode_tokens_per_s": percentile(tps, 50),
        "decode_tokens_per_s_p10": percentile(tps, 10),
        "decode_tokens_per_s_p90": percentile(tps, 90),
        "decode_tokens_per_s_cv": repeat_cv(by_batch, batches),
        "decode_step_tokens_per_s": percentile([g.decode_step_tokens_per_s for g in decoding], 50),
        "ttft_ms": percentile(ttft, 50) * ms,
        "ttft_ms_p90": percentile(ttft, 90) * ms,
        "itl_ms_p50": percentile(steps, 50) * ms,
        "itl_ms_p90": percentile(steps, 90) * ms,
        "itl_ms_p99": percentile(steps, 99) * ms,
        "itl_samples": float(len(steps)),
        "e2e_ms": percentile([g.e2e_s for g in generations], 50) * ms,
        "generated_tokens": float(sum(g.generated_tokens for g in generations)),
        "prompt_tokens_per_s": percentile([g.prompt_tokens_per_s for g in generations if g.prompt_s > 0], 50),
        "timed_generations": float(len(generations)),
    }


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim). After a large free, glibc raises its mmap
    threshold and keeps later freed blocks in its heap, so replacing a model's weights piece by piece (here, and
    quantizers/rows8.py's re-laid layers) left the old copies counted in the process's memory: an 8B int4 run
    peaked at 15.0 GB against 7.4 GB estimated, a Llama-3.2-1B int4 model held 0.5-0.9 GB more after the swap."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def own_heap() -> Iterator[None]:
    """Inside, a garbage collection sees only the objects created inside: what exists on entry (imported torch,
    transformers, MLflow, Hydra: ~650k objects) moves to the permanent generation (`gc.freeze`), and back on exit
    (`gc.unfreeze`), so garbage older than the run is still collected later. A run collects between its phases to
    hand a model's memory back before the next one (the reference model, the profiler's tables, the model itself):
    a full collection took 0.36-0.38 s with those modules imported (Zen 4), 4-6 of them per run, and ~2 us inside.
    Nested, only the outermost freezes; where something else froze objects, nothing is changed."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def reset_peak_memory(device: str) -> bool:
    """Reset the peak-memory high-water mark; False if the OS does not allow it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
        return True
    # the reset sets the mark to the current RSS, which still holds what was freed before (the tokenizer's GGUF
    # conversion on a cold cache, a reference pass): collected and trimmed first, the peak does not depend on
    # whether those caches were warm (measured on SmolLM2: 1779 MB cold vs 1355 MB warm before, ~1370/1348 after)
    gc.collect()
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def set_threads(n: int) -> int:
    """measure.threads, 0: the cores this process may use, capped by its cgroup's CPU quota (harness/cgroup.py)."""
    import torch

    n = n or cgroup.usable_cpus()
    torch.set_num_threads(n)
    return n


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
