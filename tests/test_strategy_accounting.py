"""What the batched and speculative strategies count when rows stop early or share work: a row stopped at EOS is
not a slow row, a speculative step past EOS accepts nothing it did not emit, and continuous batching prefills every
request it counts (prefix sharing off unless asked for)."""

from __future__ import annotations

import random

import pytest

from harness.measure import Generation
from harness.models import TinyRandom, load_pretrained
from strategies.base import DecodeOptions
from strategies.continuous_batch import ContinuousBatch
from strategies.decode import greedy_generate
from strategies.speculative import ModelDrafter, Speculative, speculative_generate
from strategies.static_batch import StaticBatch, row_rates


@pytest.fixture(scope="module")
def target():
    return load_pretrained(TinyRandom(), "float32", "cpu")


def test_a_row_stopped_at_eos_runs_at_the_batch_step_rate():
    """Hand-computed: 10 steps of 0.1 s in a 1.25 s wall clock (host work pro rata); the row that stopped after
    2 tokens ran 2 steps, i.e. 0.25 s, at the same 8 tokens/s as the row that ran all 10."""
    gen = Generation(sequences=[[1] * 3, [1] * 11], prompt_tokens=4, ttft_s=0.1, step_s=[0.1] * 10,
                     decode_tokens=12, decode_wall_s=1.25, stats={"row_decode_tokens": [2, 10]})
    assert row_rates(gen) == pytest.approx([8.0, 8.0])
    assert StaticBatch(batch_size=2).metrics([gen])["per_sequence_tokens_per_s"] == pytest.approx(8.0)
    uneven = Generation(sequences=[[1] * 2, [1] * 4], prompt_tokens=4, ttft_s=0.1, step_s=[0.3, 0.1, 0.1],
                        decode_tokens=4, decode_wall_s=0.5, stats={"row_decode_tokens": [1, 3]})
    assert row_rates(uneven) == pytest.approx([1 / 0.3, 3 / 0.5])  # the first step was the slow one


def test_speculative_counts_nothing_past_eos(target):
    draft = load_pretrained(TinyRandom(), "bfloat16", "cpu")  # a near copy: accepts (almost) every draft token
    prompt = [9, 10, 11, 12, 13, 14, 15, 9, 10, 11]
    free = greedy_generate(target, [prompt], DecodeOptions(max_new_tokens=16)).sequences[0]
    eos = free[2]
    assert eos not in free[:2]
    opts = DecodeOptions(max_new_tokens=16, eos_token_id=eos, stop_at_eos=True)
    gen = speculative_generate(target, prompt, opts, ModelDrafter(draft, "cpu"), 4)
    assert gen.sequences[0] == free[:3] and gen.decode_tokens == 2
    steps = gen.stats["steps"]
    assert all(0 <= a <= d for d, a in steps)
    assert sum(a for _, a in steps) <= gen.decode_tokens  # accepted tokens were all emitted
    gen.stats.update(greedy_e2e_s=1.0, greedy_decode_tokens_per_s=1.0, greedy_match=1.0)
    m = Speculative(draft="model").metrics([gen])
    assert m["tokens_per_verify_step"] == pytest.approx(gen.decode_tokens / len(steps))


def test_continuous_batch_batch_size_is_what_the_stream_can_hold():
    assert ContinuousBatch(requests=3).batch_size == 3
    assert ContinuousBatch(requests=40, max_requests_per_batch=16).batch_size == 16


@pytest.mark.parametrize("sharing", [False, True])
def test_continuous_batch_prefills_every_request_unless_sharing_is_asked_for(target, monkeypatch, sharing):
    """16 requests cycle 4 prompts of 100 tokens: with transformers' prefix sharing, a repeat's full KV pages come
    from the first copy (never prefilled, yet counted in prompt_tokens); off by default, so none do."""
    from transformers.generation.continuous_batching import cache as cbcache

    shared: list[int] = []
    search = cbcache.PagedAttentionCache.search_prefix_match

    def spy(self, *args, **kwargs):
        n = search(self, *args, **kwargs)
        shared.append(n)
        return n

    monkeypatch.setattr(cbcache.PagedAttentionCache, "search_prefix_match", spy)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(100)] for _ in range(4)]
    strategy = ContinuousBatch(prefix_sharing=sharing)
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    try:
        gen = strategy.generate(target, strategy.batches(prompts)[0], DecodeOptions(max_new_tokens=4))
    finally:
        strategy.teardown()
    assert gen.prompt_tokens == 1600 and gen.decode_tokens == 16 * 3
    assert (sum(shared) > 0) is sharing, shared
