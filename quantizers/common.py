"""Pieces the backend quantizers share (kept out of base.py, which knows no backend)."""

from __future__ import annotations

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
