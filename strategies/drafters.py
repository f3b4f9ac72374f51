"""The drafters of speculative decoding (strategies/speculative.py) and the forward they share with its loop.

A drafter has `reset()` (a new prompt), `prefill(prompt)` (inside TTFT, as the target's prefill),
`propose(seq, k) -> up to k tokens` and `rollback(keep)` (drop what the target rejected), and counts what its
decode-phase work read since `reset()` for the roofline: `forwards` (draft-model forwards, each a read of its
weights) and `kv_read` (KV positions those forwards attended over); the prefill is not a decode step's.
Also here: the draft model's checks before it loads (`source_vocab`, `as_draft` for its error messages). `ModelDrafter`: greedy
proposals from a draft model with its own KV cache; `LookupDrafter`: prompt lookup, no model (reads neither).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness import gguf_meta
from harness.errors import ConfigError, QuantbenchError
from strategies.decode import OneDnnOff


def run_forward(model: Any, ids: list[int], start: int, cache: Any, device: str, *, last: bool = False,
                gemv_aten: bool = False) -> torch.Tensor:
    """Feed `ids` at positions start.. on top of a cache holding `start` tokens; logits for every id, or for
    the newest only (`last`: prefills and draft steps need no more; greedy's `logits_to_keep=1`).

    `gemv_aten` (measure.gemv=aten): a one-token forward after the prefill runs with oneDNN off, as greedy's
    batch-1 decode steps do (strategies/decode.py); prefills and multi-token forwards keep oneDNN, as there.
    """
    n = len(ids)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    pos = torch.arange(start, start + n, device=device)
    mask = torch.ones((1, start + n), dtype=torch.long, device=device)
    with OneDnnOff() if gemv_aten and n == 1 and start > 0 else contextlib.nullcontext():
        out = model(input_ids=x, attention_mask=mask, position_ids=pos[None], cache=cache, cache_position=pos,
                    use_cache=True, logits_to_keep=1 if last else n)
    return out.logits[0]


def crop_to(cache: Any, have: int, keep: int) -> None:
    """Drop the newest `have - keep` entries (transformers 5 `crop` takes a negative count)."""
    if have > keep:
        cache.crop(keep - have)


class ModelDrafter:
    """Greedy proposals from a draft model with its own KV cache (rolled back like the target's)."""

    def __init__(self, model: Any, device: str, gemv_aten: bool = False):
        self.model, self.device, self.gemv_aten = model, device, gemv_aten  # gemv_aten: see run_forward
        self.cache: Any = None
        self.n = 0  # tokens held in the draft cache
        self.forwards = self.kv_read = 0  # since reset (module docstring)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache, self.n = DynamicCache(config=self.model.config), 0
        self.forwards = self.kv_read = 0

    def prefill(self, prompt: list[int]) -> None:
        """The prompt into the draft cache (TTFT's work, so not counted in `forwards`/`kv_read`)."""
        run_forward(self.model, prompt, 0, self.cache, self.device, last=True)
        self.n = len(prompt)

    def propose(self, seq: list[int], k: int) -> list[int]:
        out: list[int] = []
        ids = seq[self.n:]  # 1-2 tokens: what the target added since (the whole prompt if `prefill` was skipped)
        for _ in range(k):
            logits = run_forward(self.model, ids, self.n, self.cache, self.device, last=True,
                                 gemv_aten=self.gemv_aten)
            self.n += len(ids)
            self.forwards += 1
            self.kv_read += self.n  # the forward attends over everything cached, its own tokens included
            ids = [int(logits[-1].argmax())]
            out.append(ids[0])
        return out  # the cache now holds seq + out[:-1]

    def rollback(self, keep: int) -> None:
        crop_to(self.cache, self.n, keep)
        self.n = min(self.n, keep)


@dataclass
class LookupDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, propose what followed."""

    ngram_max: int = 3
    ngram_min: int = 1
    forwards = kv_read = 0  # no draft model: reads no weights, no KV (class constants, not fields)

    def reset(self) -> None:
        pass

    def prefill(self, prompt: list[int]) -> None:
        pass

    def propose(self, seq: list[int], k: int) -> list[int]:
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            tail = seq[-n:]
            for j in range(len(seq) - n - 1, -1, -1):
                if seq[j: j + n] == tail:
                    return seq[j + n: j + n + k]
        return []

    def rollback(self, keep: int) -> None:
        pass


def as_draft(exc: QuantbenchError) -> QuantbenchError:
    """A model's error about the draft model: its messages name `model.<key>`, the key is strategy.draft_model's."""
    def fix(line: str) -> str:
        # a setting's name (at the start, after a space, `(` or a backquote), never a path's `.../model.Q4_0.gguf`
        return re.sub(r"(?<![^\s(`])model\.(?=[a-z_])", "strategy.draft_model.", line)
    if isinstance(exc, ConfigError):
        return ConfigError([fix(p) for p in exc.problems])
    try:
        return type(exc)(fix(str(exc)))  # Unsupported stays Unsupported (a sweep records SKIPPED)
    except TypeError:
        return QuantbenchError(fix(str(exc)))


def source_vocab(source: Any) -> dict[str, int]:
    """Token -> id map of a model source, read from tokenizer files (no model weights are loaded)."""
    gguf = source.gguf_path
    if gguf is not None:
        tokens = gguf_meta.read(gguf).fields["tokenizer.ggml.tokens"]
        return {bytes(tokens.parts[i]).decode("utf-8", "replace"): n for n, i in enumerate(tokens.data)}
    local = Path(source.local_dir())
    tj = local / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text())
        vocab = dict(data.get("model", {}).get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        if vocab:
            return vocab
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(local), trust_remote_code=False).get_vocab())
