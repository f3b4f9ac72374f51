"""optimum-quanto through transformers' `QuantoConfig`: int8 (`quanto_int8`) and int4 (`quanto_int4`)
weights, per-row (int8) or per-group-of-64 (int4) scales.

quanto's int4 tensors break under `torch.inference_mode()` ("Cannot set version_counter for inference
tensor"), so `quanto_int4` asks the decode loop and the scorer for `torch.no_grad()` instead
(`grad_mode`, honoured by `harness.measure.model_grad_mode`). Both modes skip autograd; inference_mode
only adds version-counter savings, so timings stay comparable.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cache import cache_root
from harness.errors import ConfigError, one_of
from quantizers.base import Quantizer
from quantizers.common import TimedLoad

# transformers is imported where used: config validation instantiates quantizers before any model library loads
# (tests/test_layout.py, LAZY_OK).

_BOUNDS = {"int8": (8.0, 9.0), "int4": (4.0, 5.0)}  # int4: 4 + scale and shift per group of 64 (~4.5)


@dataclass
class Quanto(TimedLoad, Quantizer):
    """optimum-quanto weight quantization (activations stay float)."""

    weights: str = "int8"  # int8 | int4

    library = "optimum.quanto"
    pip_name = "optimum-quanto"
    quantizes = True
    instead = "quantizer=torchao_int8"

    def __post_init__(self) -> None:
        if (err := one_of("quantizer.weights", self.weights, tuple(_BOUNDS))):
            raise ConfigError([err])
        self.min_bits_per_weight, self.max_bits_per_weight = _BOUNDS[self.weights]
        self.grad_mode = "no_grad" if self.weights == "int4" else "inference"

    @property
    def name(self) -> str:
        return f"quanto_{self.weights}"

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"quanto.{self.weights}"

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        from transformers import QuantoConfig

        cache_extension()
        return {"quantization_config": QuantoConfig(weights=self.weights)}


def cache_extension() -> None:
    """quanto builds its C++ unpack kernel on first use inside its own package folder, so every fresh venv (each
    CI run) compiled it again (~35 s on 2 cores). It is built into the cache instead, in a folder named by a hash of
    its sources, flags and torch's version, and a built one is imported directly: torch's builder (setuptools +
    ninja) would rebuild it in every new venv, whose source paths and times differ. scripts/setup.sh --all builds it."""
    import optimum.quanto
    import torch
    from optimum.quanto.library.extensions.cpp import ext

    key = hashlib.sha256(torch.__version__.encode() + repr(ext.extra_cflags).encode())
    for src in ext.sources:
        key.update(Path(src).read_bytes())
    where = cache_root() / "ext" / f"quanto-{optimum.quanto.__version__}-{key.hexdigest()[:16]}"
    where.mkdir(parents=True, exist_ok=True)
    ext.build_directory = str(where)
    built = where / f"{ext.name}.so"
    if ext._lib is None and built.is_file() and (where / "pytorch_version.txt").is_file():
        spec = importlib.util.spec_from_file_location(ext.name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # what torch's builder does last, without its rebuild check
        ext._lib = module
