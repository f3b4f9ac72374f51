"""Which GPU kernel did a decode step's linear layers: the device side of harness/measure/kernels.py's profile.

A compiled decode step on a GPU replays a CUDA graph: no ATen op runs on the host, so the CPU-side profile sees
no linear op (tag `not visible (compiled region, ...)`). CUPTI still records every kernel the replay launches as a
device row (device_type CUDA, with `self_device_time_total`), so a profile with CUDA activity names the kernel.

- `kernel_name(raw)`: a readable name from a demangled kernel signature: the qualified identifier before its
  template arguments (`void gemv2T_kernel_val<int, ...>(...)` -> `gemv2T_kernel_val`); cuBLAS/cuBLASLt plain
  tokens (`sm90_xmma_gemm_..._cublas`) and Triton names (`triton_tem_fused_mm_0`) as they are; a CUTLASS wrapper
  (`cutlass::Kernel2<cutlass_80_..._gemm_...>`) keeps its first template argument, which is the real name.
- `is_linear_kernel(name)`: whether a kernel belongs to the linear layers' path (module constants say which).
- `dominant_cuda_kernel(rows, steps, head)`: from plain (raw name, self device us, calls) rows, the linear kernel
  with the most device time as tag `kernel.linear`, its share of all device time in the profiled steps, its calls
  per step, a second linear kernel when it holds >= 10% (a quantized path often splits into a dequantize kernel and
  a gemm: the reader needs both), and the whole linear path's share.

The output projection apart: kernel rows carry no operand shapes (the CPU path finds it by the vocabulary
dimension), so `head_kernels` names the kernels one eager call of it launches (`harness/measure/kernels.py`
profiles that call), and a kernel of those names that runs about once per step in the profile is the head's
(`kernel.lm_head`): quantizers leave it in 16 bits, and at 1B its cuBLAS gemv reads as many bytes as an int4 body,
so without this an int4 run could be tagged with the head's gemv. A name the body's linears run too (a 16-bit model:
one gemv for all) cannot be told apart, and the tag says so.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("quantbench")
Row = tuple[str, float, int]  # (raw kernel name, self device time in us, calls)

# Attention and its helpers win over the linear markers: FlashAttention 3 is a CUTLASS kernel
# (`cutlass::device_kernel<flash::...>`) and flash-decoding's split-KV kernels contain "splitk".
NOT_LINEAR_KERNELS = ("flash", "fmha", "attention", "attn", "sdpa", "softmax", "splitkv", "rotary", "rope_", "rms",
                      "norm")
# cuBLAS (gemv*, *gemm*, xmma, cublasLt's split-K reduce, and its Hopper/Blackwell `nvjet_*` GEMMs), CUTLASS, Marlin (GPTQ/AWQ), tinygemm (torch's
# _weight_int4pack_mm), fbgemm/mslk, gemlite, bitsandbytes (kgemm_4bit_inference_naive, int8 igemm/imma), and
# dequantize kernels: a kernel that unpacks a quantized weight for the gemm after it is part of the linear path,
# and often the bigger part of it, so it is counted there (and shows as `kernel.linear_2nd` when it is).
LINEAR_KERNELS = ("gemv", "gemm", "xmma", "cutlass", "cublas", "marlin", "tinygemm", "int4pack", "int8pack",
                  "splitk", "gemlite", "mslk", "kint8", "imma", "dequant", "wgmma", "matmul", "nvjet")
# Triton kernels are named after the ops they fused: an `mm` among them (`triton_tem_fused_mm_0`,
# `triton_red_fused__to_copy_mm_mul_0`: inductor's one-row mm as a reduction) is a linear layer; `bmm` is attention.
TRITON_LINEAR_OPS = frozenset({"mm", "addmm", "linear", "matmul", "dequantize", "int4pack", "int8pack"})
NOT_ONE_ROW_MM = frozenset({"softmax", "mean", "rsqrt", "pow", "amax", "exp", "var", "bmm"})  # norms, softmax, attention
CUTLASS_WRAPPERS = frozenset({"Kernel", "Kernel2", "device_kernel"})
SECOND_SHARE = 0.10
NO_KERNELS = "no CUDA kernels recorded"


def _top_level(raw: str) -> tuple[str, str]:
    """(the signature without template arguments and parameter list, the first template argument of its last
    template, without that argument's own template arguments)."""
    out: list[str] = []
    first, depth, start = "", 0, -1
    for i, ch in enumerate(raw):
        if ch == "<":
            depth += 1
            if depth == 1:
                start, first = i + 1, ""
        elif ch == ">" and depth:
            depth -= 1
            if depth == 0 and start >= 0 and not first:
                first = raw[start:i]
        elif depth == 1 and ch == "," and not first:
            first = raw[start:i]
        elif depth == 0:
            if ch == "(" and "".join(out).strip():
                break  # the parameter list: the name is complete
            out.append(ch)
    return "".join(out), first.split("<")[0].strip()


def kernel_name(raw: str) -> str:
    """A kernel's readable name (module docstring); at most 200 characters."""
    raw = raw.strip().replace("(anonymous namespace)::", "")
    if raw.startswith(("Memcpy", "Memset")) or not any(c in raw for c in "<( "):
        return raw[:200]
    text, first = _top_level(raw)
    words = text.split()
    name = words[-1] if words else raw
    if name.split("::")[-1] in CUTLASS_WRAPPERS and first:
        name = f"{name}<{first}>"
    return name[:200]


def is_linear_kernel(name: str) -> bool:
    """Whether a (readable) kernel name belongs to the linear layers' path."""
    low = name.lower()
    if low.startswith("triton_"):
        parts = set(low.split("_"))
        # inductor's one-row mm under coordinate-descent tuning (torchao int8's fused path) is a reduction of
        # products, `triton_red_fused__to_copy_mul_sum_0`: a mul and a sum, without the markers of a norm or softmax
        one_row_mm = {"mul", "sum"} <= parts and not parts & NOT_ONE_ROW_MM
        return bool(parts & TRITON_LINEAR_OPS) or one_row_mm or "dequant" in low
    if any(k in low for k in NOT_LINEAR_KERNELS):
        return False
    return any(k in low for k in LINEAR_KERNELS)


def _by_name(rows: list[Row]) -> list[Row]:
    """Sum rows of one readable name: each template instance (tile shape, K) is a row of its own in the profile."""
    acc: dict[str, list[float]] = {}
    for raw, us, calls in rows:
        row = acc.setdefault(kernel_name(raw), [0.0, 0])
        row[0] += us
        row[1] += calls
    return [(n, t, int(c)) for n, (t, c) in acc.items()]


def head_kernels(rows: list[Row]) -> frozenset[str]:
    """The linear kernels (readable names) in the device rows of one eager call of the output projection."""
    return frozenset(n for n in (kernel_name(raw) for raw, us, _ in rows if us > 0) if is_linear_kernel(n))


def _split_head(linear: list[Row], steps: int, head: frozenset[str]) -> tuple[list[Row], list[Row], str]:
    """(the output projection's rows, the body's rows, the `kernel.lm_head` tag when the head has no rows)."""
    if not head:
        return [], linear, "not profiled apart (no eager call of the output projection on this device)"
    # the head runs once a step (twice with a prefill in the profile); a body kernel runs layers x 4-7 times
    own = [r for r in linear if r[0] in head and r[2] < 2 * steps]
    shared = [r[0] for r in linear if r[0] in head and r[2] >= 2 * steps]
    if own and len(own) < len(linear):
        return own, [r for r in linear if r not in own], ""
    if shared:
        return [], linear, f"{shared[0]}: the body's linears run the same kernel, not told apart"
    return [], linear, f"not seen in the profiled steps (one eager call ran {', '.join(sorted(head))})"


def dominant_cuda_kernel(rows: list[Row], steps: int, head: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Tags `kernel.*` and metrics `kernel_linear_*` (and `kernel_lm_head_*`) of the profiled device rows; `head`:
    `head_kernels` of one eager call of the output projection (module docstring)."""
    steps = max(steps, 1)
    kernels = [r for r in _by_name(rows) if r[1] > 0]
    total = sum(r[1] for r in kernels)
    found: dict[str, Any] = {"kernel.device": "cuda"}
    if total <= 0:
        return {**found, "kernel.linear": NO_KERNELS}
    linear = sorted((r for r in kernels if is_linear_kernel(r[0])), key=lambda r: -r[1])
    if not linear:
        top = max(kernels, key=lambda r: r[1])[0]
        return {**found, "kernel.linear": f"none found among {len(kernels)} kernels (top: {top})"}
    heads, body, why = _split_head(linear, steps, head)
    if heads:
        us = sum(r[1] for r in heads)
        found.update({"kernel.lm_head": heads[0][0], "kernel.lm_head_share": f"{us / total:.0%}",
                      "kernel.lm_head_calls_per_step": str(round(heads[0][2] / steps)),
                      "kernel_lm_head_share": us / total, "kernel_lm_head_ms_per_step": us / 1e3 / steps})
    else:
        found["kernel.lm_head"] = why
    name, us, calls = body[0]
    found.update({"kernel.linear": name, "kernel.linear_share": f"{us / total:.0%}",
                  "kernel.linear_calls_per_step": str(round(calls / steps)),
                  "kernel.linear_path_share": f"{sum(r[1] for r in linear) / total:.0%}",
                  "kernel_linear_share": us / total, "kernel_linear_ms_per_step": us / 1e3 / steps})
    if len(body) > 1 and body[1][1] / total >= SECOND_SHARE:
        second = body[1]
        found.update({"kernel.linear_2nd": second[0], "kernel.linear_2nd_share": f"{second[1] / total:.0%}",
                      "kernel.linear_2nd_calls_per_step": str(round(second[2] / steps))})
    return found


def device_rows(averages: Any) -> list[Row]:
    """(raw name, self device us, calls) of the CUDA rows of `prof.key_averages()`: the kernels, memcpy and memset.
    Host ops are left out: their device time is their kernels' again."""
    rows = []
    for e in averages:
        if "CUDA" not in str(getattr(e, "device_type", "")):
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # torch before the device_* names
            us = getattr(e, "self_cuda_time_total", 0)
        rows.append((str(e.key), float(us), int(e.count)))
    return rows


def init_profiler_for_cuda_graphs() -> bool:
    """Start CUPTI before any CUDA graph is captured. The kernel profile (harness/measure/kernels.py) profiles
    replays of graphs captured earlier; PyTorch's docs warn that a profiler first started after a capture can
    hang or crash on some CUDA versions, and name this call as the fix. False where the hook is missing."""
    import torch.profiler

    init = getattr(getattr(torch.profiler, "_utils", None), "_init_for_cuda_graphs", None)
    if init is None:
        return False
    try:
        init()
    except Exception as exc:  # noqa: BLE001 - the profile is a side measurement; it says so when it fails
        log.warning("profiler init for CUDA graphs failed: %s", exc)
        return False
    return True
