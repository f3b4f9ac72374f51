"""Accuracy: perplexity on a corpus, and KL divergence / top-1 agreement against the reference model.

Perplexity uses fixed windows of `context_length` tokens moved by `stride` (the transformers recipe):
each token is scored at most once, by the window that first covers it, with up to
`context_length - stride` tokens of left context from the overlap (the first token of each window has
no context inside it and is not scored).

KL(reference || run) needs the reference's distribution at every scored token, but a 49k-vocabulary
model would need ~200 KB per token for it. The reference pass (same model, unquantized, in
`reference_dtype`) therefore keeps only its top-k log-probs per token plus the remaining "tail" mass, in
a safetensors file keyed by (model, corpus, context, stride, dtype, k): a sweep computes it once and no
full-vocabulary logits ever reach the disk. KL is then computed over k+1 outcomes (the top-k tokens and
one bucket for the rest). Merging outcomes can only lower a KL divergence, so this is a lower bound of
the full KL that is exact when the tail mass is negligible; with k=256 the tail holds well under 1% of
the mass for a trained model. The reference against itself gives exactly 0, and top-1 agreement is
exact (the reference's argmax is stored).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.config import AccuracyConfig
from harness.errors import QuantbenchError
from harness.measure import model_grad_mode

BUILTIN_CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def load_corpus(spec: str) -> str:
    """`builtin`, a local text file, or an HF datasets id `name[:config[:split]]`."""
    if spec == "builtin":
        return BUILTIN_CORPUS.read_text(encoding="utf-8")
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if os.sep in spec or spec.endswith(".txt"):
        raise QuantbenchError(f"accuracy.corpus={spec!r}: no such file; give a text file path or 'builtin'")
    try:
        import datasets  # optional: only for hub corpora
    except ImportError as exc:
        raise QuantbenchError(f"accuracy.corpus={spec!r} looks like an HF datasets id but 'datasets' is not "
                              "installed; pip install datasets, or pass a local text file") from exc
    name, _, rest = spec.partition(":")
    config, _, split = rest.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "test")
    except Exception as exc:  # noqa: BLE001 - offline or unknown id
        raise QuantbenchError(f"accuracy.corpus={spec!r} could not be loaded ({type(exc).__name__}); "
                              "use a local text file where the hub is unreachable") from exc
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n".join(ds[column])


def corpus_tokens(tokenizer: Any, spec: str, max_tokens: int) -> list[int]:
    text = load_corpus(spec)
    if max_tokens:
        text = text[: max_tokens * 12]  # no tokenizer averages more than ~12 chars per token on prose
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise QuantbenchError(f"accuracy.corpus={spec!r} has fewer than 2 tokens; give a longer text")
    return ids


def windows(n_tokens: int, context: int, stride: int, scoring: str = "all") -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window; no token is scored twice.

    `scoring="second_half"` is llama-perplexity's rule (stride == context): of each chunk only the tokens
    after its first half are scored, so every scored token has at least half a window of context.
    """
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + context, n_tokens)
        n_new = min(end - prev_end, end - begin - 1)  # a window's first token has no context in it
        if scoring == "second_half":
            n_new = (end - begin) - (end - begin) // 2 - 1
        if n_new > 0:
            out.append((begin, end, n_new))
        prev_end = end
        if end == n_tokens:
            return out
        begin += stride


def _tail_logp(top_lp: torch.Tensor) -> torch.Tensor:
    """log of the mass outside the top-k (float64; clamped so an all-mass top-k stays finite)."""
    mass = top_lp.double().exp().sum(-1)
    return torch.log1p(-mass.clamp(max=1 - 1e-12))


@model_grad_mode  # inference_mode, or no_grad where the quantizer needs it
def score(model: Any, ids: list[int], cfg: AccuracyConfig, device: str, reference: dict | None = None,
          keep_top_k: int = 0, progress: bool = False) -> dict[str, Any]:
    """Score the corpus. With `keep_top_k` return the reference record; with `reference` compare to it."""
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    nll_sum, n = 0.0, 0
    top_lp, top_idx, argmaxes, kls, agree = [], [], [], [], []
    offset = 0  # index into the reference's per-token arrays
    spans = windows(len(ids), cfg.context_length, cfg.stride, cfg.scoring)
    iterator = spans
    if progress:
        from tqdm import tqdm

        iterator = tqdm(spans, desc="perplexity", unit="window", leave=False)
    for begin, end, n_new in iterator:
        logits = model(input_ids=tokens[None, begin:end]).logits[0, -n_new - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = tokens[end - n_new:end]
        nll_sum += float(-logp.gather(-1, target[:, None]).sum())
        n += n_new
        if keep_top_k:
            vals, idx = logp.topk(keep_top_k, dim=-1)
            top_lp.append(vals.cpu())
            top_idx.append(idx.to(torch.int32).cpu())
            argmaxes.append(logp.argmax(-1).cpu())
        if reference is not None:
            r_lp = reference["top_lp"][offset:offset + n_new].double()
            r_idx = reference["top_idx"][offset:offset + n_new].long()
            q_lp = logp.cpu().double().gather(-1, r_idx)
            p = r_lp.exp()
            kl = (p * (r_lp - q_lp)).sum(-1)
            p_tail_lp, q_tail_lp = _tail_logp(r_lp), _tail_logp(q_lp)
            kl = kl + p_tail_lp.exp() * (p_tail_lp - q_tail_lp)
            kls.append(kl.clamp(min=0.0))
            agree.append((logp.argmax(-1).cpu() == reference["argmax"][offset:offset + n_new]).double())
        offset += n_new
    out: dict[str, Any] = {"perplexity": float(np.exp(nll_sum / n)), "scored_tokens": n}
    if keep_top_k:
        out["record"] = {"top_lp": torch.cat(top_lp), "top_idx": torch.cat(top_idx), "argmax": torch.cat(argmaxes),
                         "perplexity": torch.tensor([out["perplexity"]], dtype=torch.float64)}
    if reference is not None:
        kl_all = torch.cat(kls)
        out["kl_div_mean"] = float(kl_all.mean())
        out["kl_div_p99"] = float(torch.quantile(kl_all, 0.99))
        out["top1_agreement"] = float(torch.cat(agree).mean())
    return out


def reference_key(model_identity: dict, cfg: AccuracyConfig) -> str:
    import transformers

    corpus_text = load_corpus(cfg.corpus)
    key = {
        "model": model_identity, "corpus": hashlib.sha256(corpus_text.encode()).hexdigest(),
        "accuracy": {k: v for k, v in asdict(cfg).items() if k not in ("enabled", "kl")},
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def reference_path(model_identity: dict, cfg: AccuracyConfig) -> Path:
    from harness.models import cache_root

    return cache_root() / "reference" / f"{reference_key(model_identity, cfg)}.safetensors"


def load_reference(path: Path) -> dict | None:
    from safetensors.torch import load_file  # safetensors: never unpickles

    return load_file(str(path)) if path.is_file() else None


def save_reference(path: Path, record: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in record.items()}, str(tmp))
    os.replace(tmp, path)


def ensure_reference(source: Any, tokenizer: Any, cfg: AccuracyConfig, device: str) -> tuple[dict, bool]:
    """Return the reference record for this (model, corpus, settings), computing it on a cache miss.

    Returns (record, cache_hit). Called before the run's own model is loaded, so the reference model is
    freed before peak memory is measured.
    """
    path = reference_path(source.identity(), cfg)
    record = load_reference(path)
    if record is not None:
        return record, True
    from harness.models import load_pretrained

    ref_model = load_pretrained(source, cfg.reference_dtype, device)
    ids = corpus_tokens(tokenizer, cfg.corpus, cfg.max_tokens)
    record = score(ref_model, ids, cfg, device, keep_top_k=cfg.kl_top_k, progress=True)["record"]
    del ref_model
    save_reference(path, record)
    return record, False
