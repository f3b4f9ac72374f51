"""torchao through transformers' `TorchAoConfig`: int8 weight-only (`torchao_int8`), int8 dynamic
activations + int8 weights (`torchao_int8_dyn`) and int4 weight-only (`torchao_int4`).

int4 has three kernels, chosen by `kernel`:
- `packed` (CPU, the default there): `PrototypeInt4WeightOnlyConfig` (torchao 0.18's CPU int4 layout,
  `Int4OpaqueTensor`): int4 packed two per byte plus a bf16 scale and zero point per group
  (4 + 32/group_size bits/weight), multiplied by `aten::_weight_int4pack_mm_for_cpu` in eager and
  compiled mode. Group sizes 32, 64, 128. The kernel wants bf16 activations (5-10x slower with fp32
  ones on Zen 3), so this kernel loads the model's float parts in bf16.
- `intx` (CPU): `IntxWeightOnlyConfig(weight_dtype=torch.int4)`. torchao 0.18 stores these int4 values
  *unpacked, one per int8 byte* (`IntxUnpackedToInt8Tensor`) and dequantizes in the matmul, so the
  audit honestly reports ~8.75-9.25 bits/weight: the accuracy is int4's, the memory is int8's. Its
  bound is therefore 9.5, not 5. Kept for comparison (`quantizer.kernel=intx`).
- `tinygemm` (CUDA only, the default there): `Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`,
  packed int4 with bf16 scales, `aten::_weight_int4pack_mm` (sm_80+). On CPU torchao 0.18 fails ("Torch not
  compiled with CUDA enabled"), so preflight refuses it there.
- `preshuffled` (CUDA sm_90+): `int4_packing_format="preshuffled"` (`Int4PreshuffledTensor`), mslk's CUTLASS
  `bf16i4bf16_shuffled`: the packing torchao itself picks on sm >= 90 (quantizers/gpu_paths.py has the sources;
  `quantizer=int4` takes it there when mslk is installed). Groups of 128 or 256 (mslk's preshuffle needs >= 128).
- `plain` (CUDA): `int4_packing_format="plain"` (`Int4Tensor`), mslk's `bf16i4bf16_rowwise`; torchao's default
  format, published as 0.3x of tinygemm at batch 1 (pytorch/ao#2273): kept for comparison.
  Both need the `mslk` package (`pip install mslk-cuda==1.1.0`, the release for torch 2.11; a 44 MB wheel): without
  it torchao fails at quantize time ("Requires mslk >= 1.0.0"), so preflight refuses in one line instead.
  mslk 1.1.0 has no shape rule for `bf16i4bf16_shuffled`, so a compiled step would break its graph at every
  linear; `load` registers one first (quantizers/fake_ops.py, tag `quantizer.fake_ops`).

int8 weight-only (`Int8WeightOnlyConfig`, per-row scales) has two kernels, chosen by `kernel`:
- `int8pack` (CPU, the default there): torchao quantizes, then each layer's int8 rows and scales move into
  an `Int8PackLinear` that calls `aten::_weight_int8pack_mm` directly, in eager and compiled mode alike.
  torchao's own tensor subclass (`Int8Tensor`) dequantizes the whole weight to bf16 at every eager call
  (`aten::copy_` + `aten::mm`: int8 read, bf16 written and read again), and compiled, dynamo unwraps
  the subclass of every layer at every step (its cache lookup took 3.9 ms/step against 1.9 with plain
  tensors on Zen 3). Measured there (docs/fast_path.md): the whole SmolLM2 body at 1 row 17.4 ms int8pack
  vs 16.8 ms bf16, at 4 rows 21 vs 53 ms (emulated bf16 GEMM), at 16 rows 74 vs 222 ms. From
  `INT8_UPCAST_ROWS` rows (prefill, scoring) on a CPU that emulates bf16 the layer dequantizes into a reused
  fp32 buffer and runs an fp32 GEMM instead (200 rows: 670 vs 792 ms), the int8 twin of the fp32 prefill
  rule of quantizers/dtype.py (quantizers/int8pack.py). The op is fast only with bf16 activations, so the float parts load in bf16.
- `fused` (CUDA, the default there for weight-only): torchao's tensor subclass, compiled with the inductor flags
  of quantizers/gpu_paths.py TORCHAO_INDUCTOR. Its linear is `mm(x, w.to(dtype)) * scale`; with
  `coordinate_descent_tuning` inductor lowers a one-row mm on a GPU to mul + sum, one Triton reduction that reads
  the int8 weight and casts it in registers (the fused dequantize). Eager it dequantizes the whole weight first.
- `torchao` (and always for `dynamic=true`): torchao's tensor subclass as is; torchao then sets its recommended
  inductor flags process-wide (every later compile in the process inherits them), which is what the H200 run of
  issue #29 measured. On CPU under `measure.compile=true` inductor's weight-only-int8 pattern rewrites its
  dequantize + mm into `aten::_weight_int8pack_mm` too. Kept for comparison.
Tag `kernel.linear` records which op really ran.

torchao skips, silently, an int4 layer whose input width `group_size` does not divide; preflight refuses such a
model in one line naming the width and the group sizes that would do (`group_problem`, from the config alone).
tinygemm pads every matrix to in_features a multiple of 1024 (out a multiple of 8), so a 576-wide model stores ~7.5
bits/weight at groups of 64: its audit bound is computed from the padded shapes (`tinygemm_bits`).

The CUDA kernels (`fused`, `tinygemm`, `preshuffled`, `plain`) quantize with `set_inductor_config=False` and ask for
the same flags through `inductor_config(device)` instead (quantizers/base.py), which harness/measure/fast_path.py
applies to this run's compile only (tag `compile.inductor`).

Layers that are left in 16 bits (the tied output projection) get the fp32 upcast of multi-token
matmuls where the CPU emulates bf16 (quantizers/dtype.py), which keeps prefill and scoring fast.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from harness import env  # env.cpu_info looked up per call: tests patch it
from harness.errors import ConfigError, QuantbenchError, Unsupported, one_of
from quantizers import fake_ops, gpu_paths  # gpu_paths.device_capability looked up per call: tests patch it
from quantizers.base import Quantizer, linear_layers
from quantizers.common import TimedLoad
from quantizers.dtype import apply_prefill_matmul, native_16bit
from quantizers.int8pack import INT8_UPCAST_ROWS, int8_head, to_int8pack

# torchao (the optional `quant` extra) and transformers are imported where used: config validation instantiates this
# class on machines without it (tests/test_layout.py, LAZY_OK).

KERNELS = ("auto", "packed", "intx", "tinygemm", "preshuffled", "plain")
CUDA_INT4 = {"tinygemm": "tile_packed_to_4d", "preshuffled": "preshuffled", "plain": "plain"}  # -> packing format
MSLK_KERNELS = ("preshuffled", "plain")
MSLK_PIP = "mslk-cuda==1.1.0"  # the mslk release for torch 2.11 (the GPU image's); kernels for 8.0, 9.0a, 10.0a, 12.0a
INT8_KERNELS = ("auto", "int8pack", "torchao", "fused")
HEADS = ("keep", "int8")  # quantizer.head: the output projection left in 16 bits, or int8 per row (CPU)
GROUPS = {"packed": (32, 64, 128), "preshuffled": (128, 256), "plain": (128, 256)}  # others: 32, 64, 128, 256


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tinygemm_bits(shapes: list[tuple[int, int]], group_size: int) -> float:
    """Bits per logical weight that tinygemm stores for linears of (out, in) `shapes`: torchao 0.18
    (Int4TilePackedTo4dTensor.from_hp) pads in to a multiple of 1024 and out to one of 8, then keeps 4 bits per padded
    weight plus a bf16 scale and zero point per group of the padded row."""
    padded = sum(_up(o, 8) * _up(i, 1024) for o, i in shapes)
    return (4.0 + 32.0 / group_size) * padded / sum(o * i for o, i in shapes)


def group_problem(layers: list[tuple[str, str, int, int]], group_size: int, kernel: str) -> str:
    """One line when `group_size` does not divide the input width of a targeted layer (name, class, in, out) of
    `layers`, which torchao would leave unquantized without a word; "" when it divides every one."""
    bad = Counter(w for _, _, w, _ in layers if w % group_size)
    if not bad:
        return ""
    widths = sorted({w for _, _, w, _ in layers})
    ok = [g for g in GROUPS.get(kernel, (32, 64, 128, 256)) if all(w % g == 0 for w in widths)]
    example = next(n for n, _, w, _ in layers if w % group_size)
    fix = (f"use quantizer.group_size={' or '.join(map(str, ok))}" if ok else
           f"no group size kernel={kernel} takes divides all of them ({', '.join(map(str, widths))}); use "
           + ("quantizer.kernel=tinygemm" if kernel in MSLK_KERNELS else "quantizer=bnb_nf4 or quantizer=quanto_int4"))
    return (f"quantizer torchao_int4 group_size={group_size} does not divide the input width "
            f"{', '.join(map(str, sorted(bad)))} of {sum(bad.values())} of the {len(layers)} targeted linear layers "
            f"(e.g. {example}), which torchao would leave unquantized; {fix}")


def head_device_check(head: str, device: str) -> None:
    """head=int8 is Int8PackLinear, ATen's CPU int8 op: one line on another device, before anything loads."""
    if head == "int8" and not device.startswith("cpu"):
        raise QuantbenchError(f"quantizer.head=int8 is a CPU path (Int8PackLinear, aten::_weight_int8pack_mm); on "
                              f"{device} use quantizer.head=keep")


def head_problem(head: str, kernel: str) -> str:
    if (err := one_of("quantizer.head", head, HEADS)):
        return err
    return "" if head == "keep" or kernel in ("auto", "int8pack", "packed", "intx") else \
        f"quantizer.head=int8 is a CPU path (Int8PackLinear); with quantizer.kernel={kernel} use quantizer.head=keep"


class InductorFlags:
    """Mixin: remembers whether the decode step is compiled (check_with) so that load can record the inductor flags
    this kernel asks for (`inductor_config`) as tag compile.inductor; an eager run gets no such tag."""

    _compiled = False

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        self._compiled = getattr(measure, "compile", False) is True
        self.see_model(parts.get("model"))  # type: ignore[attr-defined]

    def compile_tags(self, device: str) -> dict[str, str]:
        flags = self.inductor_config(device)  # type: ignore[attr-defined]
        return {"compile.inductor": gpu_paths.inductor_tag(flags)} if self._compiled and flags else {}


class BF16OnCPU:
    """Mixin: on CPU load the float parts in bf16 (the int kernels' fast activation dtype) and upcast the
    multi-token matmuls of the layers left in 16 bits where bf16 is emulated (quantizers/dtype.py)."""

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)  # type: ignore[misc]
        dtype = str(model.get_output_embeddings().weight.dtype).replace("torch.", "")
        self.last_tags["quantizer.prefill_matmul"] = apply_prefill_matmul(model, dtype, device, "auto")  # type: ignore[attr-defined]
        if getattr(self, "head", "keep") == "int8":  # after the upcast pass: the int8 head has no float weight
            upcast = 0 if native_16bit("bfloat16", env.cpu_info()) else INT8_UPCAST_ROWS
            rows = int8_head(model, upcast)
            self.last_tags["quantizer.head"] = f"int8 per row ({rows} rows, aten::_weight_int8pack_mm)"  # type: ignore[attr-defined]
        return model


@dataclass
class TorchAoInt8(InductorFlags, BF16OnCPU, TimedLoad, Quantizer):
    """int8 per-row weights; `dynamic=True` also quantizes activations per token (int8 x int8 matmul)."""

    eager_dequantizes = True  # Int8Tensor's eager call: mm(x, w.to(dtype)) * scale (quantizers/base.py)

    dynamic: bool = False
    kernel: str = "auto"  # auto (int8pack on CPU and fused on CUDA for weight-only, else torchao) | int8pack | torchao | fused
    head: str = "keep"  # keep (output projection in 16 bits) | int8 (per row, as llama.cpp's Q8_0 files; CPU)

    library = "torchao"
    quantizes = True
    min_bits_per_weight = 8.0
    max_bits_per_weight = 9.0  # 8 + fp32 scale and int8 zero point per row
    instead = "quantizer=bnb_int8"

    def __post_init__(self) -> None:
        errs = [one_of("quantizer.kernel", self.kernel, INT8_KERNELS), head_problem(self.head, self.kernel)]
        if self.dynamic and self.kernel in ("int8pack", "fused"):
            errs.append(f"quantizer.kernel={self.kernel} is weight-only; with quantizer.dynamic=true choose one of: "
                        "auto, torchao")
        if any(errs):
            raise ConfigError([e for e in errs if e])
        self._device = "cpu"

    @property
    def name(self) -> str:
        return "torchao_int8_dyn" if self.dynamic else "torchao_int8"

    def _kernel(self, device: str) -> str:
        if self.kernel != "auto":
            return self.kernel
        if self.dynamic:
            return "torchao"
        return "fused" if device.startswith("cuda") else "int8pack" if device.startswith("cpu") else "torchao"

    @property
    def backend(self) -> str:  # type: ignore[override]
        if self.dynamic:
            return "torchao.int8_dynamic_int8_weight"
        kernel = self._kernel(self._device)
        return "torchao.int8_weight_only" + (f"+{kernel}" if kernel in ("int8pack", "fused") else "")

    def preflight(self, device: str) -> None:
        super().preflight(device)
        self._device = device
        head_device_check(self.head, device)
        if self._kernel(device) == "int8pack" and not device.startswith("cpu"):
            raise QuantbenchError("quantizer torchao_int8 kernel=int8pack is the CPU path; on CUDA use "
                                  "quantizer.kernel=torchao or fused (or auto)")
        if self._kernel(device) == "fused" and not device.startswith("cuda"):
            raise Unsupported("needs CUDA: quantizer torchao_int8 kernel=fused is the GPU path (inductor fuses the "
                              "int8 cast into a one-row Triton reduction); on CPU use quantizer.kernel=int8pack (or auto)")

    def inductor_config(self, device: str) -> dict[str, Any]:
        return dict(gpu_paths.TORCHAO_INDUCTOR) if self._kernel(device) == "fused" else {}

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        if self._kernel(device) == "int8pack":
            upcast = 0 if native_16bit("bfloat16", env.cpu_info()) else INT8_UPCAST_ROWS
            n = to_int8pack(model, upcast)
            self.last_tags["quantizer.int8pack"] = (f"{n} layers; fp32 from {upcast} rows (bf16 emulated on "
                                                    f"{env.cpu_info().isa})" if upcast else f"{n} layers")
        self.last_tags.update(self.compile_tags(device))
        return model

    def load_dtype(self, model_dtype: str) -> str:
        # the weight-only int8 op is fast with bf16 activations only; dynamic int8 quantizes them anyway
        return "bfloat16" if not self.dynamic and getattr(self, "_device", "cpu").startswith("cpu") else model_dtype

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        # fused: the flags come through inductor_config, for this compile only (module docstring)
        own = self._kernel(device) != "fused"
        cfg = Int8DynamicActivationInt8WeightConfig() if self.dynamic else Int8WeightOnlyConfig(set_inductor_config=own)
        return {"quantization_config": TorchAoConfig(quant_type=cfg)}


@dataclass
class TorchAoInt4(InductorFlags, BF16OnCPU, TimedLoad, Quantizer):
    """int4 weight-only with one scale per `group_size` weights (see module docstring for kernels)."""

    group_size: int = 32
    kernel: str = "auto"  # auto (packed on CPU, tinygemm on CUDA) | packed | intx | tinygemm | preshuffled | plain
    head: str = "keep"  # keep (output projection in 16 bits) | int8 (per row; llama.cpp's Q4_0 files use Q6_K; CPU)

    library = "torchao"
    quantizes = True
    min_bits_per_weight = 4.0
    instead = "quantizer=bnb_nf4"

    def __post_init__(self) -> None:
        errs = [one_of("quantizer.kernel", self.kernel, KERNELS), head_problem(self.head, self.kernel)]
        if self.group_size not in (32, 64, 128, 256):
            errs.append(f"quantizer.group_size={self.group_size!r} is not allowed; choose one of: 32, 64, 128, 256")
        elif self.kernel == "packed" and self.group_size == 256:
            errs.append("quantizer.group_size=256 is not allowed with quantizer.kernel=packed; choose one of: 32, 64, 128")
        elif self.kernel in MSLK_KERNELS and self.group_size < 128:
            errs.append(f"quantizer.group_size={self.group_size} is not allowed with quantizer.kernel={self.kernel} "
                        "(mslk's int4 kernels take groups of at least 128); choose one of: 128, 256")
        if any(errs):
            raise ConfigError([e for e in errs if e])
        self._device = "cpu"
        self._shapes: list[tuple[int, int]] = []  # (out, in) of the targeted linears, once known: tinygemm's bound

    @property
    def name(self) -> str:
        return "torchao_int4"

    def _kernel(self, device: str) -> str:
        if self.kernel != "auto":
            return self.kernel
        if device.startswith("cuda"):
            return "tinygemm"
        return "intx" if self.group_size == 256 else "packed"  # packed supports groups of 32-128

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"torchao.int4_{self._kernel(self._device)}"

    @property
    def max_bits_per_weight(self) -> float:  # type: ignore[override]
        # intx stores each int4 value in a whole int8 byte (honest, see module docstring); packed keeps a
        # bf16 scale and zero point per group: 4 + 32/group_size, plus a margin for short rows
        if self._kernel(self._device) == "intx":
            return 9.5
        if self._kernel(self._device) == "tinygemm" and self._shapes:  # padded: + a margin for biases
            return max(5.0, tinygemm_bits(self._shapes, self.group_size) + 0.1)
        return 4.0 + 32.0 / self.group_size + 0.5 if self._kernel(self._device) == "packed" else 5.0

    @property
    def storage(self) -> str:  # type: ignore[override]
        if self._kernel(self._device) == "intx":
            return "int4 values stored unpacked in int8 (IntxUnpackedToInt8Tensor): int4 accuracy, int8 memory"
        if self._kernel(self._device) == "packed":
            return "packed int4 for CPU (Int4OpaqueTensor, _weight_int4pack_mm_for_cpu)"
        if self._kernel(self._device) in MSLK_KERNELS:
            return f"packed int4 ({self._kernel(self._device)} format, mslk)"
        return "packed int4 (tinygemm)"

    def preflight(self, device: str) -> None:
        super().preflight(device)
        self._device = device
        head_device_check(self.head, device)
        if self._kernel(device) == "tinygemm" and not device.startswith("cuda"):
            raise Unsupported("needs CUDA: quantizer torchao_int4 kernel=tinygemm (Int4WeightOnlyConfig) is CUDA-only in "
                                  "torchao 0.18; on CPU use quantizer=torchao_int4 quantizer.kernel=packed "
                                  "(or quantizer=bnb_nf4)")
        if self._kernel(device) == "packed" and not device.startswith("cpu"):
            raise QuantbenchError("quantizer torchao_int4 kernel=packed (PrototypeInt4WeightOnlyConfig) is the CPU "
                                  "layout; on CUDA use quantizer.kernel=tinygemm")
        if self._kernel(device) in MSLK_KERNELS:
            self.mslk_preflight(device)
        if self._kernel(device) == "packed":
            try:
                from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig  # noqa: F401
            except ImportError as exc:
                raise QuantbenchError(f"quantizer torchao_int4 kernel=packed needs torchao's CPU int4 layout "
                                      f"(torchao 0.18: {exc}); pip install torchao==0.18.0, or use "
                                      "quantizer.kernel=intx") from exc
        layers = self.linears()  # from the config: before anything loads
        if layers and (err := group_problem(layers, self.group_size, self._kernel(device))):
            raise QuantbenchError(err)
        self._shapes = [(o, i) for _, _, i, o in layers or ()]

    def mslk_preflight(self, device: str) -> None:
        """The mslk kernels: CUDA, the package, and for preshuffled a GPU its CUTLASS kernel is built for."""
        kernel = self._kernel(device)
        if not device.startswith("cuda"):
            raise Unsupported(f"needs CUDA: quantizer torchao_int4 kernel={kernel} (mslk) is CUDA-only; on CPU use "
                              "quantizer.kernel=packed (or auto)")
        if not gpu_paths.importable("mslk"):
            raise QuantbenchError(f"quantizer torchao_int4 kernel={kernel} needs the mslk package (torchao's int4 "
                                  f"CUTLASS kernels, formerly fbgemm-gpu-genai), which is not installed; pip install "
                                  f"{MSLK_PIP} (for torch 2.11), or use quantizer.kernel=tinygemm")
        cap = gpu_paths.device_capability(device)
        if kernel == "preshuffled" and cap is not None and cap < (9, 0):
            raise Unsupported(f"needs sm_90+: quantizer torchao_int4 kernel=preshuffled runs mslk's CUTLASS kernel "
                              f"for Hopper and newer, and this GPU is sm_{cap[0]}{cap[1]}; use quantizer.kernel=tinygemm")

    def audit(self, model: Any) -> dict[str, Any]:
        # tinygemm's bound follows the layers really loaded (padded shapes: tinygemm_bits)
        self._shapes = [(int(m.out_features), int(m.in_features))
                        for _, m in linear_layers(model, self.skip_modules)[1] if hasattr(m, "in_features")]
        return super().audit(model)

    def inductor_config(self, device: str) -> dict[str, Any]:
        cuda = device.startswith("cuda") and self._kernel(device) in CUDA_INT4
        return dict(gpu_paths.TORCHAO_INDUCTOR) if cuda else {}

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = super().load(source, tokenizer=tokenizer, device=device, experiment=experiment)
        self.last_tags.update(self.compile_tags(device))
        if self._kernel(device) in MSLK_KERNELS:  # before any compile: mslk 1.1.0 lacks a shape rule (fake_ops.py)
            self.last_tags["quantizer.fake_ops"] = fake_ops.ensure_mslk_fakes()
        return model

    def load_dtype(self, model_dtype: str) -> str:
        # tinygemm and mslk's kernels take bf16 activations; the packed CPU kernel is 5-10x slower with fp32 ones
        return "bfloat16" if self._kernel(self._device) in ("packed", *CUDA_INT4) else model_dtype

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        import torch
        from torchao.quantization import Int4WeightOnlyConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup
        from transformers import TorchAoConfig

        self._device = device
        if self._kernel(device) in CUDA_INT4:  # flags through inductor_config, for this compile only
            cfg = Int4WeightOnlyConfig(group_size=self.group_size, int4_packing_format=CUDA_INT4[self._kernel(device)],
                                       set_inductor_config=False)
        elif self._kernel(device) == "packed":
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

            cfg = PrototypeInt4WeightOnlyConfig(group_size=self.group_size)
        else:
            cfg = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(self.group_size))
        return {"quantization_config": TorchAoConfig(quant_type=cfg)}
