"""What the batched and speculative strategies count when rows stop early or share work: a row stopped at EOS is
not a slow row, a speculative step past EOS accepts nothing it did not emit, and continuous batching prefills every
request it counts (prefix sharing off unless asked for)."""

from __future__ import annotations

import contextlib
import math
import random
import time
from types import SimpleNamespace

import pytest
import torch

from harness.analysis import roofline
from harness.analysis.bandwidth import Bandwidth
from harness.config import build
from harness.measure import Generation, floor, kernels, memory, summarize
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
    last = gen.decode_tokens - sum(a + 1 for _, a in steps[:-1])  # what the step that reached EOS emitted
    assert all(d == 4 for d, _ in steps[:-1]) and steps[-1][0] <= last  # drafted: up to EOS, not past it
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
    assert gen.prompt_tokens == 1600 and gen.stats["all_decode_tokens"] == 16 * 3
    assert (sum(shared) > 0) is sharing, shared


# ------------------------------------------------------------------------------------------ speculative fixes
SPEC_PROMPT = [9, 10, 11, 12, 13, 14, 15, 9, 10, 11]


def speculate(target, make_drafter, limit: int, k: int):
    """(drafter, generation): speculative decoding of SPEC_PROMPT with the drafter `make_drafter(reference)` builds
    from plain greedy's tokens; the output is checked equal to greedy's."""
    opts = DecodeOptions(max_new_tokens=limit)
    ref = [*SPEC_PROMPT, *greedy_generate(target, [SPEC_PROMPT], opts).sequences[0]]
    drafter = make_drafter(ref)
    gen = speculative_generate(target, SPEC_PROMPT, opts, drafter, k)
    assert gen.sequences[0] == ref[len(SPEC_PROMPT):]
    return drafter, gen


class OneRight:
    """Proposes greedy's next token, then k-1 wrong ones: exactly 1 of every k drafted is accepted."""

    def __init__(self, ref: list[int]):
        self.ref, self.proposed = ref, []

    forwards = kv_read = 0  # no draft model (strategies/drafters.py)

    def reset(self):
        pass

    def prefill(self, prompt):
        pass

    def rollback(self, keep):
        pass

    def propose(self, seq, k):
        out = [self.ref[len(seq)]] + [7 if self.ref[len(seq) + 1 + i] != 7 else 8 for i in range(k - 1)]
        self.proposed.append(len(out))
        return out


def test_acceptance_counts_rejected_draft_tokens(target):
    """Every drafted token is in the denominator (was: min(drafted, emitted), 0.53 for this 1-of-4 drafter)."""
    drafter, gen = speculate(target, OneRight, 21, 4)
    steps = gen.stats["steps"]
    assert [d for d, _ in steps] == drafter.proposed == [4] * 8 + [3, 1]  # the token budget trims the last two
    assert all(a == 1 for _, a in steps)
    gen.stats.update(greedy_e2e_s=1.0, greedy_decode_tokens_per_s=1.0, greedy_match=1.0)
    m = Speculative(draft="model", num_draft_tokens=4).metrics([gen])
    assert m["acceptance_rate"] == pytest.approx(10 / 36) and m["mean_accepted_tokens"] == 1.0


class Perfect(OneRight):
    def propose(self, seq, k):
        return self.ref[len(seq):len(seq) + k]


def test_a_perfect_draft_is_never_empty_and_nothing_drafted_is_nan_not_zero(target):
    """A perfect drafter: its last step, with one token of budget left, drafts nothing by the budget's rule, not
    the drafter's (empty_draft_fraction was 1/6 here). With a 2-token limit nothing is ever drafted: acceptance 0
    read "every draft rejected" for a perfect draft; it is NaN."""
    def run(limit, k):
        gen = speculate(target, Perfect, limit, k)[1]
        gen.stats.update(greedy_e2e_s=1.0, greedy_decode_tokens_per_s=1.0, greedy_match=1.0)
        return gen, Speculative(draft="model", num_draft_tokens=k).metrics([gen])

    gen, m = run(12, 1)
    assert gen.stats["steps"][-1] == (0, 0) and gen.stats["budget_steps"] == 1  # the budget's last step
    assert m["empty_draft_fraction"] == 0.0 and m["acceptance_rate"] == 1.0
    gen, m = run(2, 4)
    assert gen.stats["steps"] == [(0, 0)]
    for name in ("acceptance_rate", "mean_accepted_tokens", "empty_draft_fraction", "accepted_len_0", "accepted_len_4"):
        assert math.isnan(m[name]), name


class SlowRollback(Perfect):
    """A perfect drafter whose cache rollback takes 30 ms: the step's clock must hold it."""

    def __init__(self, ref: list[int]):
        super().__init__(ref)
        self.keeps: list[int] = []

    def rollback(self, keep):
        self.keeps.append(keep)
        time.sleep(0.03)


def test_the_draft_rollback_is_inside_the_step_time(target):
    """The draft cache's crop ran after the step's clock stopped: ITL and verify_s missed it (was ~0 here)."""
    drafter, gen = speculate(target, SlowRollback, 9, 4)
    n = len(gen.stats["steps"])
    assert sum(gen.step_s) >= 0.03 * n and gen.stats["verify_s"] >= 0.03 * n
    # the draft cache keeps every emitted token but the newest, as before the step's clock moved
    assert drafter.keeps == [len(SPEC_PROMPT) + 1 + sum(len_ + 1 for len_, _ in gen.stats["steps"][: i + 1]) - 1
                             for i in range(n)]


def test_the_greedy_reference_rate_is_a_median_over_the_references_that_decoded():
    """A reference whose first token is EOS (or a one-token limit) decodes nothing: its rate is NaN and is left out,
    as summarize() leaves such calls out of the headline; it made the whole median NaN."""
    from harness.measure import Generation

    def call(greedy_rate):
        gen = Generation(sequences=[[1, 2]], prompt_tokens=3, ttft_s=0.01, step_s=[0.01], decode_tokens=1)
        gen.stats.update(steps=[(2, 0)], draft_s=0.0, verify_s=0.01, greedy_e2e_s=0.02,
                         greedy_decode_tokens_per_s=greedy_rate, greedy_match=1.0)
        return gen

    m = Speculative(draft="prompt_lookup").metrics([call(700.0), call(float("nan")), call(720.0), call(float("nan"))])
    assert m["greedy_decode_tokens_per_s"] == pytest.approx(710.0)


def test_a_draft_model_that_needs_no_grad_runs_under_no_grad(target):
    """quanto int4 fails under inference_mode; its mark on the draft (not on the target) must pick no_grad."""
    draft = load_pretrained(TinyRandom(), "bfloat16", "cpu")
    draft.quantbench_grad_mode = "no_grad"
    modes = []
    draft.register_forward_pre_hook(lambda *a: modes.append(torch.is_inference_mode_enabled()))
    gen = speculative_generate(target, [9, 10, 11, 12], DecodeOptions(max_new_tokens=6), ModelDrafter(draft, "cpu"), 3)
    assert len(gen.sequences[0]) == 6 and modes and not any(modes)


class Spy:
    """Per forward of each model: (tokens fed, tokens before them, logits_to_keep, oneDNN on)."""

    def __init__(self, **models):
        self.calls = {name: [] for name in models}
        self.handles = [m.register_forward_pre_hook(self.hook(name), with_kwargs=True) for name, m in models.items()]

    def hook(self, name):
        def record(mod, args, kwargs):
            pos = kwargs["cache_position"]
            self.calls[name].append((len(pos), int(pos[0]), kwargs["logits_to_keep"], torch.backends.mkldnn.enabled))
        return record

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.fixture()
def bf16_draft():
    return load_pretrained(TinyRandom(), "bfloat16", "cpu")


def test_prefills_keep_only_the_last_logits(target, bf16_draft):
    spy = Spy(target=target, draft=bf16_draft)
    try:
        speculative_generate(target, list(range(9, 40)), DecodeOptions(max_new_tokens=8),
                             ModelDrafter(bf16_draft, "cpu"), 3)
    finally:
        spy.remove()
    prefill, *verify = spy.calls["target"]
    assert prefill[:3] == (31, 0, 1)  # logits_to_keep was 31: full-vocab logits for every prompt position
    assert all(keep == n for n, start, keep, _ in verify)  # the verify forward reads every position
    # the draft prefills the prompt (inside TTFT, beside the target's); it reads the newest logits only, at every step
    assert spy.calls["draft"][0][:3] == (31, 0, 1) and all(c[2] == 1 for c in spy.calls["draft"])


def test_gemv_aten_one_row_forwards_run_as_greedy_steps_do(target, bf16_draft):
    """measure.gemv=aten: greedy's batch-1 steps run with oneDNN off; so do the draft's and the target's one-token
    forwards after their prefill (the draft is built by setup from the run's options); the rest keeps oneDNN."""
    opts = DecodeOptions(max_new_tokens=12, gemv_aten=True)
    quantizer = SimpleNamespace(load=lambda *a, **k: bf16_draft, audit=lambda m: {"bits_per_weight": 16.0,
                                                                                  "weight_bytes": 1.0})
    strategy = Speculative(draft="model", num_draft_tokens=3, draft_quantizer=quantizer)
    strategy.setup(model=target, tokenizer=None, opts=opts, experiment=SimpleNamespace(model=TinyRandom()))
    spy = Spy(target=target, draft=bf16_draft)
    try:
        strategy.generate(target, [[9, 10, 11, 12, 13]], opts)
    finally:
        spy.remove()
    calls = spy.calls["target"] + spy.calls["draft"]
    one_row = [on for n, start, _, on in calls if n == 1 and start > 0]
    assert one_row and not any(one_row) and sum(c[0] == 1 for c in spy.calls["draft"]) > 0
    assert all(on for n, start, _, on in calls if n > 1 or start == 0)


def test_the_memory_estimate_counts_the_draft_model(compose, monkeypatch):
    monkeypatch.setattr(memory, "runtime_bytes", lambda device: 1.0e8)  # RSS now: pinned, the totals compare

    def estimate(*extra):
        exp = build(compose(["model=tiny_random", "quantizer=fp32", "accuracy.enabled=false", *extra]))
        exp.engine.preflight(exp, "cpu")
        return exp, memory.transformers_estimate(exp, "cpu")

    greedy_exp, greedy = estimate()
    _, lookup = estimate("strategy=speculative", "strategy.draft=prompt_lookup")
    exp, same = estimate("strategy=speculative", "quantizer@strategy.draft_quantizer=fp32")
    _, half = estimate("strategy=speculative")  # the default bf16 draft: half the target's bytes
    assert "draft weights" not in greedy.parts and "draft weights" not in lookup.parts
    assert same.parts["draft weights"] == greedy.parts["weights"] > 0
    assert same.parts["draft KV cache"] == greedy.parts["KV cache"] > 0  # batch 1 both
    assert half.parts["draft weights"] == pytest.approx(greedy.parts["weights"] / 2)
    assert same.total == pytest.approx(greedy.total + greedy.parts["weights"] + greedy.parts["KV cache"])
    # what is available excludes the process itself (its runtime part): the midpoint of what each must find free
    free = (greedy.total + same.total) / 2 - greedy.parts["runtime"]
    monkeypatch.setattr(memory, "available_bytes", lambda device: (free, "MemAvailable"))
    assert memory.check(greedy_exp, "cpu") is not None  # the target alone fits; with its draft it does not
    with pytest.raises(memory.DoesNotFit):
        memory.check(exp, "cpu")


def test_the_greedy_reference_is_neither_metered_nor_timed(target, tmp_path, monkeypatch):
    """Pipeline.timed meters the speculative work only: the greedy reference runs with the energy meter paused (a
    fake RAPL counter gains 1 J per target forward), and the Generation's times never include it."""
    import strategies.speculative as spec
    from harness.measure import energy
    from harness.run import pipeline

    pkg = tmp_path / "intel-rapl:0"
    pkg.mkdir()
    (pkg / "energy_uj").write_text("0")
    forwards = {"spec": 0, "greedy": 0}
    phase = {"now": "spec"}

    def tick(*args):
        forwards[phase["now"]] += 1
        (pkg / "energy_uj").write_text(str(int((pkg / "energy_uj").read_text()) + 1_000_000))

    def greedy(*args, **kwargs):
        phase["now"] = "greedy"
        time.sleep(0.1)  # a slow reference: in the timed call's wall clock, not in the Generation's times
        try:
            return real_greedy(*args, **kwargs)
        finally:
            phase["now"] = "spec"

    real_greedy = spec.greedy_generate
    monkeypatch.setattr(spec, "greedy_generate", greedy)
    monkeypatch.setattr(pipeline, "EnergyMeter", lambda device: energy.EnergyMeter(device, powercap=tmp_path))
    handle = target.register_forward_pre_hook(tick)
    strategy = Speculative(draft="prompt_lookup", num_draft_tokens=3)
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    pipe = pipeline.Pipeline.__new__(pipeline.Pipeline)
    pipe.device, pipe.metrics, pipe.tags, pipe._meter, pipe.batches = "cpu", {}, {}, None, [[[9, 10, 11, 9, 10]]]
    opts = DecodeOptions(max_new_tokens=8, unmetered=pipe.unmetered)
    pipe.opts, pipe.opts_for = opts, lambda batch: opts
    pipe.exp = SimpleNamespace(measure=SimpleNamespace(repetitions=1, stop_at_eos=False))
    pipe.workload = SimpleNamespace(kind="text", limits=[8])
    pipe.session = SimpleNamespace(timing=contextlib.nullcontext, after_timing=lambda *a: ({}, {}),
                                   generate=lambda batch, o: strategy.generate(target, batch, o))
    try:
        t0 = time.perf_counter()
        (gen,) = pipe.timed()
        wall = time.perf_counter() - t0
    finally:
        handle.remove()
    assert forwards["greedy"] == 8 and forwards["spec"] >= 2  # greedy: prefill + 7 steps
    assert pipe.metrics["energy_j"] == pytest.approx(forwards["spec"])  # was spec + greedy forwards
    assert gen.e2e_s <= wall - 0.1 and gen.decode_wall_s <= gen.e2e_s
    assert isinstance(pipe.unmetered(), contextlib.nullcontext)  # no meter outside the timed repetitions


def copy_draft_strategy(draft, k: int = 3) -> Speculative:
    """A model-draft Speculative whose draft_quantizer loads `draft` (no file, no quantizer library)."""
    quantizer = SimpleNamespace(load=lambda *a, **k: draft, audit=lambda m: {"bits_per_weight": 16.0, "weight_bytes": 1.0})
    return Speculative(draft="model", num_draft_tokens=k, draft_quantizer=quantizer)


@pytest.mark.parametrize("draft", ["model", "prompt_lookup"])
def test_speculative_roofline_counts_the_draft_per_verify_step(target, bf16_draft, monkeypatch, tmp_path, draft):
    """The roofline of a speculative step (draft forwards + verify): the target's weights and verify KV once, the
    draft model's weights once per draft forward plus the KV those read (counted here from the forwards that ran),
    over the tokens a verify step emits; so roofline_fraction is the share of the bandwidth the whole step reached.
    Was: the target's bytes alone, per emitted token, against tokens/s (above 1 whenever drafts were accepted)."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    bw = Bandwidth(10e9, "seeded by the test")
    monkeypatch.setattr(roofline, "host_bandwidth", lambda device, threads: bw)
    opts = DecodeOptions(max_new_tokens=10)
    strategy = copy_draft_strategy(bf16_draft) if draft == "model" else Speculative(draft="prompt_lookup")
    strategy.setup(model=target, tokenizer=None, opts=opts, experiment=SimpleNamespace(model=TinyRandom()))
    spy = Spy(target=target, draft=bf16_draft)
    try:  # the loop generate() times (its greedy reference is neither timed nor counted)
        gens = [speculative_generate(target, prompt, opts, strategy._drafter, strategy.num_draft_tokens)
                for prompt in ([9, 10, 11, 9, 10, 11, 12], [5, 6, 7])]
    finally:
        spy.remove()
    strategy.teardown()  # the pipeline computes the roofline after teardown
    verify = [c for c in spy.calls["target"] if c[1] > 0]  # every target forward but the prefills
    steps = sum(len(g.stats["steps"]) for g in gens)
    assert len(verify) == steps
    t, d = roofline.shape_from_torch(target), roofline.shape_from_torch(bf16_draft)
    drafts = [c for c in spy.calls["draft"] if c[1] > 0]  # every draft forward but the prefills (TTFT's work)
    assert (len(drafts) > steps) == (draft == "model")  # k draft forwards per step (the copy is right)
    want = (t.weights_read(1) + t.kv_bytes_per_token * sum(n + start for n, start, *_ in verify) / steps
            + (len(drafts) * d.weights_read(1) + d.kv_bytes_per_token * sum(n + start for n, start, *_ in drafts)) / steps)
    metrics, tags = {"batch_size": 1.0, "decode_tokens_per_s": 50.0}, {}
    tokens = sum(g.decode_tokens for g in gens)
    roofline.annotate(metrics, tags, t, "cpu", 1, 0.0, {"case": draft}, "spec", strategy.roofline_step(gens))
    assert metrics["bytes_per_step"] == pytest.approx(want)
    assert metrics["roofline_tokens_per_s"] == pytest.approx(tokens / steps * 10e9 / want)
    verify_steps_per_s = 50.0 / (tokens / steps)
    assert metrics["roofline_fraction"] == pytest.approx(verify_steps_per_s * want / 10e9)
    assert metrics["achieved_gb_per_s"] == pytest.approx(verify_steps_per_s * want / 1e9)
    assert tags["roofline_accounting"] == {"model": "verify_step+draft", "prompt_lookup": "verify_step"}[draft]


def test_injected_slowdown_stretches_each_speculative_step(target, monkeypatch):
    """measure.inject_slowdown / inject_work (the gate's calibration) stretch every speculative step, inside its
    timing, as greedy's steps; the greedy reference runs without them. Was: the speculative loop ignored them."""
    import strategies.decode as decode
    import strategies.speculative as spec

    calls = []

    def spy(opts, t, dt):
        calls.append((opts.inject_slowdown, opts.inject_work, dt))
        return dt + 1.0

    monkeypatch.setattr(spec, "injected_step", spy)
    monkeypatch.setattr(decode, "injected_step", lambda *a: pytest.fail("the greedy reference was slowed"))
    strategy = Speculative(draft="prompt_lookup", num_draft_tokens=3)
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    for kw in ({"inject_slowdown": 0.25}, {"inject_work": 0.5}):
        calls.clear()
        gen = strategy.generate(target, [[9, 10, 11, 9, 10, 11]], DecodeOptions(max_new_tokens=8, **kw))
        steps = len(gen.stats["steps"])
        assert len(calls) == steps > 0 and all((c[0], c[1]) == (kw.get("inject_slowdown", 0.0),
                                                                 kw.get("inject_work", 0.0)) for c in calls)
        assert sum(gen.step_s) == pytest.approx(steps + sum(c[2] for c in calls))  # the steps' times include it
        assert gen.stats["verify_s"] >= steps  # counted with the target's step (the real cost is on the wall clock)


def test_a_speculative_run_is_not_flagged_against_the_floor_row(target):
    """The pipeline's floor report (floor.step_report(metrics)) on a speculative run whose
    draft accepts everything (the target itself: 5 tokens a verify step): the step is tokens_per_verify_step over
    tokens/s, and it is not set against the one-row floor. Was: batch / tokens/s, the share 5x too high, and a floor
    between a token's time and the step's read as a false warning.floor."""
    strategy = Speculative(draft="model", num_draft_tokens=4)
    gen = speculative_generate(target, [5, 6, 7, 8, 9], DecodeOptions(max_new_tokens=21), ModelDrafter(target, "cpu"), 4)
    gen.stats.update(greedy_e2e_s=1.0, greedy_decode_tokens_per_s=1.0, greedy_match=1.0)
    m = {**summarize([gen], batches=1), **strategy.metrics([gen])}
    token_ms = 1e3 / m["decode_tokens_per_s"]
    assert m["tokens_per_verify_step"] == 5.0 and floor.decode_step_ms(m) == pytest.approx(5 * token_ms)
    got, tags = floor.step_report({**m, "linear_floor_ms": 2 * token_ms})
    assert got == {} and list(tags) == ["kernel.floor_share"] and tags["kernel.floor_share"].startswith("not compared")


def test_the_kernel_profile_leaves_out_the_greedy_reference(target, monkeypatch):
    """A speculative run's kernel profile (a whole generation: its loop never calls the decode hook) covers the
    speculative loop alone. Was: generate() with its greedy reference, whose forwards were counted as the strategy's
    (35 linear calls per step here, 14 for greedy), and tag kernel.profiled did not say so."""
    import strategies.speculative as spec

    strategy = Speculative(draft="prompt_lookup", num_draft_tokens=4)
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    prompt, forwards, references = [5, 6, 7, 8, 9, 5, 6, 7], [], []
    real = spec.greedy_generate
    monkeypatch.setattr(spec, "greedy_generate", lambda *a, **k: references.append(1) or real(*a, **k))
    handle = target.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:  # the loop alone, as long as the profile's: its prefill and verify forwards are what the profile should see
        speculative_generate(target, prompt, DecodeOptions(max_new_tokens=kernels.PROFILE_TOKENS + 1),
                             strategy._drafter, 4)
        alone, forwards[:] = len(forwards), []
        tags, _ = kernels.profile_linear(strategy, target, [prompt], DecodeOptions(max_new_tokens=64))
    finally:
        handle.remove()
    assert references == [] and len(forwards) == alone
    per_step = alone * kernels.body_linears(target) / kernels.PROFILE_TOKENS  # the profile's totals / its 4 tokens
    assert tags["kernel.linear_calls_per_step"] == str(round(per_step)), tags
    assert tags["kernel.profiled"] == ("whole generation, prefill included (5 tokens a row; per step = total / 4): "
                                       "the speculative loop alone (draft + verify forwards), not its greedy reference")


def test_a_static_batch_whose_rows_stop_at_eos_is_counted_by_its_measured_steps(target):
    """Rows finished at EOS are computed every step but not counted: a step emitted fewer tokens than the batch.
    achieved_gb_per_s must stay bytes per step x measured steps per second, and the floor's step the measured step;
    both took a step as batch_size tokens (~3x off on this batch)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (3, 17, 9, 30)]
    free = greedy_generate(target, prompts, DecodeOptions(max_new_tokens=32, stop_at_eos=False))
    eos = free.sequences[1][2]  # row 1 stops after 3 tokens; a row whose output lacks it runs all 32
    opts = DecodeOptions(max_new_tokens=32, eos_token_id=eos, pad_token_id=0, stop_at_eos=True)
    sb = StaticBatch(batch_size=4)
    gens = [sb.generate(target, prompts, opts) for _ in range(2)]
    m = {**sb.metrics(gens), **roofline.tokens_per_step(gens)}
    steps, tokens = sum(len(g.step_s) for g in gens), sum(g.decode_tokens for g in gens)
    wall = sum(g.decode_wall_s for g in gens)
    assert m["decode_tokens_per_step"] == pytest.approx(tokens / steps) and m["decode_tokens_per_step"] < 3.5
    m["decode_tokens_per_s"] = tokens / wall
    assert floor.decode_step_ms(m) == pytest.approx(1e3 * wall / steps)
    work = roofline.measured_step(m, 40.0)
    assert work.accounting == roofline.STEP_ACCOUNTING_EOS
    r = roofline.roofline_metrics(roofline.shape_from_torch(target), Bandwidth(50e9, "test"), 4, 40.0,
                                  m["decode_tokens_per_s"], work)
    assert r["achieved_gb_per_s"] == pytest.approx(r["bytes_per_step"] * steps / wall / 1e9)
    # every row emitting every step: the batch's own accounting, unchanged
    assert roofline.measured_step({"batch_size": 4.0, "decode_tokens_per_step": 4.0}, 40.0) is None


def test_continuous_batching_reads_the_kv_of_the_rows_a_forward_held(target):
    """A continuous-batching forward holds the rows scheduled then (measured: 2.5 of at most 8 here) and reads their
    KV; bytes_per_step took `batch_size` rows (8) of KV, 3.2x the KV a forward read."""
    shape = roofline.shape_from_torch(target)
    work = roofline.measured_step({"batch_size": 8.0, "decode_tokens_per_step": 2.5}, 40.0,
                                  roofline.STEP_ACCOUNTING_CB)
    r = roofline.roofline_metrics(shape, Bandwidth(50e9, "test"), 8, 40.0, 100.0, work)
    assert r["bytes_per_step"] == pytest.approx(shape.weights_read(2.5) + 2.5 * shape.kv_bytes_per_token * 40.0)
    # rows past EOS are still computed: a static batch's forward reads all 8 rows
    eos = roofline.measured_step({"batch_size": 8.0, "decode_tokens_per_step": 2.5}, 40.0)
    assert roofline.roofline_metrics(shape, Bandwidth(50e9, "test"), 8, 40.0, 100.0, eos)["bytes_per_step"] == \
        pytest.approx(roofline.bytes_per_step(shape, 8, 40.0))
