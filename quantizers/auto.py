"""The device table: what `quantizer=none`, `quantizer=int8` and `quantizer=int4` mean on this machine.

Resolution happens in `preflight(device)` (before the model loads) and reads the CPU's instruction
sets (`harness.env.cpu_info()`: tag `cpu.isa`) and whether the decode step is compiled
(`measure.compile`, seen at config time through `check_with`). For int8/int4 the first backend in the
matching row whose own preflight passes (library installed, device supported) is used and everything
else is delegated to it; tags `quantizer.backend` and `quantizer.resolved` record the choice and
`quantizer.resolved_by` the row. Rows are looked up most specific first: `cpu/<isa>+compile`,
`cpu/<isa>`, `cpu+compile`, `cpu`. On CUDA the first candidate comes from the format-path table per GPU
architecture (quantizers/gpu_paths.py: quantizer, kernel and inductor flags per compute-capability class, each
with its source), read from `torch.cuda.get_device_capability()` at preflight (tags `gpu.arch`,
`quantizer.gpu_path`, `quantizer.gpu_path_by`); a table row whose preflight refuses (a missing package, a group
size that does not divide the model's widths: preshuffled's 128 on SmolLM2's 576) gives way to the table's next row,
and the rest of the cuda row follows them as fallbacks.

| device / row | none | int8 | int4 |
|---|---|---|---|
| cpu, native bf16 (avx512_bf16, amx) | bf16 | torchao_int8 (kernel int8pack) | torchao_int4 (packed CPU layout) |
| cpu, avx2 / avx512 without bf16 | bf16 weights, multi-token matmuls in fp32 | same | same |
| cpu without avx2 | fp32 | same | same |
| cuda | model.dtype | gpu_paths (torchao_int8 kernel=fused), bnb_int8, quanto_int8 | gpu_paths (sm_90+: torchao_int4 preshuffled if mslk, else tinygemm; below sm_80: bnb_nf4), bnb_nf4, quanto_int4 |

Why (AMD EPYC Zen 3, family 25 model 1, AVX2 only, 2 threads, SmolLM2-135M; docs/quantizers.md and
docs/fast_path.md have the tables):
- `none`: see quantizers/dtype.py. bf16 decodes ~1.8x faster than fp32 everywhere measured; where
  bf16 is emulated its prefill is 3x slower, which the fp32 upcast of multi-token matmuls removes.
- `int4` -> torchao_int4, whose CPU default is torchao's packed int4 layout (Int4OpaqueTensor,
  `PrototypeInt4WeightOnlyConfig`): 4.5 bits/weight really stored, `aten::_weight_int4pack_mm_for_cpu`
  with bf16 activations in eager and compiled mode. It was the fastest format here at batch 1 (compiled
  37 tok/s vs bf16 33) and prefills as fast as fp32. bnb_nf4 stays as the fallback.
- `int8` -> torchao_int8 weight-only, whose CPU default `kernel=int8pack` takes torchao's int8 rows and
  scales out of its tensor subclass and calls `aten::_weight_int8pack_mm` directly, eager and compiled
  (quantizers/int8pack.py). Paired against bf16 on the same prompts (harness.gate A/B): eager -2.0%
  [-4.7, +0.5] vs `none` (the subclass path was 0.56x: it dequantizes per call), compiled +11.1%
  [+9.3, +14.0] vs bf16 compiled (the subclass path compiled was -2.6%). quanto_int8 reaches the same op
  eager but through Python dispatch; it stays the fallback.

The int kernels need bf16 activations (5-10x slower with fp32 ones), so torchao's CPU int paths load
the float parts in bf16 whatever model.dtype says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from harness import env  # env.cpu_info looked up per call: tests patch it
from harness.errors import ConfigError, QuantbenchError, Unsupported, one_of
from quantizers import gpu_paths  # gpu_paths.device_capability looked up per call: tests patch it
from quantizers.base import Quantizer

TABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "int8": {
        "cpu": ("torchao_int8", "quanto_int8", "bnb_int8"),
        "cuda": ("torchao_int8", "bnb_int8", "quanto_int8"),
    },
    "int4": {
        "cpu": ("torchao_int4", "bnb_nf4", "quanto_int4"),
        "cuda": ("torchao_int4", "bnb_nf4", "quanto_int4"),
    },
}
CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "quantizer"


def cpu_class(cpu: Any) -> str:
    """The ISA class the table distinguishes: native_bf16 | avx2 (AVX2/AVX-512 without bf16) | baseline."""
    if cpu.native_bf16:
        return "native_bf16"
    return "avx2" if cpu.isa in ("avx2", "avx512") else "baseline"


def native_16bit(dtype: str, cpu: Any) -> bool:
    """Whether `cpu` (harness.env.CpuInfo) has hardware dot products for the 16-bit `dtype`."""
    if dtype == "bfloat16":
        return cpu.native_bf16
    return any(f in cpu.flags for f in ("avx512_fp16", "amx_fp16"))


def float_choice(device: str, model_dtype: str, cpu: Any = None) -> tuple[str, str]:
    """(dtype, why) for quantizer=none: the float format this device is fastest with (module docstring).

    model.dtype float32 is kept (none never lowers precision); a 16-bit model.dtype keeps its 16-bit
    weights where the CPU has AVX2 or better (quantizers.dtype then upcasts multi-token matmuls where the
    16-bit dot product is emulated) and becomes float32 on a CPU without AVX2.
    """
    if not device.startswith("cpu"):
        return model_dtype, f"{device}: model.dtype as loaded"
    if cpu is None:
        cpu = env.cpu_info()
    cls = cpu_class(cpu)
    if model_dtype == "float32":
        return "float32", f"cpu.isa {cpu.isa}: model.dtype float32 kept (none never lowers precision)"
    if cls == "baseline":
        return "float32", f"cpu.isa {cpu.isa}: no AVX2, 16-bit conversions are not vectorized; fp32"
    # the rule quantizers/dtype.py's apply_prefill_matmul applies: fp16 is native on AVX512_FP16/AMX-FP16 too
    how = "native" if native_16bit(model_dtype, cpu) else "emulated: multi-token matmuls in fp32"
    return model_dtype, f"cpu.isa {cpu.isa}: {model_dtype} weights ({how})"


def candidates(bits: str, device: str, compiled: bool, cpu: Any = None) -> tuple[str, tuple[str, ...]]:
    """(row, backends in order) of the device table for `bits` on `device`."""
    kind = device.split(":")[0]
    keys = [kind]
    if kind == "cpu":
        if cpu is None:
            cpu = env.cpu_info()
        cls = cpu_class(cpu)
        keys = [f"cpu/{cls}+compile", f"cpu/{cls}", "cpu+compile", "cpu"] if compiled else [f"cpu/{cls}", "cpu"]
    row = TABLE[bits]
    key = next((k for k in keys if k in row), keys[-1])
    return key, row.get(key, ())


def build_named(name: str, overrides: dict[str, Any] | None = None) -> Quantizer:
    """Build a quantizer from conf/quantizer/<name>.yaml (its `_target_` is the registry), with `overrides` merged
    on top (a GPU path's kernel, group size): validated by the quantizer's own __post_init__."""
    cfg = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    try:
        return instantiate(OmegaConf.merge(cfg, overrides or {}), _convert_="all")
    except InstantiationException as exc:  # the quantizer's own one-line refusal, not hydra's wrapping of it
        if isinstance(exc.__cause__, QuantbenchError):
            raise exc.__cause__ from None
        raise


Candidate = tuple[gpu_paths.Choice | None, str, dict[str, Any]]  # (its GPU path table row, name, overrides)


def gpu_candidates(bits: str, device: str, names: tuple[str, ...]) -> list[Candidate]:
    """Candidates in order: the GPU path table's rows for this GPU, then the cuda row's backends not among them."""
    choices = gpu_paths.paths_for(bits, gpu_paths.device_capability(device))
    rows: list[Candidate] = [(c, c.path.quantizer, dict(c.path.overrides)) for c in choices]
    return rows + [(None, n, {}) for n in names if all(n != c.path.quantizer for c in choices)]


def gpu_choice(taken: Candidate, first: gpu_paths.Choice, reasons: list[str]) -> gpu_paths.Choice:
    """Tags gpu.arch / quantizer.gpu_path / quantizer.gpu_path_by for the candidate that ran, with why the table's
    pick did not."""
    choice, name, _ = taken
    if choice is first:
        return first
    if choice is not None:  # a later row of the table
        return gpu_paths.Choice(choice.path, choice.arch,
                                f"{choice.by}; {first.path.label} did not run ({reasons[0]})")
    return gpu_paths.Choice(gpu_paths.GpuPath(name), first.arch,
                            f"{first.by}; its pick {first.path.label} did not run ({reasons[0]}), took {name}")


@dataclass
class Auto(Quantizer):
    """Resolves to a concrete backend quantizer per device (see module docstring)."""

    bits: str = "int8"  # int8 | int4
    head: str = "keep"  # keep | int8: passed to a backend that has the option (torchao's CPU paths)

    def __post_init__(self) -> None:
        errs = [one_of("quantizer.bits", self.bits, tuple(TABLE)), one_of("quantizer.head", self.head, ("keep", "int8"))]
        if any(errs):
            raise ConfigError([e for e in errs if e])
        self._resolved: Quantizer | None = None
        self._resolved_name = ""
        self._row = ""
        self._compiled = False
        self._gpu: gpu_paths.Choice | None = None

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

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        self._compiled = getattr(measure, "compile", False) is True  # picks the table's +compile rows
        self.see_model(parts.get("model"))  # each candidate's preflight checks it (group sizes, Conv1D)

    def preflight(self, device: str) -> None:
        row, names = candidates(self.bits, device, self._compiled)
        plan: list[Candidate] = [(None, n, {}) for n in names]
        self._gpu = None
        if device.startswith("cuda"):
            plan = gpu_candidates(self.bits, device, names)
        first = plan[0][0] if plan else None
        reasons, hardware = [], bool(plan)
        for taken in plan:
            _, name, overrides = taken
            candidate = build_named(name, overrides)
            try:
                if self.head != "keep":
                    if not hasattr(candidate, "head"):
                        reasons.append(f"{name}: has no quantizer.head option")
                        continue
                    # built with it, so that its own __post_init__ checks it against the kernel
                    candidate = build_named(name, {**overrides, "head": self.head})
                candidate.see_model(self._source)
                candidate.preflight(device)
            except QuantbenchError as exc:
                reasons.append(f"{name}: {exc}")
                hardware = hardware and isinstance(exc, Unsupported)
                continue
            self._resolved, self._resolved_name, self._row = candidate, name, row
            self._gpu = gpu_choice(taken, first, reasons) if first is not None else None
            return
        # every candidate needs other hardware: this machine cannot run it (a sweep cell is SKIPPED, not FAILED)
        raise (Unsupported if hardware else QuantbenchError)(f"quantizer {self.bits}: no backend runs on {device} ("
                              + ("; ".join(reasons) or f"none listed for {row}")
                              + "); install one of them, or use quantizer=bf16")

    def identity(self) -> dict:
        return self.resolved.identity()

    def compile_blocker(self, device: str) -> str:
        return self.resolved.compile_blocker(device)  # after preflight: the backend that will really run

    def inductor_config(self, device: str) -> dict[str, Any]:
        return self.resolved.inductor_config(device) if self._resolved is not None else {}

    def versions(self) -> dict[str, str]:
        return self._resolved.versions() if self._resolved is not None else {}

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = self.resolved.load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        self.last_metrics = dict(getattr(self.resolved, "last_metrics", {}) or {})
        self.last_tags = {**(getattr(self.resolved, "last_tags", {}) or {}), "quantizer.resolved": self._resolved_name,
                          "quantizer.resolved_by": f"device table row {self._row}"}
        if self._gpu is not None:
            self.last_tags.update(self._gpu.tags())
        if self._compiled and (flags := self.inductor_config(device)):
            self.last_tags["compile.inductor"] = gpu_paths.inductor_tag(flags)
        return model

    def audit(self, model: Any) -> dict[str, Any]:
        return self.resolved.audit(model)
