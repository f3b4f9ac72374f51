"""Speculative decoding, batch 1, greedy verification, with acceptance accounting.

A cheap drafter proposes `num_draft_tokens` tokens; the target checks them all in one forward. Two
drafters: `model` (a second model, e.g. a quantized copy of the target, given by its own model and
quantizer configs) and `prompt_lookup` (copy the continuation of the latest earlier n-gram match in
prompt + output; no model). transformers' assisted generation hides acceptance counts and per-step
times, so this loop is written out.

TTFT holds both prefills, the target's and the draft model's (a server fills both caches before it answers), so
the decode phase, as greedy's, holds decode steps only.

KV caches: the target's cache always holds every token but the newest (which is fed next). Rejected
draft tokens leave stale entries in both caches; they are cropped before the next step, so no step
ever attends to a token that is not in the output. Batch 1 has no padding: the attention mask is all
ones and position ids continue from the cache length. Forwards (strategies/drafters.py `run_forward`) keep the
logits they read only (a prefill, target's or draft's: the last position, as greedy's), and under
`measure.gemv=aten` a one-token forward after a prefill runs with oneDNN off, as greedy's decode steps do.

Every generate call also runs plain greedy on the same prompt with the same target, and
`speedup_vs_greedy` compares the two timings side by side (the reference runs off the energy meter, and the
speculative Generation's times never include it). The order alternates (`greedy_first`):
whichever runs second finds the weights and the target's code paths warm in the CPU caches, so a fixed
order would favour one side. Each prompt alternates across its calls (warmup and repetitions) and
consecutive prompts start on opposite orders; `greedy_first_fraction` records the balance.
`greedy_match` records whether the tokens are identical (1) or not (0). They can differ without a bug:
in bf16 the k+1-token verify forward rounds differently from one-token decode, and where greedy's top
two logits are a few ulps apart the verify picks the runner-up (seen on SmolLM2 bf16; fp32 matched
exactly). `strategy.match=near_tie` (default) then replays plain greedy with the speculative tokens
forced (harness/measure/near_tie.py, the same check as the compiled path's `measure.compile_match`) and fails
the run only if some speculative token lies more than NEAR_TIE_ULPS ulps below greedy's top logit; it
records `spec_tie_flips` and `spec_max_gap_ulps`. `strategy.match=strict` fails on any difference.

Roofline (`roofline_step`, docs/roofline.md): a step is one speculative step, the k draft forwards and the
verify; it reads the target's weights and KV once and the draft model's weights once per draft forward, plus the
KV those forwards read (prompt lookup reads no draft bytes), and emits `tokens_per_verify_step` tokens. The test-only
`measure.inject_slowdown`/`inject_work` stretch that whole step, as greedy's (strategies/inject.py); the greedy
reference runs without them, so the injected work is sized from speculative steps alone.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness.analysis.roofline import StepWork, shape_from_torch
from harness.errors import ConfigError, QuantbenchError, one_of
from harness.measure import Generation, grad_mode, model_grad_mode, near_tie, now, percentile, resolve_device, sync
from quantizers import rows8
from quantizers.base import audit_model
from quantizers.dtype import Dtype
from strategies.base import DecodeOptions, Strategy
from strategies.decode import greedy_generate
from strategies.drafters import LookupDrafter, ModelDrafter, as_draft, crop_to, run_forward, source_vocab
from strategies.inject import injected_step

DRAFTS = ("model", "prompt_lookup")
log = logging.getLogger("quantbench")


def speculative_generate(target: Any, prompt: list[int], opts: DecodeOptions, drafter: Any, k: int) -> Generation:
    """Greedy speculative decoding of one prompt; `Generation.stats` holds the acceptance counts.

    inference_mode, or no_grad where the target's or the draft model's quantizer needs it (quanto int4).
    """
    with grad_mode(target, getattr(drafter, "model", None)):
        return speculative_loop(target, prompt, opts, drafter, k)


def speculative_loop(target: Any, prompt: list[int], opts: DecodeOptions, drafter: Any, k: int) -> Generation:
    from transformers import DynamicCache

    device = opts.device
    cache = DynamicCache(config=target.config)
    drafter.reset()
    sync(device)
    t0 = now()
    first = int(run_forward(target, prompt, 0, cache, device, last=True)[-1].argmax())
    drafter.prefill(prompt)  # the draft model's prefill is prefill too: in TTFT, as a server fills both caches first
    sync(device)
    t_first = now()  # the first token is on the host: the decode phase's wall clock starts here
    ttft = t_first - t0

    seq = [*prompt, first]
    gen = [first]
    done = opts.stop_at_eos and first == opts.eos_token_id
    steps: list[tuple[int, int]] = []  # (drafted, accepted) per verification step
    step_s: list[float] = []
    draft_s = verify_s = 0.0
    kv_read = 0  # KV positions the verify forwards attended over (roofline)
    budget_steps = 0  # steps the token budget left no room to draft in (one token left): not a drafter's miss
    while not done and len(gen) < opts.max_new_tokens:
        kk = min(k, opts.max_new_tokens - len(gen) - 1)  # never draft past the token budget
        budget_steps += kk == 0  # before the step's clock: the timed region holds the step only
        sync(device)
        t = now()
        draft = drafter.propose(seq, kk) if kk > 0 else []
        sync(device)
        t_mid = now()
        have = len(seq) - 1  # target cache holds all but the newest token
        logits = run_forward(target, [seq[-1], *draft], have, cache, device, gemv_aten=opts.gemv_aten)
        preds = logits.argmax(-1).tolist()  # one token (nothing drafted) takes greedy's one-row path
        # Greedy verification: p_i is the target's argmax after [.., d_1..d_i]; d_{i+1} is accepted iff
        # d_{i+1} == p_i, so the longest matching prefix (n tokens) is what greedy would have produced;
        # p_n is the target's own next token, hence n+1 tokens per step and output == plain greedy.
        n = 0
        while n < len(draft) and draft[n] == preds[n]:
            n += 1
        new = [*draft[:n], preds[n]]
        crop_to(cache, have + 1 + len(draft), len(seq) + n)  # drop the KV of rejected draft tokens
        drafter.rollback(len(seq) + n)  # the draft cache too, inside the step's clock (counted in verify_s)
        sync(device)
        t_end = now()
        kv_read += have + 1 + len(draft)  # the verify attends over the cache and its own k+1 tokens
        if opts.inject_slowdown > 0 or opts.inject_work > 0:  # test-only: a slower step, inside the timing
            t_end = t + injected_step(opts, t, t_end - t)  # the whole step (draft + verify), as greedy's
        if opts.stop_at_eos and opts.eos_token_id in new:
            new = new[: new.index(opts.eos_token_id) + 1]
            done = True
        seq.extend(new)
        gen.extend(new)
        # drafted: every proposed token, rejected ones included (kk kept the draft within the token budget); past
        # an EOS nothing was emitted, so such a step counts the draft tokens up to it, and accepts those it kept
        steps.append((min(len(draft), len(new)) if done else len(draft), min(n, len(new))))
        draft_s += t_mid - t
        verify_s += t_end - t_mid
        # the step's time shared by the tokens it produced: the step sum stays exact, ITL stays comparable
        step_s.extend([(t_end - t) / len(new)] * len(new))
    # wall clock of the decode phase: steps plus the host work between them (EOS cut, bookkeeping)
    decode_wall = now() - t_first if steps else 0.0
    return Generation(sequences=[gen], prompt_tokens=len(prompt), ttft_s=ttft, step_s=step_s,
                      decode_tokens=len(gen) - 1, decode_wall_s=decode_wall,
                      stats={"steps": steps, "draft_s": draft_s, "verify_s": verify_s, "kv_read": kv_read,
                             "draft_forwards": drafter.forwards, "draft_kv_read": drafter.kv_read,
                             "budget_steps": budget_steps})


@model_grad_mode  # inference_mode, or no_grad where the quantizer needs it (quanto int4)
def tie_note(model: Any, prompt: list[int], want: list[int], at: int) -> str:
    """Explain a mismatch: a near-tie of the target's top-2 logits, or a real bug in the loop."""
    from transformers import DynamicCache

    if at >= len(want):
        return "the speculative loop produced a different length: a bug in the loop"
    device = str(next(model.parameters()).device)
    logits = run_forward(model, [*prompt, *want[:at]], 0, DynamicCache(config=model.config), device, last=True)[-1]
    logits = logits.float()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    if gap < 0.05 * max(1.0, float(top.values[0].abs())):
        return (f"the target's top-2 logits there differ by only {gap:.4f} in {dtype}: verifying several tokens "
                "in one forward rounds differently from one-token decode; use a float32 target for exact equality")
    return f"the target's top-2 logits there differ by {gap:.4f}: not a rounding tie, the verify loop is wrong"


@dataclass
class Speculative(Strategy):
    """Speculative decoding with greedy verification (see module docstring)."""

    weight_dependent = "the draft's acceptance rate (and the speedup that follows from it)"
    # fields that hold a nested option, picked as `group@strategy.field=<option>` (+: not in this YAML's defaults);
    # a plain name there is refused at config time (harness/options.py)
    nested_options: ClassVar[dict[str, str]] = {"draft_model": "+model", "draft_quantizer": "quantizer"}

    draft: str = "model"  # model | prompt_lookup
    num_draft_tokens: int = 4  # tokens proposed per verification step
    ngram_max: int = 3  # prompt lookup: longest n-gram matched
    ngram_min: int = 1  # prompt lookup: shortest n-gram matched
    draft_model: Any = None  # draft=model: a model source (conf/model/*); null = the target's own weights
    draft_quantizer: Any = None  # draft=model: a quantizer (conf/quantizer/*); null = weights as loaded
    match: str = "near_tie"  # near_tie: only tokens > NEAR_TIE_ULPS below greedy's top fail | strict: any difference
    _target_source: Any = field(default=None, repr=False)
    _drafter: Any = field(default=None, repr=False)
    _draft_metrics: dict = field(default_factory=dict, repr=False)
    _draft_shape: Any = field(default=None, repr=False)  # the draft model's roofline.ModelShape; None: no model
    _order: dict = field(default_factory=dict, repr=False)  # prompt -> (first-seen index, calls so far)

    def __post_init__(self) -> None:
        p: list[str] = []
        if (err := one_of("strategy.draft", self.draft, DRAFTS)):
            p.append(err)
        if (err := one_of("strategy.match", self.match, near_tie.MATCH_POLICIES)):
            p.append(err)
        for name in ("num_draft_tokens", "ngram_max", "ngram_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                p.append(f"strategy.{name}={v!r} must be an integer >= 1")
        if not p and self.ngram_min > self.ngram_max:
            p.append(f"strategy.ngram_min={self.ngram_min} must be <= strategy.ngram_max={self.ngram_max}")
        if self.draft == "prompt_lookup" and self.draft_model is not None:
            p.append("strategy.draft_model is only used with strategy.draft=model; drop it for prompt_lookup")
        if p:
            raise ConfigError(p)

    @property
    def name(self) -> str:
        return f"Speculative-{self.draft}{self.num_draft_tokens}"

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        if measure is not None and measure.cache == "static":
            raise QuantbenchError("strategy=speculative crops the KV cache after rejections and needs "
                                  "measure.cache=dynamic")
        self._target_source = parts.get("model")
        self._device = measure.device if measure is not None else "auto"

    def draft_source(self) -> Any:
        return self.draft_model if self.draft_model is not None else self._target_source

    def preflight(self) -> None:
        """Reject a draft with another vocabulary before any model loads; check the draft quantizer."""
        if self.draft != "model":
            return  # prompt lookup: no draft model, the draft quantizer is unused
        if self.draft_model is not None:
            try:
                self.draft_model.preflight()
            except QuantbenchError as exc:
                raise as_draft(exc) from None
            if self._target_source is not None:
                target, draft = source_vocab(self._target_source), source_vocab(self.draft_model)
                if target != draft:
                    diff = sum(1 for t, i in draft.items() if target.get(t) != i)
                    raise QuantbenchError(
                        f"draft model {self.draft_model.name!r} has a different tokenizer than the target "
                        f"{self._target_source.name!r} ({len(draft)} vs {len(target)} tokens, {diff} differ); "
                        "speculative decoding needs the same vocabulary: pick a draft of the same model family")
        if self.draft_quantizer is not None:
            self.draft_quantizer.preflight(resolve_device(getattr(self, "_device", "auto")))

    def side_model(self) -> tuple[Any, Any] | None:
        return (self.draft_source(), self.draft_quantizer or Dtype()) if self.draft == "model" else None

    def setup(self, *, model: Any, tokenizer: Any, opts: DecodeOptions, experiment: Any) -> None:
        if self.draft == "prompt_lookup":
            self._drafter, self._draft_shape = LookupDrafter(self.ngram_max, self.ngram_min), None
            return
        source, quantizer = self.side_model()
        source = source or experiment.model
        t0 = now()
        draft = quantizer.load(source, tokenizer=tokenizer, device=opts.device, experiment=experiment)
        audit = quantizer.audit(draft)
        self._draft_metrics = {"draft_load_s": now() - t0, "draft_bits_per_weight": audit["bits_per_weight"],
                               "draft_weight_bytes": audit["weight_bytes"]}
        if getattr(getattr(experiment, "decode_choice", None), "gemv", "") == "rows8":
            # the draft's one-token forwards take the target's one-row kernel (quantizers/rows8.py), as the target's
            # steps do: on ATen's the speedup would charge speculative decoding with a kernel gap, not its own cost
            self._draft_metrics["draft_gemv_layers"] = float(rows8.install(draft))
            self._draft_metrics["draft_weight_bytes"] = audit_model(draft)["weight_bytes"]  # + a tied head's tiles
        self._draft_shape = shape_from_torch(draft)  # kept past teardown: the roofline is computed after it
        self._drafter = ModelDrafter(draft, opts.device, opts.gemv_aten)

    def teardown(self) -> None:
        self._drafter = None

    # what the kernel profile runs (harness/measure/kernels.py `whole_scope`): the loop the timing measures
    profiled_part: ClassVar[str] = "the speculative loop alone (draft + verify forwards), not its greedy reference"

    def profiled_generate(self, model: Any, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        """The speculative loop alone: generate()'s greedy reference (and near-tie replay) would count their
        forwards' linear calls as the strategy's, ~2x its calls per step."""
        return speculative_generate(model, batch[0], opts, self._drafter, self.num_draft_tokens)

    def generate(self, model: Any, batch: list[list[int]], opts: DecodeOptions) -> Generation:
        if len(batch) != 1:
            raise QuantbenchError("strategy=speculative runs batch 1 (one prompt per call)")
        greedy_first = self.greedy_first(batch[0])
        # the reference work (greedy, its near-tie replay) runs off the energy meter: the run's energy is the
        # speculative calls', over their tokens (spec's own times never include it); and without the test-only
        # injected cost, whose state (spin mark, work sizer) lives on `opts` for the speculative steps alone
        quiet = (dataclasses.replace(opts, inject_slowdown=0.0, inject_work=0.0)
                 if opts.inject_slowdown > 0 or opts.inject_work > 0 else opts)
        if greedy_first:
            with opts.off_meter():
                ref = greedy_generate(model, batch, quiet)
        spec = speculative_generate(model, batch[0], opts, self._drafter, self.num_draft_tokens)
        if not greedy_first:
            with opts.off_meter():
                ref = greedy_generate(model, batch, quiet)
        got, want = spec.sequences[0], ref.sequences[0]
        flips, gap = 0, 0.0
        if got != want:
            _, at = near_tie.first_diff([want], [got])
            where = (f"greedy_match=0: speculative output differs from plain greedy at generated token {at} "
                     f"(greedy {want[at:at + 3]}, speculative {got[at:at + 3]})")
            if self.match == "strict":
                raise QuantbenchError(f"{where} (strategy.match=strict); {tie_note(model, batch[0], want, at)}")
            with opts.off_meter():
                flips, gap = near_tie.replay(lambda: greedy_generate(model, batch, quiet), quiet, [got])
            if flips == 0:  # greedy made to follow them flipped none: a cut or a run past EOS, not a near-tie
                raise QuantbenchError(f"{where}; no near-tie flip explains it ({len(got)} tokens against greedy's "
                                      f"{len(want)}): the speculative loop computes something else")
            if gap > near_tie.NEAR_TIE_ULPS:
                raise QuantbenchError(f"{where}: plain greedy scores a speculative token {gap:.1f} ulps below its top "
                                      f"choice (more than the {near_tie.NEAR_TIE_ULPS:g} a rounding flip of a near-tie "
                                      "can explain): the speculative loop computes something else")
        spec.stats.update(greedy_e2e_s=ref.e2e_s, greedy_decode_tokens_per_s=ref.decode_tokens_per_s,
                          greedy_match=float(got == want), tie_flips=flips, max_gap_ulps=gap,
                          greedy_first=float(greedy_first))
        return spec

    def greedy_first(self, prompt: list[int]) -> bool:
        """Whether the greedy reference runs before the speculative loop in this call (module docstring).

        Each prompt alternates across its calls, and consecutive new prompts start on opposite orders, so
        a pass over an even number of prompts, and every two passes over any, are balanced.
        """
        key = tuple(prompt)
        first_seen, calls = self._order.get(key, (len(self._order), 0))
        self._order[key] = (first_seen, calls + 1)
        return (first_seen + calls) % 2 == 1

    def metrics(self, generations: list[Generation]) -> dict[str, float]:
        steps = [s for g in generations for s in g.stats["steps"]]
        drafted = [(d, a) for d, a in steps if d > 0]
        budget = sum(g.stats.get("budget_steps", 0) for g in generations)
        n_draft = sum(d for d, _ in drafted)
        n_acc = sum(a for _, a in drafted)
        draft_s = sum(g.stats["draft_s"] for g in generations)
        verify_s = sum(g.stats["verify_s"] for g in generations)
        spec_s = sum(g.e2e_s for g in generations)
        out = {
            "batch_size": 1.0,
            "num_draft_tokens": float(self.num_draft_tokens),
            # 1 only when every generation equals plain greedy; a difference that generate() let through
            # was explained by near-tie flips (strategy.match=near_tie), counted here with their largest gap
            "greedy_match": min((g.stats.get("greedy_match", 1.0) for g in generations), default=1.0),
            "spec_tie_flips": float(sum(g.stats.get("tie_flips", 0) for g in generations)),
            "spec_max_gap_ulps": max((g.stats.get("max_gap_ulps", 0.0) for g in generations), default=0.0),
            "acceptance_rate": n_acc / n_draft if n_draft else float("nan"),  # NaN, not 0 ("all rejected"): none drafted
            "mean_accepted_tokens": n_acc / len(drafted) if drafted else float("nan"),  # per step that drafted
            # tokens each verify step emitted: a + 1, or fewer where EOS cut the step (decode tokens are exact)
            "tokens_per_verify_step": sum(g.decode_tokens for g in generations) / len(steps) if steps else float("nan"),
            # of the steps the drafter was asked to fill: a last step with one token of budget left drafts nothing
            # by the budget's rule, not the drafter's (a model draft always proposes)
            "empty_draft_fraction": 1.0 - len(drafted) / asked if (asked := len(steps) - budget) else float("nan"),
            "verify_steps": float(len(steps)),
            "draft_ms_per_step": 1000.0 * draft_s / len(steps) if steps else float("nan"),
            "verify_ms_per_step": 1000.0 * verify_s / len(steps) if steps else float("nan"),
            "draft_time_fraction": draft_s / (draft_s + verify_s) if draft_s + verify_s else float("nan"),
            "greedy_first_fraction": (sum(g.stats.get("greedy_first", 0.0) for g in generations) / len(generations)
                                      if generations else float("nan")),
            # over the references that decoded (a first token at EOS, a one-token limit: NaN), as summarize() takes
            # the headline over the calls that decoded; one NaN would make the whole median NaN
            "greedy_decode_tokens_per_s": percentile([v for g in generations
                                                      if (v := g.stats["greedy_decode_tokens_per_s"]) == v], 50),
            # same prompts, same target, same tokens out: the ratio of wall times is the speedup
            "speedup_vs_greedy": sum(g.stats["greedy_e2e_s"] for g in generations) / spec_s if spec_s else float("nan"),
        }
        if out["spec_tie_flips"]:
            log.warning("speculative output differs from plain greedy by %d near-tie flip(s) (largest gap %.1f ulps "
                        "<= %g): rounding of the k+1-token verify forward, not a bug; greedy_match=0",
                        out["spec_tie_flips"], out["spec_max_gap_ulps"], near_tie.NEAR_TIE_ULPS)
        for n in range(self.num_draft_tokens + 1):  # histogram over steps that drafted something
            out[f"accepted_len_{n}"] = sum(1 for _, a in drafted if a == n) / len(drafted) if drafted else float("nan")
        out.update(self._draft_metrics)
        return out

    def roofline_step(self, generations: list[Generation]) -> StepWork:
        """Per speculative step (module docstring): the target's KV per verify, the draft model's weights once per
        draft forward and its KV reads (none for prompt lookup), tokens emitted per verify step."""
        n = sum(len(g.stats["steps"]) for g in generations)
        per = max(n, 1)
        extra = 0.0
        if self._draft_shape is not None:
            forwards = sum(g.stats["draft_forwards"] for g in generations)
            kv = sum(g.stats["draft_kv_read"] for g in generations)
            extra = (forwards * self._draft_shape.weights_read(1) + kv * self._draft_shape.kv_bytes_per_token) / per
        return StepWork(context=sum(g.stats["kv_read"] for g in generations) / per, extra_bytes=extra,
                        tokens_per_step=sum(g.decode_tokens for g in generations) / n if n else float("nan"),
                        accounting="verify_step+draft" if self._draft_shape is not None else "verify_step")
