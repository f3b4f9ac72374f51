"""`quantizer=int8` / `quantizer=int4`: the best backend available on the current device.

Resolution happens in `preflight(device)` (before the model loads): the first backend in the device's
row of `TABLE` whose own preflight passes (library installed, device supported) is used, and everything
else is delegated to it. The resolved backend is recorded in tag `quantizer.backend` and its config
name in `quantizer.resolved`. "Best" means: no calibration step, weights really stored at the nominal
width, and the best speed/accuracy measured here (docs/quantizers.md has the numbers):

| device | int8 | int4 |
|---|---|---|
| cpu | torchao_int8, bnb_int8, quanto_int8 | bnb_nf4, quanto_int4 |
| cuda | torchao_int8, bnb_int8, quanto_int8 | torchao_int4 (tinygemm), bnb_nf4, quanto_int4 |

On CPU torchao_int4 is not in the int4 row: torchao 0.18 stores those int4 values in int8 bytes, and
GPTQ needs a calibration pass; ask for them by name (`quantizer=torchao_int4`, `quantizer=gptq_int4`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ConfigError, QuantbenchError, one_of
from quantizers.base import Quantizer

TABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "int8": {"cpu": ("torchao_int8", "bnb_int8", "quanto_int8"), "cuda": ("torchao_int8", "bnb_int8", "quanto_int8")},
    "int4": {"cpu": ("bnb_nf4", "quanto_int4"), "cuda": ("torchao_int4", "bnb_nf4", "quanto_int4")},
}
CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "quantizer"


def build_named(name: str) -> Quantizer:
    """Build a quantizer from conf/quantizer/<name>.yaml (its `_target_` is the registry)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return instantiate(OmegaConf.load(CONF_DIR / f"{name}.yaml"), _convert_="all")


@dataclass
class Auto(Quantizer):
    """Resolves to a concrete backend quantizer per device (see module docstring)."""

    bits: str = "int8"  # int8 | int4

    def __post_init__(self) -> None:
        if (err := one_of("quantizer.bits", self.bits, tuple(TABLE))):
            raise ConfigError([err])
        self._resolved: Quantizer | None = None
        self._resolved_name = ""

    @property
    def name(self) -> str:
        return self.bits

    @property
    def resolved(self) -> Quantizer:
        if self._resolved is None:
            raise QuantbenchError(f"quantizer {self.bits} is not resolved yet; call preflight(device) first")
        return self._resolved

    @property
    def backend(self) -> str:  # type: ignore[override]
        return self._resolved.backend if self._resolved is not None else "unresolved"

    def preflight(self, device: str) -> None:
        kind = device.split(":")[0]
        reasons = []
        for name in TABLE[self.bits].get(kind, ()):
            candidate = build_named(name)
            try:
                candidate.preflight(device)
            except QuantbenchError as exc:
                reasons.append(f"{name}: {exc}")
                continue
            self._resolved, self._resolved_name = candidate, name
            return
        raise QuantbenchError(f"quantizer {self.bits}: no backend runs on {device} ("
                              + ("; ".join(reasons) or f"none listed for {kind}")
                              + "); install one of them, or use quantizer=bf16")

    def identity(self) -> dict:
        return self.resolved.identity()

    def compile_blocker(self, device: str) -> str:
        return self.resolved.compile_blocker(device)  # after preflight: the backend that will really run

    def versions(self) -> dict[str, str]:
        return self._resolved.versions() if self._resolved is not None else {}

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = self.resolved.load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        self.last_metrics = dict(getattr(self.resolved, "last_metrics", {}) or {})
        self.last_tags = {**(getattr(self.resolved, "last_tags", {}) or {}), "quantizer.resolved": self._resolved_name}
        return model

    def audit(self, model: Any) -> dict[str, Any]:
        return self.resolved.audit(model)
