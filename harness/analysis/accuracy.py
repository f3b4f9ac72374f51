"""Accuracy: perplexity on a corpus, and KL divergence / top-1 agreement against the reference model.

Perplexity uses fixed windows of `context_length` tokens moved by `stride` (the transformers recipe):
each token is scored at most once, by the window that first covers it, with up to
`context_length - stride` tokens of left context from the overlap (the first token of each window has
no context inside it and is not scored).

KL(p || q), p the reference's distribution (same model, unquantized, in `reference_dtype`) and q the
run's, needs p over the whole vocabulary at every scored token: 200 KB per token for a 49k vocabulary.
The reference pass stores what p is computed from instead, in a safetensors record keyed by (record
format, model, corpus, accuracy settings, library versions), so a sweep computes it once:

- `accuracy.kl_reference=exact` (default): h, the input of the output layer (the final hidden state,
  `hidden_size` values per token: 2.3 KB for SmolLM2 in fp32). p = softmax(W h + b), with W, b the output
  layer read in `reference_dtype` from the model's cached safetensors directory (pinned by a sha256 in
  the record), so KL is summed over the whole vocabulary, in float64: exact. The record is only written
  after checking, window by window, that F.linear(h, W, b) reproduces the reference's own logits within
  rounding (the largest difference is stored; bit-identical on CPU). A model whose config sets a logit
  transform (final_logit_softcapping, a logit scale: harness/analysis/output_layer.py), or whose logits miss
  that check, falls back, with a warning, to:
- `accuracy.kl_reference=topk`: the top-k log-probs per token (k = `kl_top_k`) plus one bucket for the
  tail mass P (Q for the run). KL over these k+1 outcomes is a lower bound: merging outcomes hides
  sum_tail p_i log(p_i/q_i) - P log(P/Q). Every tail p_i is <= p_k (the smallest stored probability)
  and they sum to P; the convex first term is largest at a vertex of that set: p_k on the smallest q_i
  until P is used up. `kl_div_tail_bound` is the mean of that bound (hidden KL <= bound), so the full KL
  lies in [kl_div_mean, kl_div_mean + kl_div_tail_bound]; `kl_ref_tail_mass` is the mean of P (both 0 if exact).

Top-1 agreement is exact in both modes (the reference's argmax is stored); the reference against itself gives KL
exactly 0. `kl_div_mean_lo`/`_hi`: a 95% block-bootstrap interval of kl_div_mean (harness/analysis/intervals.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from harness.analysis import intervals
from harness.analysis.corpus import BUILTIN_CORPUS  # noqa: F401 - re-exported
from harness.analysis.corpus import load as load_corpus
from harness.analysis.output_layer import load_head, locate_head, ref_logits, within_rounding
from harness.cache import build_lock, cache_root
from harness.config import KL_CHUNK_ROWS, TASK_FIELDS, AccuracyConfig
from harness.errors import QuantbenchError
from harness.measure import model_grad_mode
from harness.models import load_pretrained, torch_dtype

# safetensors and transformers (for its version) are imported where used: only the reference record needs them.

log = logging.getLogger("quantbench")

# 1: top-k + tail bucket, no metadata (before issue 17). 2: exact or top-k, the mode in the metadata.
# 3: as 2, but a 16-bit reference_dtype no longer lets a softcapped model pass as exact (output_layer.py)
RECORD_FORMAT = "3"
_ROWS = KL_CHUNK_ROWS  # tokens per float64 chunk


def corpus_tokens(tokenizer: Any, spec: str, max_tokens: int) -> list[int]:
    text = load_corpus(spec)
    # tokenize a prefix, not the whole corpus: ~12 chars per token covers prose; text that packs more per
    # token (SmolLM2 packs 64 spaces or dashes into one) takes a 4x longer prefix, until enough or all of it
    cut = max_tokens * 12 if max_tokens else len(text)
    while True:
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if not max_tokens or len(ids) > max_tokens or cut >= len(text):
            break
        cut *= 4
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise QuantbenchError(f"accuracy.corpus={spec!r} has fewer than 2 tokens; give a longer text")
    return ids


def windows(n_tokens: int, context: int, stride: int, scoring: str = "all") -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window; no token is scored twice (with stride == context, the first token
    of each window is scored by none: it has no context in its window).

    `scoring="second_half"` is llama-perplexity's rule (stride == context): whole chunks only (a shorter last
    chunk is dropped, as llama-perplexity's `n_tokens / n_ctx` chunks drop it), and of each chunk only the
    tokens after its first half are scored, so every scored token has at least half a window of context.
    """
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + context, n_tokens)
        n_new = min(end - prev_end, end - begin - 1)  # a window's first token has no context in it
        if scoring == "second_half":
            n_new = (end - begin) - (end - begin) // 2 - 1 if end - begin == context else 0
        if n_new > 0:
            out.append((begin, end, n_new))
        prev_end = end
        if end == n_tokens:
            return out
        begin += stride


def spans(n_tokens: int, cfg: AccuracyConfig) -> list[tuple[int, int, int]]:
    """`windows` of `cfg` over `n_tokens`; one line, not a division by zero, when they score no token."""
    out = windows(n_tokens, cfg.context_length, cfg.stride, cfg.scoring)
    if not out:
        why = (f" (whole chunks of {cfg.context_length} only, and each chunk's first half is context only)"
               if cfg.scoring == "second_half" else "")
        raise QuantbenchError(f"accuracy.corpus={cfg.corpus!r}: its {n_tokens} tokens leave none to score with "
                              f"accuracy.scoring={cfg.scoring}{why}; give a longer text")
    return out


def scored_ids(tokenizer: Any, cfg: AccuracyConfig) -> list[int]:
    """The corpus ids `score` reads, checked to leave tokens to score: engines call it before the model loads."""
    ids = corpus_tokens(tokenizer, cfg.corpus, cfg.max_tokens)
    spans(len(ids), cfg)
    return ids


def _scored(model: Any, ids: list[int], cfg: AccuracyConfig, device: str, desc: str, progress: bool,
            capture_hidden: bool = False):
    """Yield (targets, logits, hidden) for the scored positions of each window.

    `hidden` is the input of the output layer at those positions (captured by a hook), else None.
    """
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    todo = spans(len(ids), cfg)
    if progress:
        todo = tqdm(todo, desc=desc, unit="window", leave=False)
    seen: dict[str, torch.Tensor] = {}
    hook = None
    if capture_hidden:
        hook = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))
    try:
        for begin, end, n_new in todo:
            logits = model(input_ids=tokens[None, begin:end]).logits[0, -n_new - 1:-1]
            hidden = seen.pop("h")[0, -n_new - 1:-1] if capture_hidden else None
            yield tokens[end - n_new:end], logits, hidden
    finally:
        if hook is not None:
            hook.remove()


def _n_scored(n_tokens: int, cfg: AccuracyConfig) -> int:
    return sum(n for _, _, n in spans(n_tokens, cfg))


# ------------------------------------------------------------------------------------- the KL per token


def _kl_full(lp: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row over the whole vocabulary, float64; `lp` holds the reference log-probs."""
    lq = torch.log_softmax(q_logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _tail_logp(top_lp: torch.Tensor) -> torch.Tensor:
    """log of the mass outside the top-k (float64; clamped so an all-mass top-k stays finite)."""
    mass = top_lp.double().exp().sum(-1)
    return torch.log1p(-mass.clamp(max=1 - 1e-12))


def _kl_topk(r_lp: torch.Tensor, r_idx: torch.Tensor, q_logits: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: KL over the top-k + tail bucket (a lower bound), the tail mass P, and the most KL the
    bucket can hide (module docstring)."""
    r_lp, r_idx = r_lp.double(), r_idx.long()
    lq = torch.log_softmax(q_logits.double(), dim=-1)
    q_lp = lq.gather(-1, r_idx)
    # Q summed over the tail itself: 1 - sum(top q) loses all its digits when the top-k hold nearly all of q
    p_tail_lp, q_tail_lp = _tail_logp(r_lp), lq.scatter(-1, r_idx, float("-inf")).logsumexp(-1)
    p_tail = p_tail_lp.exp()
    kl = (r_lp.exp() * (r_lp - q_lp)).sum(-1)
    n_tail = lq.shape[-1] - r_idx.shape[-1]
    if n_tail <= 0:  # k covers the vocabulary: the plain KL, no tail (its Q would be log 0)
        return kl.clamp(min=0.0), torch.zeros_like(kl), torch.zeros_like(kl)
    kl = kl + p_tail * (p_tail_lp - q_tail_lp)
    # the worst tail: m tokens at the cap c = p_k, one at the remainder r, on the smallest q (ascending)
    cap_lp = r_lp.min(-1).values
    m = torch.floor(p_tail / cap_lp.exp()).clamp(max=n_tail - 1).long()
    # the m+1 smallest tail log q, ascending (stored tokens set to +inf never come first)
    lq_tail = lq.scatter(-1, r_idx, float("inf")).topk(int(m.max()) + 1, dim=-1, largest=False).values
    r = (p_tail - m * cap_lp.exp()).clamp(min=0.0)
    csum = torch.cat([torch.zeros_like(kl)[:, None], lq_tail.cumsum(-1)], dim=-1)
    worst = (m * cap_lp.exp() * cap_lp - cap_lp.exp() * csum.gather(-1, m[:, None])[:, 0]
             + torch.xlogy(r, r) - r * lq_tail.gather(-1, m[:, None])[:, 0])
    bound = worst - torch.xlogy(p_tail, p_tail) + p_tail * q_tail_lp
    bound = torch.where(p_tail > 0, bound, 0.0)  # no tail mass, nothing hidden (and no 0 x inf)
    return kl.clamp(min=0.0), p_tail, bound.clamp(min=0.0)


# ---------------------------------------------------------------------------------------------- scoring


@model_grad_mode  # inference_mode, or no_grad where the quantizer needs it
def score(model: Any, ids: list[int], cfg: AccuracyConfig, device: str, reference: dict | None = None,
          progress: bool = False) -> dict[str, Any]:
    """Perplexity of `model` on `ids`; with `reference` (from `ensure_reference`) also KL and agreement."""
    exact = reference is not None and reference["meta"]["mode"] == "exact"
    if reference is not None and (n := _n_scored(len(ids), cfg)) != len(reference["argmax"]):
        raise QuantbenchError(f"the reference record scores {len(reference['argmax'])} tokens, this corpus "
                              f"{n}: it was built for other settings; delete {reference['meta'].get('path')}")
    head = load_head(reference["meta"], device) if exact else None
    nll_sum, n = 0.0, 0
    kls, tails, bounds, agree = [], [], [], []
    for target, logits, _ in _scored(model, ids, cfg, device, "perplexity", progress):
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        nll_sum += float(-logp.gather(-1, target[:, None]).sum())
        if reference is not None:
            for i in range(0, len(target), _ROWS):
                rows = slice(n + i, n + min(i + _ROWS, len(target)))
                q = logits[i:i + _ROWS]
                if exact:
                    lp = torch.log_softmax(ref_logits(reference["hidden"][rows], head).double(), dim=-1)
                    kls.append(_kl_full(lp, q).cpu())
                else:
                    kl, tail, bound = _kl_topk(reference["top_lp"][rows].to(q.device),
                                               reference["top_idx"][rows].to(q.device), q)
                    kls.append(kl.cpu())
                    tails.append(tail.cpu())
                    bounds.append(bound.cpu())
            agree.append((logp.argmax(-1).cpu() == reference["argmax"][n:n + len(target)]).double())
        n += len(target)
    out: dict[str, Any] = {"perplexity": float(np.exp(nll_sum / n)), "scored_tokens": n}
    if reference is not None:
        kl_all = torch.cat(kls).clamp(min=0.0)
        out["kl_div_mean"] = float(kl_all.mean())
        out["kl_div_p99"] = float(torch.quantile(kl_all, 0.99))
        out.update(intervals.kl_interval(kl_all.double().numpy()))  # the 95% block-bootstrap interval
        out["top1_agreement"] = float(torch.cat(agree).mean())
        out["kl_ref_tail_mass"] = float(torch.cat(tails).mean()) if tails else 0.0
        out["kl_div_tail_bound"] = float(torch.cat(bounds).mean()) if bounds else 0.0
    return out


# ------------------------------------------------------------------------------------ the reference record


@model_grad_mode
def _reference_pass(model: Any, ids: list[int], cfg: AccuracyConfig, device: str,
                    head: tuple[torch.Tensor, torch.Tensor | None] | None) -> tuple[dict, float, float]:
    """One pass of the reference model: perplexity, argmax, top-k and (with `head`) the hidden states.

    Returns (tensors, max |recomputed - own logits|, that difference in units of rounding: `within_rounding`);
    the caller keeps the hidden states only when the latter is <= 1, else the top-k.
    """
    nll_sum, n, worst, excess = 0.0, 0, 0.0, 0.0
    top_lp, top_idx, argmax, hidden = [], [], [], []
    k = min(cfg.kl_top_k, model.get_output_embeddings().out_features)
    for target, logits, h in _scored(model, ids, cfg, device, "reference", True, capture_hidden=head is not None):
        if head is not None:
            largest = float(logits.float().abs().max())
            for i in range(0, len(target), _ROWS):  # the same chunks as `score` recomputes
                again, own = ref_logits(h[i:i + _ROWS], head), logits[i:i + _ROWS]
                worst = max(worst, float((again.float() - own.float()).abs().max()))
                excess = max(excess, within_rounding(again, own, largest))
            hidden.append(h.cpu())
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll_sum += float(-logp.gather(-1, target[:, None]).sum())
        n += len(target)
        vals, idx = logp.topk(k, dim=-1)
        top_lp.append(vals.cpu())
        top_idx.append(idx.to(torch.int32).cpu())
        argmax.append(logp.argmax(-1).cpu())
    record = {"top_lp": torch.cat(top_lp), "top_idx": torch.cat(top_idx), "argmax": torch.cat(argmax),
              "perplexity": torch.tensor([float(np.exp(nll_sum / n))], dtype=torch.float64)}
    if head is not None:
        record["hidden"] = torch.cat(hidden)
    return record, worst, excess


def build_reference(source: Any, tokenizer: Any, cfg: AccuracyConfig, device: str) -> tuple[dict, dict]:
    """Run the reference model over the corpus; returns (tensors, metadata) of the record to store."""
    ids = scored_ids(tokenizer, cfg)  # a corpus with nothing to score is refused before the model loads
    ref_model = load_pretrained(source, cfg.reference_dtype, device)
    meta, why, head = {}, "accuracy.kl_reference=topk", None
    if cfg.kl_reference == "exact":
        meta, why = locate_head(ref_model, source.local_dir(), torch_dtype(cfg.reference_dtype))
        if meta:
            out = ref_model.get_output_embeddings()
            head = (out.weight.detach(), None if out.bias is None else out.bias.detach())
    record, worst, excess = _reference_pass(ref_model, ids, cfg, device, head)
    del ref_model
    if head is not None:
        if excess <= 1.0:  # rounding of a differently blocked matmul, nothing systematic
            meta.update(mode="exact", logit_max_abs_diff=repr(worst))
            return {k: record[k] for k in ("hidden", "argmax", "perplexity")}, meta
        why = (f"recomputing the logits from the output layer's input misses them by up to {worst:.3g} "
               "(extra logit processing such as final_logit_softcapping?)")
    if cfg.kl_reference == "exact":
        log.warning("accuracy: exact KL is not available for this model (%s); falling back to the top-%d "
                    "record, a lower bound: see metrics kl_ref_tail_mass and kl_div_tail_bound", why, cfg.kl_top_k)
    return {k: record[k] for k in ("top_lp", "top_idx", "argmax", "perplexity")}, {"mode": "topk", "why": why}


def reference_key(model_identity: dict, cfg: AccuracyConfig) -> str:
    import transformers

    key = {"format": RECORD_FORMAT, "model": model_identity,
           "corpus": hashlib.sha256(load_corpus(cfg.corpus).encode()).hexdigest(),
           "accuracy": {k: v for k, v in asdict(cfg).items() if k not in ("enabled", "kl", *TASK_FIELDS)},
           "torch": torch.__version__, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def reference_path(model_identity: dict, cfg: AccuracyConfig) -> Path:
    return cache_root() / "reference" / f"{reference_key(model_identity, cfg)}.safetensors"


def load_reference(path: Path) -> dict | None:
    """The record at `path` with its metadata under "meta"; None if absent or of another format."""
    from safetensors import safe_open  # safetensors: never unpickles

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        if meta.get("format") != RECORD_FORMAT:  # an older layout is never read as this one
            return None
        record: dict[str, Any] = {k: f.get_tensor(k) for k in f.keys()}
    record["meta"] = {**meta, "path": str(path)}
    return record


def save_reference(path: Path, record: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in record.items()}, str(tmp),
              metadata={**{k: str(v) for k, v in meta.items()}, "format": RECORD_FORMAT})
    os.replace(tmp, path)


def _usable_reference(path: Path, source: Any) -> dict | None:
    """The cached record at `path` if its output layer still matches the model directory, else None."""
    record = load_reference(path)
    if record is not None and record["meta"]["mode"] == "exact":
        record["meta"]["model_dir"] = str(source.local_dir())
        try:
            load_head(record["meta"], "cpu")  # the model directory still holds that output layer
        except QuantbenchError as exc:
            log.warning("accuracy: rebuilding the reference record: %s", exc)
            record = None
    return record


def ensure_reference(source: Any, tokenizer: Any, cfg: AccuracyConfig, device: str) -> tuple[dict, bool]:
    """Return the reference record for this (model, corpus, settings), computing it on a cache miss.

    Returns (record, cache_hit); record["meta"] says how to read it. Called before the run's own model is
    loaded, so the reference model is freed before peak memory is measured.
    """
    path = reference_path(source.identity(), cfg)
    with build_lock(path):  # a second process needing this record waits for the first one's, then reads it
        if (record := _usable_reference(path, source)) is not None:
            return record, True
        save_reference(path, *build_reference(source, tokenizer, cfg, device))
    record = load_reference(path)
    record["meta"]["model_dir"] = str(source.local_dir())
    return record, False
