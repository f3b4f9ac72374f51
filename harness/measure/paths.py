"""The decode path of a run: `measure.path` (eager | compiled | freezing | best) and `measure.gemv` on CPU.

A format's speed on a CPU is the speed of the path its decode step takes, so a comparison of formats must
put each on its fastest path and say which one ran. Two choices make up that path:

- `measure.path`: `eager`; `compiled` (torch.compile of the decode step, static cache); `freezing`
  (compiled with inductor freezing: weights become constants, prepacked where oneDNN takes them, a tensor
  subclass unwrapped once); `best` (default) reads `PATHS` below, measured per CPU line, format and size.
- `measure.gemv`: which kernel a one-row matmul (batch-1 decode) reaches on CPU. `rows8` sends the 16-bit
  linears and int8 `Int8PackLinear` layers to quantbench's own kernels (quantizers/rows8.py: 8 weight rows
  streamed side by side per core, AVX-512); `aten` runs the decode step with oneDNN switched off, so ATen's own
  GEMV (fp32 accumulation) streams the weights; `onednn` leaves torch's dispatch alone; `auto` reads
  one_row.GEMV (rows8 on Zen 4/Zen 5; where it cannot build, aten, and the tag says why). Only batch-1 decode
  steps are affected: prefill, scoring and batches keep oneDNN, which is faster there.

Why (AMD EPYC family 25 model 17, Zen 4, AVX-512 + native bf16, torch 2.13, 2 threads; interleaved,
`benchmarks/cpu_kernels.py --one-row`): one 14336 x 4096 bf16 weight at one row streams 19 GB/s through
oneDNN and 31 GB/s through ATen's GEMV (fp16 through ATen 33, zentorch 2.13.0.2 31-32); on 1 thread 11 vs
22. A Llama-3.2-1B decode step (eager, bf16) went from 165.6 to 75.9 ms with it. oneDNN takes bf16
matmuls only where bf16 is native, so on AVX2 CPUs (Zen 3) both settings run the same ATen kernel. rows8
streams ~1.15x ATen's GEMV (quantizers/rows8.py has the numbers).

Refusals and fallbacks (`settle`, before anything loads): `best` takes its row's path, or the next one
down (freezing -> compiled -> eager) when the path cannot run: the quantizer cannot compile, freezing's
prepacked copies do not fit in memory, `measure.context_depth` is set, or the compile estimate passes the
sweep's `sweep.timeout_s`; tag `decode_path.by` says which and why. An explicit `measure.path` that cannot run
is refused in one line. An explicit `measure.compile=false` or `measure.cache=dynamic` means eager. At config
time (`check`) contradictory settings are refused (`measure.path=eager` with `measure.compile=true`,
`measure.path=compiled` with `measure.compile_freezing=true`, ...), and so are compile settings on a run that
surely decodes eager; where only `best` decides eager they are tagged `measure.unused`.
An explicit setting this CPU, by its flags, runs slower than its default (slow_settings.py `forced_slow`: only
costs measured in the repo) is run as asked, with one warning line each and tag `warning.forced_slow`.

Add a row: measure the paths with benchmarks/cpu_kernels.py on that CPU (`--arch` for a size), then add a
`Row` with the command, host and numbers in `source`. Rows are matched most specific first (uarch, then
ISA line), then by the largest `min_params` not above the model's parameter count.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from harness import env
from harness.errors import QuantbenchError
from harness.measure import fast_path, memory
from harness.measure.one_row import gemv_choice
from harness.measure.slow_settings import forced_slow, format_class
from harness.schema import COMPILE_ONLY, set_apart

log = logging.getLogger("quantbench")

ORDER = ("freezing", "compiled", "eager")  # best path first; a path that cannot run falls to the next one
GB = 1e9
DEPTH = "measure.context_depth needs the eager step"


@dataclass(frozen=True)
class Row:
    """One measured choice: on `cpu` (a `cpu.uarch` like zen4, or a `cpu.isa` line), for `fmt` (16 | int8 |
    int4) from `min_params` parameters up, the decode step takes `path`; `source` says how that was measured."""

    cpu: str
    fmt: str
    min_params: float
    path: str
    source: str


ZEN4_1B = ("benchmarks/cpu_kernels.py --arch llama-3.2-1b --paths eager,compiled,compiled+freezing, AMD EPYC "
           "family 25 model 17 (Zen 4), 2 threads, 2026-12-05")
PATHS: tuple[Row, ...] = (
    # below 1B no row: a default run (SmolLM2-135M, ~800 decode steps) saves less than the ~20-30 s a compile
    # costs, and tests use tiny models; eager is the path there
    Row("zen4", "16", 1e9, "compiled", f"{ZEN4_1B}: bf16 eager 13.4, compiled 14.0, freezing 13.3 tok/s "
                                       "(freezing also holds a second copy of the weights)"),
    Row("zen4", "int8", 1e9, "compiled", f"{ZEN4_1B}: int8 eager 14.0-14.1, compiled 14.7-15.1, freezing "
                                         "14.6-15.1 tok/s (int8 head: 14.0 / 15.5 / 15.2)"),
    Row("zen4", "int4", 1e9, "compiled", f"{ZEN4_1B}: int4 eager 18.6, compiled 21.6, freezing 21.3 tok/s "
                                         "(int8 head: 18.8 / 22.2 / 22.4: a tie)"),
    # Zen 5 shares Zen 4's ISA line (AVX-512 + native bf16); not re-measured there at 1B: the Zen 4 rows
    Row("avx512_bf16", "16", 1e9, "compiled", f"Zen 4's row ({ZEN4_1B}); not measured on this CPU"),
    Row("avx512_bf16", "int8", 1e9, "compiled", f"Zen 4's row ({ZEN4_1B}); not measured on this CPU"),
    Row("avx512_bf16", "int4", 1e9, "compiled", f"Zen 4's row ({ZEN4_1B}); not measured on this CPU"),
    # Zen 3 (AVX2, emulated bf16), SmolLM2-135M (docs/fast_path.md): compiled 1.3-2x eager for every format
    Row("avx2", "16", 1e9, "compiled", "benchmarks/cpu_kernels.py, AMD EPYC family 25 model 1 (Zen 3), 135M, "
                                       "2026-12-04: bf16 compiled 37.9 vs eager 17.1 tok/s (not measured at 1B)"),
    Row("avx2", "int8", 1e9, "compiled", "the same run: int8 compiled 41.2 vs eager 21.7 tok/s"),
    Row("avx2", "int4", 1e9, "freezing", "the same run: int4 freezing 39.0, compiled 36.7, eager 20.4 tok/s"),
)
@dataclass
class Choice:
    """What `settle` decided: the decode path, the one-row kernel, and why each."""

    path: str
    by: str
    gemv: str
    gemv_by: str
    requested: str
    auto: str = ""  # what measure.compile/cache/compile_mode=auto became (`resolve_auto`)
    unused: str = ""  # compile settings that an eager run does not read (`best` decided eager)
    forced_slow: str = ""  # explicit settings this CPU is known to run slower than its default (`forced_slow`)

    def tags(self) -> dict[str, str]:
        tags = {"measure.path": self.requested, "decode_path": self.path, "decode_path.by": self.by,
                "kernel.gemv": self.gemv, "kernel.gemv_by": self.gemv_by, "measure.auto": self.auto}
        if self.forced_slow:
            tags["warning.forced_slow"] = self.forced_slow
        return {**tags, "measure.unused": self.unused} if self.unused else tags


def compile_only(measure: Any) -> list[str]:
    """The compile settings `measure` sets to something only a compiled step reads, as `measure.k=v`."""
    return set_apart(measure, COMPILE_ONLY)


def eager_reason(measure: Any, strategy: Any) -> str:
    """Which explicit setting makes this run decode eager whatever the CPU ("" when none does)."""
    if measure.path == "eager":
        return "measure.path=eager"
    if measure.compile is False:
        return "measure.compile=false"
    if measure.cache == "dynamic":
        return "measure.cache=dynamic"
    if strategy is not None and not strategy.stepwise:
        return f"strategy {strategy.name} (it runs its own loop)"
    return ""


def check(measure: Any, strategy: Any) -> None:
    """Config-time refusals, in one line: contradictory decode settings, and compile settings a run cannot read."""
    path, compile_, cache = measure.path, measure.compile, measure.cache
    if strategy is not None and not strategy.stepwise and (compile_ is True or path in ("compiled", "freezing")):
        asked = "measure.compile=true" if compile_ is True else f"measure.path={path}"
        raise QuantbenchError(f"{asked} compiles the decode step of strategies/decode.py, and strategy "
                              f"{strategy.name} runs its own loop; drop {asked.split('=')[0]} or use strategy=greedy")
    if path == "eager" and compile_ is True:
        raise QuantbenchError("measure.path=eager and measure.compile=true contradict each other: use "
                              "measure.path=compiled (or measure.path=freezing), or drop measure.compile")
    if path in ("compiled", "freezing") and (compile_ is False or cache == "dynamic"):
        asked = "measure.compile=false" if compile_ is False else "measure.cache=dynamic"
        raise QuantbenchError(f"measure.path={path} compiles the decode step with a static cache and {asked} asks "
                              f"for eager: use measure.path=eager, or drop {asked.split('=')[0]}")
    if path == "compiled" and measure.compile_freezing is True:
        raise QuantbenchError("measure.path=compiled runs without inductor freezing and measure.compile_freezing=true "
                              "asks for it: use measure.path=freezing")
    if strategy is not None and strategy.schedules_rows and cache == "static":
        raise QuantbenchError(f"strategy {strategy.name} schedules its own rows in a paged KV cache: measure.cache="
                              "static does nothing there; drop it (or use strategy=static_batch)")
    if (why := eager_reason(measure, strategy)) and (odd := compile_only(measure)):
        raise QuantbenchError(f"{', '.join(odd)}: only a compiled decode step reads it, and {why} decodes eager; "
                              "drop it, or use measure.path=compiled")
    if measure.compile_freezing is True and path != "freezing" and compile_ is not True:
        raise QuantbenchError("measure.compile_freezing=true is read only with measure.compile=true, and "
                              f"measure.path={path} picks its own path (it may leave freezing off): use "
                              "measure.path=freezing")


def lookup(cpu: env.CpuInfo, fmt: str, params: float | None) -> Row | None:
    """The most specific row for this CPU, format and size (None: eager)."""
    if params is None:
        return None
    for key in (cpu.uarch, cpu.isa):
        rows = [r for r in PATHS if key and r.cpu == key and r.fmt == fmt and r.min_params <= params]
        if rows:
            return max(rows, key=lambda r: r.min_params)
    return None


def compile_estimate_s(layers: int, weight_bytes: float, freezing: bool) -> float:
    """A generous bound on the compile warmup (measured: 18-35 s for 16-32 layers on 2 cores; freezing
    folds and prepacks every weight, ~2 GB/s)."""
    return 20.0 + 2.0 * layers + (weight_bytes / GB * 3.0 if freezing else 0.0)


def blocker(path: str, exp: Any, device: str, avail: float | None = None) -> str:
    """Why `path` cannot run for `exp` ("" when it can)."""
    if path == "eager":
        return ""
    if not exp.strategy.stepwise:
        return f"strategy {exp.strategy.name} runs its own loop (only the shared decode loop compiles)"
    if exp.measure.context_depth:  # the compiled path sizes its static cache from the prompts alone
        return DEPTH
    if (reason := fast_path.compile_blocker(exp.quantizer, device)):
        return reason
    counts = memory.model_counts(exp.model)
    if counts is None:
        return ""
    est = memory.transformers_estimate(exp, device)
    weights = est.parts["weights"] if est is not None else 0.0
    if path == "freezing" and est is not None and device.startswith("cpu"):
        # the folded constants are new tensors next to the module's own parameters: a second copy
        need = est.total - est.parts.get("runtime", 0.0) + weights  # what is available excludes this process
        have = avail if avail is not None else memory.available_bytes(device)[0]
        if need > have:
            return (f"freezing holds a prepacked copy of the weights: ~{need / GB:.1f} GB at peak but "
                    f"{have / GB:.1f} GB is available")
    timeout = float(((exp.config or {}).get("sweep") or {}).get("timeout_s") or 0)
    guess = compile_estimate_s(counts.layers, weights, path == "freezing")
    if timeout and guess > timeout * 0.5:
        return f"compiling takes up to ~{guess:.0f} s here, more than half of sweep.timeout_s={timeout:g}"
    return ""


def resolve_auto(exp: Any, device: str) -> str:
    """Replace `measure.compile/cache/compile_mode=auto` by what they mean on `device`; returns tag `measure.auto`.

    On CUDA an eager decode step is host launch time: the 135M model and the 8B shape both took ~19 ms per
    eager step on an H200, while the compiled 8B step with CUDA graphs took 6.7 ms (docs/gpu.md). So auto on
    CUDA is the path that shows the bytes: static cache + torch.compile in mode reduce-overhead (one graph
    replay per step). A run that cannot take it (a quantizer that cannot compile, a strategy with its own
    loop, measure.context_depth) stays eager with a one-line warning and says why in the tag. On CPU auto is
    eager with a dynamic cache, and `measure.path=best` (`settle`) picks the measured best path per CPU.
    An explicit true/false/static/dynamic/mode is never changed.
    """
    m = exp.measure
    cuda = device.startswith("cuda")
    asked = {k: getattr(m, k) for k in ("compile", "cache", "compile_mode")}
    if m.compile_mode == "auto":
        m.compile_mode = "reduce-overhead" if cuda else "default"
    tag = ""
    if cuda and m.compile == "auto" and m.cache != "dynamic" and m.path == "best":
        if (why := blocker("compiled", exp, device)):
            m.compile = False
            tag = f"cuda: eager ({why})"
            warn_once(exp, "measure.compile=auto on CUDA: %s; decoding eager", why)
        else:
            m.compile = True
            m.compile_fallback = True  # a run-time capture failure falls back to eager (tag fast_path) too
            tag = f"cuda: static cache + torch.compile {m.compile_mode}" + (
                " (CUDA graphs)" if m.compile_mode == "reduce-overhead" else "")
    if m.compile == "auto":
        m.compile = False
        tag = tag or ("eager (measure.cache=dynamic)" if m.cache == "dynamic" else
                      f"{device.split(':')[0]}: eager unless measure.path=best picks a compiled path" if
                      m.path == "best" else f"measure.path={m.path}")
    if m.cache == "auto":
        m.cache = "static" if m.compile is True else "dynamic"
    if not any(v == "auto" for v in asked.values()):
        return "off (explicit measure.compile/cache/compile_mode)"
    return tag or f"compile={str(m.compile).lower()} cache={m.cache} mode={m.compile_mode}"


_WARNED: set[tuple[str, str]] = set()  # (config, line) already logged by this process


def warn_once(exp: Any, fmt: str, *args: Any) -> None:
    """A settle warning, logged once per config and process: run.py's check and the runner each build and settle
    their own copy of one config, and the user should read each line once (the tags are set on both)."""
    line = fmt % args
    config = {k: v for k, v in (getattr(exp, "config", None) or {}).items() if k != "hydra"}
    key = (json.dumps(config, sort_keys=True, default=str), line)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", line)


def settle(exp: Any, device: str) -> Choice:
    """Resolve `measure.path` and `measure.gemv` for this run, set the measure knobs that implement them,
    and remember the choice on `exp` (idempotent: run.py and the runner both call it)."""
    done = getattr(exp, "decode_choice", None)
    if done is not None:
        return done
    m = exp.measure
    asked = {"compile": m.compile, "cache": m.cache}  # before auto resolves: an explicit false/dynamic means eager
    odd = compile_only(m)
    auto = resolve_auto(exp, device)
    cpu = env.cpu_info()
    gemv, gemv_by = gemv_choice(m.gemv, device, cpu)
    requested = m.path
    load = getattr(exp, "load", None)
    if load is not None and load.enabled:  # the load target decodes as it does (harness/load/run.py)
        choice = Choice("eager", f"load.profile={load.profile}: the load target runs its own continuous batching",
                        gemv, gemv_by, requested)
    elif m.compile is True and auto.startswith("cuda: static"):
        choice = Choice("compiled", f"measure.compile=auto on {device}: {auto}", gemv, gemv_by, requested)
    elif m.compile is True:  # the low-level switches were set by hand: they win, and say so
        path = "freezing" if m.compile_freezing else "compiled"
        choice = Choice(path, "measure.compile=true", gemv, gemv_by, requested)
    elif requested != "best":
        if (why := blocker(requested, exp, device)):
            raise QuantbenchError(f"measure.path={requested} cannot run: {why}; use measure.path=best (picks the "
                                  "fastest path that can) or measure.path=eager")
        choice = Choice(requested, f"measure.path={requested}", gemv, gemv_by, requested)
    elif asked["compile"] is False or asked["cache"] == "dynamic":  # docs/fast_path.md: honoured everywhere
        setting = "measure.compile=false" if asked["compile"] is False else "measure.cache=dynamic"
        choice = Choice("eager", f"{setting} (explicit: eager)", gemv, gemv_by, requested)
    else:
        choice = _best(exp, device, cpu, gemv, gemv_by)
    if choice.path != "eager":
        m.cache, m.compile = "static", True
        m.compile_freezing = choice.path == "freezing"
        if m.compile_skip_guards == "auto":  # safe on this path (docs/fast_path.md); compiled_match re-checks tokens
            m.compile_skip_guards = True
    elif odd:  # `best` decided eager (an explicit eager run with them is refused in `check`)
        choice.unused = f"{', '.join(odd)} (the decode step runs eager)"
        warn_once(exp, "%s not used: the decode step runs eager (%s)", ", ".join(odd), choice.by)
    if m.compile_skip_guards == "auto":
        m.compile_skip_guards = False
    choice.auto = auto
    slow = forced_slow(exp, device, cpu)
    for line in slow:  # a legitimate experiment: recorded (tag warning.forced_slow), never refused
        warn_once(exp, "forced slower than this CPU's default: %s", line)
    choice.forced_slow = "; ".join(slow)
    exp.decode_choice = choice
    return choice


def _best(exp: Any, device: str, cpu: env.CpuInfo, gemv: str, gemv_by: str) -> Choice:
    """`measure.path=best`: the measured row's path, or the next one down that can run."""
    fmt = format_class(exp.quantizer, getattr(exp.model, "dtype", None), device)
    counts = memory.model_counts(exp.model)
    row = lookup(cpu, fmt, counts.params if counts else None) if device.startswith("cpu") else None
    if row is None:
        where = f"{cpu.uarch or cpu.isa} {fmt}" if device.startswith("cpu") else device
        return Choice("eager", f"no measured row for {where} at this size (harness/measure/paths.py)", gemv, gemv_by,
                      "best")
    by, path = f"{row.cpu} {row.fmt} >= {row.min_params / 1e9:g}B params: {row.source}", "eager"
    for candidate in ORDER[ORDER.index(row.path):]:
        why = blocker(candidate, exp, device)
        if not why:
            path = candidate
            break
        by = f"{candidate} refused ({why}); {by}"
        warn_once(exp, "measure.path=best: %s cannot run (%s); trying the next path", candidate, why)
    return Choice(path, by, gemv, gemv_by, "best")
