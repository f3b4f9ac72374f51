"""Explicit settings this CPU runs slower than its default (`forced_slow`), and the format class a run is judged by.

harness/measure/paths.py `settle` calls `forced_slow` before anything loads: each finding is one warning line
and tag `warning.forced_slow`, never a refusal (forcing a slow path is a legitimate experiment). Only costs
measured in this repository are quoted, each with where it was measured; a setting whose cost was not
measured is not listed. Add one: measure it side by side (benchmarks/cpu_kernels.py has a row per setting), add
its cost to a table below with the host and numbers, and a case to tests/test_paths.py.
"""

from __future__ import annotations

from typing import Any

from harness import env
from harness.measure import memory
from harness.measure.one_row import GEMV
from quantizers import rows8
from quantizers.auto import float_choice, native_16bit


def format_class(quantizer: Any, model_dtype: str | None = None, device: str = "cpu") -> str:
    """16 | int8 | int4 | other: the column of the table a quantizer reads (by the bits it stores). A float format
    is judged by the dtype it loads: quantizer=none keeps its name when it resolves to float32 (float_choice)."""
    if getattr(quantizer, "bits", None) in ("int8", "int4"):  # quantizer=int8/int4 (quantizers/auto.py)
        return quantizer.bits
    q = memory.backend_of(quantizer)
    if not getattr(q, "quantizes", False):
        dtype = getattr(q, "dtype", None) or (float_choice(device, model_dtype)[0] if model_dtype else None)
        return "other" if dtype == "float32" else "16"
    bits = float(getattr(q, "max_bits_per_weight", 32.0))
    return "int4" if bits <= 6 else "int8" if bits <= 10 else "other"


# quantizer.prefill_matmul=native where this CPU emulates the 16-bit dot product: (missing flags, measured cost)
EMULATED_PREFILL = {
    "bfloat16": ("avx512_bf16/amx_bf16", "oneDNN's emulated bf16 GEMM makes prefill 3x slower than fp32 (mean TTFT "
                 "of the default prompts 730 vs 230 ms, Zen 3, 2 threads, SmolLM2-135M: docs/fast_path.md 'The "
                 "resolution rule', quantizers/dtype.py)"),
    "float16": ("avx512_fp16/amx_fp16", "fp16 prefill is ~10x slower than bf16 without AVX512_FP16 "
                "(docs/quantizers.md, docs/fast_path.md 'quantizer=auto16')"),
}


# quantizer.prefill_matmul=fp32 where this CPU has the 16-bit dot product: measured cost (only bf16 is measured)
NATIVE_PREFILL = {
    "bfloat16": ("TTFT 66-74 vs 125-260 ms and decode 34-39 vs 47-56 tok/s (the upcast layers also keep rows8's "
                 "row-major one-row kernel, not its tiled one), Zen 4, 2 threads, SmolLM2-135M, 4 alternating pairs: "
                 "docs/fast_path.md 'Settings forced onto a slower path'"),
}


# measure.gemv=aten/onednn for torchao's int layers where rows8 is the default (it re-lays them and the bf16 head):
# format -> (the torchao backend whose layers rows8 takes over, measured cost); measured with the head in 16 bits
ROWS8_INT = {
    "int8": ("torchao.int8_weight_only+int8pack",
             "eager decode 49.8 tok/s with rows8 vs 40.2 with ATen's GEMV, SmolLM2-135M, Zen 4, 2 threads, "
             "benchmarks/cpu_kernels.py"),
    "int4": ("torchao.int4_packed",
             "eager decode 60.4 tok/s with rows8 vs 38.1 with ATen's GEMV and 40.7 with oneDNN's, SmolLM2-135M, "
             "Zen 4, 2 threads, benchmarks/cpu_kernels.py"),
}


def forced_slow(exp: Any, device: str, cpu: env.CpuInfo) -> list[str]:
    """Explicit settings that this CPU, by its flags alone, runs slower than the default the harness picks for it:
    one line each (the setting, the CPU's fact, the measured cost and where it is documented, what to set instead).
    Only explicit values count (`auto` is the default, by definition the fast one), and only costs measured in
    this repository are quoted; a case without a measured number is not listed."""
    if not device.startswith("cpu"):
        return []
    out = []
    q = memory.backend_of(exp.quantizer)
    policy, model_dtype = getattr(q, "prefill_matmul", "auto"), getattr(exp.model, "dtype", None)
    dtype = getattr(q, "dtype", None) or (float_choice(device, model_dtype, cpu)[0] if model_dtype else None)
    if policy == "native" and dtype in EMULATED_PREFILL and not native_16bit(dtype, cpu):
        flags, cost = EMULATED_PREFILL[dtype]
        out.append(f"quantizer.prefill_matmul=native: {dtype} is emulated on this CPU ({cpu.isa}, no {flags}), so "
                   f"prefill runs the emulated 16-bit matmul: {cost}. Drop quantizer.prefill_matmul (auto: matmuls "
                   "of 12+ rows in fp32 on upcast weights)")
    if policy == "fp32" and dtype in NATIVE_PREFILL and native_16bit(dtype, cpu):
        out.append(f"quantizer.prefill_matmul=fp32: {dtype} is native on this CPU ({cpu.isa}), so upcasting the "
                   f"matmuls of 12+ rows to fp32 only adds work: {NATIVE_PREFILL[dtype]}. Drop "
                   f"quantizer.prefill_matmul (auto: native {dtype} matmuls)")
    row = GEMV.get(cpu.uarch)
    default_rows8 = cpu.native_bf16 and row is not None and row[0] == "rows8" and rows8.available(cpu)[0]
    fmt = format_class(exp.quantizer, model_dtype, device)
    if exp.measure.gemv in ("aten", "onednn") and default_rows8 and fmt == "16":
        src = row[1] if cpu.uarch == "zen4" or "zen4" not in GEMV else f"{row[1]}: {GEMV['zen4'][1]}"
        out.append(f"measure.gemv={exp.measure.gemv}: this CPU ({cpu.uarch}, {cpu.isa}) defaults to rows8 for "
                   f"16-bit weights, measured {src.replace('; ', ', ')} (harness/measure/one_row.py GEMV, "
                   "docs/fast_path.md 'The one-row kernel'). Drop measure.gemv (auto: rows8)")
    elif (exp.measure.gemv in ("aten", "onednn") and default_rows8 and fmt in ROWS8_INT and "avx512_vnni" in cpu.flags
          and getattr(q, "backend", "") == ROWS8_INT[fmt][0] and getattr(q, "head", "keep") == "keep"):
        out.append(f"measure.gemv={exp.measure.gemv}: this CPU ({cpu.uarch}, {cpu.isa}) defaults to rows8, which "
                   f"also takes torchao's {fmt} layers (VNNI kernels) and the 16-bit output head: "
                   f"{ROWS8_INT[fmt][1]} (docs/fast_path.md 'The one-row kernel'). Drop measure.gemv (auto: rows8)")
    return out
