"""GPTQ (and its round-to-nearest baseline, and AWQ) through `gptqmodel`, auto-gptq's maintained successor.

Flow: calibrate on `calibration_samples` x `calibration_length` tokens taken with the accuracy code's
corpus loader (`harness.analysis.accuracy.load_corpus`), quantize with `GPTQModel.load(dir, QuantizeConfig)` +
`.quantize()`, save the checkpoint under `<cache>/quantized/<key>` and load it back with gptqmodel's own
loader (`GPTQModel.load(dir, backend=...)`, as its docs show). The key hashes the model identity, this
quantizer's settings, the calibration text and the versions of gptqmodel/torch/transformers, so a sweep
quantizes once; `quantize_s` is the time the checkpoint took to make and tag `quantizer.cache` says
whether this run made it (`miss`) or reused it (`hit`).

Calibration text (`calibration_corpus`): by default `calibration`, harness/data/calibration.txt, ~9.2k
tokens of mixed English (essays, a story, how-tos, a dialogue, worked problems, chat Q&A, Python) written
for this project, so GPTQ runs offline out of the box and never calibrates on the text perplexity scores
(harness/data/corpus.txt, the `builtin` accuracy corpus, is a different text). Any other value goes
through the accuracy code's corpus loader (a text file, `builtin`, an HF datasets id); empty means
`accuracy.corpus`, whose first `accuracy.max_tokens` tokens (what perplexity scores) are skipped if the
corpus has enough tokens after them; otherwise the run is tagged `warning.calibration_overlap`.

Random-weight shapes (`model=random`, harness/models/random_model.py) have no text tokenizer (an `IdTokenizer`):
they calibrate on seeded synthetic token ids instead, `calibration_samples` x `calibration_length` ids uniform in
[0, vocab_size) from `numpy.random.default_rng(calibration_seed)`, tagged `quantizer.calibration=synthetic token ids
(seed S, N x L; random-weight shape: speed only)`; the seed is in the cache key. Their accuracy is refused anyway
(RandomModel.check_with). gptqmodel's loader insists on a tokenizer in the model folder, so the random weights are
read through a folder of links to them plus a word-level tokenizer whose token `<i>` is id i (`id_model_dir`).

Kernels (`kernel`, a gptqmodel BACKEND): `auto` = `gptq_torch_int8` on CPU (gptqmodel's default CPU
kernel rejects group size 128 at K=576 on SmolLM2); on CUDA the GPU path table's kernel for this GPU
(quantizers/gpu_paths.py: 4-bit GPTQ `gptq_marlin` and AWQ `awq_marlin` on sm_80+, gptqmodel's own choice
below; tags `gpu.arch`, `quantizer.gpu_path`, `quantizer.gpu_path_by`, and `quantizer.kernel`). Honesty note:
`gptq_torch_int8` re-packs the 4-bit GPTQ values into int8 with per-channel scales at load time, so what
is stored in memory is ~8.x bits/weight; the audit reports that (bound 9.0, tag `quantizer.storage`).
`gptq_torch` keeps the packed 4-bit weights (~4.x bits, bound `bits + 1`) but is slow on CPU.

`method=rtn` is gptqmodel's weight-only round-to-nearest in the same format and group size: the baseline
GPTQ must beat. It reads no calibration text at all (its cache key holds no calibration settings).
`method=awq` needs CUDA in gptqmodel 7.6 ("AWQ: CUDA is not available." on CPU), so preflight refuses it
there.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from harness.analysis import corpus
from harness.cache import atomic_dir, cache_root, short_hash
from harness.errors import ConfigError, QuantbenchError, one_of
from harness.measure import now
from harness.models import torch_dtype
from harness.models.random_model import IdTokenizer
from quantizers import gpu_paths  # gpu_paths.device_capability looked up per call: tests patch it
from quantizers.base import Quantizer
from quantizers.common import TimedLoad

# gptqmodel (the optional `quant` extra) is imported where used: config validation instantiates this class on machines
# without it (tests/test_layout.py, LAZY_OK).

METHODS = ("gptq", "rtn", "awq")
INT8_REPACK_KERNELS = ("gptq_torch_int8", "awq_torch_int8")
CALIBRATION = "calibration"  # the project's own calibration text (module docstring)
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "harness" / "data" / "calibration.txt"


def synthetic_calibration(vocab_size: int, samples: int, length: int, seed: int) -> list[dict]:
    """`samples` rows of `length` token ids uniform in [0, vocab_size), the same for the same seed (module docstring)."""
    ids = np.random.default_rng(seed).integers(0, vocab_size, size=(samples, length))
    return [{"input_ids": [int(i) for i in row], "attention_mask": [1] * length} for row in ids]


def id_model_dir(source: Any, tokenizer: IdTokenizer) -> Path:
    """The random weights as gptqmodel's loader wants them: a folder of links to `source.local_dir()`'s files plus a
    word-level tokenizer mapping `<i>` to id i (gptqmodel 7.6 models/loader.py loads a tokenizer from the model
    folder unconditionally; calibration passes ids, never text, so any tokenizer with the right size does)."""
    src = Path(source.local_dir())

    def build(tmp: Path) -> None:
        for f in src.iterdir():
            (tmp / f.name).symlink_to(f.resolve())
        tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(tokenizer.vocab_size)}, unk_token="<0>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(tmp / "tokenizer.json"))
        special = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id,
                   "pad_token": tokenizer.pad_token_id}
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<0>",
            **{k: f"<{v}>" for k, v in special.items() if v is not None}}))

    return atomic_dir(cache_root() / "quantized" / "sources" / f"{src.name}-ids", build)


def calibration_text(spec: str) -> str:
    """`calibration` (the shipped text), else whatever the accuracy corpus loader accepts."""
    if spec == CALIBRATION:
        return CALIBRATION_TEXT.read_text(encoding="utf-8")
    return corpus.load(spec)


@dataclass
class GPTQModelQuantizer(TimedLoad, Quantizer):
    """Calibrated weight-only quantization through gptqmodel (see module docstring)."""

    method: str = "gptq"  # gptq | rtn | awq
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    damp_percent: float = 0.05
    calibration_samples: int = 32
    calibration_length: int = 256
    calibration_corpus: str = CALIBRATION  # the shipped text | a text file | "builtin" | "" = accuracy.corpus
    kernel: str = "auto"  # a gptqmodel BACKEND name for inference; auto = gptq_torch_int8 on CPU, the GPU path table's on CUDA
    workers: int = 2  # GPTQMODEL_CPU_WORKERS (on 2 cores the default asks for more than the parent has)
    calibration_seed: int = 0  # synthetic calibration ids of a random-weight shape (module docstring)

    library = "gptqmodel"
    quantizes = True
    min_bits_per_weight = 2.0

    def __post_init__(self) -> None:
        errs = [one_of("quantizer.method", self.method, METHODS), one_of("quantizer.bits", self.bits, (2, 3, 4, 8))]
        for f in ("group_size", "calibration_samples", "calibration_length", "workers"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                errs.append(f"quantizer.{f}={getattr(self, f)!r} must be a positive integer")
        if not isinstance(self.calibration_seed, int) or isinstance(self.calibration_seed, bool) \
                or self.calibration_seed < 0:
            errs.append(f"quantizer.calibration_seed={self.calibration_seed!r} must be an integer >= 0")
        if not 0 < self.damp_percent < 1:
            errs.append(f"quantizer.damp_percent={self.damp_percent!r} must be in (0, 1)")
        if any(errs):
            raise ConfigError([e for e in errs if e])
        if self.method == "awq":  # gptqmodel 7.6 AWQ quantization raises "AWQ: CUDA is not available." on CPU
            self.devices = ("cuda",)
        self._device = "cpu"
        self._accuracy: Any = None
        self._gpu: gpu_paths.Choice | None = None

    @property
    def name(self) -> str:
        return f"{self.method}_int{self.bits}"

    @property
    def instead(self) -> str:  # type: ignore[override]
        return "quantizer=gptq_int4" if self.method == "awq" else "quantizer=bnb_nf4"

    def _kernel(self, device: str) -> str:
        if self.kernel != "auto":
            return self.kernel
        if device.startswith("cuda"):  # the table's kernel for this GPU (preflight looked it up), else gptqmodel's
            return str(self._gpu.path.overrides.get("kernel", "auto")) if self._gpu is not None else "auto"
        return "awq_torch_int8" if self.method == "awq" else "gptq_torch_int8"

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"gptqmodel.{self.method}:{self._kernel(self._device)}"

    @property
    def max_bits_per_weight(self) -> float:  # type: ignore[override]
        return 9.0 if self._kernel(self._device) in INT8_REPACK_KERNELS else self.bits + 1.0

    @property
    def storage(self) -> str:  # type: ignore[override]
        if self._kernel(self._device) in INT8_REPACK_KERNELS:
            return (f"{self.bits}-bit {self.method} values re-packed to int8 per channel by "
                    f"{self._kernel(self._device)} at load (int8 memory)")
        return f"packed {self.bits}-bit"

    def versions(self) -> dict[str, str]:
        out = {}
        for dist in ("gptqmodel", "torch", "transformers"):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out

    def preflight(self, device: str) -> None:
        super().preflight(device)
        self._device = device
        self._gpu = None
        if device.startswith("cuda") and self.kernel == "auto" and self.bits == 4:  # rtn saves GPTQ's format
            self._gpu = gpu_paths.path_for("awq_int4" if self.method == "awq" else "gptq_int4",
                                           gpu_paths.device_capability(device))
        if self.method != "rtn" and (spec := self._calibration_spec()) != CALIBRATION:
            corpus.check(spec, "quantizer.calibration_corpus")  # an HF datasets id: cached, or the hub answers
        os.environ["GPTQMODEL_CPU_WORKERS"] = str(self.workers)

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        if self.method == "rtn":
            return
        spec = self.calibration_corpus or (accuracy.corpus if accuracy is not None else "")
        if not spec:
            raise QuantbenchError(f"quantizer {self.name} needs calibration text: set quantizer.calibration_corpus="
                                  "<text file> or accuracy.corpus")
        if spec != CALIBRATION and (err := corpus.file_problem("quantizer.calibration_corpus", spec)):
            raise QuantbenchError(err)  # a local file: checked now, not after the model loads
        self._accuracy = accuracy

    def _calibration_spec(self) -> str:
        acc = self._accuracy
        return self.calibration_corpus or (acc.corpus if acc is not None else "builtin")

    # --- calibration and cache -------------------------------------------------------------------
    def calibration(self, tokenizer: Any) -> tuple[list[dict], str, bool]:
        """(samples, corpus hash, overlaps-scored-text) from the accuracy corpus loader; seeded synthetic ids where
        the tokenizer is a random model's IdTokenizer (the hash then names the seed: it is in the cache key)."""
        if isinstance(tokenizer, IdTokenizer):
            samples = synthetic_calibration(tokenizer.vocab_size, self.calibration_samples, self.calibration_length,
                                            self.calibration_seed)
            digest = hashlib.sha256(json.dumps([s["input_ids"] for s in samples]).encode()).hexdigest()[:16]
            return samples, f"synthetic-seed{self.calibration_seed}-{digest}", False
        acc = self._accuracy
        spec = self._calibration_spec()
        text = calibration_text(spec)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        need = self.calibration_samples * self.calibration_length
        skip = 0
        if not self.calibration_corpus and acc is not None:  # same text as perplexity: skip what it scores
            scored = acc.max_tokens or len(ids)
            skip = scored if len(ids) - scored >= need else 0
        overlap = not self.calibration_corpus and acc is not None and skip == 0
        pool = ids[skip:]
        if len(pool) < need:
            raise QuantbenchError(f"quantizer {self.name}: calibration needs {self.calibration_samples} x "
                                  f"{self.calibration_length} = {need} tokens but {spec!r} has {len(pool)}; lower "
                                  "quantizer.calibration_samples/calibration_length or set "
                                  "quantizer.calibration_corpus=<longer text file>")
        L = self.calibration_length
        samples = [{"input_ids": pool[i * L:(i + 1) * L], "attention_mask": [1] * L}
                   for i in range(self.calibration_samples)]
        digest = hashlib.sha256(json.dumps([s["input_ids"] for s in samples]).encode()).hexdigest()[:16]
        return samples, digest, overlap

    def cache_dir(self, source: Any, calib_digest: str) -> Path:
        ignored = ("kernel", "workers", "calibration_corpus", "calibration_seed")  # the seed: in calib_digest
        if self.method == "rtn":  # no calibration: its settings must not split the cache
            ignored += ("calibration_samples", "calibration_length", "damp_percent")
        settings = {k: v for k, v in asdict(self).items() if k not in ignored}
        key = short_hash(source.identity(), settings, calib_digest, self.versions(), self.load_dtype(source.dtype))
        return cache_root() / "quantized" / f"{source.name}-{self.name}-g{self.group_size}-{key}"

    def _quantize_config(self, offload: Path):
        from gptqmodel import QuantizeConfig

        # gptqmodel offloads each finished module to disk while it quantizes (offload_to_disk, on by default) into a
        # TemporaryDirectory of its own in /tmp, removed only by a finalizer at interpreter exit: a sweep cell (a
        # multiprocessing child, which leaves through os._exit) or a killed run left every quantized module there
        # (a whole 8B model's worth), and /tmp may be RAM. The offload goes beside the cache build, removed after.
        kw: dict[str, Any] = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                              "desc_act": self.desc_act, "offload_to_disk_path": str(offload)}
        if self.method == "rtn":
            kw["weight_only"] = {"method": "rtn"}
        elif self.method == "awq":
            kw["method"] = "awq"
        else:
            kw["damp_percent"] = self.damp_percent
        return QuantizeConfig(**kw)

    def load(self, source: Any, *, tokenizer: Any, device: str, experiment: Any) -> Any:
        from gptqmodel import GPTQModel

        self._device = device
        os.environ["GPTQMODEL_CPU_WORKERS"] = str(self.workers)
        if experiment is not None and self._accuracy is None:
            self._accuracy = getattr(experiment, "accuracy", None)
        # rtn is weight-only: gptqmodel ignores calibration text, so none is read (nor can be too short)
        samples, digest, overlap = self.calibration(tokenizer) if self.method != "rtn" else (None, "rtn", False)
        dtype = torch_dtype(self.load_dtype(source.dtype))
        final = self.cache_dir(source, digest)
        hit = final.exists()
        spent = 0.0

        def build(tmp: Path) -> None:
            nonlocal spent
            t0 = now()
            where = id_model_dir(source, tokenizer) if isinstance(tokenizer, IdTokenizer) else source.local_dir()
            offload = Path(tempfile.mkdtemp(prefix=tmp.name + ".offload", dir=tmp.parent))
            try:
                model = GPTQModel.load(str(where), self._quantize_config(offload), device="cpu"
                                       if not device.startswith("cuda") else device, dtype=dtype)
                model.quantize(samples, batch_size=1)  # rtn: samples is None (weight-only lifecycle)
                model.save(str(tmp))
            finally:
                shutil.rmtree(offload, ignore_errors=True)
            spent = now() - t0
            (tmp / "quantbench.json").write_text(json.dumps({"quantize_s": spent}))
            del model

        atomic_dir(final, build)
        meta = json.loads((final / "quantbench.json").read_text())
        wrapped = GPTQModel.load(str(final), device=device, backend=self._kernel(device), dtype=dtype)
        model = wrapped.model.eval()
        self.last_metrics = {"quantize_s": float(meta["quantize_s"]), "quantize_run_s": spent,
                             "calibration_tokens": float(len(samples or []) * self.calibration_length)}
        self.last_tags = {**self.base_tags(), "quantizer.cache": "hit" if hit else "miss",
                          "quantizer.kernel": self._kernel(device)}
        if self._gpu is not None:
            self.last_tags.update(self._gpu.tags())
        if isinstance(tokenizer, IdTokenizer) and self.method != "rtn":
            self.last_tags["quantizer.calibration"] = (f"synthetic token ids (seed {self.calibration_seed}, "
                                                       f"{self.calibration_samples} x {self.calibration_length}; "
                                                       "random-weight shape: speed only)")
        if overlap and self.method != "rtn":
            self.last_tags["warning.calibration_overlap"] = ("calibration text overlaps the scored text; set "
                                                             "quantizer.calibration_corpus to a separate file")
        return model
