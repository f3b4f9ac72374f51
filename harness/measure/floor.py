"""The floor row: the loaded model's own linear layers, each called once on one row, timed alone.

A decode step at batch 1 is the linear layers (each weight matrix read once for one row) plus the rest: attention,
norms, sampling, launches or graph overhead. `linear_floor` times the first part with the model's own modules, so
the format's own kernel runs (cuBLAS for 16 bits, Marlin, tinygemm, bitsandbytes, ... for a quantized format) and
no second copy of the weights is made:

- CUDA: one eager pass first (kernel selection, lazy init, a library's first-call conversion), then the whole
  pass captured in ONE `torch.cuda.CUDAGraph` and replayed `repeats` times, each replay timed by the wall clock
  between two synchronizes: the linear layers as a compiled step's graph replays them, without Python or launch
  gaps. A library that syncs or allocates on the host inside its forward cannot be captured: then the eager pass
  is timed the same way and tag `kernel.floor` says why.
- CPU: the eager pass by the wall clock (median of 3): the measurement one_row.stream_rate records as
  `kernel_stream_wall_ms`, taken once and handed to it.

Metrics `linear_floor_ms` (median), `linear_floor_spread_ms` (max - min over the timed passes); tag `kernel.floor`
says how it was measured. `floor_report` sets it against the run's decode step (`linear_floor_share`,
`step_rest_ms`; `step_report`), where that step is one target forward: a speculative step is not compared. Modules
are called as nn.Modules. Under torch.compile a tensor-subclass format (torchao) reaches
another kernel than its eager dispatch does, so where the run's step was compiled on CUDA and the format's eager call
dequantizes the whole weight (`eager_dequantizes`, quantizers/base.py: torchao int8), the pass is compiled too, with
the step's inductor flags (`compiled_pass`), then captured; formats that call one kernel eager and compiled (cuBLAS,
tinygemm, Marlin, bitsandbytes) stay eager (no second compile on the device's clock).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable
from typing import Any

from harness.measure import finite, now, sync
from harness.measure.one_row import gemv_off_onednn, matrices

log = logging.getLogger("quantbench")

CUDA_REPEATS = 20  # graph replays timed: each is a few ms at most (an 8B model's weights once)
CPU_REPEATS = 3  # eager passes: an 8B model's pass is ~1 s on a few cores


def linear_modules(model: Any) -> list[tuple[Any, int]]:
    """(module, in_features) of every linear-like module, each once (harness/measure/one_row.py `matrices`, which
    kernel_stream_gbps counts over: the floor and the stream rate time the same modules)."""
    return [(mod, k) for mod, k, _ in matrices(model)]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def capture_graph(one_pass: Callable[[], Any]) -> Callable[[], Any]:
    """`one_pass` captured in one CUDA graph; returns its replay. Raises where the pass cannot be captured."""
    import torch

    side = torch.cuda.Stream()  # warm-up on a side stream before capture, as torch.cuda.graphs' docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        one_pass()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_pass()
    graph.replay()  # the first replay uploads the graph: not a timed one
    torch.cuda.synchronize()
    return graph.replay


def runner(one_pass: Callable[[], Any], device: str, capture: Callable = capture_graph,
           cleanup: Callable[[], Any] = lambda: sync("cuda")) -> tuple[Callable[[], Any], str]:
    """(what to time, how): the graph replay on CUDA, the eager pass where capture fails or off CUDA."""
    if not device.startswith("cuda"):
        return one_pass, f"eager pass on {device}"
    try:
        return capture(one_pass), "one CUDA graph"
    except Exception as exc:  # noqa: BLE001 - any library's capture failure falls back to the eager pass
        with contextlib.suppress(Exception):  # a failed capture leaves work queued: let it end before timing
            cleanup()
        why = first_line(exc)
        log.warning("floor row: CUDA graph capture failed (%s); timing the eager pass", why)
        return one_pass, f"eager on cuda (capture failed: {why})"


def time_passes(run: Callable[[], Any], repeats: int, wait: Callable[[], Any]) -> list[float]:
    """Wall seconds of `repeats` calls of `run`, each between two `wait()`s (a device synchronize)."""
    times = []
    for _ in range(repeats):
        wait()
        t0 = now()
        run()
        wait()
        times.append(now() - t0)
    return times


def summary(times: list[float], mods: int, how: str) -> tuple[dict[str, float], dict[str, str]]:
    """Metrics `linear_floor_ms`, `linear_floor_spread_ms` and tag `kernel.floor` of the timed passes."""
    if not times:
        return {}, {}
    what = "replays" if how.endswith("one CUDA graph") else "passes"
    return ({"linear_floor_ms": statistics.median(times) * 1e3, "linear_floor_spread_ms": (max(times) - min(times)) * 1e3},
            {"kernel.floor": f"{how}: {mods} linears, one row each, median of {len(times)} {what}"})


def pass_of(mods: list[tuple[Any, int]], xs: dict[int, Any]) -> Callable[[], list[Any]]:
    """One call of each linear module on its one-row input. The outputs are returned: a compiled pass whose
    outputs were dropped would be dead code to inductor, which then removes every matmul and times nothing."""

    def one_pass() -> list[Any]:
        return [mod(xs[k]) for mod, k in mods]

    return one_pass


def compiled_pass(one_pass: Callable[[], Any], inductor: dict[str, Any]) -> Callable[[], Any]:
    """`one_pass` through torch.compile (mode default: the CUDA graph is ours) with the step's inductor flags.

    Why: a tensor-subclass format (torchao int8) reaches its fast kernel only when inductor fuses the dequantize
    into the matmul, which the compiled step does and an eager call never does (it dequantizes the whole weight,
    then multiplies). An eager floor would time the slow kernel and read as a floor above the step."""
    import torch

    fn = torch.compile(one_pass, mode="default")

    def run() -> Any:
        with torch._inductor.config.patch(inductor):
            return fn()

    return run


def linear_floor(model: Any, dtype: Any, device: str, gemv_aten: bool = False, repeats: int | None = None,
                 inductor: dict[str, Any] | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) of the floor row (module docstring). `inductor` (CUDA, a compiled step of a quantized format):
    the pass is compiled with these flags first, so it reaches the kernel the compiled step reaches."""
    import torch

    mods = linear_modules(model)
    if not mods:
        return {}, {"kernel.floor": "no linear modules found"}
    repeats = repeats or (CUDA_REPEATS if device.startswith("cuda") else CPU_REPEATS)
    one_pass = pass_of(mods, {k: torch.randn(1, 1, k, dtype=dtype, device=device) for k in {k for _, k in mods}})

    grad = torch.no_grad() if getattr(model, "quantbench_grad_mode", "") == "no_grad" else torch.inference_mode()
    try:
        with grad, gemv_off_onednn(gemv_aten and device.startswith("cpu")):
            one_pass()  # eager first: kernel selection, lazy init, a library's first-call weight conversion
            sync(device)
            timed, compiled_how = one_pass, ""
            if inductor is not None and device.startswith("cuda"):
                try:
                    timed = compiled_pass(one_pass, inductor)
                    timed()  # compiles here, not inside the capture
                    sync(device)
                    compiled_how = "compiled as the step, "
                except Exception as exc:  # noqa: BLE001 - the eager pass is still a floor, tagged as such
                    log.warning("floor row: compiling the pass failed (%s); timing it eager", first_line(exc))
                    timed, compiled_how = one_pass, f"eager (compile failed: {first_line(exc)}), "
            run, how = runner(timed, device)
            times = time_passes(run, repeats, lambda: sync(device))
            how = compiled_how + how
    except Exception as exc:  # noqa: BLE001 - the floor is a side measurement: it never fails the run
        log.warning("floor row failed: %s", exc)
        return {}, {"kernel.floor": f"failed: {first_line(exc)}"}
    return summary(times, len(mods), how)


def positive(value: Any) -> bool:
    """A finite number above 0 (NaN, inf and non-numbers are not)."""
    return finite(value) and value > 0


def speculative_apart(metrics: dict) -> str:
    """Why a speculative step is not set against the floor row.

    The floor is one pass of the target's linears at one row: the linear work of a greedy step. A speculative step
    is k draft forwards (the draft model's linears k times; none for prompt lookup) plus one verify forward of the
    target at k+1 rows, another shape than the floor's (on CPU the one-row gemv paths, measure.gemv, take one row
    only). floor / step would read as the linear layers' share of the step while the draft's and the verify's extra
    linear work sat in `step_rest_ms`, which says attention, norms and overhead, and a greedy run's share and this
    one would be two different ratios under one name. No fair floor for that step exists here, so neither is
    reported; `linear_floor_ms` itself (the model and format's one-row pass) stands."""
    k = metrics.get("num_draft_tokens")
    drafts = f"up to {k:g} draft tokens and one verify of up to {k + 1:g}" if positive(k) else "a draft and one verify"
    return (f"not compared: a speculative step ({drafts} of the target, "
            f"{metrics.get('tokens_per_verify_step', float('nan')):.2f} tokens a step) is not the one target forward "
            "at one row the floor times; its share would count the draft's and the verify's linears as the rest")


def decode_step_ms(metrics: dict) -> float | None:
    """The run's decode step in ms: the tokens a step emits / decode tokens per s, as harness/analysis/roofline.py
    counts a step (StepWork.tokens_per_step): the batch, the measured `decode_tokens_per_step` of a step loop (below
    the batch when rows finished at EOS early), or `tokens_per_verify_step` for a speculative step (batch /
    tokens per s read that step that many times too short)."""
    tps = metrics.get("decode_tokens_per_s")
    # a static batch whose rows finished at EOS early still computes them: the measured tokens a step emitted
    per_step = metrics.get("tokens_per_verify_step", metrics.get("decode_tokens_per_step",
                                                                 metrics.get("batch_size", 1) or 1))
    if not (positive(tps) and positive(per_step)):
        return None
    return 1e3 * float(per_step) / float(tps)


def step_report(metrics: dict) -> tuple[dict[str, float], dict[str, str]]:
    """The run's decode step against its floor row (`floor_report`), where the step is one target forward; a
    speculative step is not compared, and tag `kernel.floor_share` says why (`speculative_apart`)."""
    floor_ms = metrics.get("linear_floor_ms")
    if "tokens_per_verify_step" in metrics:
        return ({}, {"kernel.floor_share": speculative_apart(metrics)}) if positive(floor_ms) else ({}, {})
    return floor_report(decode_step_ms(metrics), floor_ms)


def floor_report(step_ms: float | None, floor_ms: float | None) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags): `linear_floor_share` = floor / step and `step_rest_ms` = step - floor, what the step
    spends beyond its linear layers. A floor above the step (share > 1, negative rest) is kept and tagged
    `warning.floor`: the floor pass then ran a slower path than the step did, which is the finding to read."""
    if not all(positive(v) for v in (step_ms, floor_ms)):
        return {}, {}
    out = {"linear_floor_share": floor_ms / step_ms, "step_rest_ms": step_ms - floor_ms}
    if floor_ms <= step_ms:
        return out, {}
    return out, {"warning.floor": f"linear floor {floor_ms:.3f} ms > decode step {step_ms:.3f} ms: the one-row pass "
                                  "reached a slower path than the step (eager vs compiled kernel, capture failed?)"}
