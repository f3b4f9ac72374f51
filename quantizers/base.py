"""The quantizer interface and the audit that keeps quantizers honest.

The audit walks the loaded model and counts what is really stored: bytes of every tensor (tensor
subclasses such as torchao's and quanto's are unpacked through `__tensor_flatten__`; bitsandbytes keeps
scales on the parameter), linear layers and how many of them hold quantized weights, and the classes
that do the matmul (the kernel path). A quantizer whose targeted layers are not all quantized, or whose
stored bits per weight exceed its `max_bits_per_weight`, fails the run: a silent no-op or fallback is
the usual way quantization benchmarks lie. transformers' `Conv1D` (GPT-2 family: weight stored (in, out), sizes
`nx`/`nf`) counts as a linear layer; torchao and quanto replace `nn.Linear` only, so preflight refuses them on a model
that has Conv1D layers (`model_linears`: the layers read from the config on the meta device, before any weight).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from harness.errors import QuantbenchError, Unsupported
from harness.models import hub, load_pretrained
from quantizers import gpu_paths

# torch is imported where used: config validation instantiates quantizers before any model library loads
# (tests/test_layout.py, LAZY_OK).


def tensor_bytes(t: Any, seen: set[Any] | None = None) -> int:
    """Bytes really stored by a tensor, including quantization metadata hung on it."""
    import torch

    seen = set() if seen is None else seen
    if t is None or id(t) in seen:
        return 0
    seen.add(id(t))
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n), seen) for n in names)
    n = 0
    if isinstance(t, torch.Tensor):
        try:
            # two tensor objects can view one storage (bitsandbytes' Int8Params.CB is the weight's own
            # int8 data): count each (storage, offset, size) view once
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype) if t.numel() else None
            if key is not None and key in seen:
                return 0
            if key is not None:
                seen.add(key)
            n = t.untyped_storage().nbytes() if t.numel() else 0
            n = min(n, t.numel() * t.element_size()) or t.numel() * t.element_size()
        except (RuntimeError, NotImplementedError):
            n = t.numel() * t.element_size()
    for attr in ("SCB", "CB"):  # bitsandbytes int8: row scales (and the int8 copy before first use)
        extra = getattr(t, attr, None)
        if isinstance(extra, torch.Tensor) and extra is not t:
            n += tensor_bytes(extra, seen)
    qs = getattr(t, "quant_state", None)  # bitsandbytes 4-bit: absmax (+ nested), code table
    if qs is not None:
        for attr in ("absmax", "code"):
            n += tensor_bytes(getattr(qs, attr, None), seen)
        nested = getattr(qs, "state2", None)
        if nested is not None:
            for attr in ("absmax", "code"):
                n += tensor_bytes(getattr(nested, attr, None), seen)
        n += tensor_bytes(getattr(qs, "offset", None), seen)
    return n


# libraries whose quantize pass replaces nn.Linear only: transformers' Conv1D (GPT-2 family) stays float
NN_LINEAR_ONLY = ("torchao", "optimum.quanto")
_LINEARS: dict[str, list[tuple[str, str, int, int]]] = {}  # model_linears per config, per process


def _is_conv1d(m: Any) -> bool:
    # transformers' Conv1D (GPT-2 family): a linear layer whose weight is stored (in, out), sized by nx/nf
    return type(m).__name__ == "Conv1D" and isinstance(getattr(m, "nf", None), int) \
        and getattr(m, "weight", None) is not None


def _is_linear(m: Any) -> bool:
    import torch

    if isinstance(m, torch.nn.Linear) or hasattr(m, "qweight") or _is_conv1d(m):
        return True
    # quantized linears that are not nn.Linear subclasses and may repack their weights under other
    # names (gptqmodel's CPU int8 kernel keeps `int8_weight_nk`): a module with in/out features that
    # holds tensors of its own
    own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
    return isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int) \
        and bool(own)


def _weight_like(m: Any) -> Any:
    for attr in ("weight", "qweight"):
        if getattr(m, attr, None) is not None:
            return getattr(m, attr)
    own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
    return max(own, key=lambda t: t.numel()) if own else None


def _logical_weights(m: Any) -> int:
    fin = getattr(m, "in_features", None) or getattr(m, "infeatures", None) or getattr(m, "nx", None)
    fout = getattr(m, "out_features", None) or getattr(m, "outfeatures", None) or getattr(m, "nf", None)
    if fin and fout:
        return int(fin) * int(fout)
    return int(m.weight.numel())


def _bias_numel(m: Any) -> int:
    bias = getattr(m, "bias", None)
    return int(bias.numel()) if type(bias).__name__ in ("Tensor", "Parameter") else 0


def _is_quantized(m: Any) -> bool:
    import torch

    if hasattr(m, "qweight") or (type(m) is not torch.nn.Linear and not _is_conv1d(m)):
        return True
    w = m.weight
    return type(w) not in (torch.Tensor, torch.nn.Parameter) or not w.dtype.is_floating_point


def _weight_desc(w: Any) -> str:
    # the tensor class, plus the element type where a plain tensor holds packed/quantized values
    name = type(w).__name__
    if name in ("Tensor", "Parameter") and not w.dtype.is_floating_point:
        return f"{name}:{str(w.dtype).replace('torch.', '')}"
    return name


def state_tensors(module: Any) -> list[Any]:
    """Weights a module holds outside its parameters and buffers: bitsandbytes int8 moves CB/SCB (the int8
    matrix, the fp32 row scales) to `module.state` on the first forward."""
    state = getattr(module, "state", None)
    return [getattr(state, attr, None) for attr in ("CB", "SCB")]


def module_bytes(module: Any, seen: set[Any]) -> int:
    return sum(tensor_bytes(t, seen) for t in [*module.parameters(), *module.buffers(), *state_tensors(module)])


def _tied_copy_weights(model: Any, linear_ids: set[int]) -> int:
    """The logical weights of an output head that is a copy of a tied embedding in another format (quantizer.head=int8:
    the table stays 16-bit for the lookup, the head an int8 copy): one logical matrix, stored twice. `params` counts
    it once, by the table, as it counts a head that shares the table's Parameter; `weight_bytes` keeps both copies."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return 0
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    table = getattr(emb, "weight", None)
    if head is None or table is None or id(head) not in linear_ids or any(p is table for p in head.parameters()):
        return 0
    return _logical_weights(head)


def linear_layers(model: Any, skip: tuple[str, ...] = ("lm_head",)) -> tuple[list, list]:
    """(every linear layer, those not in `skip`) as (name, module), outermost only."""
    linear, targeted = [], []
    for name, m in model.named_modules():
        if _is_linear(m) and not any(name.startswith(f"{p}.") for p, _ in linear):
            linear.append((name, m))
            if not any(name == s or name.endswith("." + s) for s in skip):
                targeted.append((name, m))
    return linear, targeted


def _hf_config(source: Any) -> Any:
    """The HF config that describes `source` without its weights; None where none does here (a GGUF, a hub id that
    is not cached)."""
    if hasattr(source, "hf_config"):
        return source.hf_config()
    spec = str(getattr(source, "name_or_path", "") or "")
    local = Path(spec) if spec and Path(spec).is_dir() else None
    if local is None and spec:
        local = hub.cached_snapshot(spec, "model", getattr(source, "revision", "main"))
    if local is None or not (local / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(local), trust_remote_code=False)


def model_linears(source: Any, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, str, int, int]] | None:
    """(name, class, input width, output width) of every targeted linear layer of `source`, read from its config on
    the meta device (no weights, milliseconds to a second; once per config); None where no config describes it."""
    try:
        cfg = _hf_config(source)
        if cfg is None:
            return None
        key = f"{cfg.to_json_string()}{skip}"
        if key not in _LINEARS:
            import torch
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
            _LINEARS[key] = [(n, type(m).__name__, int(m.nx if _is_conv1d(m) else m.in_features),
                              int(m.nf if _is_conv1d(m) else m.out_features))
                             for n, m in linear_layers(model, skip)[1] if hasattr(m, "in_features") or _is_conv1d(m)]
        return _LINEARS[key]
    except (QuantbenchError, OSError, ValueError, KeyError, AttributeError, TypeError, ImportError):
        return None  # the check is skipped; the audit after loading still holds


def audit_model(model: Any, skip: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """Count what the model really stores (see module docstring)."""
    seen: set[Any] = set()
    linear, targeted = linear_layers(model, skip)
    target_bytes = sum(module_bytes(m, seen) for _, m in targeted)
    # a bias is stored weights too (in the float dtype): counted, a biased float linear stays at its 16/32 bits
    target_weights = sum(_logical_weights(m) + _bias_numel(m) for _, m in targeted)
    quantized = [(n, m) for n, m in targeted if _is_quantized(m)]
    weight_bytes = target_bytes + sum(tensor_bytes(t, seen) for t in list(model.parameters()) + list(model.buffers()))
    # logical parameter count: linear layers by shape (packed storage would miscount), the rest by numel
    lin_params = {id(p) for _, m in linear for p in m.parameters()}
    params = sum(_logical_weights(m) for _, m in linear)
    params += sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in lin_params)
    params += sum(getattr(m, "bias", None).numel() for _, m in linear if getattr(m, "bias", None) is not None
                  and type(m.bias).__name__ in ("Tensor", "Parameter"))
    params -= _tied_copy_weights(model, {id(m) for _, m in linear})
    kernel = sorted({f"{type(m).__module__.split('.')[0]}.{type(m).__name__}[{_weight_desc(_weight_like(m))}]"
                     for _, m in targeted})
    return {
        "bits_per_weight": 8.0 * target_bytes / target_weights if target_weights else float("nan"),
        "weight_bytes": float(weight_bytes),
        "params": float(params),
        "linear_layers": float(len(targeted)),
        "quantized_layers": float(len(quantized)),
        "all_linear_layers": float(len(linear)),
        "kernel_path": ",".join(kernel),
    }


@dataclass
class Quantizer:
    """Base: load through `from_pretrained` (+ kwargs), then `apply`, then audit.

    Subclasses set the class attributes below and override the hooks they need.
    """

    backend = "none"  # recorded as tag quantizer.backend
    library = ""  # import name of the library doing the work (version recorded); "" for none
    pip_name = ""  # what to pip install when the library is missing
    max_bits_per_weight = 32.0  # audit: stored bits/weight over targeted linears must not exceed this
    min_bits_per_weight = 0.0  # audit: and not fall below this (catches a dtype baseline that is wrong)
    quantizes = False  # True for real quantizers: every targeted linear must hold quantized weights
    # what the backend does, not options (ClassVar: no config key, not in the allowed keys an error lists)
    skip_modules: ClassVar[tuple[str, ...]] = ("lm_head",)  # tied to the embedding; usual quantizers leave it
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")  # an instance may narrow it (GPTQ's AWQ: cuda only)
    instead = "quantizer=bf16"  # what to suggest when this one cannot run here
    compilable = True  # torch.compile can trace its matmuls (False: measure.compile=true fails before loading)
    # its eager linear dequantizes the whole weight and then multiplies, a path only a compile fuses (torchao int8):
    # the floor row of a compiled step then compiles its pass too (harness/measure/floor.py); others call the same
    # kernel eager and compiled, and their floor stays eager (no second compile on the device's clock)
    eager_dequantizes = False
    _source = None  # the model source (check_with, or Auto for its candidates): preflight checks its linear layers

    @property
    def name(self) -> str:
        return type(self).__name__

    def see_model(self, source: Any) -> None:
        """Remember the model source so that preflight can check its layers before anything loads."""
        self._source = source

    def linears(self) -> list[tuple[str, str, int, int]] | None:
        """The targeted linear layers of the model seen (model_linears); None where unknown."""
        return model_linears(self._source, self.skip_modules) if self._source is not None else None

    def load_dtype(self, model_dtype: str) -> str:
        """dtype the float parts are loaded in (default: the model's configured dtype)."""
        return model_dtype

    def preflight(self, device: str) -> None:
        """Fail fast (before loading) when the backend is missing or cannot run on this device."""
        if self.library and not gpu_paths.importable(self.library):  # "optimum.quanto" without optimum: not a crash
            raise QuantbenchError(f"quantizer {self.name} needs {self.library!r}, which is not installed; "
                                  f"pip install {self.pip_name or self.library}, or use {self.instead}")
        if device.split(":")[0] not in self.devices:  # this machine, not the input: a sweep records SKIPPED
            need = "needs CUDA: " if tuple(self.devices) == ("cuda",) else ""
            raise Unsupported(f"{need}quantizer {self.name} ({self.backend}) does not run on {device} "
                              f"(supported: {', '.join(self.devices)}); use {self.instead}")
        if self.quantizes and self.library in NN_LINEAR_ONLY and (layers := self.linears()):
            conv = [n for n, cls, _, _ in layers if cls == "Conv1D"]
            if conv:  # the library would leave them float and the audit would refuse after the whole load
                raise QuantbenchError(f"quantizer {self.name} ({self.library}) quantizes nn.Linear layers only, and "
                                      f"{len(conv)} of this model's {len(layers)} linear layers are transformers "
                                      f"Conv1D (GPT-2 family, e.g. {conv[0]}); use quantizer=bnb_int8 or "
                                      "quantizer=bnb_nf4, which convert Conv1D")

    def compile_blocker(self, device: str) -> str:
        """Why measure.compile=true cannot run with this quantizer on `device`; "" when it can."""
        if self.compilable:
            return ""
        return f"quantizer {self.name} ({self.backend}) cannot be compiled with torch.compile"

    def inductor_config(self, device: str) -> dict[str, Any]:
        """torch._inductor.config settings this quantizer's kernels need when the decode step is compiled on
        `device` (e.g. {"coordinate_descent_tuning": True}, which fuses torchao's int8 dequantize into a one-row
        Triton reduction on a GPU; quantizers/gpu_paths.py). harness/measure/fast_path.py applies them to this run's
        compile only, so they never leak into the next run of a sweep; tag compile.inductor lists them. Default:
        none."""
        return {}

    def identity(self) -> dict:
        """What distinguishes this quantizer's output (keys quantized-checkpoint caches)."""
        return {"class": type(self).__name__, **dataclasses.asdict(self), "versions": self.versions()}

    def versions(self) -> dict[str, str]:
        if not self.library:
            return {}
        dist = self.pip_name or self.library
        try:
            return {dist: importlib.metadata.version(dist)}
        except importlib.metadata.PackageNotFoundError:
            return {}

    def from_pretrained_kwargs(self, device: str) -> dict[str, Any]:
        return {}

    def apply(self, model: Any, *, source: Any, tokenizer: Any, device: str, experiment: Any) -> Any:
        """Quantize an already-loaded model (libraries that work in place). Default: nothing."""
        return model

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        model = load_pretrained(source, self.load_dtype(source.dtype), device, **self.from_pretrained_kwargs(device))
        return self.apply(model, source=source, tokenizer=tokenizer, device=device, experiment=experiment)

    def audit(self, model: Any) -> dict[str, Any]:
        """Audit the stored model and fail on a silent no-op (see module docstring)."""
        report = audit_model(model, self.skip_modules)
        bits, n_lin, n_q = report["bits_per_weight"], report["linear_layers"], report["quantized_layers"]
        if not n_lin:  # bits/weight would be 0/0: say what the model is made of instead
            classes = sorted({type(m).__name__ for m in model.modules() if getattr(m, "weight", None) is not None})
            raise QuantbenchError(f"quantizer {self.name} found no linear layers to audit (module classes: "
                                  f"{', '.join(classes) or 'none with weights'}); quantbench audits nn.Linear, "
                                  "transformers Conv1D and quantized linears: use a model built from them")
        if self.quantizes and n_q < n_lin:
            left = Counter(f"{type(m).__module__.split('.')[0]}.{type(m).__name__}[{_weight_desc(_weight_like(m))}]"
                           for _, m in linear_layers(model, self.skip_modules)[1] if not _is_quantized(m))
            raise QuantbenchError(f"quantizer {self.name} left {int(n_lin - n_q)} of {int(n_lin)} targeted linear "
                                  f"layers unquantized ({', '.join(f'{n} x {k}' for k, n in sorted(left.items()))}; "
                                  f"kernel path {report['kernel_path']}); {self.name} did not convert them, so "
                                  "refusing a silent no-op: use a quantizer that supports these layers")
        if not self.min_bits_per_weight <= bits <= self.max_bits_per_weight:
            raise QuantbenchError(f"quantizer {self.name} stores {bits:.2f} bits/weight, outside the expected "
                                  f"{self.min_bits_per_weight:g}..{self.max_bits_per_weight:g}; the backend did not "
                                  "store what it claims")
        return report

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        """Cross-section checks at config time (e.g. GPTQ needs a calibration corpus). Default: remember the model
        for preflight's layer checks (reading its config imports transformers: not at config time)."""
        self.see_model(parts.get("model"))
