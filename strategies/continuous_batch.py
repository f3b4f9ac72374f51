"""Continuous batching through transformers' own scheduler (`generate_batch`, paged KV cache).

A stream of `requests` prompts of mixed lengths (the prompt set cycled) is handed to
`model.generate_batch`, which schedules them into shared forward passes and retires each request when
it finishes. transformers 5.24 runs it on CPU with `attn_implementation="paged|eager"`; the model is
switched to it in `setup` through the public `set_attn_implementation` and switched back in `teardown`,
so the loader needs no special case. Only generated tokens are counted (the library returns them per
request; EOS ends a request only with measure.stop_at_eos=true).

Times: the scheduler mixes prompt chunks and other requests' decode tokens in one forward, so the stream's time
is split by forward (`decode_phase`): a forward that starts while some prompt is being processed is prefill's
(`prefill_s`, the union of those spans, `prefill_window`, which `prompt_tokens_per_s` divides by); the others are
the decode phase: `decode_wall_s` is their wall clock (forward start to the next, host work included) and
`decode_tokens` the tokens they emitted, so `decode_tokens_per_s` is the stream's decode-only rate, as static
batching's decode phase is. (The window from the first token to the last, used before, was mostly other
requests' prefill at short outputs: 384 against 3342 tokens/s on the tiny model, 16 requests of ~120-token
prompts, 8 new tokens; and that time was counted in `prefill_s` as well.) Tokens that rode on a prefill forward
count in `generated_tokens`, `stream_tokens_per_s` and `decode_step_tokens_per_s` (all decode tokens over the sum
of per-request gaps: the mean speed of a single request); `step_s` (ITL) holds the gaps between each request's
own consecutive tokens, and `e2e_ms` the calls' own wall clock from the start to the last token.

Prefix sharing is off (`prefix_sharing: false`): the stream cycles a few prompts, and transformers' default
(`allow_block_sharing`) would serve a repeated prompt's full pages from the first copy's KV, so up to half the
prompt tokens counted in `prompt_tokens_per_s` were never prefilled (60% of them at 512-token prompts, measured
on the tiny test model) and static batching, which recomputes every row, lost an unfair comparison. `true`
measures prefix caching on purpose (the run records it as param `strategy.prefix_sharing`).

The paged cache is sized from the requests (`num_blocks=null`): transformers' own sizing assumes a GPU
and allocates far too much on CPU, which made a 3-request call take ~45 s instead of ~2 s here. It holds every
request's pages from the start (`pages`), so the memory estimate counts them all (`kv_positions`), not one
batch's rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from harness.errors import ConfigError, QuantbenchError
from harness.measure import Generation, now, percentile, sync
from harness.measure.omp import free_omp_pool
from strategies.base import DecodeOptions, Strategy

PAGED = "paged|eager"  # "sdpa_paged" is rejected by transformers 5.24; "sdpa" ran 2-4% faster here (noise)


def prefill_spans(results: list[Any], t0: float) -> list[tuple[float, float]]:
    """Each request's [scheduled (left the queue), first token]: when its prompt was being processed."""
    return sorted((r.lifespan[0] if r.lifespan[0] >= 0 else max(r.created_time, t0), r.timestamps[0])
                  for r in results if r.timestamps)


def prefill_window(results: list[Any], t0: float) -> float:
    """Seconds during which some request's prompt was being processed: the union of `prefill_spans`.
    Requests prefill side by side (shared forward passes), so the union, not the sum, is the time the prompts
    took; decode tokens of other requests that share those forwards ride in it (the scheduler mixes them).
    """
    spans = prefill_spans(results, t0)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total


def decode_phase(starts: list[float], spans: list[tuple[float, float]], stamps: list[list[float]]
                 ) -> tuple[int, float, int]:
    """(tokens, seconds, forwards) of the decode phase (module docstring): the forwards that start while no
    prompt is being processed, each from its start to the next one's (the last: to the last token), inside the
    window from the first token to the last; and the decode tokens (a request's 2nd, 3rd...) they emitted: a
    token is stamped after the forward that made it and before the next starts."""
    starts = sorted(starts)
    flat = sorted(t for ts in stamps for t in ts)
    if not starts or len(flat) < 2:
        return 0, 0.0, 0
    first, last = flat[0], flat[-1]
    decode = [not any(a <= t < b for a, b in spans) for t in starts]
    seconds = sum(max(0.0, min(starts[i + 1] if i + 1 < len(starts) else last, last) - max(t, first))
                  for i, t in enumerate(starts) if decode[i])
    tokens = sum(1 for ts in stamps for t in ts[1:] if (i := bisect.bisect_right(starts, t) - 1) >= 0 and decode[i])
    return tokens, seconds, sum(1 for i, t in enumerate(starts) if decode[i] and first <= t < last)


@dataclass
class ContinuousBatch(Strategy):
    """A stream of mixed-length requests through transformers' continuous batching."""

    batches_rows = True
    schedules_rows = True  # requests join and leave the batch on their own: the roofline takes them one by one

    requests: int = 16  # requests per stream (the prompt set is cycled)
    max_requests_per_batch: int = 16  # how many requests may share one forward pass
    page_size: int = 32  # tokens per KV page
    num_blocks: int | None = None  # KV pages; null = enough for every request at once
    max_batch_tokens: int = 512  # tokens per forward pass (prefill chunks + decode tokens)
    prefix_sharing: bool = False  # reuse the KV pages of a prompt seen before (module docstring)
    _original_attn: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        p = []
        for name in ("requests", "max_requests_per_batch", "page_size", "max_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                p.append(f"strategy.{name}={v!r} must be an integer >= 1")
        if not isinstance(self.prefix_sharing, bool):
            p.append(f"strategy.prefix_sharing={self.prefix_sharing!r} must be true or false")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            p.append(f"strategy.num_blocks={self.num_blocks!r} must be null (auto) or an integer >= 1")
        if p:
            raise ConfigError(p)

    @property
    def batch_size(self) -> int:
        return min(self.max_requests_per_batch, self.requests)  # the most rows a step can hold

    def pages(self, lengths: list[int]) -> int:
        """KV pages the paged cache is given for requests of `lengths` tokens (prompt + new): `num_blocks`, else
        every request's own pages at once, plus one each. transformers allocates them all when the call starts."""
        return self.num_blocks or sum(-(-n // self.page_size) + 1 for n in lengths)

    def kv_positions(self, positions: int) -> int:
        return self.pages([positions] * self.requests) * self.page_size  # all requests', not one batch's

    def preflight(self) -> None:
        try:
            from transformers import ContinuousBatchingConfig  # noqa: F401
        except ImportError as exc:
            raise QuantbenchError("strategy=continuous_batch needs transformers >= 5 (generate_batch with paged "
                                  "attention); install the pinned transformers==5.24.0") from exc

    def workload_problem(self, prompts: int) -> str | None:
        if self.requests < prompts:  # the stream takes the first `requests` prompts: the rest would never run
            return (f"strategy.requests={self.requests} is fewer than the workload's {prompts} prompts: "
                    f"{prompts - self.requests} would never run while prompt_len_tokens and the workload tags "
                    f"describe all {prompts}; set strategy.requests >= {prompts} (a multiple of {prompts} runs each "
                    "prompt equally often) or give fewer prompts")
        return None

    def batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        return [[prompts[i % len(prompts)] for i in range(self.requests)]] if prompts else []

    def setup(self, *, model: Any, tokenizer: Any, opts: DecodeOptions, experiment: Any) -> None:
        if not hasattr(model, "generate_batch"):
            raise QuantbenchError(f"{type(model).__name__} has no generate_batch; strategy=continuous_batch needs a "
                                  "transformers model (use strategy=static_batch)")
        self._original_attn = model.config._attn_implementation
        if self._original_attn != PAGED:
            model.set_attn_implementation(PAGED)
        self._model = model

    def teardown(self) -> None:
        model = getattr(self, "_model", None)
        if model is not None and self._original_attn not in (None, PAGED):
            model.set_attn_implementation(self._original_attn)
        self._model = None

    def generate(self, model: Any, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        cb = ContinuousBatchingConfig(page_size=self.page_size,
                                      num_blocks=self.pages([len(p) + opts.max_new_tokens for p in batch]),
                                      max_batch_tokens=self.max_batch_tokens,
                                      max_requests_per_batch=self.max_requests_per_batch, auto_switch_to_flash=False,
                                      allow_block_sharing=self.prefix_sharing)
        gen_cfg = GenerationConfig(max_new_tokens=opts.max_new_tokens, do_sample=False,
                                   eos_token_id=opts.eos_token_id if opts.stop_at_eos else -1,
                                   pad_token_id=opts.pad_token_id)
        sync(opts.device)
        free_omp_pool()  # generate_batch decodes on its own thread: without this its every op ran ~2x slower (omp.py)
        starts: list[float] = []  # each forward's start (the scheduler calls model(**batch): hooks fire)
        hook = model.register_forward_pre_hook(lambda *_: starts.append(now()))
        t0 = now()
        try:
            out = model.generate_batch(inputs=batch, generation_config=gen_cfg, continuous_batching_config=cb,
                                       record_timestamps=True, progress_bar=False, warmup=False)
        finally:
            hook.remove()
        sync(opts.device)
        wall = now() - t0
        results = sorted(out.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
        if len(results) != len(batch) or any(r.error for r in results):
            errors = [r.error for r in results if r.error]
            raise QuantbenchError(f"continuous batching returned {len(results)} of {len(batch)} requests"
                                  + (f"; first error: {errors[0]}" if errors else ""))
        sequences = [list(r.generated_tokens) for r in results]
        stamps = sorted(t for r in results for t in (r.timestamps or []))
        first = [r.timestamps[0] - r.created_time for r in results if r.timestamps]
        latency = [r.timestamps[-1] - r.created_time for r in results if r.timestamps]
        # ITL per request: the gaps between one request's consecutive tokens (never between two requests')
        itl = [b - a for r in results for a, b in zip(r.timestamps or [], (r.timestamps or [])[1:], strict=False)]
        created = min((r.created_time for r in results), default=t0)
        # timestamps are perf_counter readings per emitted token; the decode phase is the decode-only forwards
        tokens, seconds, forwards = decode_phase(starts, prefill_spans(results, t0), [r.timestamps or [] for r in results])
        return Generation(sequences=sequences, prompt_tokens=sum(len(p) for p in batch),
                          ttft_s=(stamps[0] - t0) if stamps else wall, step_s=itl,
                          decode_tokens=tokens, decode_wall_s=seconds, prefill_s=prefill_window(results, t0),
                          stats={"wall_s": wall, "request_latency_s": latency, "request_ttft_s": first,
                                 "request_itl_s": itl, "stream_s": (stamps[-1] - created) if stamps else wall,
                                 "e2e_s": (stamps[-1] - t0) if stamps else wall,
                                 "all_decode_tokens": sum(len(s) for s in sequences) - len(sequences),
                                 # the decode phase's forwards: its steps (rows per forward vary, so the
                                 # roofline's and the floor's step is measured, not the batch)
                                 "decode_forwards": forwards})

    def metrics(self, generations: list[Generation]) -> dict[str, float]:
        wall = sum(g.stats["wall_s"] for g in generations)
        lat = [x for g in generations for x in g.stats["request_latency_s"]]
        ttft = [x for g in generations for x in g.stats["request_ttft_s"]]
        stream = sum(g.stats["stream_s"] for g in generations)
        ms = 1000.0
        return {
            "batch_size": float(self.batch_size),
            "requests": float(self.requests),
            # whole generate_batch calls, scheduler start and stop included
            "aggregate_tokens_per_s": sum(g.generated_tokens for g in generations) / wall if wall else float("nan"),
            # from the first request's arrival to the last token: excludes the scheduler's start/stop
            "stream_tokens_per_s": sum(g.generated_tokens for g in generations) / stream if stream else float("nan"),
            "request_itl_ms_p50": percentile([x for g in generations for x in g.stats["request_itl_s"]], 50) * ms,
            # the calls' own wall clock (TTFT + decode_wall_s would leave out the prefill forwards after the first
            # token) and a single request's speed over every decode token (module docstring)
            "e2e_ms": percentile([g.stats["e2e_s"] for g in generations], 50) * ms,
            "decode_step_tokens_per_s": percentile([g.stats["all_decode_tokens"] / sum(g.step_s) for g in generations
                                                    if g.step_s and sum(g.step_s) > 0], 50),
            "request_latency_ms_p50": percentile(lat, 50) * ms,
            "request_latency_ms_p90": percentile(lat, 90) * ms,
            "request_ttft_ms_p50": percentile(ttft, 50) * ms,
            "request_ttft_ms_p90": percentile(ttft, 90) * ms,
            # the headline TTFT is per request here: a call's first token (of whichever request the scheduler
            # served first) would make one stream of many requests look as responsive as one greedy request
            "ttft_ms": percentile(ttft, 50) * ms,
            "ttft_ms_p90": percentile(ttft, 90) * ms,
            # tokens a forward emitted on average in the decode window: the step of the roofline and the floor
            **({"decode_tokens_per_step": sum(g.decode_tokens for g in generations) / forwards}
               if (forwards := sum(g.stats.get("decode_forwards", 0) for g in generations)) else {}),
        }
