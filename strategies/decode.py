"""The shared prefill + decode loop (batch >= 1, left padding), written out so every step is timed.

transformers' `generate()` hides per-step times, so quantbench runs its own loop: one forward for the
prompt (TTFT), then one forward per new token against the KV cache. Left padding keeps the newest token
of every row in the last column; the attention mask hides the pads and `position_ids` restart at 0 after
them, so a padded row computes exactly what it would alone. Only real tokens are counted: never pads,
and with `stop_at_eos` nothing after a row's EOS.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.measure import Generation, model_grad_mode, now, sync
from strategies.base import DecodeOptions


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
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    fast = opts.fast_path  # compiled path: its own reused fixed-length static cache and compiled step
    cache = (fast.make_cache(model, bsz, width + opts.max_new_tokens) if fast is not None
             else make_cache(model, opts, bsz, width + opts.max_new_tokens))
    cache_position = torch.arange(width, device=device)
    step = step_fn or (fast.step if fast is not None else forward)

    sync(device)
    t0 = now()
    logits = forward(model, ids, mask, pos, cache, cache_position)
    nxt = logits.argmax(-1) if opts.choose is None else opts.choose(logits, 0)
    tokens = nxt.tolist()  # host copy: needed to test EOS, and it is what a server would stream
    sync(device)
    ttft = now() - t0

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
        cpos = torch.tensor([width + i], device=device)
        sync(device)
        t = now()
        logits = step(model, nxt[:, None], mask, last_pos, cache, cpos)
        nxt = logits.argmax(-1) if opts.choose is None else opts.choose(logits, i + 1)
        tokens = nxt.tolist()
        sync(device)
        dt = now() - t
        if opts.inject_slowdown > 0:  # test-only: makes the step really slower, inside the timing
            # spin, not sleep: sleep(0.1 ms) measured 0.18 ms median here (OS wake-up latency), so a 10% sleep
            # stretched tiny-model steps by far more than 10% and would overstate the gate's power
            until = t + dt * (1.0 + opts.inject_slowdown)
            while now() < until:
                pass
            dt = now() - t
        step_s.append(dt)
        for row, tok in enumerate(tokens):
            if done[row]:
                continue  # generated past this row's EOS: computed, never counted
            sequences[row].append(tok)
            decode_tokens += 1
            if opts.stop_at_eos and tok == opts.eos_token_id:
                done[row] = True
    return Generation(sequences=sequences, prompt_tokens=int(mask[:, :width].sum()), ttft_s=ttft,
                      step_s=step_s, decode_tokens=decode_tokens)
