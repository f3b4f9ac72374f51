"""Float baselines: `none` (weights as loaded, in model.dtype) and fp32 / bf16 / fp16 casts."""

from __future__ import annotations

from dataclasses import dataclass

from harness.config import DTYPES
from harness.errors import ConfigError, one_of
from quantizers.base import Quantizer

_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}


@dataclass
class Dtype(Quantizer):
    """Plain floating-point weights. `dtype=None` keeps model.dtype (quantizer=none)."""

    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and (err := one_of("quantizer.dtype", self.dtype, DTYPES)):
            raise ConfigError([err])

    @property
    def name(self) -> str:
        return {None: "none", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]

    @property
    def backend(self) -> str:  # type: ignore[override]
        return "torch"

    def load_dtype(self, model_dtype: str) -> str:
        return self.dtype or model_dtype

    def audit(self, model):
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        self.min_bits_per_weight = self.max_bits_per_weight = _BITS[dtype]
        return super().audit(model)
