"""Workloads: what a run feeds the model (`measure.prompts`, `prompt_tokens`, `context_depth`), as token ids.

`measure.prompts` is one of
- a named set of harness/measure/prompts.py (`default`, `edit`): texts, wrapped in the tokenizer's chat template
  (`measure.chat_template`) and tokenized;
- a text file (any path not ending in `.jsonl`): prompts separated by blank lines; a prompt may span
  several lines and keeps its line breaks (a file of one-line prompts needs a blank line between them);
- a JSONL file (`*.jsonl`): one object per line, `{"prompt": "...", "max_new_tokens": 32}`; the length is
  optional (default `measure.max_new_tokens`); other keys are an error (a typo would change the run silently);
- `synthetic` (4 prompts) or `synthetic:N` (N prompts) with `measure.prompt_tokens=<n>`: seeded random
  token ids from the tokenizer's ordinary vocabulary (no special or added tokens), fed as they are (no chat
  template, no BOS). The seed is `measure.seed`, so every quantizer and engine of a sweep gets the same ids.

`measure.context_depth=<n>` puts n more seeded random ordinary ids in the KV cache before every prompt,
prefilled untimed (llama-bench's `-d`): TTFT and decode are then timed at that depth
(strategies/decode.py `DepthContext`; llama.cpp keeps them in its cache the same way).

Checks: the file's format in `source_problems` (config time, no model); lengths against the model's
context in `check` (config time, from config.json / GGUF metadata, and the tokenizer only when a prompt
could be near the limit; never the weights); the engines check the exact lengths again once the
tokenizer is loaded, before the weights.

The resolved workload is recorded: tags `workload` (a short description), `workload.hash` (of the ids: the
same for every quantizer and for both engines when the ids are), `workload.pp` / `workload.tg` (llama-bench's
test names, e.g. pp512 and tg128), metrics `prompt_len_tokens`, `decode_len_tokens`, `context_depth_tokens`,
the mean and sd of the per-call speeds, and the ids (with the texts) as the MLflow artifact `workload.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.analysis.crossover import flop_metrics
from harness.cache import cache_root
from harness.errors import QuantbenchError
from harness.gguf_meta import HEADER_ERRORS, gguf_context_length
from harness.measure.prompts import JSONL_KEYS, SYNTHETIC, SYNTHETIC_DEFAULT_COUNT, Source, parse, source_problems
from harness.models import load_tokenizer

# parsing `measure.prompts` lives in harness/measure/prompts.py; these names stay importable from here
__all__ = ["JSONL_KEYS", "SYNTHETIC", "SYNTHETIC_DEFAULT_COUNT", "Source", "Workload", "check", "check_resolved",
           "context_length", "encode_prompts", "gguf_context_length", "metrics", "ordinary_ids", "parse",
           "random_ids", "record", "resolve", "source_problems"]

log = logging.getLogger("quantbench")

# A prompt of B UTF-8 bytes is at most B + 1 tokens for byte-level BPE and SentencePiece tokenizers; a chat
# template adds its own tokens (SmolLM2's default system prompt ~30). Under this bound a prompt surely fits
# and the config check needs no tokenizer; over it, the prompt is tokenized to decide.
TEMPLATE_SLACK = 256


# ---------------------------------------------------------------------------------------------- context
def context_length(model: Any) -> int | None:
    """The model's context (positions) from its config, without loading weights; None when unknown."""
    n = getattr(model, "max_position_embeddings", None)  # a model built from a config (tiny_random)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    try:
        gguf = model.gguf_path
    except QuantbenchError:
        return None  # the file is missing: the model's preflight says so
    if gguf is not None:
        try:
            return gguf_context_length(gguf)
        except HEADER_ERRORS:  # a damaged file: GGUFFile.preflight refuses it in one line
            return None
    local = Path(str(getattr(model, "name_or_path", "") or ""))
    if local.name and (local / "config.json").is_file():  # a local HF checkpoint; a hub id is checked later
        try:
            cfg = json.loads((local / "config.json").read_text())
        except (OSError, ValueError):
            return None
        cfg = cfg.get("text_config", cfg) if "max_position_embeddings" not in cfg else cfg
        n = cfg.get("max_position_embeddings")
        return int(n) if isinstance(n, int) else None
    return None


def check(model: Any, measure: Any, strategy: Any = None, tokenizer: Any = None) -> None:
    """Config-time checks of the workload against the model and strategy (see module docstring)."""
    depth = measure.context_depth
    src = parse(str(measure.prompts))
    if depth and strategy is not None and not strategy.supports_context_depth:
        raise QuantbenchError(f"measure.context_depth={depth} is not supported by strategy {strategy.name} (it runs "
                              "its own cache); use a strategy that runs strategies/decode.py's loop (strategy=greedy, "
                              "static_batch) or measure.context_depth=0")
    if depth and (measure.compile is True or measure.path in ("compiled", "freezing")):
        asked = "measure.compile=true" if measure.compile is True else f"measure.path={measure.path}"
        raise QuantbenchError(f"measure.context_depth with {asked} is not supported (the compiled path sizes its "
                              "static cache from the prompts); drop one of them (measure.path=best decodes eager "
                              "at a depth)")
    # the prompt count is known without a tokenizer: a strategy that cannot decode that many (continuous_batch's
    # strategy.requests below it) is refused here, not inside the run as a FAILED cell (harness/run/pipeline.py)
    count = src.count if src.kind == "synthetic" else len(src.texts)
    if (problem := getattr(strategy, "workload_problem", lambda n: None)(count)):
        raise QuantbenchError(problem)
    limits = [lim or measure.max_new_tokens for lim in src.limits]
    ctx = context_length(model)
    if ctx is None:
        return
    if src.kind == "synthetic":
        _fits(ctx, depth, [measure.prompt_tokens] * src.count, [measure.max_new_tokens] * src.count, src,
              measure)
        return
    slack = TEMPLATE_SLACK if measure.chat_template else 2
    bounds = [len(t.encode("utf-8")) + 1 + slack for t in src.texts]
    if all(depth + b + lim <= ctx for b, lim in zip(bounds, limits, strict=True)):
        return  # surely fits: no tokenizer needed
    if depth + min(limits) >= ctx:  # too long whatever the prompts
        _fits(ctx, depth, [1] * len(limits), limits, src, measure)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(model)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' own: a traceback from a config check
            why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            raise QuantbenchError(f"the tokenizer of model {getattr(model, 'name', '?')} does not load ({why}), and "
                                  f"the prompts must be measured against its context of {ctx} positions; "
                                  "give a model with a tokenizer, or use measure.prompts=synthetic") from exc
    ids = encode_prompts(tokenizer, src.texts, measure.chat_template)
    _fits(ctx, depth, [len(x) for x in ids], limits, src, measure)


def _fits(ctx: int, depth: int, lengths: list[int], limits: list[int], src: Source, measure: Any) -> None:
    for i, (n, lim) in enumerate(zip(lengths, limits, strict=True)):
        if depth + n + lim <= ctx:
            continue
        if src.kind == "synthetic":
            what = f"measure.prompt_tokens={n}"
        elif depth + lim >= ctx:
            what = None
        else:
            what = f"prompt {src.where(i)} is {n} tokens"
        parts = ([what] if what else []) + [f"measure.context_depth={depth}" if depth else "",
                                            f"{lim} new tokens"]
        need = " + ".join(x for x in parts if x)
        raise QuantbenchError(f"{need} = {depth + n + lim if what else depth + lim} positions, beyond the "
                              f"model's context of {ctx}; shorten the prompt or lower measure.context_depth / "
                              "measure.max_new_tokens")


# --------------------------------------------------------------------------------------------- resolve
def prefill_only(kind: str, limits: list[int]) -> bool:
    """A synthetic workload of one new token per prompt measures the prefill alone (conf/workload/pp512.yaml)."""
    return kind == "synthetic" and max(limits) == 1


def no_decode_problem(m: Any, load: Any = None) -> str:
    """Why a run could time no decode step, from the config alone ('' when it can). A load run (load.enabled) sends
    its own lengths to a target: not the pipeline's decode. Checked at build (harness/config.py), so a sweep of
    measure.max_new_tokens=1,2 is refused in one line before any cell instead of recording a FAILED one."""
    if getattr(load, "enabled", False):
        return ""
    try:
        src = parse(str(m.prompts))
    except QuantbenchError:  # reported by the prompts' own check
        return ""
    limits = [lim or m.max_new_tokens for lim in src.limits] or [m.max_new_tokens]
    if max(limits) > 1 or prefill_only(src.kind, limits):
        return ""
    return (f"no decode phase (zero decode tokens): measure.max_new_tokens={m.max_new_tokens} (with measure.prompts="
            f"{m.prompts}) leaves only the prefill's token, so decode_tokens_per_s has nothing to time; use "
            "measure.max_new_tokens >= 2 (for the prefill alone, use synthetic prompts: +workload=pp512)")


@dataclass
class Workload:
    """The ids a run feeds the model, with their per-prompt lengths and the depth context."""

    kind: str
    prompts: list[list[int]]
    limits: list[int]  # max_new_tokens per prompt
    context: list[int]  # context_depth ids, prefilled before every prompt
    texts: list[str | None]  # the source texts (None for synthetic)
    description: str = ""
    hash: str = ""

    @property
    def depth(self) -> int:
        return len(self.context)

    @property
    def max_new_tokens(self) -> int:
        return max(self.limits)

    def opts_for(self, opts: Any):
        """`batch -> DecodeOptions`: the run's options, with the batch's longest per-prompt length.

        Without per-prompt lengths this is always the same object (state kept on it, e.g. the test-only
        injected work, lives for the whole run). A batch decodes its longest row's length.
        """
        if len(set(self.limits)) == 1:
            return lambda batch: opts
        by_ids: dict[tuple, int] = {}
        for ids, lim in zip(self.prompts, self.limits, strict=True):
            by_ids[tuple(ids)] = max(lim, by_ids.get(tuple(ids), 0))
        copies: dict[int, Any] = {}

        def pick(batch: list[list[int]]) -> Any:
            lim = max(by_ids.get(tuple(p), opts.max_new_tokens) for p in batch)
            if lim == opts.max_new_tokens:
                return opts
            if lim not in copies:
                copies[lim] = replace(opts, max_new_tokens=lim)
            return copies[lim]

        return pick

    def tags(self) -> dict[str, str]:
        lens = sorted({len(p) for p in self.prompts})
        pp = f"pp{lens[0]}" if len(lens) == 1 else f"pp{lens[0]}-{lens[-1]}"
        tgs = sorted(set(self.limits))
        tg = f"tg{tgs[0]}" if len(tgs) == 1 else f"tg{tgs[0]}-{tgs[-1]}"
        start = self.depth + lens[0] if len(lens) == 1 else None
        return {"workload": self.description, "workload.hash": self.hash, "workload.kind": self.kind,
                "workload.pp": pp + (f" @ d{self.depth}" if self.depth else ""),
                "workload.tg": tg + (f" @ d{start}" if start and start > 1 else
                                     (f" @ d{self.depth}+prompt" if self.depth else ""))}

    def artifact(self) -> str:
        """The workload as JSONL: the context ids (if any), then one line per prompt."""
        lines = [json.dumps({"context_ids": self.context})] if self.context else []
        lines += [json.dumps({"prompt": t, "ids": ids, "max_new_tokens": lim})
                  for t, ids, lim in zip(self.texts, self.prompts, self.limits, strict=True)]
        return "\n".join(lines) + "\n"

    def save(self) -> Path:
        """Write the artifact once per hash under the cache root (tracking logs it as workload.jsonl)."""
        path = cache_root() / "workloads" / f"{self.hash}.jsonl"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(self.artifact())
            os.replace(tmp, path)
        return path


def encode_prompts(tokenizer: Any, prompts: list[str], chat_template: bool) -> list[list[int]]:
    """Texts to ids, through the tokenizer's chat template when asked and present."""
    out = []
    for text in prompts:
        if chat_template and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(list(ids))
    return out


def ordinary_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's vocabulary without special and added tokens (control tokens, chat markers)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [i for i in range(len(tokenizer)) if i not in special]


def random_ids(tokenizer: Any, n: int, seed: int, stream: int) -> list[int]:
    """n seeded random ordinary ids; `stream` separates prompts from the depth context."""
    pool = np.asarray(ordinary_ids(tokenizer), dtype=np.int64)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, stream])
    return [int(x) for x in pool[rng.integers(0, len(pool), size=n)]]


def resolve(measure: Any, tokenizer: Any) -> Workload:
    """The run's workload as ids (deterministic: same settings and tokenizer, same ids)."""
    src = parse(str(measure.prompts))
    m = measure
    if src.kind == "synthetic":
        ids = [random_ids(tokenizer, m.prompt_tokens, m.seed, 1 + i) for i in range(src.count)]
        texts: list[str | None] = [None] * src.count
        limits = [m.max_new_tokens] * src.count
        what = f"synthetic: {src.count} x {m.prompt_tokens} random token ids (seed {m.seed})"
    else:
        ids = encode_prompts(tokenizer, src.texts, m.chat_template)
        texts = list(src.texts)
        limits = [lim or m.max_new_tokens for lim in src.limits]
        lens = sorted(len(x) for x in ids)
        origin = f"set {src.name}" if src.kind == "set" else f"file {src.name} ({src.kind})"
        what = (f"{origin}: {len(ids)} prompts, {lens[0]}-{lens[-1]} tokens"
                + (", chat template" if m.chat_template and getattr(tokenizer, "chat_template", None) else ""))
    context = random_ids(tokenizer, m.context_depth, m.seed, 0) if m.context_depth else []
    news = sorted(set(limits))
    what += f", {news[0]}" + (f"-{news[-1]}" if len(news) > 1 else "") + " new tokens"
    if context:
        what += f", context depth {len(context)}"
    digest = hashlib.sha256(json.dumps({"prompts": ids, "limits": limits, "context": context}).encode())
    return Workload(kind=src.kind, prompts=ids, limits=limits, context=context, texts=texts, description=what,
                    hash=digest.hexdigest()[:16])


def check_resolved(wl: Workload, model: Any) -> None:
    """The exact lengths against the model's context (engines call it before loading the weights)."""
    ctx = context_length(model)
    if ctx is None:
        return
    for i, (ids, lim) in enumerate(zip(wl.prompts, wl.limits, strict=True)):
        if wl.depth + len(ids) + lim > ctx:
            raise QuantbenchError(f"prompt {i} is {len(ids)} tokens: with measure.context_depth={wl.depth} and "
                                  f"{lim} new tokens it needs {wl.depth + len(ids) + lim} positions, beyond the "
                                  f"model's context of {ctx}; shorten it or lower the depth / max_new_tokens")


# --------------------------------------------------------------------------------------------- record
def _mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v == v]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def metrics(wl: Workload, gens: list[Any], model_config: Any = None, params: float | None = None) -> dict[str, float]:
    """Lengths and llama-bench-style mean +- sd of the per-call speeds (pp: prefill, tg: decode).

    With the model's config and parameter count, also the compute side of the roofline (harness/analysis/crossover.py).
    """
    pp = [g.prompt_tokens_per_s for g in gens if g.prompt_s > 0]  # over prefill time (harness/measure/__init__.py)
    tg = [g.decode_tokens_per_s for g in gens if g.decode_tokens > 0 and g.decode_s > 0]  # decode wall clock
    (pp_mean, pp_sd), (tg_mean, tg_sd) = _mean_sd(pp), _mean_sd(tg)
    out = {"prompt_len_tokens": float(statistics.median(len(p) for p in wl.prompts)),
           "decode_len_tokens": float(statistics.median(wl.limits)),
           "context_depth_tokens": float(wl.depth),
           "prompt_tokens_per_s_mean": pp_mean, "prompt_tokens_per_s_sd": pp_sd,
           "decode_tokens_per_s_mean": tg_mean, "decode_tokens_per_s_sd": tg_sd}
    if model_config is not None and params:
        out.update(flop_metrics(model_config, float(params), gens, wl.depth))
    return out


def record(wl: Workload) -> dict[str, str]:
    """Tags of the workload, with the path of its saved artifact (`workload.file`)."""
    tags = wl.tags()
    try:
        tags["workload.file"] = str(wl.save())
    except OSError as exc:  # the run does not depend on the artifact
        log.warning("could not save the workload artifact: %s", exc)
    return tags
