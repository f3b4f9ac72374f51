"""The shared prefill + decode loop (batch >= 1, left padding), written out so every step is timed.

transformers' `generate()` hides per-step times, so quantbench runs its own loop: one forward for the
prompt (TTFT), then one forward per new token against the KV cache. Each step is timed on its own
(`step_s`: ITL), and the decode phase as a whole by the wall clock from the first token on the host to
the last (`decode_wall_s`: decode tokens/s), so host work between steps counts too. Left padding keeps
the newest token of every row in the last column; the attention mask hides the pads and `position_ids`
restart at 0 after them, so a padded row computes exactly what it would alone. Only real tokens are
counted: never pads, and with `stop_at_eos` nothing after a row's EOS.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from harness.measure import Generation, model_grad_mode, now, sync
from strategies.base import DecodeOptions
from strategies.inject import injected_step


class OneDnnOff:
    """A reusable context: oneDNN off inside (ATen's own kernels take the matmuls), restored after."""

    def __enter__(self) -> None:
        self.before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.mkldnn.enabled = self.before


def left_pad(batch: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def make_cache(model: Any, opts: DecodeOptions, batch_size: int, max_len: int):
    from transformers import DynamicCache, StaticCache

    if opts.cache == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return DynamicCache(config=model.config)


def forward(model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any,
            cache_position: torch.Tensor) -> torch.Tensor:
    """One forward pass; returns last-position logits only (`logits_to_keep=1`: no full-vocab prefill)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                cache_position=cache_position, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]


class DepthContext:
    """`measure.context_depth`: the same `ids` sit in the KV cache before every prompt (llama-bench's -d).

    They are prefilled untimed, in chunks of `CHUNK` tokens (bounded attention memory), once per batch size:
    at batch 1, then repeated for every row (identical rows give identical K/V, so a batch of 16 at depth
    4096 costs one 4096-token prefill, not 16). After each generation the dynamic cache is cropped back to
    the depth, so warmup and repetitions reuse it. A static cache (measure.cache=static) has a fixed length
    per call and is prefilled at the batch size for every call instead.
    """

    CHUNK = 512

    def __init__(self, ids: list[int]):
        self.ids = list(ids)
        self._caches: dict[int, Any] = {}

    @property
    def depth(self) -> int:
        return len(self.ids)

    def _prefill(self, model: Any, cache: Any, bsz: int, device: str) -> None:
        for start in range(0, self.depth, self.CHUNK):
            chunk = self.ids[start:start + self.CHUNK]
            x = torch.tensor([chunk] * bsz, dtype=torch.long, device=device)
            pos = torch.arange(start, start + len(chunk), device=device)
            mask = torch.ones((bsz, start + len(chunk)), dtype=torch.long, device=device)
            forward(model, x, mask, pos[None].expand(bsz, -1), cache, pos)

    def cache_for(self, model: Any, opts: DecodeOptions, bsz: int, new_len: int) -> Any:
        """A cache holding exactly the depth tokens, for `new_len` more positions per row."""
        if opts.cache == "static":
            cache = make_cache(model, opts, bsz, self.depth + new_len)
            self._prefill(model, cache, bsz, opts.device)
            return cache
        cache = self._caches.get(bsz)
        if cache is None:
            cache = make_cache(model, opts, 1, self.depth)
            self._prefill(model, cache, 1, opts.device)
            if bsz > 1:
                cache.batch_repeat_interleave(bsz)
            self._caches[bsz] = cache
        extra = cache.get_seq_length() - self.depth
        if extra > 0:
            cache.crop(-extra)  # drop the previous generation's prompt and tokens
        return cache


@model_grad_mode  # inference_mode, or no_grad where the quantizer needs it
def greedy_generate(model: Any, batch: list[list[int]], opts: DecodeOptions,
                    step_fn: Any = None) -> Generation:
    """Greedy decoding of a (left-padded) batch, timing prefill and every decode step.

    `step_fn(ids, mask, pos, cache, cache_position) -> logits` replaces the plain forward for decode
    steps (the compiled fast path passes its compiled function here).
    """
    device = opts.device
    ids, mask = left_pad(batch, opts.pad_token_id, device)
    bsz, width = ids.shape
    fast = opts.fast_path  # compiled path: its own reused fixed-length static cache and compiled step
    depth = opts.context.depth if opts.context is not None else 0  # tokens already in the cache (untimed)
    if opts.context is not None:
        cache = opts.context.cache_for(model, opts, bsz, width + opts.max_new_tokens)
        mask = torch.cat([mask.new_ones((bsz, depth)), mask], dim=1)  # the mask spans the whole cache
    else:
        cache = (fast.make_cache(model, bsz, width + opts.max_new_tokens) if fast is not None
                 else make_cache(model, opts, bsz, width + opts.max_new_tokens))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, depth:]
    cache_position = torch.arange(depth, depth + width, device=device)
    step = step_fn or (fast.step if fast is not None else forward)
    # measure.gemv=aten: one-row matmuls take ATen's GEMV, not oneDNN's (harness/measure/paths.py); reusable
    one_row = OneDnnOff() if opts.gemv_aten and bsz == 1 else contextlib.nullcontext()

    sync(device)
    t0 = now()
    logits = forward(model, ids, mask, pos, cache, cache_position)
    nxt = logits.argmax(-1) if opts.choose is None else opts.choose(logits, 0)
    tokens = nxt.tolist()  # host copy: needed to test EOS, and it is what a server would stream
    sync(device)
    t_first = now()  # the first token is on the host: the decode phase's wall clock starts here
    ttft = t_first - t0

    sequences: list[list[int]] = [[t] for t in tokens]
    done = [opts.stop_at_eos and t == opts.eos_token_id for t in tokens]
    step_s: list[float] = []
    decode_tokens = 0
    last_pos = pos[:, -1:]
    for i in range(opts.max_new_tokens - 1):
        if all(done):
            break
        mask = torch.cat([mask, mask.new_ones((bsz, 1))], dim=1)
        last_pos = last_pos + 1
        cpos = torch.tensor([depth + width + i], device=device)
        sync(device)
        t = now()
        with one_row:
            logits = step(model, nxt[:, None], mask, last_pos, cache, cpos)
        nxt = logits.argmax(-1) if opts.choose is None else opts.choose(logits, i + 1)
        tokens = nxt.tolist()
        sync(device)
        dt = now() - t
        if opts.inject_slowdown > 0 or opts.inject_work > 0:  # test-only: a slower step, inside the timing
            dt = injected_step(opts, t, dt)  # spin-wait or real extra work (strategies/inject.py)
        step_s.append(dt)
        for row, tok in enumerate(tokens):
            if done[row]:
                continue  # generated past this row's EOS: computed, never counted
            sequences[row].append(tok)
            decode_tokens += 1
            if opts.stop_at_eos and tok == opts.eos_token_id:
                done[row] = True
    # the decode phase's wall clock: steps plus the host work between them (mask, positions, bookkeeping)
    decode_wall = now() - t_first if step_s else 0.0
    return Generation(sequences=sequences, prompt_tokens=int(mask[:, depth:depth + width].sum()), ttft_s=ttft,
                      step_s=step_s, decode_tokens=decode_tokens, decode_wall_s=decode_wall)
