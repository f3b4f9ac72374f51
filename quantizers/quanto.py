"""optimum-quanto through transformers' `QuantoConfig`: int8 (`quanto_int8`) and int4 (`quanto_int4`)
weights, per-row (int8) or per-group (int4) scales. quanto picks each int4 layer's group size itself (optimum-quanto
0.2.7, QModuleMixin): 128, stepped down by 32 until it divides the layer's input width (96 at SmolLM2's 576), per
row where the width is 128 or less (or no such step divides it); tag `quantizer.group_sizes` records what it chose.

quanto's int4 tensors break under `torch.inference_mode()` ("Cannot set version_counter for inference
tensor"), so `quanto_int4` asks the decode loop and the scorer for `torch.no_grad()` instead
(`grad_mode`, honoured by `harness.measure.model_grad_mode`). Both modes skip autograd; inference_mode
only adds version-counter savings, so timings stay comparable.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import env
from harness.cache import cache_root
from harness.errors import ConfigError, QuantbenchError, one_of
from quantizers.base import Quantizer
from quantizers.common import TimedLoad

# transformers is imported where used: config validation instantiates quantizers before any model library loads
# (tests/test_layout.py, LAZY_OK).

_BOUNDS = {"int8": (8.0, 9.0), "int4": (4.0, 5.0)}  # int4: 4 + a scale and shift per group of 32-128 (or row)


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

    def preflight(self, device: str) -> None:
        super().preflight(device)
        # int4 unpacks through quanto_cpp, which quanto compiles at the first forward: without a compiler that
        # failed after loading, with the compiler's command line as the error (a cached build needs none)
        if self.weights == "int4" and device.startswith("cpu") and not env.cxx_compiler() and not _extension()[2]:
            raise QuantbenchError("quanto_int4 needs a C++ compiler to build quanto_cpp (apt-get install g++), or use "
                                  "quantizer=torchao_int4")

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        if self.weights == "int4":
            self.last_tags["quantizer.group_sizes"] = group_sizes(model)
        return model

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        from transformers import QuantoConfig

        cache_extension()
        return {"quantization_config": QuantoConfig(weights=self.weights)}


def _extension() -> tuple[Any, Path, bool]:
    """(quanto's C++ extension, its folder in the cache, whether a build is there)."""
    import optimum.quanto
    import torch
    from optimum.quanto.library.extensions.cpp import ext

    key = hashlib.sha256(torch.__version__.encode() + repr(ext.extra_cflags).encode())
    for src in ext.sources:
        key.update(Path(src).read_bytes())
    where = cache_root() / "ext" / f"quanto-{optimum.quanto.__version__}-{key.hexdigest()[:16]}"
    return ext, where, (where / f"{ext.name}.so").is_file() and (where / "pytorch_version.txt").is_file()


def cache_extension() -> None:
    """quanto builds its C++ unpack kernel on first use inside its own package folder, so every fresh venv (each
    CI run) compiled it again (~35 s on 2 cores). It is built into the cache instead, in a folder named by a hash of
    its sources, flags and torch's version, and a built one is imported directly: torch's builder (setuptools +
    ninja) would rebuild it in every new venv, whose source paths and times differ. scripts/setup.sh --all builds it."""
    ext, where, built = _extension()
    where.mkdir(parents=True, exist_ok=True)
    ext.build_directory = str(where)
    if ext._lib is None and built:
        spec = importlib.util.spec_from_file_location(ext.name, where / f"{ext.name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # what torch's builder does last, without its rebuild check
        ext._lib = module


def group_sizes(model: Any) -> str:
    """The group sizes quanto's layers chose (`weight_group_size`, None: one scale per row), with how many layers
    took each: e.g. "96 (210 layers)" or "128 (8 layers), per-row (6 layers)"."""
    sizes = Counter(m.weight_group_size for m in model.modules() if hasattr(m, "weight_group_size"))
    return ", ".join(f"{'per-row' if g is None else g} ({n} layer{'s' * (n != 1)})"
                     for g, n in sorted(sizes.items(), key=lambda kv: -1 if kv[0] is None else kv[0], reverse=True))
