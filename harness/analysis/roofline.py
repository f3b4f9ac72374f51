"""The decode roofline: a decode step cannot be faster than (bytes it must read) / (memory bandwidth).

Three pieces, all used on every run:

- `host_bandwidth(device, threads)` (harness/analysis/bandwidth.py): the device's memory bandwidth, measured once per
  host and cached (key: host name, CPU or GPU model, thread count). CPU: a read-only pass (`sum(b)`, N bytes), torch
  copy and triad (`a = b + s*c`) over fp32 arrays of max(256 MiB, 8 x last-level cache) each, best of 5, STREAM byte
  counting (copy moves 2N bytes, triad 3N; write-allocate traffic is not counted, as in STREAM). The bound uses the
  fastest of the three: what torch itself can stream. It is not the hardware's limit: llama.cpp's hand-written kernels
  read faster (on the Zen 5 host, 2026-12-04, its BF16 decode of an 8B shape read 15.0 GB per 348 ms step = 43 GB/s,
  against torch's read 32.6, copy 31.0, triad 34.2 GB/s), so a llama.cpp row can show a fraction above 1: read it as
  "faster than torch can stream", and compare engines by ms/token. CUDA: a device-to-device copy of 1 GiB timed with
  CUDA events, best of 10 (2N bytes). The method is recorded in tag `bandwidth_method`.
- `ModelShape` + `bytes_per_step`: bytes one decode step reads. Weights as really stored (after
  quantization, scales and zeros included; `quantizers.base.tensor_bytes`), except the input embedding,
  of which a step reads only `batch` rows; when the output projection is tied to the embedding it still
  reads the whole matrix once per step. Plus the KV cache read at the current context length:
  batch x layers x 2 (K and V) x kv_heads x head_dim x bytes per element x context, averaged over the
  decode steps actually run (left-padded batches read their padded width).
- `roofline_metrics`: `roofline_tokens_per_s` = batch x bandwidth / bytes_per_step, `roofline_fraction`
  = achieved / roofline, `achieved_gb_per_s` = bytes_per_step x steps per second. A strategy whose step is
  more than one target forward per batch row (speculative: draft forwards + a verify) gives a `StepWork`:
  its bytes per step and the tokens a step emits stand in for the batch (tag `roofline_accounting`).

"slow kernel path?": a run reaching less than `SLOW_FRACTION` of its bound while a lighter format
(fewer bytes per step) is not faster than a heavier one on the same model, engine, device, threads,
batch and decode length. Runs are compared with the others recorded on this host in a small JSON cache
(`speeds-<host>.json` under the cache root); `slow_kernel_flags(rows)` does the same over any list of
rows (a sweep report). See docs/roofline.md.

Calculator: `python -m harness.analysis.roofline --params 7e9 --bits 16 --bandwidth 3.35e12` (or `--device h100`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import cgroup, gguf_meta
from harness.analysis import figures
from harness.analysis.bandwidth import DEVICES, Bandwidth, host_bandwidth, host_key
from harness.cache import cache_root, short_hash
from quantizers.base import state_tensors, tensor_bytes

SLOW_FRACTION = 0.5  # below half the bound *and* a lighter format not faster: flag the kernel path
SLOW_TAG = "slow kernel path?"
# The speeds cache compares a run with the other formats' latest runs of the last hours (two run.py calls of one
# session); its group keys neither the code nor the libraries, so an older entry may be of other software
SPEEDS_MAX_AGE_S = 12 * 3600
log = logging.getLogger("quantbench")

# ----------------------------------------------------------------------------- bytes per step
@dataclass
class ModelShape:
    """What a decode step of one model reads, independent of batch and context."""

    weight_bytes: float  # every stored weight tensor once (tied embedding counted once)
    embed_bytes: float  # the input embedding table as stored
    embed_rows: int
    tied: bool  # output projection shares the embedding: it reads the whole table each step
    layers: int
    kv_heads: int
    head_dim: int
    kv_elem_bytes: float

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_elem_bytes

    def weights_read(self, batch: int) -> float:
        rows = batch * self.embed_bytes / self.embed_rows
        # tied: the table is already in weight_bytes once, read in full by the output projection
        return self.weight_bytes + rows if self.tied else self.weight_bytes - self.embed_bytes + rows


def _kv_dims(cfg: Any) -> tuple[int, int, int]:
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), kv_heads, head_dim


def shape_from_torch(model: Any) -> ModelShape:
    """Shape of a loaded transformers model, bytes as really stored (see quantizers.base)."""
    seen: set[int] = set()
    total = sum(tensor_bytes(t, seen) for t in list(model.parameters()) + list(model.buffers()))
    # what decoding moved out of them (bnb int8's row scales, after the first forward), as the audit counts it
    total += sum(tensor_bytes(t, seen) for m in model.modules() for t in state_tensors(m))
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    out_w = getattr(out, "weight", None) if out is not None else None
    # measure.gemv=rows8 gives a tied head its own tiled copy (quantizers/rows8.py, Bf16RowsLinear: no `weight`):
    # the model then holds both, untied, and a step reads the whole copy and one embedding row per batch row,
    # which is what the untied sum reads (weight_bytes, the run's metric after the swap, less the embedding)
    tied = out_w is not None and (out_w is emb or out_w.data_ptr() == emb.data_ptr())
    layers, kv_heads, head_dim = _kv_dims(model.config)
    # the KV cache holds activations, which take the embedding's dtype (embeddings are never quantized)
    return ModelShape(weight_bytes=float(total), embed_bytes=float(tensor_bytes(emb, set())),
                      embed_rows=int(emb.shape[0]), tied=bool(tied), layers=layers, kv_heads=kv_heads,
                      head_dim=head_dim, kv_elem_bytes=float(emb.element_size()))


def shape_from_gguf(path: str | Path, kv_elem_bytes: float = 2.0) -> ModelShape:
    """Shape of a GGUF file as llama.cpp reads it (its KV cache is f16 by default: 2 bytes)."""
    reader = gguf_meta.read(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(name: str) -> int:
        f = reader.fields[f"{arch}.{name}"]
        return int(f.parts[f.data[0]][0])

    tensors = {t.name: t for t in reader.tensors}
    emb = tensors["token_embd.weight"]
    heads = field("attention.head_count")
    kv_heads = field("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in reader.fields else heads
    key_length = f"{arch}.attention.key_length" in reader.fields
    head_dim = field("attention.key_length") if key_length else field("embedding_length") // heads
    rows = int(max(int(d) for d in emb.shape))  # GGUF lists dims innermost first: (hidden, vocab)
    return ModelShape(weight_bytes=float(sum(int(t.n_bytes) for t in reader.tensors)),
                      embed_bytes=float(emb.n_bytes), embed_rows=rows, tied="output.weight" not in tensors,
                      layers=field("block_count"), kv_heads=kv_heads, head_dim=head_dim, kv_elem_bytes=kv_elem_bytes)


def mean_context(batch_widths: list[tuple[int, int]]) -> float:
    """Mean KV length read per decode step: (prompt width, steps) per generation -> mean over steps.

    A decode step that produces the token at index `width + i` attends over `width + i + 1` positions
    (the new token's K/V is written, then read with the rest).
    """
    total, steps = 0.0, 0
    for width, n in batch_widths:
        total += n * width + n * (n + 1) / 2.0
        steps += n
    return total / steps if steps else 0.0


def fixed_context(lengths_steps: list[tuple[int, int]]) -> float:
    """Mean KV length read per decode step with a static cache: (cache length, steps) per generation.

    transformers' StaticLayer.update hands attention the whole `max_cache_len` buffer (unwritten positions
    masked), so every step reads the full length, not the `width + i + 1` positions of `mean_context`."""
    steps = sum(n for _, n in lengths_steps)
    return sum(length * n for length, n in lengths_steps) / steps if steps else 0.0


def bytes_per_step(shape: ModelShape, batch: float, context: float) -> float:
    return shape.weights_read(batch) + batch * shape.kv_bytes_per_token * context


STEP_ACCOUNTING = "decode_step"  # tag roofline_accounting of a step that is one target forward per batch row
STEP_ACCOUNTING_EOS, STEP_ACCOUNTING_CB = "decode_step, rows past EOS", "forward, rows per forward measured"


@dataclass
class StepWork:
    """A decode step that is more than one target forward per batch row (`Strategy.roofline_step`), measured.

    Speculative: k draft forwards + one verify forward per step (docs/roofline.md)."""

    context: float  # the target's mean KV length read per step
    extra_bytes: float  # read per step besides the target's weights and KV (a draft model's weights and KV)
    tokens_per_step: float  # tokens a step emits on average (stands in for the batch)
    accounting: str  # tag roofline_accounting


def tokens_per_step(gens: list) -> dict[str, float]:
    """`decode_tokens_per_step` of a step loop, measured: a row past its EOS is computed each step, not counted."""
    steps = sum(len(g.step_s) for g in gens)
    return {"decode_tokens_per_step": sum(g.decode_tokens for g in gens) / steps} if steps else {}


def measured_step(metrics: dict, context: float, accounting: str | None = None) -> StepWork | None:
    """The step of a run whose rows did not all emit a token every step (`tokens_per_step` below the batch): achieved
    GB/s stays bytes per step x measured steps per s. None: the roofline's own accounting (a step is the batch)."""
    per_step = metrics.get("decode_tokens_per_step")
    if per_step is None or not per_step < float(metrics.get("batch_size", 1) or 1) - 1e-9:
        return None
    return StepWork(context, extra_bytes=0.0, tokens_per_step=per_step, accounting=accounting or STEP_ACCOUNTING_EOS)


def roofline_metrics(shape: ModelShape, bw: Bandwidth, batch: int, context: float,
                     decode_tokens_per_s: float, work: StepWork | None = None) -> dict[str, float]:
    """The roofline metrics (names are a contract); `work`: a measured step (its context replaces `context`; under
    continuous batching a forward reads the weights and KV of the rows measured per forward, not `batch`)."""
    context = work.context if work is not None else context
    rows = work.tokens_per_step if work is not None and work.accounting == STEP_ACCOUNTING_CB else batch
    step = bytes_per_step(shape, rows, context) + (work.extra_bytes if work is not None else 0.0)
    per_step = work.tokens_per_step if work is not None else batch  # tokens one step emits
    bound = per_step * bw.bytes_per_s / step
    achieved = decode_tokens_per_s if decode_tokens_per_s == decode_tokens_per_s else float("nan")
    return {
        "bandwidth_gb_per_s": bw.gb_per_s,
        "bytes_per_step": step,
        "roofline_tokens_per_s": bound,
        "roofline_fraction": achieved / bound,
        "achieved_gb_per_s": achieved / per_step * step / 1e9,
        "kv_context_mean": context,
    }


# ----------------------------------------------------------------------------- slow kernel path
def slow_kernel_flags(rows: list[dict]) -> dict[int, str]:
    """Index -> warning for rows below SLOW_FRACTION whose lighter format is not faster than a heavier one.

    Each row: `group` (what must match to compare), `label`, `bytes_per_step`, `decode_tokens_per_s`,
    `roofline_fraction`. "Lighter" means at least 5% fewer bytes per step (same-size formats are not
    compared: their speed difference is not about bytes).
    """
    return {i: _slow_message(rows[i], rows[partners[0]]) for i, partners in _slow_pairs(rows).items()}


def _kernel_note(r: dict) -> str:
    return f" [kernel {r['kernel']}]" if r.get("kernel") else ""


def _slow_pairs(rows: list[dict]) -> dict[int, list[int]]:
    """Flagged row index -> indices of the heavier rows (same group) not slower than it."""
    out: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.get("roofline_fraction", 1.0) < SLOW_FRACTION:
            continue
        partners = [j for j, other in enumerate(rows)
                    if other is not r and other.get("group") == r.get("group")
                    and other["bytes_per_step"] > 1.05 * r["bytes_per_step"]
                    and other["decode_tokens_per_s"] >= r["decode_tokens_per_s"]]
        if partners:
            out[i] = partners
    return out


def _slow_message(r: dict, other: dict) -> str:
    """The warning for lighter row `r`, not faster than heavier row `other`.

    A row may carry `kernel` (tag kernel.linear of the run, harness/measure/kernels.py): the warning names the
    matmul kernel of both sides, e.g. int8's `aten::mm` (a dequantize per call) against bf16's.
    """
    return (f"{SLOW_TAG} {r['label']}{_kernel_note(r)} reads {r['bytes_per_step'] / 1e6:.0f} "
            f"MB/step but decodes {r['decode_tokens_per_s']:.1f} tok/s, not faster than "
            f"{other['label']}{_kernel_note(other)} ({other['bytes_per_step'] / 1e6:.0f} MB/step, "
            f"{other['decode_tokens_per_s']:.1f} tok/s); it reaches {r['roofline_fraction']:.0%} "
            f"of its bound (< {SLOW_FRACTION:.0%})")


def check_slow_kernel(group: dict, label: str, metrics: dict, device: str, threads: int,
                      kernel: str = "") -> str | None:
    """Record this run in the host's speeds cache, compare with the others, return a warning or None.

    The warning is about this run when it is the slow lighter format, or about a lighter format recorded
    earlier that this (heavier) run outpaces: whichever of the two runs comes second says so, so the
    order of a sweep or of two run.py calls does not hide it.
    """
    path = cache_root() / "roofline" / f"speeds-{host_key(device, threads)}.json"
    gkey = short_hash(group)
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        data = {}  # a corrupt cache only loses comparisons
    now = time.time()
    entries = {k: v for k, v in data.get(gkey, {}).items() if now - v.get("t", 0) < SPEEDS_MAX_AGE_S}
    entries[label] = {"bytes_per_step": metrics["bytes_per_step"], "t": now,
                      "decode_tokens_per_s": metrics["decode_tokens_per_s"],
                      "roofline_fraction": metrics["roofline_fraction"], "kernel": kernel}
    data[gkey] = entries
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    rows = [{"group": gkey, "label": k, **v} for k, v in entries.items()]
    pairs = _slow_pairs(rows)
    mine = next(i for i, r in enumerate(rows) if r["label"] == label)
    if mine in pairs:
        return _slow_message(rows[mine], rows[pairs[mine][0]])
    # an earlier lighter run that this run outpaces now: the warning names this run as the heavier side
    slower = [i for i, partners in pairs.items() if mine in partners]
    return _slow_message(rows[slower[0]], rows[mine]) if slower else None


def annotate(metrics: dict, tags: dict, shape: ModelShape, device: str, threads: int, context: float,
             group: dict, label: str, work: StepWork | None = None) -> None:
    """Add the roofline metrics and tags of one run in place (used by every engine; `work`: see StepWork)."""
    bw = host_bandwidth(device, threads)
    batch = int(metrics.get("batch_size", 1) or 1)
    metrics.update(roofline_metrics(shape, bw, batch, context, float(metrics.get("decode_tokens_per_s", math.nan)),
                                    work))
    tags["bandwidth_method"] = bw.method
    tags["roofline_accounting"] = work.accounting if work is not None else STEP_ACCOUNTING
    if math.isfinite(metrics["roofline_fraction"]):
        warning = check_slow_kernel({**group, "batch": batch, "device": device, "threads": threads}, label,
                                    metrics, device, threads, kernel=tags.get("kernel.linear", ""))
        if warning:
            tags["warning.slow_kernel"] = warning
            log.warning(warning)


def run_group(exp: Any, engine: str) -> dict:
    """What two runs must share for their speeds to be compared (slow-kernel check)."""
    m = exp.measure
    group = {"model": exp.model.identity(), "engine": engine, "strategy": exp.strategy.name, "prompts": m.prompts,
             "max_new_tokens": m.max_new_tokens, "chat_template": m.chat_template, "cache": m.cache,
             "compile": m.compile}
    for key in ("prompt_tokens", "context_depth"):  # workload lengths (harness/measure/workloads.py), when set
        if getattr(m, key, 0):
            group[key] = getattr(m, key)
    return group


# ----------------------------------------------------------------------------- plot
def roofline_plot(rows: list[dict], path: str | Path, machine: str = "") -> Path:
    """Achieved vs bound decode tok/s per cell (rows: label, decode_tokens_per_s, roofline_tokens_per_s)."""
    import matplotlib  # heavy: only when a report draws the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ok(v: Any) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v)

    rows = [r for r in rows if ok(r.get("roofline_tokens_per_s")) and ok(r.get("decode_tokens_per_s"))]
    fig, ax = plt.subplots(figsize=(6.5, 5))
    if rows:
        hi = max(max(r["roofline_tokens_per_s"], r["decode_tokens_per_s"]) for r in rows) * 1.15
        ax.plot([0, hi], [0, hi], color="grey", lw=1, label="bound (fraction 1)")
        ax.plot([0, hi], [0, hi * SLOW_FRACTION], color="grey", lw=1, ls=":", label=f"fraction {SLOW_FRACTION:g}")
        for r in rows:
            ax.scatter(r["roofline_tokens_per_s"], r["decode_tokens_per_s"], s=30)
            ax.annotate(str(r.get("label", "")), (r["roofline_tokens_per_s"], r["decode_tokens_per_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
    ax.set_xlabel("roofline decode tokens/s (batch x bandwidth / bytes per step)")
    ax.set_ylabel("achieved decode tokens/s")
    ax.set_title("decode: achieved vs memory-bandwidth bound" + machine, fontsize=9)  # machine: "\n<CPU>"
    if rows:
        ax.legend(loc="upper left", fontsize=8)
    return figures.save(fig, path, dpi=120)


# ----------------------------------------------------------------------------- calculator
def floor(params: float, bits: float, bandwidth: float, batch: int = 1, context: int = 0, layers: int = 0,
          kv_dim: int = 0, kv_bits: float = 16.0) -> dict[str, float]:
    """Back-of-envelope decode floor: every weight read once per step, plus the KV cache."""
    weights = params * bits / 8.0
    kv = batch * context * 2.0 * layers * kv_dim * kv_bits / 8.0
    step_s = (weights + kv) / bandwidth
    # every sequence of the batch gets one token per step: ms/token per sequence is the step time
    return {"bytes_per_step": weights + kv, "ms_per_token": step_s * 1e3, "tokens_per_s": batch / step_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.analysis.roofline", description=(
        "Decode roofline calculator: floor = bytes read per step / memory bandwidth."))
    p.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7e9")
    p.add_argument("--bits", type=float, default=16.0, help="bits per weight incl. scales (default 16)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bandwidth", type=float, help="memory bandwidth in bytes/s, e.g. 3.35e12")
    src.add_argument("--device", help=f"named device: {', '.join(DEVICES)}, or 'host' (measured here)")
    p.add_argument("--threads", type=int, default=0, help="with --device host: threads (0 = all cores)")
    p.add_argument("--measure", action="store_true",
                   help="with --device host: measure again (on the same boot the cache keeps the higher value)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=0, help="KV cache length read per step (tokens)")
    p.add_argument("--layers", type=int, help="layers (for the KV cache)")
    p.add_argument("--kv-dim", type=int, help="kv_heads x head_dim (for the KV cache)")
    p.add_argument("--kv-bits", type=float, default=16.0)
    a = p.parse_args(argv)
    if (min(a.params, a.bits, a.batch, a.kv_bits, *(v for v in (a.layers, a.kv_dim) if v is not None)) <= 0
            or a.context < 0):  # a negative KV size took bytes off the weights' (layers, kv-dim: None if not given)
        p.error("--params, --bits, --batch, --layers, --kv-dim and --kv-bits must be > 0 and --context >= 0")
    if a.context and not (a.layers and a.kv_dim):
        p.error("--context needs --layers and --kv-dim (kv_heads x head_dim) to size the KV cache")
    source = "given"
    if a.device:
        if a.device == "host":
            threads = a.threads or cgroup.usable_cpus()
            bw = host_bandwidth("cpu", threads, refresh=a.measure)
            a.bandwidth, source = bw.bytes_per_s, bw.method
        elif a.device in DEVICES:
            a.bandwidth, source = DEVICES[a.device]
        else:
            p.error(f"--device {a.device!r} is unknown; choose one of: {', '.join(DEVICES)}, host")
    if a.bandwidth <= 0:
        p.error("--bandwidth must be > 0 (bytes/s)")
    f = floor(a.params, a.bits, a.bandwidth, a.batch, a.context, a.layers or 0, a.kv_dim or 0, a.kv_bits)
    print(f"bandwidth      {a.bandwidth / 1e9:,.1f} GB/s ({source})")
    print(f"bytes per step {f['bytes_per_step'] / 1e9:,.3f} GB (batch {a.batch}, context {a.context})")
    print(f"floor          {f['ms_per_token']:.2f} ms/token per sequence")
    print(f"ceiling        {f['tokens_per_s']:,.1f} tokens/s (batch {a.batch})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
