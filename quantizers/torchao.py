"""torchao through transformers' `TorchAoConfig`: int8 weight-only (`torchao_int8`), int8 dynamic
activations + int8 weights (`torchao_int8_dyn`) and int4 weight-only (`torchao_int4`).

int4 has two kernels, chosen by `kernel`:
- `intx` (CPU, the default there): `IntxWeightOnlyConfig(weight_dtype=torch.int4)`. torchao 0.18 stores
  these int4 values *unpacked, one per int8 byte* (`IntxUnpackedToInt8Tensor`) and dequantizes in the
  matmul, so the audit honestly reports ~8.75-9.25 bits/weight (8 + a scale and zero point per group):
  the accuracy is int4's, the memory is int8's. Its bound is therefore 9.5, not 5.
- `tinygemm` (CUDA only): `Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`, packed int4
  with bf16 scales. On CPU torchao 0.18 fails ("Torch not compiled with CUDA enabled"; the default
  "plain" format needs the `mslk` package), so preflight refuses it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.errors import ConfigError, QuantbenchError, one_of
from quantizers.base import Quantizer
from quantizers.common import TimedLoad


@dataclass
class TorchAoInt8(TimedLoad, Quantizer):
    """int8 per-row weights; `dynamic=True` also quantizes activations per token (int8 x int8 matmul)."""

    dynamic: bool = False

    library = "torchao"
    quantizes = True
    min_bits_per_weight = 8.0
    max_bits_per_weight = 9.0  # 8 + fp32 scale and int8 zero point per row
    instead = "quantizer=bnb_int8"

    @property
    def name(self) -> str:
        return "torchao_int8_dyn" if self.dynamic else "torchao_int8"

    @property
    def backend(self) -> str:  # type: ignore[override]
        return "torchao.int8_dynamic_int8_weight" if self.dynamic else "torchao.int8_weight_only"

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        cfg = Int8DynamicActivationInt8WeightConfig() if self.dynamic else Int8WeightOnlyConfig()
        return {"quantization_config": TorchAoConfig(quant_type=cfg)}


@dataclass
class TorchAoInt4(TimedLoad, Quantizer):
    """int4 weight-only with one scale per `group_size` weights (see module docstring for kernels)."""

    group_size: int = 32
    kernel: str = "auto"  # auto (intx on CPU, tinygemm on CUDA) | intx | tinygemm

    library = "torchao"
    quantizes = True
    min_bits_per_weight = 4.0
    instead = "quantizer=bnb_nf4"

    def __post_init__(self) -> None:
        errs = [one_of("quantizer.kernel", self.kernel, ("auto", "intx", "tinygemm"))]
        if self.group_size not in (32, 64, 128, 256):
            errs.append(f"quantizer.group_size={self.group_size!r} is not allowed; choose one of: 32, 64, 128, 256")
        if any(errs):
            raise ConfigError([e for e in errs if e])
        self._device = "cpu"

    @property
    def name(self) -> str:
        return "torchao_int4"

    def _kernel(self, device: str) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "tinygemm" if device.startswith("cuda") else "intx"

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"torchao.int4_{self._kernel(self._device)}"

    @property
    def max_bits_per_weight(self) -> float:  # type: ignore[override]
        # intx stores each int4 value in a whole int8 byte (honest, see module docstring)
        return 9.5 if self._kernel(self._device) == "intx" else 5.0

    @property
    def storage(self) -> str:  # type: ignore[override]
        if self._kernel(self._device) == "intx":
            return "int4 values stored unpacked in int8 (IntxUnpackedToInt8Tensor): int4 accuracy, int8 memory"
        return "packed int4 (tinygemm)"

    def preflight(self, device: str) -> None:
        super().preflight(device)
        self._device = device
        if self._kernel(device) == "tinygemm" and not device.startswith("cuda"):
            raise QuantbenchError("quantizer torchao_int4 kernel=tinygemm (Int4WeightOnlyConfig) is CUDA-only in "
                                  "torchao 0.18; on CPU use quantizer=torchao_int4 quantizer.kernel=intx "
                                  "(or quantizer=bnb_nf4)")

    def load_dtype(self, model_dtype: str) -> str:
        return "bfloat16" if self._kernel(self._device) == "tinygemm" else model_dtype  # tinygemm is bf16-only

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        import torch
        from torchao.quantization import Int4WeightOnlyConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup
        from transformers import TorchAoConfig

        self._device = device
        if self._kernel(device) == "tinygemm":
            cfg = Int4WeightOnlyConfig(group_size=self.group_size, int4_packing_format="tile_packed_to_4d")
        else:
            cfg = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(self.group_size))
        return {"quantization_config": TorchAoConfig(quant_type=cfg)}
