"""Models the size users run, with random weights: `model=random model.arch=<preset>` (or `model.config_path=`).

Weights of 1B-8B models cannot be downloaded here, and speed, memory and the roofline do not depend on the
weight values (optimum-benchmark's `no_weights` does the same). The shapes are the published
`config.json` fields of real models, shipped in harness/data/arch/<preset>.json; any local config.json
of a Llama or Qwen2 model works too.

Values: one seeded block tiled over every tensor, so a tensor's values depend only on (seed, name, shape)
and the transformers model and the GGUF (harness/models/gguf_export.py) hold the same weights, bit for bit
(harness/models/random_weights.py).

Building: the model is created on the meta device (no memory), then each decoder layer is allocated in the
load dtype, filled (a memory-bound copy of the block, ~2 GB/s while the pages are first touched: an 8B
model in seconds) and, when the quantizer is torchao's, quantized before the next layer is allocated, so
the full 16-bit model is never held next to its quantized copy (peak: quantized model + one layer).
Quantizers that only load through `from_pretrained` (bitsandbytes, quanto) read a safetensors copy written
once per preset and seed into the cache (`local_dir()`, one shard per layer).

The model has no tokenizer: `tokenizer()` is an `IdTokenizer` (ids in, ids out), the workload is seeded
synthetic token ids (conf/model/random.yaml sets measure.prompts=synthetic), a text prompt set or file is
refused in one line. Accuracy (perplexity, KL) and speculative acceptance depend on the weight values and
mean nothing here: the accuracy pass is off by default and an explicit `accuracy.enabled=true` or `accuracy.tasks`,
like a strategy whose metrics depend on the weights (`weight_dependent`), is refused (docs/scaling_models.md).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cache import atomic_dir, cache_root, require_free, short_hash
from harness.errors import QuantbenchError, one_of, raise_if
from harness.measure.workloads import parse
from harness.models import ModelSource, torch_dtype
from harness.models.gguf_export import write_gguf
from harness.models.random_weights import BLOCK, VALUES, fill_, first_id, values  # noqa: F401 - BLOCK re-exported (tests)

# torch, transformers, torchao and safetensors are imported where used: config validation of model=random (presets,
# shapes, one-line refusals) must not load a model library (tests/test_layout.py, LAZY_OK).

ARCH_DIR = Path(__file__).resolve().parents[1] / "data" / "arch"
MODEL_TYPES = ("llama", "qwen2")  # what harness/models/gguf_export.py writes (both engines must run the same shapes)
NO_TOKENIZER = ("model=random has no tokenizer: its workload is token ids; use measure.prompts=synthetic "
                "measure.prompt_tokens=<n> (text prompts need a real model)")


def presets() -> list[str]:
    return sorted(p.stem for p in ARCH_DIR.glob("*.json"))


def read_config(arch: str, config_path: str) -> dict:
    """The architecture fields of a preset or a config.json file (keys starting with `_` are notes)."""
    path = ARCH_DIR / f"{arch}.json" if arch else Path(config_path).expanduser()
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    data = data.get("text_config", data) if "hidden_size" not in data else data
    return {k: v for k, v in data.items() if not k.startswith("_")}


class IdTokenizer:
    """Stands in for a tokenizer where the model has none: token ids in, token ids out.

    Enough for synthetic workloads (harness/measure/workloads.py draws ids from `range(len(tok))` minus the special
    ids) and for recording samples (`decode` writes the ids); encoding text raises the one-line error.
    """

    chat_template = None
    added_tokens_decoder: dict = {}

    def __init__(self, vocab_size: int, bos: int | None, eos: int | None, pad: int | None) -> None:
        self.vocab_size = int(vocab_size)
        self.bos_token_id, self.eos_token_id = bos, eos
        self.pad_token_id = pad if pad is not None else (eos if eos is not None else 0)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return sorted({i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id) if i is not None})

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids if not (skip_special_tokens and int(i) in self.all_special_ids)]
        return "ids: " + " ".join(map(str, ids))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise QuantbenchError(NO_TOKENIZER)

    encode = apply_chat_template = __call__


def shape_problems(cfg: dict) -> list[str]:
    """What a config.json lacks to build the model, in config.py's words (a run failed late with KeyError
    'vocab_size', or with transformers' validator message cut off)."""
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    bad = [k for k in need if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool) or cfg.get(k) < 1]
    if bad:
        return [f"model.config_path: {', '.join(bad)} must be integers >= 1 (a model's config.json has them)"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    out = []
    if cfg["hidden_size"] % heads and not cfg.get("head_dim"):
        out.append(f"model.config_path: hidden_size {cfg['hidden_size']} is not divisible by num_attention_heads {heads}")
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        out.append(f"model.config_path: num_key_value_heads {kv!r} must divide num_attention_heads {heads}")
    return out


# ------------------------------------------------------------------------------------------------ source
@dataclass
class RandomModel(ModelSource):
    """A published architecture with deterministic random weights (see module docstring)."""

    dtype: str = "bfloat16"
    arch: str = ""  # a preset of harness/data/arch/ (llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-7b, tiny)
    config_path: str = ""  # or any local config.json of a Llama / Qwen2 model
    seed: int = 0

    builds_gguf = True  # engine=llama_cpp: the GGUF is written from the same values (harness/models/gguf_export.py)

    def __post_init__(self) -> None:
        if self.config_path:
            self.arch = ""  # a config file of the user's wins over the preset the YAML names by default
        super().__post_init__()

    def problems(self) -> list[str]:
        p = super().problems()
        if not self.arch and not self.config_path:
            return p + ["model=random needs model.arch=<preset> (" + ", ".join(presets())
                        + ") or model.config_path=/path/to/config.json"]
        if self.arch and (err := one_of("model.arch", self.arch, presets())):
            return p + [err]
        if self.config_path:
            path = Path(self.config_path).expanduser()
            if not path.is_file():
                return p + [f"model.config_path={self.config_path!r}: no such file; give a config.json"]
            try:
                cfg = read_config("", self.config_path)
            except (OSError, ValueError) as exc:
                return p + [f"model.config_path={self.config_path!r} is not a JSON config ({exc})"]
            if cfg.get("model_type") not in MODEL_TYPES:
                p.append(f"model.config_path: model_type {cfg.get('model_type')!r} is not supported; "
                         f"choose a config of: {', '.join(MODEL_TYPES)}")
            p += shape_problems(cfg)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            p.append(f"model.seed={self.seed!r} must be an integer >= 0")
        return p

    @functools.cached_property
    def config(self) -> dict:
        return read_config(self.arch, self.config_path)

    @property
    def name(self) -> str:
        return f"random-{self.arch or Path(self.config_path).resolve().parent.name}"

    @property
    def max_position_embeddings(self) -> int:  # harness/measure/workloads.py reads the context from here
        return int(self.config.get("max_position_embeddings", 2048))

    @property
    def std(self) -> float:
        return float(self.config.get("initializer_range", 0.02))

    def identity(self) -> dict:
        return {"random": self.config, "seed": self.seed, "values": VALUES}

    def tags(self) -> dict[str, str]:
        return {"model.arch": self.arch or str(self.config_path), "weights": "random", "model.seed": str(self.seed)}

    def reference_source(self) -> str:
        return "random"

    def hf_config(self):
        from transformers import AutoConfig

        # a deep copy: transformers rewrites nested fields in place (rope_scaling gains rope_theta), and the
        # config is this model's identity, the key of its cached weights and GGUF
        fields = copy.deepcopy({k: v for k, v in self.config.items() if k not in ("architectures", "torch_dtype", "dtype")})
        return AutoConfig.for_model(**fields)

    def tokenizer(self) -> IdTokenizer:
        c = self.config
        return IdTokenizer(c["vocab_size"], first_id(c.get("bos_token_id")), first_id(c.get("eos_token_id")),
                           first_id(c.get("pad_token_id")))

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        """What random weights cannot measure, refused at config time (module docstring), all at once."""
        p: list[str] = []
        if accuracy is not None and accuracy.enabled:
            p.append("model=random has random weights: perplexity and KL on them mean nothing; drop "
                     "accuracy.enabled=true (the accuracy pass is off for model=random)")
        if accuracy is not None and accuracy.tasks:  # listed before accuracy.tasks' own line (needs accuracy.enabled)
            p.append("model=random has random weights: task accuracy on them means nothing; drop "
                     f"accuracy.tasks=[{','.join(map(str, accuracy.tasks))}]")
        strategy = parts.get("strategy")
        if strategy is not None and getattr(strategy, "weight_dependent", ""):
            p.append(f"model=random has random weights: strategy={strategy.name} measures "
                     f"{strategy.weight_dependent}, which depends on the weight values; use a real "
                     "model, or strategy=greedy / static_batch")
        if measure is not None:
            try:
                if parse(str(measure.prompts)).kind != "synthetic":
                    p.append(f"{NO_TOKENIZER}; measure.prompts={measure.prompts} is text")
            except QuantbenchError:
                pass  # a prompt set that is not one: measure.prompts says so itself
        raise_if(p)

    # -------------------------------------------------------------------------------------------- build
    def meta_model(self, dtype: str = "bfloat16") -> Any:
        """The model with every tensor on the meta device: shapes and names, no memory."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config(), dtype=torch_dtype(dtype))

    def build(self, dtype: str, device: str = "cpu", quantize: Any = None) -> Any:
        """The model in memory, block by block; `quantize(layer)` runs on each decoder layer once it is filled."""
        import torch

        model = self.meta_model(dtype)
        layers = model.get_decoder().layers
        for i, layer in enumerate(layers):
            self._materialize(layer, f"{self._layer_prefix(model)}.{i}.", device)
            if quantize is not None:
                quantize(layer)
        tied = bool(self.config.get("tie_word_embeddings"))
        head = model.get_output_embeddings() if tied else None
        for name, module in model.named_modules():
            # a tied head is the embedding: filled on its own it held a second vocab x hidden matrix until
            # tie_weights (+0.27 GB at 1B, +0.39 GB at 3B, beyond the memory estimate of the quantized path)
            if module is not head and any(p.is_meta for p in module.parameters(recurse=False)):
                self._materialize(module, f"{name}.", device, recurse=False)
        if tied:
            model.tie_weights()
        rotary = model.get_decoder().rotary_emb  # non-persistent buffers: computed, not random
        with torch.device(device):
            model.get_decoder().rotary_emb = type(rotary)(config=model.config)
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise QuantbenchError(f"model=random could not build {self.name}: {', '.join(left[:3])} left unset")
        return model.eval()

    def params(self) -> int:
        """Parameter count of the architecture (built on the meta device: no memory)."""
        return sum(p.numel() for p in self.meta_model("bfloat16").parameters())

    @staticmethod
    def _layer_prefix(model: Any) -> str:
        layers = model.get_decoder().layers
        return next(n for n, m in model.named_modules() if m is layers)

    def _materialize(self, module: Any, prefix: str, device: str, recurse: bool = True) -> None:
        module.to_empty(device=device, recurse=recurse)
        for name, p in module.named_parameters(recurse=recurse):
            fill_(p.data, prefix + name, self.seed, self.std)

    def load_in_memory(self, dtype: str, device: str, **kwargs: Any) -> Any:
        """Build for `load_pretrained`: float, or torchao-quantized layer by layer; None: use local_dir()."""
        qc = kwargs.pop("quantization_config", None)
        if kwargs or (qc is not None and type(qc).__name__ != "TorchAoConfig"):
            return None  # bitsandbytes / quanto quantize inside from_pretrained: the safetensors copy
        quantize = None
        if qc is not None:
            from torchao.quantization import quantize_

            def quantize(layer: Any) -> None:
                quantize_(layer, qc.get_apply_tensor_subclass())

        return self.build(dtype, device, quantize)

    def local_dir(self) -> Path:
        """A safetensors copy in bf16 (the values are bf16 numbers: lossless), one shard per layer."""
        final = cache_root() / "models" / f"{self.name}-s{self.seed}-{short_hash(self.identity())}"
        if not final.exists():
            require_free(final.parent, 2.0 * self.params(), f"writing the random {self.name} weights")

        def build(tmp: Path) -> None:
            from safetensors.torch import save_file

            meta = self.meta_model("bfloat16")
            prefix = self._layer_prefix(meta) + "."
            groups: dict[str, list[tuple[str, tuple]]] = {}
            for name, p in meta.named_parameters():
                key = ".".join(name.split(".")[:3]) if name.startswith(prefix) else "rest"
                groups.setdefault(key, []).append((name, tuple(p.shape)))
            index, total = {}, 0
            for n, names in enumerate(groups.values()):
                shard = f"model-{n:05d}.safetensors"
                tensors = {name: values(name, shape, self.seed, self.std) for name, shape in names}
                save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
                total += sum(t.numel() * 2 for t in tensors.values())
                index.update(dict.fromkeys(tensors, shard))
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                          "weight_map": index}))
            self.hf_config().save_pretrained(str(tmp))

        return atomic_dir(final, build)

    # ---------------------------------------------------------------------------------------------- gguf
    @property
    def gguf_path(self) -> Path | None:
        """Where the BF16 GGUF of these weights is cached (written by `make_gguf`, not by reading this)."""
        return cache_root() / "gguf" / f"{self.name}-s{self.seed}-{short_hash(self.identity())}-BF16.gguf"

    def make_gguf(self) -> Path:
        path = self.gguf_path
        if not path.is_file():
            require_free(path.parent, 2.0 * self.params(), f"writing the BF16 GGUF of random {self.name}")
            write_gguf(self, path)
        return path

