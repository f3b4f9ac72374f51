"""One-row kernels: what a batch-1 decode step's matmuls stream, measured alone.

- `gemv_off_onednn(active)`: the context a batch-1 decode step runs in under `measure.gemv=aten`
  (harness/measure/paths.py says why: oneDNN's one-row bf16 matmul streams ~0.6x of ATen's GEMV on Zen 4).
- `stream_rate(model, ...)`: every weight matrix of the model (body linears and the output head), each
  called once with one row, the way a decode step calls it: metrics `kernel_stream_gbps` (stored bytes of
  those matrices / the matmul ops' own time in the profiler), `kernel_stream_ms` (that time),
  `kernel_stream_wall_ms` (the pass by the wall clock, Python and dispatch included: median of 3) and
  `kernel_stream_gb`. Set beside a run's ms/token it tells a slow kernel from a slow step.
- `sixteen_choice(device)`: `quantizer=auto16` / `engine.format=auto16`: bf16 or fp16, whichever one-row
  kernel streams faster on this CPU, measured once per host and torch version (cached) and recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from typing import Any

import torch

from harness import cgroup, env
from harness.cache import cache_root
from harness.errors import QuantbenchError
from harness.measure import now, sync
from harness.measure.kernels import is_linear_op
from quantizers import rows8
from quantizers.base import module_bytes
from strategies.decode import OneDnnOff

log = logging.getLogger("quantbench")
GB = 1e9
# measure.gemv=auto: where ATen's one-row GEMV beats oneDNN's for 16-bit weights (module docstring)
GEMV: dict[str, tuple[str, str]] = {
    "zen4": ("rows8", "AMD EPYC family 25 model 17 (Zen 4), 2 threads, 2026-12-05: every Llama-3.2-1B matrix at "
                      "one row, fp16, rows8 46.8 GB/s vs ATen 39.1 (oneDNN bf16 19); the 1B fp16 compiled step "
                      "against llama.cpp F16 in the paired gate: -21.0% with ATen, -4.0% with rows8"),
    "zen5": ("rows8", "Zen 4's row (same ISA line; not re-measured on Zen 5)"),
}
FP16_MARGIN = 1.10  # fp16 only when it streams >= 10% faster: without AVX512_FP16 its prefill is ~10x slower


def gemv_off_onednn(active: bool) -> contextlib.AbstractContextManager:
    """oneDNN off for the duration (ATen's GEMV takes one-row matmuls); a no-op when not `active`."""
    return OneDnnOff() if active else contextlib.nullcontext()


def gemv_choice(setting: str, device: str, cpu: env.CpuInfo) -> tuple[str, str]:
    if not device.startswith("cpu"):
        return "n/a", f"measure.gemv applies to CPU runs ({device})"
    if setting == "rows8":
        rows8.require(cpu)
        rows8.load()  # builds once (~25 s), or says in one line why it cannot, before any model loads
        return setting, "measure.gemv=rows8"
    if setting != "auto":
        return setting, f"measure.gemv={setting}"
    if not cpu.native_bf16:
        return "aten", "bf16 is not native on this CPU: oneDNN does not take bf16 matmuls, ATen's GEMV runs either way"
    kernel, why = GEMV.get(cpu.uarch, ("onednn", f"no measured row for {cpu.uarch or cpu.isa}: torch's own dispatch"))
    if kernel == "rows8":
        try:
            rows8.require(cpu)
            rows8.load()
        except QuantbenchError as exc:  # auto never fails a run: ATen's GEMV, the next best, and why
            return "aten", f"rows8 cannot run here ({exc}); ATen's GEMV instead"
    return kernel, why


def matrices(model: Any) -> list[tuple[Any, int, int]]:
    """(module, in_features, stored bytes) of every linear-like module holding a weight matrix, head included, each
    once: nn.Linear and its subclasses (torchao's tensor-subclass weights, bitsandbytes, quanto) and modules that only
    look like one (gptqmodel's QuantLinear, rows8's layers: `in_features`/`out_features` and packed buffers). A wrapper
    with a weight of its own around another such module is the one the model calls, so its inner one is skipped; a
    wrapper without a weight is skipped for its inner one. Shared by `stream_rate` and harness/measure/floor.py."""
    seen: set[Any] = set()
    out: list[tuple[str, Any, int, int]] = []
    for name, mod in model.named_modules():
        k, n = getattr(mod, "in_features", None), getattr(mod, "out_features", None)
        own = next(iter(mod.parameters(recurse=False)), None) is not None or \
            next(iter(mod.buffers(recurse=False)), None) is not None
        if not (isinstance(k, int) and isinstance(n, int) and own):
            continue  # not a matmul, or a wrapper whose inner linear is counted
        if any(name.startswith(f"{outer}.") for outer, *_ in out):
            continue  # inside a counted module: named_modules() lists parents first
        out.append((name, mod, int(k), int(module_bytes(mod, seen))))
    return [(mod, k, b) for _, mod, k, b in out]


@torch.inference_mode()
def stream_rate(model: Any, dtype: torch.dtype, device: str, gemv_aten: bool, repeats: int = 3,
                wall_ms: float | None = None) -> dict[str, float]:
    """Metrics `kernel_stream_gbps` / `_ms` / `_gb`: each weight matrix once at one row (module docstring).
    `wall_ms`: the pass's wall clock where it was just measured (harness/measure/floor.py's eager pass on CPU)."""
    mats = matrices(model)
    if not mats:
        return {}
    xs = {k: torch.randn(1, 1, k, dtype=dtype, device=device) for k in {k for _, k, _ in mats}}

    def one_pass() -> float:
        sync(device)
        t0 = now()
        for mod, k, _ in mats:
            mod(xs[k])
        sync(device)
        return now() - t0

    from torch.profiler import ProfilerActivity, profile

    with gemv_off_onednn(gemv_aten and device.startswith("cpu")):
        one_pass()  # first touch, kernel selection
        wall = wall_ms / 1e3 if wall_ms else statistics.median(one_pass() for _ in range(repeats))
        # the kernels' own time: the self time of the matmul ops, without the Python and dispatch around them
        # (a tensor subclass's unwrapping costs ~50-100 us per call on 2 cores: 10 ms over a 1B model's 113 calls)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_pass()
    kernel_s = sum(e.self_cpu_time_total for e in prof.key_averages() if is_linear_op(e.key)) / 1e6
    total = float(sum(b for _, _, b in mats))
    out = {"kernel_stream_gb": total / GB, "kernel_stream_wall_ms": wall * 1e3}
    # A compiled or opaque kernel the profiler cannot see leaves only the wall time. On a GPU an op's self CPU time
    # is its launch, not its kernel: no kernel rate from it (the floor row, harness/measure/floor.py, times the
    # kernels themselves in one CUDA graph).
    if kernel_s > 0 and not device.startswith("cuda"):
        out.update({"kernel_stream_gbps": total / kernel_s / GB, "kernel_stream_ms": kernel_s * 1e3})
    return out


def rates(dtypes: tuple[torch.dtype, ...], kernel: str, n: int = 4096, mats: int = 8,
          rounds: int = 3) -> dict[str, float]:
    """GB/s of a one-row matmul per dtype over `mats` n x n weights (beyond the caches), interleaved, through
    `kernel` (measure.gemv's choice: rows8, aten, onednn)."""
    ws = {dt: [torch.randn(n, n).to(dt) * 0.02 for _ in range(mats)] for dt in dtypes}
    mms = {dt: torch.nn.functional.linear for dt in dtypes}
    if kernel == "rows8":  # the kernel a run's layer will use: bf16 in gemv16t's tiles where the CPU takes them
        mms = {dt: rows8.gemv16 for dt in dtypes}
        if torch.bfloat16 in ws and "avx512_bf16" in env.cpu_info().flags:  # rows8.bf16_tiles: n x n fits
            ws[torch.bfloat16] = [rows8.relayout16(w) for w in ws[torch.bfloat16]]
            mms[torch.bfloat16] = torch.ops.quantbench.gemv16t
    xs = {dt: torch.randn(1, n).to(dt) for dt in dtypes}
    out: dict[str, list[float]] = {str(dt).replace("torch.", ""): [] for dt in dtypes}
    with gemv_off_onednn(kernel == "aten"), torch.inference_mode():
        for r in range(rounds + 1):
            for dt in (dtypes if r % 2 else tuple(reversed(dtypes))):
                t0 = time.perf_counter()
                for w in ws[dt]:
                    mms[dt](xs[dt], w)
                if r:  # round 0 warms up
                    out[str(dt).replace("torch.", "")].append(mats * n * n * 2 / (time.perf_counter() - t0) / GB)
    return {k: statistics.median(v) for k, v in out.items()}


def sixteen_choice(device: str, kernel: str, threads: int = 0) -> tuple[str, str]:
    """(dtype, why): bf16 or fp16 for auto16 on `device`, from this host's measured one-row rates (cached), at the
    run's thread count (`threads`, measure.threads; 0: what set_threads will give). Preflight runs before the run
    sets its threads, so the rates are measured under that count here, not under torch's default."""
    if not device.startswith("cpu"):
        return "bfloat16", f"{device}: bf16 (GPU GEMV streams both 16-bit formats alike; not measured here)"
    cpu, n = env.cpu_info(), int(threads or cgroup.usable_cpus())
    key = f"{cpu.vendor}-{cpu.family}-{cpu.model}-{cpu.isa}-{torch.__version__}-{n}t-" \
          f"{kernel}{'-t16' if kernel == 'rows8' else ''}".replace(" ", "_")  # -t16: bf16 in gemv16t's tiles
    path = cache_root() / "auto16" / f"{key}.json"
    try:
        measured = json.loads(path.read_text())
    except (OSError, ValueError):
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            measured = rates((torch.bfloat16, torch.float16), kernel)
        finally:
            torch.set_num_threads(before)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured))
    bf, fp = measured["bfloat16"], measured["float16"]
    pick = "float16" if fp >= FP16_MARGIN * bf else "bfloat16"
    why = (f"one-row {kernel} kernel on this CPU ({cpu.uarch or cpu.isa}, {n} threads, measured once "
           f"per host): bf16 {bf:.1f} GB/s, fp16 {fp:.1f} GB/s; fp16 only when >= {FP16_MARGIN:.2f}x bf16")
    return pick, why
