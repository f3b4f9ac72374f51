"""Memory that fits: the peak a run will need, estimated before anything loads, against what is available.

`check(exp, device)` runs after the engine's preflight and before any weight is allocated (harness/run/runner.py;
run.py does it before the run starts, so a run that cannot fit is refused in one line, exit 2). The estimate adds up:

- runtime: the process as it stands (Python, torch, transformers imported; its RSS now);
- weights: the decoder layers' matrices at the quantizer's stored bits per weight (its audit bound
  `max_bits_per_weight`: int8 9, int4 packed 5.5) and everything else in the load dtype
  (`quantizer.load_dtype`); llama.cpp: the GGUF file of the format (mmapped and read whole every step);
- transient: what building or quantizing holds beside the result: one decoder layer in the load dtype (the
  random model is built and quantized layer by layer: harness/models/random_model.py) or a float32 copy of the
  largest tensor (per-tensor conversion in `from_pretrained`, llama.cpp's quantizer);
- KV cache: what the strategy's cache allocates (`Strategy.kv_positions`: batch x context, i.e. depth + prompt
  + new tokens; continuous batching: the pages of every request, allocated at once; llama.cpp: its n_ctx in f16);
- a model the strategy loads beside the target (`Strategy.side_model()`: speculative decoding's draft): its
  weights, counted as the target's are (its source, its quantizer's bits), and its KV cache at batch 1; its
  quantizing transient when larger than the target's (the two loads follow each other);
- activations and logits (batch x prompt x widths, batch x vocabulary);
- a tied output head's own copy where one is made (rows8 tiles; quantizer.head=int8: int8 rows + bf16 scales);
- the accuracy pass: its logits, the float64 temporaries of a KL chunk and the exact reference's output layer,
  and the float32 reference model, loaded and freed *before* the run's model (the peak: the larger phase, not a sum);
- a GGUF's first conversion to the float32 cache (harness/models/gguf_convert.py), another phase before the
  run's model: one tensor at a time, or the whole model where transformers' newer GGUF path loads it.

Available: `psutil.virtual_memory().available`, lowered to what the tightest cgroup limit still allows where one is
set (containers, Slurm jobs, systemd units: this process's own cgroup and each one above it, harness/cgroup.py); on
CUDA the device's free memory. Each excludes the process itself, so the estimate less its runtime is what must fit:
a run over it raises `DoesNotFit` (an `Unsupported`: a sweep records the cell SKIPPED) with both numbers and a way
out. The estimate (runtime included) is metric `mem_estimate_mb`, beside the measured `peak_mem_mb`
(docs/scaling_models.md compares them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from harness import cgroup, gguf_meta
from harness.analysis.roofline import shape_from_gguf
from harness.cache import short_hash
from harness.config import KL_CHUNK_ROWS
from harness.errors import QuantbenchError, Unsupported
from harness.measure import resolve_device
from harness.measure.workloads import TEMPLATE_SLACK, context_length, parse
from harness.models import hub

# torch, transformers, gguf: imported where used; run.py's memory check runs before any loads (tests/test_layout.py)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GGUF_BITS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0}
GB = 1e9
Q6_K_BITS = 6.5625  # 210 bytes per 256 weights
TEXT_PROMPT_BOUND = 512  # tokens: a bound for the named prompt sets and files (synthetic ones have exact lengths)


class DoesNotFit(Unsupported):
    """The run needs more memory than this machine has available: refused before anything loads."""


@dataclass
class Counts:
    """What sizes a model's memory, read from its config or GGUF header (never from its weights)."""

    params: float  # logical parameters, a tied output head once
    layer_params: float  # in the decoder layers: what weight quantizers store in fewer bits
    largest_layer: float  # parameters of one decoder layer (the layer-by-layer build holds one)
    largest_tensor: float  # elements of the largest tensor (per-tensor conversions hold one in fp32)
    largest_layer_tensor: float  # elements of the largest matrix in a decoder layer (a quantizer's fp32 copy)
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    hidden: int
    intermediate: int
    tied: bool = False  # the output head is the input embedding's table


@dataclass
class Estimate:
    """Peak bytes by part; `phases` holds parts that are never resident together with the run's model."""

    parts: dict[str, float]
    where: str = "RAM"
    phases: dict[str, float] = field(default_factory=dict)
    alternatives: list[tuple[str, float]] = field(default_factory=list)  # (way out, its peak bytes)
    available: float = 0.0  # bytes available when checked (metric mem_available_mb)

    @property
    def total(self) -> float:
        runtime = self.parts.get("runtime", 0.0)
        run = sum(v for k, v in self.parts.items() if k != "runtime")
        return runtime + max([run, *self.phases.values()])

    def describe(self) -> str:
        shown = [f"{k} {v / GB:.1f}" for k, v in self.parts.items() if v >= 0.05 * GB]
        shown += [f"{k} {v / GB:.1f} (before the run)" for k, v in self.phases.items() if v >= 0.05 * GB]
        return " + ".join(shown) + " GB"


# ---------------------------------------------------------------------------------------------- counting
def _counts_from_hf(cfg: Any) -> Counts:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = {id(p): p for p in model.parameters()}
    layers = model.get_decoder().layers
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return Counts(params=float(sum(p.numel() for p in params.values())), layer_params=float(sum(per_layer)),
                  largest_layer=float(max(per_layer, default=0)),
                  largest_tensor=float(max(p.numel() for p in params.values())),
                  largest_layer_tensor=float(max((p.numel() for p in layers.parameters()), default=0)),
                  layers=len(layers),
                  kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
                  vocab=int(text.vocab_size), hidden=int(text.hidden_size),
                  intermediate=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
                  tied=bool(getattr(text, "tie_word_embeddings", False)))


def _counts_from_gguf(path: Path) -> Counts:
    tensors = gguf_meta.read(path).tensors
    shape = shape_from_gguf(path)
    layer: dict[str, float] = {}
    for t in tensors:
        if t.name.startswith("blk."):
            key = t.name.split(".")[1]
            layer[key] = layer.get(key, 0.0) + int(t.n_elements)
    emb = next(t for t in tensors if t.name == "token_embd.weight")
    hidden = int(min(int(d) for d in emb.shape))
    ffn = [int(max(int(d) for d in t.shape)) for t in tensors if t.name.endswith("ffn_up.weight")]
    return Counts(params=float(sum(int(t.n_elements) for t in tensors)), layer_params=sum(layer.values()),
                  largest_layer=max(layer.values(), default=0.0),
                  largest_tensor=float(max(int(t.n_elements) for t in tensors)),
                  largest_layer_tensor=float(max((int(t.n_elements) for t in tensors if t.name.startswith("blk.")),
                                                 default=0)), layers=shape.layers,
                  kv_heads=shape.kv_heads, head_dim=shape.head_dim, vocab=shape.embed_rows, hidden=hidden,
                  intermediate=ffn[0] if ffn else 4 * hidden, tied=shape.tied)


def _config_dir(source: Any) -> Path | None:
    """A local checkpoint or a hub id's snapshot in the local HF cache (as quantizers/base.py's) with a config.json."""
    if not (spec := str(getattr(source, "name_or_path", "") or "")):  # (Path("") is the working directory)
        return None
    local = Path(spec) if Path(spec).is_dir() else hub.cached_snapshot(spec, "model", source.revision)  # HFModel
    return local if local is not None and (local / "config.json").is_file() else None


_COUNTS: dict[tuple[str, str], Counts] = {}  # per process: a sweep's cells and run.py's precheck count once


def model_counts(source: Any) -> Counts | None:
    """The source's counts from what describes it without weights; None when nothing does (an uncached hub id)."""
    try:
        if hasattr(source, "hf_config"):
            key = ("config", short_hash(source.identity()))
            make = lambda: _counts_from_hf(source.hf_config())  # noqa: E731
        elif source.gguf_path is not None and Path(source.gguf_path).is_file():
            key = ("gguf", str(source.gguf_path))
            make = lambda: _counts_from_gguf(Path(key[1]))  # noqa: E731
        elif (local := _config_dir(source)) is not None:
            from transformers import AutoConfig

            key = ("dir", str(local.resolve()))
            make = lambda: _counts_from_hf(AutoConfig.from_pretrained(key[1], trust_remote_code=False))  # noqa: E731
        else:
            return None
        return _COUNTS[key] if key in _COUNTS else _COUNTS.setdefault(key, make())
    except (QuantbenchError, OSError, ValueError, KeyError, AttributeError, StopIteration):
        return None


# ---------------------------------------------------------------------------------------------- estimates
def runtime_bytes(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.memory_allocated())
    return float(psutil.Process().memory_info().rss)


def context_lengths(measure: Any, model: Any = None) -> tuple[int, int]:
    """(prompt positions, all positions) one request holds, context depth included, before any tokenizer runs.

    Synthetic lengths are exact; a text prompt is at most its UTF-8 bytes + BOS + the template's slack in tokens
    (as workloads.check bounds it), never under TEXT_PROMPT_BOUND; a JSONL row's max_new_tokens counts. The
    model's context caps both (workloads.check refuses more)."""
    src = parse(str(measure.prompts))
    depth = int(measure.context_depth)
    limits = [lim or measure.max_new_tokens for lim in src.limits] or [measure.max_new_tokens]
    if src.kind == "synthetic":
        prompts = [int(measure.prompt_tokens)] * len(limits)
    else:
        slack = TEMPLATE_SLACK if measure.chat_template else 2
        prompts = [max(TEXT_PROMPT_BOUND, len(t.encode("utf-8")) + 1 + slack) for t in src.texts]
    prompt, total = depth + max(prompts), depth + max(p + lim for p, lim in zip(prompts, limits, strict=True))
    ctx = context_length(model) if model is not None else None
    return (min(prompt, ctx), min(total, ctx)) if ctx else (prompt, total)


def context_positions(measure: Any, model: Any = None) -> int:
    return context_lengths(measure, model)[1]


def backend_of(quantizer: Any) -> Any:
    """The quantizer that really runs (the device table's choice for int8/int4, once preflight resolved it)."""
    try:
        return getattr(quantizer, "resolved", quantizer)
    except Exception:  # noqa: BLE001 - not resolved yet: judge by the alias itself
        return quantizer


def weight_bytes(counts: Counts, load_bytes: int, bits: float) -> float:
    return counts.layer_params * bits / 8 + (counts.params - counts.layer_params) * load_bytes


def stored(quantizer: Any, model_dtype: str) -> tuple[Any, str, int, float]:
    """(the quantizer that runs, load dtype, its bytes per value, stored bits per decoder-layer weight)."""
    q = backend_of(quantizer)
    load = q.load_dtype(model_dtype)
    fb = DTYPE_BYTES.get(load, 4)
    return q, load, fb, min(float(q.max_bits_per_weight), 8.0 * fb) if q.quantizes else 8.0 * fb


def model_parts(counts: Counts, q: Any, fb: int, bits: float, cached: int) -> dict[str, float]:
    """A loaded model's weights, its load transient and its KV cache (`cached`: the token positions it allocates)."""
    return {
        "weights": weight_bytes(counts, fb, bits),
        # quantizing: one float layer + the quantizer's fp32 work copy of its largest matrix; else one tensor
        # converted on its way in (from_pretrained) -- the random model's in-memory build needs not even that
        "transient": (counts.largest_layer * fb + counts.largest_layer_tensor * 8.0 if q.quantizes
                      else counts.largest_tensor * fb),
        "KV cache": counts.layers * 2 * counts.kv_heads * counts.head_dim * fb * cached,
    }


def side_parts(exp: Any, positions: int) -> dict[str, float]:
    """The model the strategy loads beside the target (speculative's draft), at batch 1; {} when none."""
    side = getattr(exp.strategy, "side_model", lambda: None)()
    if side is None:
        return {}
    source = side[0] if side[0] is not None else exp.model
    if (counts := model_counts(source)) is None:
        return {}
    q, _, fb, bits = stored(side[1], source.dtype)
    return {f"draft {k}": v for k, v in model_parts(counts, q, fb, bits, positions).items()}


def accuracy_parts(acc: Any, vocab: int, hidden: int) -> dict[str, float]:
    """What the accuracy pass holds beside the run's model: one window's logits, their float32 copy and log-probs;
    with the KL, the float64 temporaries of one chunk of KL_CHUNK_ROWS tokens, five at once (the reference's and
    the run's log-probs, exp, difference, product: accuracy._kl_full), and for the exact reference its output
    layer in the reference dtype. SmolLM2's default run: the pass lifted RSS by 626 MB, the logits alone count 302."""
    parts = {"accuracy logits": acc.context_length * vocab * 4.0 * 3}
    if acc.kl:
        parts["accuracy KL"] = 5.0 * min(KL_CHUNK_ROWS, acc.context_length) * vocab * 8 + (
            vocab * hidden * DTYPE_BYTES.get(acc.reference_dtype, 4) if acc.kl_reference == "exact" else 0.0)
    return parts


def transformers_estimate(exp: Any, device: str) -> Estimate | None:
    if (counts := model_counts(exp.model)) is None:
        return None
    q, load, fb, bits = stored(exp.quantizer, exp.model.dtype)
    batch = int(getattr(exp.strategy, "batch_size", 1) or 1)
    prompt, positions = context_lengths(exp.measure, exp.model)
    # the positions the strategy's cache allocates: batch x context, or a paged cache's pages for every request
    kv_positions = getattr(exp.strategy, "kv_positions", None)
    cached = kv_positions(positions) if kv_positions is not None else batch * positions
    parts = {
        "runtime": runtime_bytes(device),
        **model_parts(counts, q, fb, bits, cached),
        "activations": batch * (prompt * (8 * counts.hidden + 3 * counts.intermediate) * 4 + counts.vocab * 8),
    }
    draft = side_parts(exp, positions)
    if draft:  # loaded after the target: the larger of the two load transients, never both at once
        parts["transient"] = max(parts["transient"], draft.pop("draft transient"))
        parts.update(draft)
    phases = {}
    acc = exp.accuracy
    if acc.enabled:
        parts.update(accuracy_parts(acc, counts.vocab, counts.hidden))
        if acc.kl:
            phases["reference"] = counts.params * DTYPE_BYTES.get(acc.reference_dtype, 4) + parts["accuracy logits"]
    if exp.measure.compile is True and exp.measure.compile_freezing and not device.startswith("cuda"):
        # inductor freezing folds the weights into new constant tensors (prepacked where oneDNN takes them)
        # beside the module's own parameters: a second copy (harness/measure/paths.py)
        parts["freezing copy"] = parts["weights"]
    if counts.tied and load == "bfloat16" and getattr(getattr(exp, "decode_choice", None), "gemv", "") == "rows8" \
            and getattr(exp.quantizer, "head", "") != "int8":
        # quantizers/rows8.py re-lays bf16 linears in gemv16t's tiles; a tied head gets its own copy
        parts["tied head copy (rows8 tiles)"] = counts.vocab * counts.hidden * 2.0
    if counts.tied and getattr(exp.quantizer, "head", "") == "int8":
        # quantizers/int8pack.py int8_head: the tied table stays for the lookup, the head gets int8 rows + bf16 scales
        parts["tied head copy (int8)"] = counts.vocab * (counts.hidden + 2.0)
    if (conversion := getattr(exp.model, "conversion_bytes", None)) is not None:
        # a GGUF's first load converts it to the float32 cache, before the run's model loads (models/gguf_convert.py)
        phases["GGUF conversion"] = conversion(counts.params, counts.largest_tensor)
    est = Estimate(parts=parts, where="GPU memory" if device.startswith("cuda") else "RAM", phases=phases)
    fixed = parts["runtime"] + parts["KV cache"] + parts["activations"] + sum(draft.values())
    int_peak = counts.largest_layer * 2 + counts.largest_layer_tensor * 8.0  # one bf16 layer + a fp32 work copy
    est.alternatives = [
        ("quantizer=int4 (quantized layer by layer)", fixed + weight_bytes(counts, 2, 5.5) + int_peak),
        ("quantizer=int8 (quantized layer by layer)", fixed + weight_bytes(counts, 2, 9.0) + int_peak),
        ("model.dtype=bfloat16 quantizer=none", fixed + counts.params * 2 + counts.largest_tensor * 2.0),
    ]
    return est


def gguf_bytes(counts: Counts, fmt: str) -> float:
    """Bytes of the weights llama.cpp's quantizer writes for `fmt`. Its llama_tensor_get_type keeps the output
    matrix (token_embd when the head is tied) out of Q4_0 / Q4_1: Q6_K, or Q8_0 where a row is not a multiple of
    256 (a 512-wide 32k-vocab model: 25.3 MB counted this way, 26.1 MB on disk with the vocabulary, 21.1 MB at 4.5
    bits everywhere)."""
    bits = GGUF_BITS.get(fmt, 16.0)
    if fmt not in ("Q4_0", "Q4_1"):
        return counts.params * bits / 8
    head = float(counts.vocab * counts.hidden)
    return (counts.params - head) * bits / 8 + head * (Q6_K_BITS if counts.hidden % 256 == 0 else 8.5) / 8


def llama_cpp_estimate(exp: Any, fmt: str, converted: Path | None, n_ctx: int, n_batch: int) -> Estimate | None:
    """llama.cpp: the format's GGUF mmapped whole, its f16 KV cache of n_ctx, one batch's compute buffers."""
    if (counts := model_counts(exp.model)) is None:
        return None
    if converted is not None and converted.is_file():
        weights, transient = float(converted.stat().st_size), 0.0
    else:
        src = exp.model.gguf_path
        weights = (float(Path(src).stat().st_size) if fmt == "gguf" and src and Path(src).is_file()
                   else gguf_bytes(counts, fmt))
        # llama_model_quantize: an fp32 copy of a tensor, its output and work buffers (the 8B Q4_0 conversion
        # peaked 0.9 GB above fp32 + output: 8 bytes per element covers it)
        transient = counts.largest_tensor * 8.0
    parts = {"runtime": runtime_bytes("cpu"), "weights": weights, "transient": transient,
             "KV cache": counts.layers * 2 * counts.kv_heads * counts.head_dim * 2.0 * n_ctx,
             "activations": n_batch * (counts.vocab + 4 * counts.intermediate) * 4.0}
    est = Estimate(parts=parts)
    fixed = parts["runtime"] + parts["KV cache"] + parts["activations"] + counts.largest_tensor * 8.0
    est.alternatives = [(f"engine.format={f}", fixed + gguf_bytes(counts, f)) for f in ("Q4_0", "Q8_0")]
    return est


# ---------------------------------------------------------------------------------------------- available
def available_bytes(device: str) -> tuple[float, str]:
    """(bytes available now, where the number comes from)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return float(free), "free GPU memory"
    avail, how = float(psutil.virtual_memory().available), "MemAvailable"
    if (left := cgroup.memory_left()) is not None and left < avail:
        avail, how = left, "cgroup limit minus usage"
    return avail, how


def check(exp: Any, device: str) -> Estimate | None:
    """Estimate the run's peak and raise DoesNotFit when it exceeds what is available (module docstring)."""
    if (est := getattr(exp.engine, "memory_estimate", lambda *_: None)(exp, device)) is None:
        return None
    avail, how = available_bytes(device)
    est.available = avail
    # what is available excludes this process already (MemAvailable, a cgroup's usage, free GPU memory): compared
    # with the runtime too, the process counted twice and runs that fit were refused (`total` stays the reported peak)
    own = est.parts.get("runtime", 0.0)
    if est.total - own > avail:
        fits = [f"{what} (~{peak / GB:.1f} GB)" for what, peak in est.alternatives if peak - own < avail]
        smaller = "a smaller model" + (" (model.arch=llama-3.2-3b or llama-3.2-1b)" if getattr(exp.model, "arch", "")
                                       else "")
        way = f"fits: {', or '.join(fits)}; or {smaller}" if fits else f"use {smaller}"
        raise DoesNotFit(f"{exp.model.name} with quantizer {getattr(exp.quantizer, 'name', '?')} on {exp.engine.name} "
                         f"needs ~{est.total / GB:.1f} GB of {est.where} at peak ({est.describe()}) but "
                         f"{avail / GB:.1f} GB is available ({how}); {way}")
    return est


def metrics(est: Estimate | None) -> dict[str, float]:
    """The estimate beside the measured peak_mem_mb (MiB, like it)."""
    return {} if est is None else {"mem_estimate_mb": est.total / 2**20, "mem_available_mb": est.available / 2**20}


def refusal(exp: Any) -> str | None:
    """run.py, before the run starts: the one-line DoesNotFit message, or None (other problems: the run records
    them as before, e.g. SKIPPED for a missing GPU)."""
    try:
        device = resolve_device(exp.measure.device)
        exp.engine.preflight(exp, device)  # resolves the quantizer (int8/int4: the device table's backend)
        check(exp, device)
    except DoesNotFit as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - anything else (a bug included): the run meets it again, fails and is recorded
        return None
    return None
