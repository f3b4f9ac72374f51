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
through the accuracy code's corpus loader (a text file, `builtin`, an HF datasets id); empty means `accuracy.corpus`.
Whenever it is the accuracy corpus (empty, the same name, or the same file by real path: `text_key`), its first
`accuracy.max_tokens` tokens (what perplexity and KL score) are skipped if the corpus has enough tokens after them;
otherwise the run is tagged `warning.calibration_overlap`.

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
`gptq_torch` keeps the packed 4-bit weights (~4.x bits, bound `bits + 1`) but is slow on CPU. Settings the kernel
cannot take (KERNELS) are refused at config time (`check_with`); those the GPU path table's kernel cannot, in preflight.

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
from collections import namedtuple
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from harness.analysis import corpus
from harness.cache import atomic_dir, cache_root, short_hash
from harness.errors import ConfigError, QuantbenchError, Unsupported, one_of
from harness.measure import now, resolve_device
from harness.models import torch_dtype
from harness.models.random_model import IdTokenizer
from quantizers import gpu_paths  # gpu_paths.device_capability looked up per call: tests patch it
from quantizers.base import Quantizer
from quantizers.common import TimedLoad

# gptqmodel (the optional `quant` extra) is imported where used: config validation instantiates this class on machines
# without it (tests/test_layout.py, LAZY_OK).

METHODS = ("gptq", "rtn", "awq")
# what one gptqmodel kernel class takes: its SUPPORTS_* (devices: cpu/cuda, ALL is both; XPU, ROCm do not run here)
KernelSpec = namedtuple("KernelSpec", "bits group_size devices sym desc_act dtypes")
# The kernels gptqmodel 7.6 loads this quantizer's checkpoints with (gptq and rtn save FORMAT.GPTQ, awq FORMAT.GEMM:
# gptqmodel.utils.importer.BACKEND_TO_METHOD_FORMAT_MAPPING), each with what its class takes. Hard-coded because
# importing gptqmodel takes ~6 s (torch and every kernel), too slow for config time; tests/test_gptq_validation.py
# compares the table with the installed gptqmodel. Left out: mlx (Apple MPS) and gptq_w4afp8/gptq_w4a_nvfp4, which
# quantize activations too (a QuantizeConfig activation policy this quantizer never sets).
_G = (-1, 16, 32, 64, 128)
_G32, _G_ALL, _B_ALL, _CPU, _CUDA = (-1, 32, 64, 128), (*_G, 256, 512, 1024), (2, 3, 4, 5, 6, 7, 8), ("cpu",), ("cuda",)
_TF, _HALF, _ANY = (True, False), ("float16", "bfloat16"), ("float32", "float16", "bfloat16")
GPTQ_KERNELS = {
    "gptq_torch_int8": KernelSpec((2, 4, 8), _G, _CPU, _TF, _TF, _ANY),
    "gptq_torch": KernelSpec(_B_ALL, _G_ALL, ("cpu", "cuda"), _TF, _TF, _HALF),
    "gptq_torch_fused": KernelSpec((4,), _G, _CPU, _TF, _TF, _ANY),
    "gptq_torch_aten": KernelSpec((4,), _G[1:], _CPU, _TF, _TF, _HALF),
    "gptq_marlin": KernelSpec((4, 8), _G32, _CUDA, (True,), _TF, _HALF),
    "gptq_machete": KernelSpec((4, 8), (-1, 64, 128), _CUDA, _TF, _TF, _HALF),
    "gptq_swordfish": KernelSpec((4, 8), _G32, _CUDA, _TF, _TF, _HALF),
    "gptq_exllama_v2": KernelSpec((4,), _G32, _CUDA, _TF, _TF, _HALF),
    "gptq_triton": KernelSpec((2, 4, 8), _G_ALL, _CUDA, _TF, _TF, _HALF),
    "gptq_bitblas": KernelSpec((2, 4, 8), _G32, _CUDA, _TF, (False,), _HALF),
}
AWQ_KERNELS = {
    "awq_torch_int8": KernelSpec((4,), _G, _CPU, _TF, _TF, _ANY),
    "awq_torch": KernelSpec(_B_ALL, _G, ("cpu", "cuda"), _TF, _TF, _HALF),
    "awq_torch_fused": KernelSpec((4,), _G, _CPU, _TF, _TF, _ANY),
    "awq_torch_aten": KernelSpec((4,), _G[1:], _CPU, _TF, _TF, _HALF),
    "awq_marlin": KernelSpec((4, 8), _G32, _CUDA, _TF, _TF, _HALF),
    "awq_machete": KernelSpec((4, 8), _G32, _CUDA, _TF, (False,), _HALF),
    "awq_swordfish": KernelSpec((4,), _G32, _CUDA, _TF, (False,), _HALF),
    "awq_exllama_v2": KernelSpec((4,), _G32, _CUDA, _TF, _TF, _HALF),
    "awq_gemm": KernelSpec((4,), _G, _CUDA, _TF, _TF, _HALF),
    "awq_gemm_triton": KernelSpec((4,), _G32, _CUDA, _TF, _TF, ("float16",)),
    "awq_bitblas": KernelSpec((4,), _G32, _CUDA, _TF, _TF, _HALF),
}
KERNELS = {"gptq": GPTQ_KERNELS, "rtn": GPTQ_KERNELS, "awq": AWQ_KERNELS}
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


def text_key(spec: str) -> str:
    """What a corpus spec reads: a file (the shipped `builtin`, `calibration` too) by real path, a dataset id as is."""
    path = {"builtin": corpus.BUILTIN_CORPUS, CALIBRATION: CALIBRATION_TEXT}.get(spec, os.path.expanduser(spec))
    return os.path.realpath(path) if spec == CALIBRATION or corpus.kind(spec) != "dataset" else spec


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
        kernels = KERNELS.get(self.method, GPTQ_KERNELS)  # a group size none takes fails inside model.quantize
        groups = sorted({g for k in kernels.values() for g in k.group_size})
        errs = [one_of("quantizer.method", self.method, METHODS), one_of("quantizer.bits", self.bits, (2, 3, 4, 8)),
                one_of("quantizer.group_size", self.group_size, groups),
                one_of("quantizer.kernel", self.kernel, ("auto", *kernels))]
        for f in ("calibration_samples", "calibration_length", "workers"):
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
        self._device, self._dtype = "cpu", None  # _dtype: the model's, which the kernel gets (check_with)
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

    def kernel_problems(self, device: str, dtype: str | None) -> list[str]:
        """What the kernel that will run on `device` cannot take of these settings, one line each naming it and what to
        set instead; none where gptqmodel picks the kernel (it picks one that takes them). Where it runs: preflight."""
        dev, kernels, kernel = device.split(":")[0], KERNELS[self.method], self._kernel(device)
        if kernel not in kernels or dev not in self.devices:  # AWQ on CPU: preflight's Unsupported (SKIPPED)
            return []
        dev = dev if dev in kernels[kernel].devices else kernels[kernel].devices[-1]  # alternatives: where it runs
        spec, on_dev = kernels[kernel], [k for k, s in kernels.items() if dev in s.devices]
        settings = [("quantizer.bits", self.bits, "bits"), ("quantizer.group_size", self.group_size, "group_size"),
                    ("quantizer.sym", self.sym, "sym"), ("quantizer.desc_act", self.desc_act, "desc_act"),
                    # AWQ: gptqmodel loads it in float16 where the kernel lacks the dtype (_coerce_quantized_awq_dtype)
                    *([("model.dtype", dtype, "dtypes")] if dtype and self.method != "awq" else [])]
        which = f"quantizer.kernel={kernel}" if self.kernel != "auto" else \
            f"{kernel}, the kernel quantizer.kernel=auto picks on " + (self._gpu.arch if self._gpu else dev)
        out = []
        for key, value, field in settings:
            if value in getattr(spec, field):
                continue
            # another kernel on this device that takes every setting (a dtype it lacks: said, unless that is the key)
            ways = [k + ("" if not dtype or dtype in s.dtypes else f" (with model.dtype={' or '.join(s.dtypes)})")
                    for k, s in kernels.items() if k != kernel and k in on_dev
                    and all(v in getattr(s, f) for _, v, f in settings if f != "dtypes" or field == "dtypes")]
            instead = (f", or set quantizer.kernel to one of: {', '.join(ways)}" if len(ways) > 1 else
                       f", or set quantizer.kernel={ways[0]}" if ways else f"; no other kernel on {dev} takes it")
            out.append(f"{key}={value!r} is not supported by {which} (it takes {field}: "
                       f"{', '.join(map(str, getattr(spec, field)))}); choose one of those{instead}")
        return out

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
        if (errs := self.kernel_problems(device, self._dtype)):  # on CUDA: the GPU path table's kernel, now known
            raise ConfigError(errs)
        kernel, dev, kernels = self._kernel(device), device.split(":")[0], KERNELS[self.method]
        if kernel in kernels and dev not in kernels[kernel].devices:  # as torchao's: CUDA-only on CPU is SKIPPED
            others = ", ".join(k for k, s in kernels.items() if dev in s.devices)
            why = (f"quantizer {self.name} kernel={kernel} runs on {', '.join(kernels[kernel].devices)} only; on {dev} "
                   f"use quantizer.kernel=auto or one of: {others}")
            raise Unsupported(f"needs CUDA: {why}") if dev == "cpu" else QuantbenchError(why)
        if self.method != "rtn" and (spec := self._calibration_spec()) != CALIBRATION:
            corpus.check(spec, "quantizer.calibration_corpus")  # an HF datasets id: cached, or the hub answers
        os.environ["GPTQMODEL_CPU_WORKERS"] = str(self.workers)

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        self._dtype, want = getattr(parts.get("model"), "dtype", None), getattr(measure, "device", "auto")
        errs = self.kernel_problems(want, self._dtype) if want in ("cpu", "cuda") else []
        if want == "auto" and (errs := self.kernel_problems("cpu", self._dtype)):  # torch (~2 s) only then
            errs = self.kernel_problems(resolve_device(want), self._dtype)
        if errs:
            raise ConfigError(errs)
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
        return self.calibration_corpus or (self._accuracy.corpus if self._accuracy is not None else "builtin")

    # --- calibration and cache -------------------------------------------------------------------
    def calibration(self, tokenizer: Any) -> tuple[list[dict], str, bool]:
        """(samples, corpus hash, overlaps-scored-text) from the accuracy corpus loader; seeded synthetic ids where
        the tokenizer is a random model's IdTokenizer (the hash then names the seed: it is in the cache key)."""
        if isinstance(tokenizer, IdTokenizer):
            samples = synthetic_calibration(tokenizer.vocab_size, self.calibration_samples, self.calibration_length,
                                            self.calibration_seed)
            digest = hashlib.sha256(json.dumps([s["input_ids"] for s in samples]).encode()).hexdigest()[:16]
            return samples, f"synthetic-seed{self.calibration_seed}-{digest}", False
        acc, spec = self._accuracy, self._calibration_spec()
        ids = tokenizer(calibration_text(spec), add_special_tokens=False)["input_ids"]
        need = self.calibration_samples * self.calibration_length
        # the text perplexity/KL score, however named (empty, builtin twice, one file): skip what they score, or say so
        scored = (acc.max_tokens or len(ids)) if acc is not None and text_key(spec) == text_key(acc.corpus) else 0
        skip, overlap = (scored, False) if len(ids) - scored >= need else (0, scored > 0)
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
        self._accuracy = self._accuracy or getattr(experiment, "accuracy", None)
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
