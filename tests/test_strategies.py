"""Decode strategies: speculative == greedy, honest token counts under padding, batched == per-prompt,
the mismatched-tokenizer error, and every shipped strategy YAML end to end on the tiny model."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from conftest import FAST

from harness.analysis.roofline import mean_context
from harness.cli import precheck
from harness.config import build
from harness.errors import QuantbenchError
from harness.models import TinyRandom, byte_tokenizer, load_pretrained
from harness.run import runner
from strategies.base import DecodeOptions
from strategies.decode import greedy_generate
from strategies.speculative import LookupDrafter, ModelDrafter, speculative_generate

STRATEGIES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "strategy").glob("*.yaml"))

# mixed lengths, and repeats so that prompt lookup finds matches
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 9, 10, 11], [20, 21] + [30, 31, 32] * 5, [40] * 2 + list(range(60, 90))]


@pytest.fixture(scope="module")
def target():
    return load_pretrained(TinyRandom(), "float32", "cpu")


@pytest.fixture(scope="module")
def drafts(target):
    # a bf16 copy (accepts most tokens) and a different model with the same tokenizer (rejects most):
    # together they exercise full acceptance, partial acceptance and the cache rollback after rejections
    return {"bf16_copy": load_pretrained(TinyRandom(), "bfloat16", "cpu"),
            "other_seed": load_pretrained(TinyRandom(seed=1), "float32", "cpu")}


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_equals_greedy_tiny(target, drafts, k):
    opts = DecodeOptions(max_new_tokens=20)
    rejected = 0
    for prompt in PROMPTS:
        want = greedy_generate(target, [prompt], opts).sequences[0]
        drafters = [ModelDrafter(d, "cpu") for d in drafts.values()] + [LookupDrafter(3, 1)]
        for drafter in drafters:
            gen = speculative_generate(target, prompt, opts, drafter, k)
            assert gen.sequences[0] == want, (k, type(drafter).__name__, prompt)
            steps = gen.stats["steps"]
            assert all(0 <= a <= d <= k for d, a in steps)
            assert 1 + sum(a + 1 for _, a in steps) == len(want) == opts.max_new_tokens
            assert gen.decode_tokens == len(want) - 1 and len(gen.step_s) == gen.decode_tokens
            rejected += sum(1 for d, a in steps if a < d)
    assert rejected > 0  # the rollback path really ran


def test_speculative_stops_at_eos_like_greedy(target, drafts):
    free = greedy_generate(target, [PROMPTS[1]], DecodeOptions(max_new_tokens=16)).sequences[0]
    opts = DecodeOptions(max_new_tokens=16, eos_token_id=free[5], stop_at_eos=True)
    want = greedy_generate(target, [PROMPTS[1]], opts).sequences[0]
    got = speculative_generate(target, PROMPTS[1], opts, ModelDrafter(drafts["bf16_copy"], "cpu"), 4).sequences[0]
    assert got == want and len(want) < 16 and want[-1] == free[5]


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    lookup = LookupDrafter(ngram_max=2, ngram_min=1)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2], 3) == [5, 6, 1]  # latest "1 2", not the first
    assert lookup.propose([7, 8, 9], 3) == []


def test_batching_counts_exactly_the_non_pad_tokens(target):
    # very different prompt lengths: the short row carries 30 pads, and one row stops early at EOS; counting
    # columns or steps x rows would inflate both counts
    batch = [PROMPTS[0], PROMPTS[3]]
    free = [greedy_generate(target, [p], DecodeOptions(max_new_tokens=10)).sequences[0] for p in batch]
    eos = free[0][3]
    assert eos not in free[1]
    opts = DecodeOptions(max_new_tokens=10, eos_token_id=eos, stop_at_eos=True)
    gen = greedy_generate(target, batch, opts)
    assert gen.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[3])
    assert gen.sequences[0] == free[0][: free[0].index(eos) + 1] and gen.sequences[1] == free[1]
    assert gen.generated_tokens == free[0].index(eos) + 1 + 10
    assert gen.decode_tokens == gen.generated_tokens - 2


def test_batched_outputs_equal_per_prompt_greedy(target):
    from strategies.static_batch import StaticBatch

    strategy = StaticBatch(batch_size=3)
    batches = strategy.batches(PROMPTS)
    assert [len(b) for b in batches] == [3, 3] and batches[1][1:] == [PROMPTS[0], PROMPTS[1]]  # cycled to fill
    opts = DecodeOptions(max_new_tokens=12)
    for batch in batches:
        gen = strategy.generate(target, batch, opts)
        for prompt, seq in zip(batch, gen.sequences, strict=True):
            assert seq == greedy_generate(target, [prompt], opts).sequences[0]
    assert strategy.metrics([gen])["batch_size"] == 3.0


def _tokenizer_dir(tmp_path: Path, shift: bool) -> Path:
    """A model directory with a real tokenizer (ids shifted when `shift`) and a corrupt weight file."""
    tok = byte_tokenizer()
    if shift:
        tok.add_tokens(["<extra_a>", "<extra_b>"])
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint: loading it would fail differently")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # present, as preflight asks
    return tmp_path


def test_mismatched_draft_tokenizer_is_rejected_before_loading(compose, tmp_path):
    bad = _tokenizer_dir(tmp_path / "bad", shift=True)
    cfg = compose([*FAST, "strategy=speculative", "+model@strategy.draft_model=hf",
                   f"strategy.draft_model.name_or_path={bad}"])
    exp = build(cfg)
    with pytest.raises(QuantbenchError, match="different tokenizer"):
        exp.strategy.preflight()
    problem = precheck([*FAST, "strategy=speculative", "+model@strategy.draft_model=hf",  # run.py: exit 2, no run
                        f"strategy.draft_model.name_or_path={bad}"])
    assert problem and "different tokenizer" in problem and "\n" not in problem
    result = runner.run(compose([*FAST, "strategy=speculative", "+model@strategy.draft_model=hf",
                                 f"strategy.draft_model.name_or_path={bad}", "accuracy.enabled=false",
                                 "tracking.enabled=false", f"tracking.results_dir={tmp_path}"]))
    assert result.status == "FAILED" and "different tokenizer" in result.error and "load_s" not in result.metrics
    # the same vocabulary passes the check (the corrupt weights are never touched by preflight)
    good = _tokenizer_dir(tmp_path / "good", shift=False)
    build(compose([*FAST, "strategy=speculative", "+model@strategy.draft_model=hf",
                   f"strategy.draft_model.name_or_path={good}"])).strategy.preflight()


def test_bad_strategy_options_fail_at_config_time(compose):
    from harness.errors import ConfigError

    for overrides, needle in [(["strategy=static_batch", "strategy.batch_size=0"], "batch_size"),
                              (["strategy=speculative", "strategy.draft=layers"], "prompt_lookup"),
                              (["strategy=speculative", "strategy.num_draft_tokens=0"], "num_draft_tokens"),
                              (["strategy=speculative", "strategy.match=loose"], "strategy.match.*near_tie, strict"),
                              (["strategy=speculative", "measure.cache=static"], "measure.cache=dynamic")]:
        with pytest.raises(ConfigError, match=needle):
            build(compose([*FAST, *overrides]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_end_to_end(compose, results_overrides, strategy):
    extra = {"continuous_batch": ["strategy.requests=6"], "static_batch": ["strategy.batch_size=3"]}
    cfg = compose([*FAST, f"strategy={strategy}", "accuracy.enabled=false", "measure.repetitions=1",
                   *extra.get(strategy, []), *results_overrides])
    result = runner.run(cfg)
    assert result.status == "OK", result.error
    m = result.metrics
    assert m["decode_tokens_per_s"] > 0 and "batch_size" in m
    n_prompts = 4
    expected = {"greedy": n_prompts * 8, "speculative": n_prompts * 8, "static_batch": 6 * 8,
                "continuous_batch": 6 * 8}
    assert m["generated_tokens"] == expected[strategy]
    if strategy == "speculative":
        assert m["greedy_match"] == 1.0 and m["speedup_vs_greedy"] > 0
        assert m["spec_tie_flips"] == 0.0 and m["spec_max_gap_ulps"] == 0.0  # fp32: identical, nothing to explain
        assert 0.0 <= m["acceptance_rate"] <= 1.0
        assert sum(m[f"accepted_len_{i}"] for i in range(5)) == pytest.approx(1.0)
    if strategy == "continuous_batch":
        tiny = load_pretrained(TinyRandom(), "float32", "cpu")
        want = [s["tokens"] for s in result.samples]
        assert len(want) == 6
        from harness.measure.prompts import PROMPT_SETS
        from harness.run.engines import encode_prompts

        tok = byte_tokenizer()
        prompts = encode_prompts(tok, PROMPT_SETS["default"], True)
        for i, seq in enumerate(want):  # continuous batching reproduces per-prompt greedy
            assert seq == greedy_generate(tiny, [prompts[i % 4]], DecodeOptions(max_new_tokens=8)).sequences[0]
        # the roofline takes each request with its own prompt and 7 steps (not the 6 x 7 pooled gaps as one row's),
        # at the 6 rows the stream can hold (requests=6 < max_requests_per_batch=16)
        assert m["kv_context_mean"] == pytest.approx(mean_context([(len(prompts[i % 4]), 7) for i in range(6)]))
        assert m["batch_size"] == 6


def test_speculative_prompt_lookup_end_to_end(compose, results_overrides):
    cfg = compose([*FAST, "strategy=speculative", "strategy.draft=prompt_lookup", "strategy.num_draft_tokens=3",
                   "measure.prompts=edit", "accuracy.enabled=false", "measure.repetitions=1", *results_overrides])
    result = runner.run(cfg)
    assert result.status == "OK", result.error
    assert result.metrics["greedy_match"] == 1.0 and "draft_load_s" not in result.metrics


def test_greedy_mismatch_fails_the_run(target, monkeypatch):
    import strategies.speculative as spec

    real = spec.speculative_generate

    def off_by_one(*args, **kwargs):
        gen = real(*args, **kwargs)
        gen.sequences[0][-1] += 1
        return gen

    monkeypatch.setattr(spec, "speculative_generate", off_by_one)
    strategy = spec.Speculative(draft="prompt_lookup")
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    with pytest.raises(QuantbenchError, match="greedy_match=0"):
        strategy.generate(target, [PROMPTS[0]], DecodeOptions(max_new_tokens=6))



@pytest.mark.parametrize("fault", ["cut", "past_eos"])
def test_a_speculative_output_of_another_length_fails_the_run(target, monkeypatch, fault):
    # Greedy replayed with the speculative tokens forced never flips at a cut (the forced tokens end early) or past
    # an EOS (greedy stops there): no gap to measure, so the near-tie check passed both, greedy_match=0 and no word.
    import strategies.speculative as spec

    real = spec.speculative_generate
    free = greedy_generate(target, [PROMPTS[0]], DecodeOptions(max_new_tokens=8)).sequences[0]
    eos = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # stops greedy after a few tokens
    opts = DecodeOptions(max_new_tokens=8, eos_token_id=eos, stop_at_eos=True)

    def wrong_length(target_, prompt, opts_, *args, **kwargs):
        if fault == "cut":
            gen = real(target_, prompt, opts_, *args, **kwargs)
            gen.sequences[0].pop()
            return gen
        return real(target_, prompt, DecodeOptions(max_new_tokens=opts_.max_new_tokens), *args, **kwargs)  # no stop

    monkeypatch.setattr(spec, "speculative_generate", wrong_length)
    strategy = spec.Speculative(draft="prompt_lookup")
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    with pytest.raises(QuantbenchError, match="no near-tie flip explains it"):
        strategy.generate(target, [PROMPTS[0]], opts)


def test_the_draft_models_prefill_is_in_ttft_not_in_the_decode_steps(target, drafts, monkeypatch):
    # The draft model's prefill of the prompt ran inside the first decode step: the decode phase's tokens/s, ITL and
    # draft_ms_per_step each carried a whole prefill that greedy's decode phase does not have.
    import strategies.drafters as dr

    clock = iter(range(10**6))
    seen: list[tuple[int, int, int]] = []  # (prompt tokens fed, start position, tick) of every draft forward
    real = dr.run_forward

    def spy(model, ids, start, *args, **kwargs):
        if model is draft:
            seen.append((len(ids), start, next(clock)))
        return real(model, ids, start, *args, **kwargs)

    monkeypatch.setattr(dr, "run_forward", spy)
    import strategies.speculative as spec

    reads: list[int] = []  # ticks of the loop's clock reads: t0, then t_first (the decode phase starts there)
    real_now = spec.now
    monkeypatch.setattr(spec, "now", lambda: (reads.append(next(clock)), real_now())[1])
    draft, prompt = drafts["other_seed"], PROMPTS[3]
    gen = speculative_generate(target, prompt, DecodeOptions(max_new_tokens=8), ModelDrafter(draft, "cpu"), 3)
    prefills = [s for s in seen if s[0] == len(prompt)]
    assert len(prefills) == 1 and prefills[0][1] == 0, seen
    assert reads[0] < prefills[0][2] < reads[1], (reads, seen)  # inside TTFT
    assert all(n <= 2 and start >= len(prompt) for n, start, _ in seen if (n, start, _) != prefills[0]), seen
    assert gen.stats["draft_forwards"] == len(seen) - 1  # decode-phase forwards only (the roofline's)
    ref = greedy_generate(target, [prompt], DecodeOptions(max_new_tokens=8)).sequences[0]
    assert gen.sequences[0] == ref

class TieHead(torch.nn.Module):
    """An lm_head that puts token b's logit exactly one bf16 ulp below token a's: wherever a is greedy's choice,
    b is the runner-up at a genuine near-tie (the situation bf16 SmolLM2 shows at a few positions per prompt)."""

    def __init__(self, head: torch.nn.Module, a: int, b: int):
        super().__init__()
        self.head, self.a, self.b = head, a, b

    def forward(self, x):
        out = self.head(x)
        top = out[..., self.a]
        out[..., self.b] = top - torch.finfo(out.dtype).eps * torch.exp2(torch.floor(torch.log2(top.abs())))
        return out


@pytest.fixture()
def tie(monkeypatch):
    """A bf16 tiny target with a planted near-tie, and a verify forward that rounds it the other way."""
    import strategies.speculative as spec
    from harness.measure.near_tie import ulp

    target = load_pretrained(TinyRandom(), "bfloat16", "cpu")
    prompt = PROMPTS[3]
    want = greedy_generate(target, [prompt], DecodeOptions(max_new_tokens=12)).sequences[0]
    a = max(set(want[1:]), key=want[1:].count)  # greedy's most frequent later token: top at verify positions
    b = (a + 7) % target.config.vocab_size
    target.lm_head = TieHead(target.lm_head, a, b)
    real = spec.run_forward
    mode = {"verify": "tie"}

    def verify_rounds_differently(model, ids, start, cache, device, **kwargs):
        logits = real(model, ids, start, cache, device, **kwargs)
        if model is target and start > 0 and len(ids) > 1:  # the k+1-token verify forward
            logits = logits.clone()
            for row in range(logits.shape[0]):
                top = int(logits[row].argmax())
                if mode["verify"] == "tie" and top == a:  # rounds b one ulp above a: greedy's runner-up wins
                    logits[row, b] = float(logits[row, a]) + ulp(float(logits[row, a]), logits.dtype)
                elif mode["verify"] == "wrong":  # a broken verify: the least likely token wins
                    logits[row, int(logits[row].argmin())] = float(logits[row, top]) + 1.0
        return logits

    monkeypatch.setattr(spec, "run_forward", verify_rounds_differently)
    draft = ModelDrafter(load_pretrained(TinyRandom(), "bfloat16", "cpu"), "cpu")  # another object: not patched
    return target, prompt, draft, mode


def test_bf16_near_tie_flip_is_counted_not_failed(tie):
    from strategies.speculative import Speculative

    target, prompt, draft, _ = tie
    strategy = Speculative(draft="model", num_draft_tokens=3)
    strategy._drafter = draft
    paused: list[int] = []  # the energy meter's pauses: the greedy reference and its near-tie replay
    opts = DecodeOptions(max_new_tokens=12, unmetered=lambda: contextlib.nullcontext(paused.append(1)))
    gen = strategy.generate(target, [prompt], opts)
    assert len(paused) == 2
    assert gen.sequences[0] != greedy_generate(target, [prompt], opts).sequences[0]
    assert opts.choose is None  # the replay hook is removed again
    m = strategy.metrics([gen])
    assert m["greedy_match"] == 0.0 and m["spec_tie_flips"] >= 1
    assert m["spec_max_gap_ulps"] == 1.0  # the planted gap, measured in bf16 ulps of greedy's top logit

    strict = Speculative(draft="model", num_draft_tokens=3, match="strict")
    strict._drafter = draft
    with pytest.raises(QuantbenchError, match=r"greedy_match=0.*strategy.match=strict"):
        strict.generate(target, [prompt], opts)


def test_speculative_token_far_below_greedy_fails(tie):
    from strategies.speculative import Speculative

    target, prompt, draft, mode = tie
    mode["verify"] = "wrong"
    strategy = Speculative(draft="model", num_draft_tokens=3)
    strategy._drafter = draft
    with pytest.raises(QuantbenchError, match=r"greedy_match=0.*ulps below its top choice"):
        strategy.generate(target, [prompt], DecodeOptions(max_new_tokens=12))


@pytest.mark.slow
def test_speculative_equals_greedy_embedded_model():
    from harness.models import EmbeddedGGUF, load_tokenizer

    source = EmbeddedGGUF()
    tok = load_tokenizer(source)
    # fp32 target: exact equality is the contract there (bf16 verification can flip near-ties, see docs)
    model = load_pretrained(source, "float32", "cpu")
    from harness.measure.prompts import PROMPT_SETS
    from harness.run.engines import encode_prompts

    prompts = encode_prompts(tok, PROMPT_SETS["default"][:2] + PROMPT_SETS["edit"][:1], True)  # 3: CI time
    opts = DecodeOptions(max_new_tokens=16, pad_token_id=tok.pad_token_id)  # 16 (was 24): CI time
    draft = load_pretrained(source, "bfloat16", "cpu")  # a cheaper copy: near, not equal (rejections happen)
    for prompt in prompts:
        want = greedy_generate(model, [prompt], opts).sequences[0]
        for drafter, k in [(ModelDrafter(draft, "cpu"), 4), (LookupDrafter(3, 1), 3), (LookupDrafter(3, 1), 6)]:
            assert speculative_generate(model, prompt, opts, drafter, k).sequences[0] == want


# ------------------------------------------------------------------------------------ capabilities and timings
def test_shipped_strategies_declare_their_capabilities():
    from strategies.continuous_batch import ContinuousBatch
    from strategies.greedy import Greedy
    from strategies.speculative import Speculative
    from strategies.static_batch import StaticBatch

    caps = ("stepwise", "supports_context_depth", "batches_rows", "supports_llama_cpp", "schedules_rows")
    table = {cls.__name__: tuple(getattr(cls, c) for c in caps)
             for cls in (Greedy, StaticBatch, Speculative, ContinuousBatch)}
    assert table == {"Greedy": (True, True, False, True, False), "StaticBatch": (True, True, True, False, False),
                     "Speculative": (False, False, False, False, False),
                     "ContinuousBatch": (False, False, True, False, True)}


def test_core_code_asks_capabilities_not_class_names(compose):
    """A Greedy subclass that declares no context depth is refused; an unrelated class that declares it passes."""
    from dataclasses import dataclass

    from harness.measure import fast_path, workloads
    from strategies.base import Strategy
    from strategies.greedy import Greedy

    @dataclass
    class NoDepthGreedy(Greedy):
        supports_context_depth = False
        stepwise = False

    @dataclass
    class OwnDecodeLoop(Strategy):
        supports_context_depth = True

    exp = build(compose([*FAST, "measure.context_depth=8"]))
    workloads.check(exp.model, exp.measure, OwnDecodeLoop())
    with pytest.raises(QuantbenchError, match="measure.context_depth=8 is not supported by strategy NoDepthGreedy"):
        workloads.check(exp.model, exp.measure, NoDepthGreedy())
    exp = build(compose([*FAST, "measure.cache=static", "measure.compile=true"]))
    exp.strategy = NoDepthGreedy()
    with pytest.raises(QuantbenchError, match="strategy NoDepthGreedy runs its own loop"):
        fast_path.preflight(exp, "cpu")


class SlowEos:
    """An EOS id that never matches and takes 5 ms per comparison: host work between decode steps."""

    def __eq__(self, other: object) -> bool:
        import time

        time.sleep(0.005)
        return False

    __hash__ = object.__hash__


@pytest.mark.parametrize("loop", ["greedy", "speculative"])
def test_decode_wall_clock_counts_host_work_between_steps(target, loop):
    opts = DecodeOptions(max_new_tokens=6, eos_token_id=SlowEos(), stop_at_eos=True)  # type: ignore[arg-type]
    if loop == "greedy":
        gen = greedy_generate(target, [PROMPTS[0]], opts)
        host = 5 * 0.005  # one EOS comparison per row after each of the 5 steps
    else:
        gen = speculative_generate(target, PROMPTS[2], opts, LookupDrafter(3, 1), 3)
        host = 5 * 0.005  # one comparison per emitted token after its verify step
    assert gen.decode_tokens == 5 and gen.decode_wall_s is not None
    assert gen.decode_wall_s - gen.decode_s_steps >= host * 0.99
    assert gen.decode_tokens_per_s < gen.decode_step_tokens_per_s


def test_speculative_alternates_the_greedy_reference(target, monkeypatch):
    import strategies.speculative as spec

    order: list[str] = []
    real_spec, real_greedy = spec.speculative_generate, spec.greedy_generate
    monkeypatch.setattr(spec, "speculative_generate", lambda *a, **k: order.append("spec") or real_spec(*a, **k))
    monkeypatch.setattr(spec, "greedy_generate", lambda *a, **k: order.append("greedy") or real_greedy(*a, **k))
    strategy = spec.Speculative(draft="prompt_lookup")
    strategy.setup(model=target, tokenizer=None, opts=DecodeOptions(), experiment=None)
    a, b = PROMPTS[1], PROMPTS[2]
    gens = [strategy.generate(target, [p], DecodeOptions(max_new_tokens=6)) for p in (a, b, a, b)]
    # each prompt alternates across its calls; consecutive new prompts start on opposite orders
    assert [g.stats["greedy_first"] for g in gens] == [0.0, 1.0, 1.0, 0.0]
    assert order == ["spec", "greedy", "greedy", "spec", "greedy", "spec", "spec", "greedy"]
    assert strategy.metrics(gens)["greedy_first_fraction"] == 0.5


def test_continuous_batch_itl_is_per_request(monkeypatch):
    """Hand-computed from scripted request timestamps and forward starts (transformers' generate_batch replaced by
    a fake). The decode phase is the forwards that start while no prompt is processed: the window from the first
    token to the last (used before) was mostly other requests' prefill, also counted in prefill_s."""
    from types import SimpleNamespace

    import strategies.continuous_batch as cb
    from harness.measure import summarize

    def req(i: int, start: float, stamps: list[float]) -> SimpleNamespace:
        return SimpleNamespace(request_id=f"req_{i}", generated_tokens=list(range(len(stamps))), timestamps=stamps,
                               created_time=100.0, lifespan=(start, stamps[-1]), error=None)

    outputs = {r.request_id: r for r in (req(0, 100.5, [101.0, 102.0, 104.0]),
                                          req(1, 101.5, [103.0, 103.5, 105.0, 106.0]),
                                          req(2, 100.6, [101.2]))}
    # prompts are processed over [100.5, 101.2) and [101.5, 103.0): the first four forwards are prefill's
    forwards = [100.5, 101.1, 101.5, 102.5, 103.2, 103.8, 104.5, 105.5]
    hooks: list = []

    def generate_batch(**kwargs):
        for _ in forwards:
            for fn in hooks:
                fn(None, None)
        return outputs

    model = SimpleNamespace(generate_batch=generate_batch,
                            register_forward_pre_hook=lambda fn: (hooks.append(fn), SimpleNamespace(remove=lambda: None))[1])
    clock = iter([100.0, *forwards, 107.0])
    monkeypatch.setattr(cb, "now", lambda: next(clock))
    gen = cb.ContinuousBatch(requests=3).generate(model, [[1, 2], [3, 4, 5], [6]], DecodeOptions(max_new_tokens=4))
    assert gen.step_s == [1.0, 2.0, 0.5, 1.5, 1.0]  # each request's own gaps, never across requests
    # 104.0, 103.5, 105.0, 106.0 came from decode-only forwards (102.0 rode on a prefill forward), over their
    # wall clock: 103.2 .. 106.0, the last token
    assert gen.decode_tokens == 4 and gen.decode_wall_s == pytest.approx(106.0 - 103.2)
    assert gen.stats["decode_forwards"] == 4 and gen.stats["all_decode_tokens"] == 8 - 3
    assert gen.ttft_s == 1.0
    assert gen.prefill_s == pytest.approx((101.2 - 100.5) + (103.0 - 101.5))  # union of [scheduled, first token]
    m = summarize([gen])
    assert m["itl_ms_p50"] == pytest.approx(1000.0) and m["decode_tokens_per_s"] == pytest.approx(4 / 2.8)
    assert m["prompt_tokens_per_s"] == pytest.approx(6 / 2.2)
    m.update(cb.ContinuousBatch(requests=3).metrics([gen]))  # as the pipeline merges them: strategy last
    assert m["ttft_ms"] == pytest.approx(1200.0) and m["ttft_ms_p90"] == m["request_ttft_ms_p90"]  # per request
    assert m["e2e_ms"] == pytest.approx(1000.0 * (106.0 - 100.0))  # the call's: from its start to the last token
    assert m["decode_step_tokens_per_s"] == pytest.approx(5 / 6.0)  # every decode token over the request gaps
    assert m["decode_tokens_per_step"] == pytest.approx(1.0)


def test_a_stream_shorter_than_the_prompt_set_is_refused_before_any_weights_load(compose, results_overrides,
                                                                                 monkeypatch):
    """strategy.requests=2 over the 4 default prompts decoded only the first 2, while prompt_len_tokens and the
    workload tags described all 4 (a median of 101.5 tokens for prompts whose median was 46.5)."""
    from harness.run import pipeline

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(pipeline.Pipeline, "_add", lambda self, *a: no_load(), raising=True)
    result = runner.run(compose([*FAST, "strategy=continuous_batch", "strategy.requests=2", "accuracy.enabled=false",
                                 *results_overrides]))
    assert result.status == "FAILED"
    assert result.error.startswith("strategy.requests=2 is fewer than the workload's 4 prompts: 2 would never run")
    assert "\n" not in result.error


def test_continuous_batching_counts_its_forwards_as_the_roofline_step():
    """Rows per forward vary (requests join, finish, prefill beside decode): the roofline and the floor took a step as
    batch_size tokens (a 2.38 ms step against a 1.55 ms inter-token p50). The forwards of the decode window are
    counted (a forward pre-hook), and a step is decode tokens / forwards."""
    import strategies.continuous_batch as cb
    from harness.analysis import roofline

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    strategy = cb.ContinuousBatch(requests=6, max_requests_per_batch=4)  # 2 requests wait for a free row
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13], [14]]
    strategy.setup(model=model, tokenizer=None, opts=DecodeOptions(max_new_tokens=6), experiment=None)
    try:
        gen = strategy.generate(model, prompts, DecodeOptions(max_new_tokens=6, stop_at_eos=False))
    finally:
        strategy.teardown()
    assert not model._forward_pre_hooks  # the counting hook is gone
    forwards = gen.stats["decode_forwards"]
    assert gen.decode_tokens == 6 * 5 and 10 <= forwards <= gen.decode_tokens  # two waves of 5 decode steps at least
    m = strategy.metrics([gen])
    assert m["decode_tokens_per_step"] == pytest.approx(30 / forwards) and m["decode_tokens_per_step"] < 3.5
    work = roofline.measured_step({**m, "batch_size": 4.0}, 10.0, roofline.STEP_ACCOUNTING_CB)
    assert work.accounting == roofline.STEP_ACCOUNTING_CB and work.tokens_per_step == m["decode_tokens_per_step"]
