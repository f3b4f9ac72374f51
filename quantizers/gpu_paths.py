"""The format-path table per GPU architecture: which quantizer, kernel and compile settings each weight format
takes on CUDA, per compute-capability class, and where the claim that it is the fast path comes from.

Why a table: the same format has several CUDA kernels and the fast one depends on the GPU (issue #29: on an H200,
torchao int4 through tinygemm decoded at 0.78x of fp16 and int8 weight-only at 0.69x, where torchao's own H100
table has 1.90x and 1.57x). Every row names its source; none of these paths is measured on a GPU yet.

Lookup (`path_for(fmt, capability, available)`): the capability class (`gpu_arch`: sm_80 A100/A30; sm_86 for
8.6 and 8.7, Ampere consumer and Orin; sm_89 Ada; sm_90 H100/H200; sm_100 every Blackwell; `fallback` below 8.0 or
unknown), then the rows of (format, class), or of (format, fallback) where the class has none, in order; the first
row whose extra package is importable wins. A row that is skipped for its package is named in the reason
(tag `quantizer.gpu_path_by`), with what to install. Every chain ends in a row that needs no extra package.
Tags: `gpu.arch`, `quantizer.gpu_path`, `quantizer.gpu_path_by`; the inductor flags a path needs reach
torch.compile through the quantizer's `inductor_config(device)` (quantizers/base.py) and are recorded as
`compile.inductor`.

Adding one more entry: append a `GpuPath` to the tuple of its (format, arch) key in TABLE (before the rows it
should win over), with a quantizer name that exists as conf/quantizer/<name>.yaml, overrides that instantiate
(tests/test_gpu_paths.py builds every row), its `source`, and `package`/`pip` if it needs a library the quantizer
does not already need. A new format also goes in FORMATS and needs a (format, "fallback") row. Then regenerate the
table in docs/quantizers.md from `markdown()` (a test compares them).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("fp16", "bf16", "int8", "int4", "gptq_int4", "awq_int4", "bnb_nf4", "bnb_int8")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "fallback")
FALLBACK = "fallback"
COMPILE_MODE = "reduce-overhead"  # eager decode on a GPU measures kernel launches, not bytes (docs/gpu.md)

# torchao's recommended_inductor_config_setter (torchao 0.18 quantization/utils.py), minus fx_graph_cache (a cache
# switch, on by default). torchao sets these process-wide whenever a config with set_inductor_config=True quantizes
# a layer, so every later compile in the process (an fp16 baseline in the same sweep too) inherited them. The CUDA
# kernels of quantizers/torchao.py pass set_inductor_config=False and ask for them here instead, per compile.
# coordinate_descent_tuning is the one that fuses int8 weight-only: with it torch/_inductor/decomposition.py's mm()
# turns a one-row mm on a GPU into mul + sum, a Triton reduction into which the int8 -> 16-bit cast fuses (without
# it: a whole-weight cast kernel, then cuBLAS reads the 16-bit copy: 5 bytes moved per weight instead of 1).
TORCHAO_INDUCTOR: dict[str, Any] = {
    "coordinate_descent_tuning": True,
    "coordinate_descent_check_all_directions": True,
    "force_fuse_int_mm_with_mul": True,
    "triton.unique_kernel_names": True,
}

S_FP16 = ("cuBLAS gemv through aten::mm. Measured on an H200 with the Llama-3.1-8B shape, compiled + CUDA graphs: "
          "fp16 163.4 tok/s (issue #29); other GPUs not measured")
S_INT8 = ("torchao README benchmarks (Llama-3.1-8B, H100, compiled, batch 1): int8wo 198.9 tok/s = 1.57x bf16 "
          "(https://github.com/pytorch/ao/tree/main/torchao/quantization#benchmarks); gpt-fast README (A100, "
          "Llama-2-7B): int8 155.6 vs base 104.9 tok/s (https://github.com/pytorch-labs/gpt-fast). Fusion: "
          "torch/_inductor/decomposition.py mm() with coordinate_descent_tuning (torch 2.13). Measured on an H200: "
          "kernel=torchao (flags set process-wide by torchao) 113.3 tok/s = 0.69x fp16 (issue #29); kernel=fused "
          "not measured")
S_PRESHUFFLED = ("torchao 0.18 prototype/tensor_conversion/api.py convert_to_packed_tensor_based_on_current_hardware "
                 "picks Int4PreshuffledTensor on sm >= 90 when mslk is installed; "
                 "https://github.com/vllm-project/vllm/pull/26066 ('the fastest int4 kernel for int4 weight only'); "
                 "mslk-cuda 1.1.0 pairs with torch 2.11 and ships kernels for 8.0, 9.0a, 10.0a, 12.0a "
                 "(https://pypi.org/project/mslk-cuda-nightly/); groups >= 128 (mslk quantize/shuffle.py). "
                 "Not measured at batch 1")
S_TINYGEMM = ("torchao README (H100, compiled, batch 1): int4wo-64 241.4 tok/s = 1.90x bf16; gpt-fast README (A100): "
              "int4 g32 196.8 vs base 104.9 tok/s. Measured on an H200: 127.0 tok/s = 0.78x fp16 (issue #29, cause "
              "not found yet)")
S_GPTQ = ("Marlin: near-ideal 4x over fp16 up to batch 16-32 on A10/A100 (https://github.com/IST-DASLab/marlin); "
          "gptqmodel 7.6 nn_modules/qlinear/marlin.py: sm_75+ (fp16 only on 7.5), symmetric, groups -1/32/64/128, "
          "built on first use (~120 s, utils/jit_compile_baselines.py). gptqmodel's own auto prefers Machete on "
          "sm_90 and Swordfish on sm_100. Not measured")
S_AWQ = ("gptqmodel 7.6 nn_modules/qlinear/marlin_awq.py: AWQ's GEMM format through Marlin on sm_80+, its auto "
         "priority 90 over awq_gemm's 60; vLLM serves AWQ through awq_marlin on sm_80+. Not measured")
S_NF4 = ("bitsandbytes 0.50 autograd/_functions.py matmul_4bit: one gemm_4bit op per layer when no grad is "
         "needed; quantizer.compute_dtype must equal the activation dtype, or every call casts. Measured on an "
         "H200 only at 135M, eager (docs/gpu.md)")
S_BNB8 = ("LLM.int8 splits outlier columns out on every call; bitsandbytes describes it as slower than 16-bit "
          "inference (https://huggingface.co/blog/hf-bitsandbytes-integration). Measured on an H200 only at 135M, "
          "eager: 0.19x fp16 (docs/gpu.md)")
S_OLD = "below sm_80 tinygemm, Marlin (bf16) and mslk do not run; not measured"
S_BLACKWELL = "; on Blackwell torchao's rule is the same (sm >= 90), not verified there"


@dataclass(frozen=True)
class GpuPath:
    """One way to run a format on a GPU (module docstring)."""

    quantizer: str  # conf/quantizer/<name>.yaml
    overrides: dict[str, Any] = field(default_factory=dict)  # quantizer.<key>=<value> on top of the yaml
    inductor: dict[str, Any] = field(default_factory=dict)  # what the quantizer's inductor_config("cuda") returns
    compile_mode: str = COMPILE_MODE  # the measure.compile_mode to run it with (measure.compile=true)
    kernel: str = ""  # expected kernel: '|'-separated substrings, one of them in tag kernel.linear (any case)
    package: str = ""  # import name of an extra library the path needs ("" none)
    pip: str = ""  # what to install when `package` is missing
    source: str = "not measured"  # where the claim that this path is fast comes from

    @property
    def label(self) -> str:
        """The quantizer and its overrides, as tag quantizer.gpu_path (e.g. `torchao_int4 kernel=preshuffled`)."""
        return " ".join([self.quantizer, *(f"{k}={v}" for k, v in self.overrides.items())])

    def kernel_matches(self, tag: str) -> bool:
        """Whether a kernel.linear tag shows this path's kernel (always, where the row expects none)."""
        return not self.kernel or any(k in tag.lower() for k in self.kernel.lower().split("|"))


@dataclass(frozen=True)
class Choice:
    """What `path_for` picked: the row, the arch class it was looked up for, and why (tag quantizer.gpu_path_by)."""

    path: GpuPath
    arch: str
    by: str

    def tags(self) -> dict[str, str]:
        return {"gpu.arch": self.arch, "quantizer.gpu_path": self.path.label, "quantizer.gpu_path_by": self.by}


def _float(name: str, source: str) -> GpuPath:
    return GpuPath(name, kernel="gemv|gemm|xmma|nvjet", source=source)  # nvjet_*: cuBLAS's sm_90+ GEMMs


def _rows(arch: str) -> dict[str, tuple[GpuPath, ...]]:
    """The rows of one compute-capability class (sm_80 and newer differ only where the sources say so)."""
    fp16 = S_FP16 if arch == "sm_90" else "cuBLAS gemv through aten::mm; not measured on this class"
    bf16 = "cuBLAS gemv through aten::mm; bf16 not measured (fp16 on an H200: 163.4 tok/s, issue #29)"
    int8 = GpuPath("torchao_int8", {"kernel": "fused"}, TORCHAO_INDUCTOR, kernel="triton_red_fused", source=S_INT8)
    tinygemm = GpuPath("torchao_int4", {"kernel": "tinygemm"}, TORCHAO_INDUCTOR, kernel="tinygemm", source=S_TINYGEMM)
    int4: tuple[GpuPath, ...] = (tinygemm,)
    if arch in ("sm_90", "sm_100"):  # the packing torchao itself picks on sm >= 90; tinygemm where mslk is absent
        preshuffled = GpuPath("torchao_int4", {"kernel": "preshuffled", "group_size": 128}, TORCHAO_INDUCTOR,
                              kernel="cutlass|gemmuniversal|shuffled", package="mslk", pip="mslk-cuda==1.1.0",
                              source=S_PRESHUFFLED + (S_BLACKWELL if arch == "sm_100" else ""))
        int4 = (preshuffled, tinygemm)
    return {
        "fp16": (_float("fp16", fp16),),
        "bf16": (_float("bf16", bf16 if arch == "sm_90" else fp16),),
        "int8": (int8,),
        "int4": int4,
        "gptq_int4": (GpuPath("gptq_int4", {"kernel": "gptq_marlin"}, kernel="marlin", source=S_GPTQ),),
        "awq_int4": (GpuPath("awq_int4", {"kernel": "awq_marlin"}, kernel="marlin", source=S_AWQ),),
        "bnb_nf4": (GpuPath("bnb_nf4", kernel="gemm_4bit|gemv_4bit", source=S_NF4),),
        "bnb_int8": (GpuPath("bnb_int8", kernel="xmma|imma|int8", source=S_BNB8),),
    }


def _fallback_rows() -> dict[str, tuple[GpuPath, ...]]:
    """Below sm_80 (or an unknown GPU): the library's own choice, and bitsandbytes for int4."""
    return {
        "fp16": (_float("fp16", S_OLD),),
        "bf16": (_float("bf16", S_OLD),),
        "int8": (GpuPath("torchao_int8", {"kernel": "fused"}, TORCHAO_INDUCTOR, kernel="triton_red_fused",
                         source="Triton runs on sm_70+; " + S_OLD),),
        "int4": (GpuPath("bnb_nf4", kernel="gemm_4bit|gemv_4bit", source="tinygemm needs sm_80; " + S_OLD),),
        "gptq_int4": (GpuPath("gptq_int4", {"kernel": "auto"}, source="gptqmodel's own choice; " + S_OLD),),
        "awq_int4": (GpuPath("awq_int4", {"kernel": "auto"}, source="gptqmodel's own choice; " + S_OLD),),
        "bnb_nf4": (GpuPath("bnb_nf4", kernel="gemm_4bit|gemv_4bit", source=S_OLD),),
        "bnb_int8": (GpuPath("bnb_int8", kernel="xmma|imma|int8", source=S_OLD),),
    }


TABLE: dict[tuple[str, str], tuple[GpuPath, ...]] = {
    (fmt, arch): rows
    for arch in ARCHS
    for fmt, rows in (_fallback_rows() if arch == FALLBACK else _rows(arch)).items()
}


def gpu_arch(capability: tuple[int, int] | None) -> str:
    """The table's class for a CUDA compute capability (module docstring); `fallback` for None or below 8.0."""
    if capability is None:
        return FALLBACK
    major, minor = int(capability[0]), int(capability[1])
    if major >= 10:
        return "sm_100"
    if major == 9:
        return "sm_90"
    if major == 8:
        return {0: "sm_80", 9: "sm_89"}.get(minor, "sm_86")  # 8.6 and 8.7 (Orin) behave as consumer Ampere
    return FALLBACK


def importable(package: str) -> bool:
    """Whether `package` can be imported here (find_spec: nothing is imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def device_capability(device: str) -> tuple[int, int] | None:
    """The compute capability of a CUDA `device`; None for other devices or where CUDA cannot answer. Looked up per
    call through this module (tests patch it), and only for CUDA devices: torch is imported here, not at config time."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def paths_for(fmt: str, capability: tuple[int, int] | None,
              available: Callable[[str], bool] | None = None) -> list[Choice]:
    """Every row of (fmt, arch) whose package is `available` (default `importable`, looked up per call: tests patch
    it), in order, each with why (module docstring). A row that cannot take the model (quantizers/auto.py: a group
    size that does not divide its widths) gives way to the next."""
    available = available or importable
    if fmt not in FORMATS:
        raise KeyError(f"no GPU path table for format {fmt!r}; formats: {', '.join(FORMATS)}")
    arch = gpu_arch(capability)
    key = (fmt, arch) if (fmt, arch) in TABLE else (fmt, FALLBACK)
    where = f"sm_{capability[0]}{capability[1]}" if capability else "capability unknown"
    skipped: list[str] = []
    choices = []
    for i, path in enumerate(TABLE[key], 1):
        if path.package and not available(path.package):
            skipped.append(f"{path.label} needs {path.package} (pip install {path.pip or path.package})")
            continue
        by = f"gpu path table {key[0]} @ {key[1]} row {i} ({where})"
        choices.append(Choice(path, arch, by + ("; skipped " + "; ".join(skipped) if skipped else "")))
    if not choices:
        raise LookupError(f"every GPU path for {fmt} on {arch} needs a missing package: {'; '.join(skipped)}")
    return choices


def path_for(fmt: str, capability: tuple[int, int] | None,
             available: Callable[[str], bool] | None = None) -> Choice:
    """The first row of (fmt, arch) whose package is `available` (paths_for), and why."""
    return paths_for(fmt, capability, available)[0]


def inductor_tag(flags: dict[str, Any]) -> str:
    """Tag compile.inductor: the flags a compile applied, sorted (`none` for none)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(flags.items())) or "none"


def markdown() -> str:
    """The table as docs/quantizers.md shows it (a test keeps the two equal): a format x arch grid whose cells are
    the rows in order (`a, else b`: b where a's package is missing) with their source numbers, then what each path
    needs (inductor flags, compile mode, expected kernel), then the numbered sources."""
    sources: list[str] = []
    paths: dict[str, GpuPath] = {}
    for rows in TABLE.values():
        for p in rows:
            if p.source not in sources:
                sources.append(p.source)
            paths.setdefault(p.label, p)

    def cell(p: GpuPath) -> str:
        return f"`{p.label}` [{sources.index(p.source) + 1}]" + (f" (needs {p.pip})" if p.pip else "")

    lines = ["| format | " + " | ".join(ARCHS) + " |", "|" + "---|" * (len(ARCHS) + 1)]
    for fmt in FORMATS:
        lines.append(f"| {fmt} | " + " | ".join(", else ".join(map(cell, TABLE[(fmt, a)])) for a in ARCHS) + " |")
    lines += ["", "| path | inductor flags (`compile.inductor`) | measure.compile_mode | kernel.linear shows | needs |",
              "|---|---|---|---|---|"]
    for label, p in paths.items():
        kernel = p.kernel.replace("|", " or ") or "-"  # a bare | would split the markdown cell
        lines.append(f"| `{label}` | {inductor_tag(p.inductor)} | {p.compile_mode} | {kernel} | "
                     f"{p.pip or '-'} |")
    lines += ["", "Sources:", ""] + [f"{i}. {s}." for i, s in enumerate(sources, 1)]
    return "\n".join(lines) + "\n"
