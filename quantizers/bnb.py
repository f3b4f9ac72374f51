"""bitsandbytes through transformers' `BitsAndBytesConfig`: LLM.int8 (`bnb_int8`) and 4-bit NF4/FP4
(`bnb_nf4`, `bnb_fp4`). bitsandbytes 0.50 has a real CPU backend for all three, so they run here.

Stored bits per weight: int8 keeps one fp32 scale per output row (8 + 32/in_features); 4-bit keeps one
fp32 absmax per block of 64 weights (4 + 32/64 = 4.5). Bounds below allow that plus a margin of 0.5 bit
(e.g. the small layers of a tiny model have shorter rows). On a CPU with AVX512-BF16, bitsandbytes repacks each
4-bit weight on its first forward with a bf16 absmax (4 + 16/64 = 4.25, double_quant undone): `Bnb4bit.apply`
makes that happen at load, so the audit describes what every decode step reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.errors import ConfigError, one_of
from harness.models import torch_dtype
from quantizers.base import Quantizer
from quantizers.common import TimedLoad

# transformers is imported where used: config validation instantiates quantizers before any model library loads
# (tests/test_layout.py, LAZY_OK).

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class BnbInt8(TimedLoad, Quantizer):
    """LLM.int8: int8 weights with per-row scales, outlier activation columns in 16-bit."""

    threshold: float = 6.0  # outlier threshold of LLM.int8 (transformers' default)

    backend = "bitsandbytes.llm_int8"
    library = "bitsandbytes"
    quantizes = True
    min_bits_per_weight = 8.0
    max_bits_per_weight = 9.0
    instead = "quantizer=torchao_int8"

    def __post_init__(self) -> None:
        self._device = "cpu"

    @property
    def name(self) -> str:
        return "bnb_int8"

    def preflight(self, device: str) -> None:
        super().preflight(device)
        self._device = device

    def load_dtype(self, model_dtype: str) -> str:
        # LLM.int8's CUDA matmul runs in fp16: it casts bf16 inputs to fp16 on every call and logs a warning each
        # time (12 MB of log and 0.19x of fp16 in the first H200 check, docs/gpu.md), so load fp16 there
        return "float16" if self._device.startswith("cuda") and model_dtype == "bfloat16" else model_dtype

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=self.threshold)}


@dataclass
class Bnb4bit(TimedLoad, Quantizer):
    """4-bit NF4 or FP4 weights (blocks of 64 with an fp32 absmax), matmul in `compute_dtype`."""

    quant_type: str = "nf4"  # nf4 | fp4
    compute_dtype: str = "bfloat16"  # bf16 is the fast CPU dtype here
    double_quant: bool = False  # True quantizes the absmax too (~4.13 bits instead of 4.5; not on AVX512-BF16 CPUs)

    library = "bitsandbytes"
    quantizes = True
    min_bits_per_weight = 4.0
    max_bits_per_weight = 5.0
    instead = "quantizer=quanto_int4"

    def __post_init__(self) -> None:
        errs = [e for e in (one_of("quantizer.quant_type", self.quant_type, ("nf4", "fp4")),
                            one_of("quantizer.compute_dtype", self.compute_dtype, COMPUTE_DTYPES)) if e]
        if errs:
            raise ConfigError(errs)

    @property
    def name(self) -> str:
        return f"bnb_{self.quant_type}"

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"bitsandbytes.{self.quant_type}"

    def apply(self, model: Any, *, source: Any, tokenizer: Any, device: str, experiment: Any) -> Any:
        """One forward of one token on CPU: where the CPU has AVX512-BF16, bitsandbytes 0.50 repacks every 4-bit
        weight on its first forward (a bf16 absmax; double_quant's nested one dequantized and dropped), so the
        layout audited right after loading (4.50 bits/weight, 4.13 with double_quant) was not the one decoded
        (4.25 either way), and weight_bytes and the roofline's bytes_per_step described two layouts. Done here,
        the repack is part of quantize_s, and the tag quantizer.storage says it happened."""
        if not device.startswith("cpu"):
            return model
        import torch  # heavy: see the module note

        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
        if any(getattr(getattr(getattr(m, "weight", None), "quant_state", None), "packing_format_for_cpu", False)
               for m in model.modules()):
            self.storage = ("repacked for AVX512-BF16 at load (bitsandbytes' CPU layout: a bf16 absmax per block of "
                            "64, ~4.25 bits/weight, double_quant undone)")
        return model

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        from transformers import BitsAndBytesConfig

        return {"quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_compute_dtype=torch_dtype(self.compute_dtype),
            bnb_4bit_use_double_quant=self.double_quant)}
