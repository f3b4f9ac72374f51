"""Float baselines: `none` (no quantization: the model's float format, computed the way this CPU is
fastest) and fp32 / bf16 / fp16 casts.

`quantizer=none` resolves in `preflight(device)` through the device table in quantizers/auto.py
(`float_choice`), which reads the CPU's instruction sets (harness.env.cpu_info). The rule:

- model.dtype float32 stays float32: none never lowers precision below what the model asks for.
- model.dtype bfloat16 (the shipped default) or float16 keeps its 16-bit weights (half the bytes a
  decode step reads) where the CPU has AVX2 or better, and where the CPU has no native 16-bit dot
  product (no AVX512_BF16/AMX for bf16, no AVX512_FP16/AMX for fp16) its multi-token matmuls
  (prefill, perplexity scoring, batches of >= PREFILL_ROWS rows) run in fp32 on upcast weights; a CPU
  without AVX2 gets float32 (unmeasured there; fp32 is what every x86 computes natively).
- On CUDA, none is the model's dtype, as loaded.

Why, measured on AMD EPYC Zen 3 (family 25 model 1, AVX2, no AVX512_BF16), 2 threads, SmolLM2-135M
(docs/quantizers.md has the table): bf16 decode is ~1.8x fp32 (memory-bound: half the bytes), but
oneDNN's emulated bf16 GEMM makes prefill 3x slower than fp32 (mean TTFT of the default prompts 730 vs
230 ms). Upcasting the multi-token matmuls (same arithmetic: bf16 inputs, fp32 accumulation, output
rounded to bf16) gives bf16's decode with fp32's prefill. Where bf16 is native (Zen 5, AVX512_BF16)
bf16 was faster in both (TTFT 57 ms). The resolution is recorded in tags `quantizer.resolved` and
`quantizer.prefill_matmul`.

`prefill_matmul` (fp32/bf16/fp16 configs too): `auto` (the rule above), `native` (the library's own
16-bit matmul everywhere), `fp32` (always upcast multi-token 16-bit matmuls). The compiled decode step
never upcasts (inductor would fold the fp32 weights into the graph and read twice the bytes).
`native` where the CPU emulates the 16-bit dot product runs, with tag `warning.forced_slow`
(harness/measure/slow_settings.py `forced_slow`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from harness import env  # env.cpu_info looked up per call: tests patch it
from harness.errors import ConfigError, one_of
from harness.measure.one_row import gemv_choice, sixteen_choice
from harness.schema import DTYPES
from quantizers.auto import float_choice, native_16bit
from quantizers.base import Quantizer

# torch is imported where used: config validation instantiates quantizers before any model library loads
# (tests/test_layout.py, LAZY_OK).

_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}
PREFILL_MATMUL = ("auto", "native", "fp32")
# Rows (tokens x batch) from which a 16-bit matmul on a CPU without native 16-bit dot products runs in fp32
# on upcast weights. Measured on Zen 3, 2 threads, all of SmolLM2's linears (30 layers + the 49152-row head,
# weights from DRAM, the reused upcast buffer): rows 1: bf16 23 ms vs upcast 57; 4: 70-82 vs 94-138;
# 5-6: 85-92 vs 141-152 (one outlier run 137 vs 90); 8: 120-125 vs 98-148; 12: 254 vs 168; 16: 267 vs 179.
# The upcast costs a nearly fixed weight conversion, emulated bf16 ~15 ms more per row. The first cut (4
# rows, from one 1536x576 linear in cache) made 4-row batched decode upcast and run slower than batch 1.
PREFILL_ROWS = 12


_SCRATCH: dict[tuple[int, ...], Any] = {}  # one fp32 weight buffer per shape, reused by every layer of that shape


def _fp32_weight(w: Any) -> Any:
    """`w` in fp32, written into a reused buffer: a fresh 3.5 MB tensor per layer per prefill costs page
    faults (~80 ms of a 300 ms SmolLM2 prefill on Zen 3); a reused one stays mapped and in cache."""
    import torch

    buf = _SCRATCH.get(tuple(w.shape))
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: also writable outside inference mode (scoring)
            buf = _SCRATCH[tuple(w.shape)] = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    return buf.copy_(w)


def _upcast_forward(self: Any, x: Any) -> Any:
    import torch

    if x.numel() >= PREFILL_ROWS * x.shape[-1] and not torch.compiler.is_compiling():
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), _fp32_weight(self.weight), bias).to(x.dtype)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def upcast_prefill(model: Any) -> int:
    """Multi-row matmuls of the model's plain 16-bit nn.Linear layers run in fp32 (see module docstring).

    Quantized layers (tensor subclasses, integer weights) are left alone. The layers keep their class
    and weights (the audit and the bytes read per decode step are unchanged); returns how many changed.
    """
    import torch

    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if type(m) is torch.nn.Linear and type(w) in (torch.Tensor, torch.nn.Parameter) \
                and w.dtype in (torch.bfloat16, torch.float16):
            m.forward = types.MethodType(_upcast_forward, m)
            n += 1
    return n


def apply_prefill_matmul(model: Any, dtype: str, device: str, policy: str) -> str:
    """Apply `policy` to a loaded model whose float parts are `dtype`; returns the tag value."""
    if dtype not in ("bfloat16", "float16") or not device.startswith("cpu") or policy == "native":
        return "native"
    if policy == "auto" and native_16bit(dtype, env.cpu_info()):
        return f"native ({dtype} in hardware: {env.cpu_info().isa})"
    n = upcast_prefill(model)
    why = "asked" if policy == "fp32" else f"{dtype} emulated on {env.cpu_info().isa}"
    return f"fp32 from {PREFILL_ROWS} rows ({n} layers; {why})" if n else "native"


@dataclass
class Dtype(Quantizer):
    """Plain floating-point weights. `dtype=None` is quantizer=none (resolved per device, see above)."""

    dtype: str | None = None
    prefill_matmul: str = "auto"  # auto | native | fp32 (see module docstring)

    def __post_init__(self) -> None:
        errs = [one_of("quantizer.prefill_matmul", self.prefill_matmul, PREFILL_MATMUL)]
        if self.dtype is not None:
            errs.append(one_of("quantizer.dtype", self.dtype, DTYPES))
        if any(errs):
            raise ConfigError([e for e in errs if e])
        self._choice: tuple[str, str] | None = None  # (dtype or "" for as loaded, why) once preflight ran

    @property
    def name(self) -> str:
        return {None: "none", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]

    @property
    def backend(self) -> str:  # type: ignore[override]
        return "torch"

    def preflight(self, device: str) -> None:
        super().preflight(device)
        if self.dtype is None:
            self._choice = (device, "")  # decided against model.dtype when loading (float_choice)

    def load_dtype(self, model_dtype: str) -> str:
        if self.dtype:
            return self.dtype
        if self._choice is None:  # not preflighted (e.g. a speculative draft copy): as loaded
            return model_dtype
        dtype, why = float_choice(self._choice[0], model_dtype)
        self._choice = (self._choice[0], why)
        return dtype

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        dtype = self.load_dtype(source.dtype)
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        self.last_tags = {"quantizer.prefill_matmul": apply_prefill_matmul(model, dtype, device, self.prefill_matmul)}
        if self.dtype is None:
            why = self._choice[1] if self._choice else "as loaded (not resolved)"
            self.last_tags.update({"quantizer.resolved": {"float32": "fp32", "bfloat16": "bf16",
                                                          "float16": "fp16"}[dtype],
                                   "quantizer.resolved_by": why or "as loaded"})
        return model

    def audit(self, model):
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        self.min_bits_per_weight = self.max_bits_per_weight = _BITS[dtype]
        return super().audit(model)


@dataclass
class Auto16(Dtype):
    """`quantizer=auto16`: bf16 or fp16 weights, whichever one-row kernel streams faster on this CPU.

    The two differ in numerics (8 vs 11 mantissa bits, 8 vs 5 exponent bits), so `quantizer=none` never
    switches between them; this named choice does, and records what it picked and why (tags
    `quantizer.resolved`, `quantizer.resolved_by`: the measured GB/s of each, harness/measure/one_row.py).
    llama.cpp's `engine.format=auto16` makes the same choice, so an fp16 row meets F16 and a bf16 row BF16.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self._gemv = "auto"
        self._threads = 0  # measure.threads (check_with): auto16's rates are measured at the run's count
        self._why = ""

    @property
    def name(self) -> str:
        return "auto16"

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        self._gemv = getattr(measure, "gemv", "auto") if measure is not None else "auto"
        self._threads = int(getattr(measure, "threads", 0) or 0) if measure is not None else 0

    def preflight(self, device: str) -> None:
        super().preflight(device)
        if not self._why:
            kernel = gemv_choice(self._gemv, device, env.cpu_info())[0]
            self.dtype, self._why = sixteen_choice(device, kernel, self._threads)

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        self.last_tags.update({"quantizer.resolved": {"bfloat16": "bf16", "float16": "fp16"}[self.dtype],
                               "quantizer.resolved_by": self._why})
        return model
