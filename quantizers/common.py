"""Pieces the backend quantizers share (kept out of base.py, which knows no backend)."""

from __future__ import annotations

import types
from typing import Any

from harness.measure import now


class TimedLoad:
    """Mixin for quantizers that quantize while loading: records `quantize_s` and the library version.

    For libraries that quantize inside `from_pretrained` (bitsandbytes, torchao, quanto) the time
    includes reading the weights; compare it with `load_s` of the fp32/bf16 baselines.
    """

    grad_mode = "inference"  # "no_grad" for backends that fail under torch.inference_mode (quanto int4)
    storage = ""  # a note for the tag quantizer.storage where storage differs from the nominal bits

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        t0 = now()
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)  # type: ignore[misc]
        self.last_metrics = {"quantize_s": now() - t0}
        self.last_tags = self.base_tags()
        mark_grad_mode(model, self.grad_mode)
        return model

    def base_tags(self) -> dict[str, str]:
        tags = {f"quantizer.version.{k}": v for k, v in self.versions().items()}  # type: ignore[attr-defined]
        if self.storage:
            tags["quantizer.storage"] = self.storage
        return tags


def mark_grad_mode(model: Any, mode: str) -> None:
    """Tell the decode loop and the scorer to run this model under no_grad (see measure.model_grad_mode)."""
    if mode == "no_grad":
        model.quantbench_grad_mode = "no_grad"


def release(module: Any) -> None:
    """Drop the methods bound to `module` in its own __dict__, so that it is freed when its last reference goes.

    torchao's `quantize_` sets `layer.extra_repr = MethodType(_linear_extra_repr, layer)` (and quantizers/dtype.py
    and rows8 patch `forward` the same way): a module that refers to itself through its own dict is a reference
    cycle, freed only when Python's cyclic collector next runs. A layer replaced by another (quantizers/int8pack.py,
    quantizers/vnni.py) stayed in memory until then, with its weights: measured on AMD EPYC family 25 model 17,
    2026-12-05, a Llama-3.1-8B int4 model went from 7.1 to 10.1 GB through rows8's swap (6.3 GB after a
    gc.collect()), and an 8B int8 run peaked at 16.7 GB against 10.8 GB estimated (the old torchao layers held the
    int8 rows the re-laid copies had replaced)."""
    for key, value in list(vars(module).items()):
        if isinstance(value, types.MethodType) and value.__self__ is module:
            delattr(module, key)
