"""The regression gate: its statistic and sequential rule on a synthetic noisy machine, the interleaving,
the worker protocol and the refusal of revisions that predate it, the accuracy rules, exit codes and
errors, and real gate runs on the smoke config (tiny model): A/A on this checkout, and `make gate`'s
comparison of a commit that adds real work to every decode step with its parent (tests/test_gate_ci.py)."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from harness import env, gate
from harness.errors import QuantbenchError
from harness.gate import GateError, GateOptions, compare_accuracy, interleave, speed_stats, stats

# The CI gate's config (.ci/run): the smoke experiment, 32 tokens a prompt, 1 thread.
SMOKE = "+experiment=smoke measure.max_new_tokens=32 measure.repetitions=1 measure.threads=1"
BASELINE_FILE = ROOT / "results" / "baselines" / "smoke.json"


# ------------------------------------------------------------------------------- a synthetic machine


class Host:
    """A noisy shared machine: slow phases (shared by neighbouring blocks), per-step jitter, preemptions.

    `now` advances with every simulated step, so it doubles as the gate's clock for budget tests.
    """

    def __init__(self, seed: int, phase_sd: float = 0.3, phase_steps: int = 40, jitter: float = 0.08,
                 preempt: float = 0.01, step_s: float = 1e-3, preempt_factor: float = 5.0):
        self.rng = np.random.default_rng(seed)
        self.phase_sd, self.phase_steps, self.jitter, self.preempt, self.step_s = (
            phase_sd, phase_steps, jitter, preempt, step_s)
        self.preempt_factor = preempt_factor
        self.steps, self.phase, self.now = 0, 1.0, 0.0

    def step(self, factor: float) -> float:
        if self.steps % self.phase_steps == 0:  # a new host phase: up to ~2x slower or faster, both sides alike
            self.phase = math.exp(self.rng.normal(0, self.phase_sd))
        self.steps += 1
        dt = self.step_s * factor * self.phase * math.exp(self.rng.normal(0, self.jitter))
        if self.rng.random() < self.preempt:
            dt *= self.preempt_factor  # a preemption: one wild step
        self.now += dt
        return dt


class FakeSide:
    """A gate side on the synthetic host; `slowdown` stretches its steps (0.10: tokens/s -9.1%).

    A block is whole generate calls of `steps_per_call` decode steps until at least `min_tokens`
    tokens, as harness/gate/worker.py measures it; the reply has the worker's fields.
    """

    def __init__(self, host: Host, label: str, slowdown: float = 0.0, calls: list | None = None,
                 steps_per_call: int = 16):
        self.host, self.label, self.slowdown, self.calls = host, label, slowdown, calls
        self.steps_per_call = steps_per_call

    def block(self, min_tokens: int) -> dict:
        if self.calls is not None:
            self.calls.append(self.label)
        tokens, wall = 0, 0.0
        while tokens < min_tokens:
            wall += sum(self.host.step(1 + self.slowdown) for _ in range(self.steps_per_call))
            tokens += self.steps_per_call
        return {"decode_tokens": tokens, "decode_wall_s": wall, "generations": 1, "wall": [0.0, 0.0]}


def fake_gate(seed: int, slowdown: float, budget_s: float = 120.0, max_pairs: int = 8192, min_pairs: int = 64,
              **host) -> stats.SpeedStats:
    h = Host(seed, **host)
    plan = interleave.Plan(budget_s=budget_s, max_pairs=max_pairs, min_pairs=min_pairs, seed=seed, resamples=1000)
    return interleave.measure_sequential(FakeSide(h, "A"), FakeSide(h, "B", slowdown), plan, clock=lambda: h.now)[2]


# ------------------------------------------------------------------------------------ statistics


def test_planted_slowdown_is_caught_through_shared_phase_noise():
    caught = [fake_gate(seed, 0.10) for seed in range(10)]  # steps 10% longer: tokens/s -9.1%
    assert all(s.verdict == "regression" for s in caught), [s.stop for s in caught]
    for s in caught:
        assert s.cv_baseline > 0.15  # per side the host phases look like huge noise ...
        assert s.ci_high < -0.05  # ... the adjacent-block ratio sees through (bounds are changes, exp(x) - 1)
        assert -0.2 < s.change < -0.05
        assert "decided: regression" in s.stop
    # a run that stops at its first decided look overstates the effect a little (it stopped because it
    # looked clear); across runs the estimate is centred on the truth and the bounds hold it
    assert np.median([s.change for s in caught]) == pytest.approx(1 / 1.1 - 1, abs=0.015)
    assert sum(s.ci_low <= 1 / 1.1 - 1 <= s.ci_high for s in caught) >= 8


def test_aa_with_shared_phase_noise_is_not_flagged():
    runs = [fake_gate(seed, 0.0) for seed in range(100, 130)]
    assert not [s for s in runs if s.verdict == "regression"]
    assert sum(s.verdict == "no regression" for s in runs) >= 28  # and it usually says so, quickly
    changes = [s.change for s in runs]
    assert abs(np.mean(changes)) < 0.015 and np.median(np.abs(changes)) < 0.02  # no bias; a single run +-7%
    # each look's two-sided interval is ~98.9% (0.53% each side): a miss or two in 30 runs is expected
    assert sum(s.ci_low <= 0 <= s.ci_high for s in runs) >= 28


def test_sequential_stops_early_when_clear_and_measures_more_when_not():
    clear = fake_gate(1, 0.25)
    assert clear.verdict == "regression" and len(clear.looks) == 1 and clear.pairs == 64
    # a slowdown right at the threshold on a noisier host: the bounds straddle -5% look after look
    edge = fake_gate(2, 0.0526, budget_s=6.0, jitter=0.3)
    assert edge.verdict == "undecided" and "budget" in edge.stop and "a pass that says so" in edge.stop
    assert len(edge.looks) >= 2 and edge.pairs > 64
    assert all(lk.low <= math.log(0.95) <= lk.high for lk in edge.looks)
    capped = fake_gate(2, 0.0526, max_pairs=128, jitter=0.3)
    assert capped.verdict == "undecided" and "--max-blocks 128 reached" in capped.stop and capped.pairs == 128


def test_order_effect_cancels_in_abba_groups():
    # the block right after a switch pays 4% (cold caches): A/A must still estimate ~0
    h = Host(3, phase_sd=0.0, jitter=0.02, preempt=0.0)

    class Cold(FakeSide):
        last = ""

        def block(self, min_tokens):
            out = super().block(min_tokens)
            if Cold.last and Cold.last != self.label:
                out["decode_wall_s"] *= 1.04
            Cold.last = self.label
            return out

    a, b, s = interleave.measure_sequential(Cold(h, "A"), Cold(h, "B"), interleave.Plan(max_pairs=256))
    assert s.order_effect == pytest.approx(-0.08, abs=0.02)  # AB pairs see B cold, BA pairs see A cold
    assert abs(s.change) < 0.01


def test_trimmed_mean_ignores_a_preempted_block():
    rng = np.random.default_rng(4)
    a = list(100 * np.exp(rng.normal(0, 0.02, 64)))
    b = list(90 * np.exp(rng.normal(0, 0.02, 64)))
    clean = speed_stats(a, b)
    b[7] = 10.0  # one block hit by a long preemption
    hit = speed_stats(a, b)
    assert hit.change == pytest.approx(clean.change, abs=0.01) and hit.verdict == clean.verdict == "regression"


def test_bootstrap_is_seeded_and_reproducible():
    rng = np.random.default_rng(5)
    x = rng.normal(-0.03, 0.1, 200)
    one, two = stats.bound(x, 0.01, 2000, seed=7), stats.bound(x, 0.01, 2000, seed=7)
    assert one == two
    other = stats.bound(x, 0.01, 2000, seed=8)
    assert other[0] == one[0] and other[1:] != one[1:]  # same estimate, a different resample draw
    a, b = list(100 * np.exp(rng.normal(0, 0.05, 64))), list(97 * np.exp(rng.normal(0, 0.05, 64)))
    assert speed_stats(a, b, seed=3) == speed_stats(a, b, seed=3)


def test_moving_blocks_widen_the_bound_for_correlated_pairs():
    # pair values that drift together (AR(1), rho 0.8): independent resampling would understate the spread
    rng = np.random.default_rng(6)
    x = np.zeros(1024)
    for i in range(1, x.size):
        x[i] = 0.8 * x[i - 1] + rng.normal(0, 0.05)
    boot = stats.moving_block_bootstrap(x, 2000, seed=0, trim=0.0)
    naive = x.std() / math.sqrt(x.size)
    assert boot.std() > 2 * naive  # the true standard error is 3x naive here


def test_pocock_level_spends_alpha_across_looks():
    sizes = tuple(stats.look_schedule(64, 8192))
    assert sizes == (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    level = stats.pocock_alpha(sizes, 0.05)
    assert 0.05 / len(sizes) < level < 0.05  # less strict than Bonferroni, stricter than one look
    assert stats.pocock_alpha((64,), 0.05) == 0.05
    # check it independently: z-tests at that level on null data cross at any look ~5% of the time
    rng = np.random.default_rng(9)
    data = rng.standard_normal((4000, 512))
    looks = (64, 128, 256, 512)
    lvl4 = stats.pocock_alpha(looks, 0.05)
    z_crit = -_norm_ppf(lvl4)
    crossed = np.zeros(4000, dtype=bool)
    for n in looks:
        crossed |= data[:, :n].sum(1) / math.sqrt(n) > z_crit
    assert crossed.mean() == pytest.approx(0.05, abs=0.012)


def test_bound_is_t_times_the_bootstrap_sd():
    # the percentile bootstrap's quantiles were too narrow at the per-look levels (docs/gate.md, "Bounds")
    x = np.random.default_rng(11).normal(-0.03, 0.08, 64)  # 32 groups, moving blocks of 3: 10 blocks, 9 df
    assert stats.bound_df(64) == 9
    est, low, high = stats.bound(x, 0.01, 2000, seed=7)
    sd = stats.moving_block_bootstrap(x, 2000, seed=7).std(ddof=1)
    assert est == pytest.approx(float(stats.trimmed_mean(x)))
    assert high - est == pytest.approx(est - low) == pytest.approx(2.821 * sd, rel=1e-3)  # t(0.99, 9) = 2.821
    # the untrimmed total throughput's bound: the same t, the sd of its own bootstrap on the same resamples
    rng = np.random.default_rng(12)
    a, b = 700 * np.exp(rng.normal(0, 0.05, 64)), 680 * np.exp(rng.normal(0, 0.05, 64))
    lk = stats.look(a, b, 0.05, 0.01, 2000, seed=7)
    tot_sd = stats.totals_bootstrap(a, b, resamples=2000, seed=7).std(ddof=1)
    assert lk.totals == pytest.approx(math.log(b.size / (1 / b).sum()) - math.log(a.size / (1 / a).sum()))
    assert lk.totals_high - lk.totals == pytest.approx(lk.totals - lk.totals_low) == pytest.approx(2.821 * tot_sd, rel=1e-3)
    # two statistics may say "regression": each gets half of the error (Bonferroni), spent across the looks
    sizes = tuple(stats.look_schedule(64, 2048))
    assert stats.look_alpha(sizes, 0.95) == stats.pocock_alpha(sizes, 0.025) < stats.pocock_alpha(sizes, 0.05) / 1.9
    # Student's t quantiles (table values)
    for p, df, t in ((0.99, 4, 3.747), (0.975, 9, 2.262), (0.95, 30, 1.697), (0.95, 1, 6.314), (0.995, 2, 9.925)):
        assert stats.t_ppf(p, df) == pytest.approx(t, abs=1e-3)
        assert stats.t_ppf(1 - p, df) == pytest.approx(-t, abs=1e-3)


def _stalls(n: int, every: int = 6, seed: int = 12) -> tuple[list[float], list[float]]:
    # both sides cycle the same calls in lockstep; every 6th candidate call stalls 2x (periodic GC, recompile):
    # throughput -14.3%, but only 1 pair in 6 shows it, and the trimmed mean drops those pairs
    rng = np.random.default_rng(seed)
    a = 700 * np.exp(rng.normal(0, 0.05, n))
    b = 700 * np.exp(rng.normal(0, 0.05, n)) / np.where(np.arange(n) % every == every - 1, 2.0, 1.0)
    return list(a), list(b)


def test_a_slowdown_in_some_blocks_only_is_a_regression_of_total_throughput():
    s = speed_stats(*_stalls(256))
    assert s.change > -0.05 and s.ci_low > -0.05  # the trimmed estimate and its bound clear the threshold ...
    assert s.change_totals == pytest.approx(1 / (5 / 6 + 2 / 6) - 1, abs=0.02)  # ... total tokens / time do not
    assert s.ci_high_totals < -0.05 and s.verdict == "regression"  # and its upper bound fails the gate


class OnePromptSlow(FakeSide):
    """A candidate whose generate call on one prompt of a 4-prompt cycle is `factor` x slower (both sides cycle
    the prompts in lockstep, so pair i compares prompt i mod 4: harness/gate/interleave.py)."""

    def __init__(self, host, label, factor, prompts=4, slow=0):
        super().__init__(host, label)
        self.factor, self.prompts, self.slow, self.calls_made = factor, prompts, slow, 0

    def block(self, min_tokens):
        out = super().block(min_tokens)
        if self.calls_made % self.prompts == self.slow:
            out["decode_wall_s"] *= self.factor
        self.calls_made += 1
        return out


def test_one_slow_prompt_of_four_fails_the_gate_and_the_stop_line_says_how():
    # one prompt of 8 made 2x slower is -11% of throughput, but 1 pair in 8: the trimmed mean drops those
    # pairs, and the gate used to end "undecided" (a pass) at every budget (an audit: one prompt of 4 1.5x
    # slower, -11%, the same on the real CI config)
    h = Host(13, jitter=0.05)
    s = interleave.measure_sequential(FakeSide(h, "A"), OnePromptSlow(h, "B", 2.0, prompts=8), interleave.Plan())[2]
    assert s.change > -0.05 and s.change_totals == pytest.approx(1 / (7 / 8 + 2 / 8) - 1, abs=0.02)
    assert s.verdict == "regression" and s.ci_high_totals < -0.05
    assert "total tokens / total time -1" in s.stop and "some blocks only" in s.stop
    # the same host with an unchanged candidate: both statistics clear the threshold
    h = Host(13, jitter=0.05)
    aa = interleave.measure_sequential(FakeSide(h, "A"), OnePromptSlow(h, "B", 1.0), interleave.Plan())[2]
    assert aa.verdict == "no regression" and aa.ci_low_totals > -0.05 and "both lower bounds" in aa.stop


def test_rare_very_slow_blocks_on_both_sides_are_no_false_alarm():
    # the untrimmed totals follow a long preemption (a step 40x slower: its block ~3.5x), so their bound is
    # wider than the trimmed one; an A/A gate on such a host must still never say "regression"
    runs = [fake_gate(seed, 0.0, preempt=0.004, preempt_factor=40.0) for seed in range(200, 230)]
    assert not [s for s in runs if s.verdict == "regression"]
    assert all(s.ci_high_totals - s.ci_low_totals > s.ci_high - s.ci_low for s in runs)
    assert sum(s.verdict == "no regression" for s in runs) >= 25


def test_a_straddling_total_throughput_keeps_the_gate_undecided_and_says_why():
    # one prompt of 8 1.5x slower: -5.9% of throughput, too close to -5% for 128 pairs of this noise
    h = Host(21, phase_sd=0.1, jitter=0.05)
    s = interleave.measure_sequential(FakeSide(h, "A"), OnePromptSlow(h, "B", 1.5, prompts=8),
                                      interleave.Plan(max_pairs=128))[2]
    assert s.ci_low > -0.05 and s.ci_low_totals < -0.05 < s.ci_high_totals and s.verdict == "undecided"
    assert "--max-blocks 128 reached" in s.stop and "the trimmed estimate clears -5%" in s.stop
    assert "not a clear pass" in s.stop


def _norm_ppf(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(-mid / math.sqrt(2)) < p else (lo, mid)
    return lo


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_nan_or_zero_speed_is_an_error(bad):
    with pytest.raises(GateError, match="not a positive number"):
        speed_stats([100.0] * 8, [100.0, 101.0, bad, 99.0, 100.0, 100.0, 100.0, 100.0])


def test_unpaired_or_partial_groups_are_an_error():
    with pytest.raises(GateError, match="unpaired"):
        speed_stats([100.0] * 8, [100.0] * 10)
    with pytest.raises(GateError, match="whole A B B A groups"):
        speed_stats([100.0] * 7, [100.0] * 7)


def test_sides_alternate_in_abba_groups():
    calls: list[str] = []
    h = Host(10, phase_sd=0.0, jitter=0.01, preempt=0.0)
    a, b, s = interleave.measure_sequential(FakeSide(h, "A", calls=calls), FakeSide(h, "B", calls=calls),
                                            interleave.Plan(min_pairs=8, max_pairs=8))
    assert "".join(calls) == "ABBA" * 5  # one untimed warm-up group, then 4 measured groups = 8 pairs
    assert len(a) == len(b) == s.pairs == 8


def test_a_look_at_few_blocks_never_decides():
    # a 25% slowdown is plain to see, but 8 or 16 pairs are too few for a trustworthy bootstrap bound
    few = fake_gate(1, 0.25, min_pairs=8)
    assert [lk.pairs for lk in few.looks] == [8, 16, 32] and few.verdict == "regression"
    assert [lk.decision for lk in few.looks[:2]] == ["undecided", "undecided"]
    budget = fake_gate(1, 0.25, budget_s=0.3, min_pairs=8)  # the budget ends after a few groups
    assert budget.pairs < interleave.MIN_DECIDE_PAIRS and budget.verdict == "undecided"
    assert "fewer than the 32 a decision needs" in budget.stop
    assert fake_gate(1, 0.25, min_pairs=32).verdict == "regression"  # from 32 pairs on it decides


@pytest.mark.parametrize("max_blocks", [8, 16, 30])
def test_a_plan_whose_looks_can_never_decide_is_refused(max_blocks):
    # below 32 blocks every look is "undecided" (a pass): such a gate could never fail, so refuse it
    with pytest.raises(GateError, match=f"--max-blocks {max_blocks}: at least 32, the fewest blocks a decision"):
        GateOptions(baseline=[], candidate=[], min_blocks=8, max_blocks=max_blocks)
    assert not interleave.Plan(min_pairs=8, max_pairs=32).problems()


def test_options_are_validated_before_any_work():
    with pytest.raises(GateError, match="even number >= 8"):
        GateOptions(baseline=[], candidate=[], min_blocks=5)
    with pytest.raises(GateError, match="write-baseline needs"):
        GateOptions(baseline=[], candidate=[], write_baseline=True)
    with pytest.raises(GateError, match="--budget"):
        GateOptions(baseline=[], candidate=[], budget_s=0)
    with pytest.raises(GateError, match="--block-steps"):
        GateOptions(baseline=[], candidate=[], block_steps=0)
    with pytest.raises(GateError, match="--seed -1: give an integer >= 0"):  # was: numpy's error at the first look
        GateOptions(baseline=[], candidate=[], seed=-1)


def test_block_speed_is_decode_tokens_over_decode_wall_clock():
    assert interleave.block_tps({"decode_tokens": 62, "decode_wall_s": 0.5}, "x") == 124.0
    with pytest.raises(GateError, match="zero decode tokens"):
        interleave.block_tps({"decode_tokens": 0, "decode_wall_s": 0.5}, "x")
    with pytest.raises(GateError, match="decode time"):
        interleave.block_tps({"decode_tokens": 3, "decode_wall_s": float("nan")}, "x")


# ------------------------------------------------------------------------------------- accuracy


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(BASELINE_FILE.read_text())


def current_from(baseline: dict) -> dict:
    return {**copy.deepcopy(baseline["metrics"]), "greedy_tokens": copy.deepcopy(baseline["greedy_tokens"])}


def test_committed_baseline_has_every_metric(committed):
    assert set(gate.ACCURACY_METRICS) <= set(committed["metrics"])
    assert len(committed["greedy_tokens"]) == 4 and all(len(t) == 32 for t in committed["greedy_tokens"])
    assert committed["config"]["model._target_"] == "harness.models.TinyRandom"


def test_identical_metrics_pass(committed):
    checks = compare_accuracy(current_from(committed), committed)
    assert [c.name for c in checks] == ["perplexity", "kl_div_mean", "top1_agreement", "greedy_tokens"]
    assert all(c.ok for c in checks)


def test_perplexity_rule_is_one_percent(committed):
    cur = current_from(committed)
    cur["perplexity"] = committed["metrics"]["perplexity"] * 1.009
    assert all(c.ok for c in compare_accuracy(cur, committed))
    cur["perplexity"] = committed["metrics"]["perplexity"] * 1.011
    failed = [c.name for c in compare_accuracy(cur, committed) if not c.ok]
    assert failed == ["perplexity"]


def test_kl_and_agreement_bounds(committed):
    cur = current_from(committed)
    cur["kl_div_mean"] = committed["metrics"]["kl_div_mean"] * gate.KL_RATIO + 2 * gate.KL_SLACK
    cur["top1_agreement"] = committed["metrics"]["top1_agreement"] - 2 * gate.AGREEMENT_DROP
    failed = {c.name for c in compare_accuracy(cur, committed) if not c.ok}
    assert failed == {"kl_div_mean", "top1_agreement"}


def test_greedy_token_difference_fails_and_says_where(committed):
    cur = current_from(committed)
    cur["greedy_tokens"][2][5] = (cur["greedy_tokens"][2][5] + 1) % 259
    check = compare_accuracy(cur, committed)[-1]
    assert not check.ok and "prompt 2 differs at token 5" in check.detail
    # compared only on the first 5 tokens, the same output passes
    assert compare_accuracy(cur, committed, greedy_tokens=5)[-1].ok


def test_missing_or_nan_metric_is_an_error(committed):
    cur = current_from(committed)
    del cur["kl_div_mean"]
    with pytest.raises(GateError, match="kl_div_mean"):
        compare_accuracy(cur, committed)
    cur = current_from(committed)
    cur["perplexity"] = float("nan")
    with pytest.raises(GateError, match="not a finite number"):
        compare_accuracy(cur, committed)
    with pytest.raises(GateError, match="greedy_tokens"):
        compare_accuracy(current_from(committed), {"metrics": committed["metrics"]})


def test_a_baseline_scored_on_another_number_of_tokens_is_an_error(committed):
    """scored_tokens was recorded but never compared: after the corpus text changed under the same config,
    perplexity, KL and top-1 were checked against a baseline scored on other tokens (a pass or a FAIL, never 2)."""
    cur = current_from(committed)
    assert committed["metrics"]["scored_tokens"] == 299
    cur["scored_tokens"] = 300
    with pytest.raises(GateError, match=r"^candidate scored 300 corpus tokens, the accuracy baseline 299: .* rewrite "
                                        r"the baseline with --write-baseline$"):
        compare_accuracy(cur, committed)
    del cur["scored_tokens"]
    with pytest.raises(GateError, match=r"^candidate scored no corpus tokens, the accuracy baseline 299"):
        compare_accuracy(cur, committed)
    cur["scored_tokens"] = 299  # an int from the run, a float in the file
    assert all(c.ok for c in compare_accuracy(cur, committed))
    older = {**committed, "metrics": {k: v for k, v in committed["metrics"].items() if k != "scored_tokens"}}
    cur["scored_tokens"] = 1
    assert all(c.ok for c in compare_accuracy(cur, older))  # a file without it: nothing to compare


def test_baseline_for_another_config_is_an_error(committed):
    config = {"model": {"_target_": "harness.models.TinyRandom", "seed": 1}}
    with pytest.raises(GateError, match="model.seed"):
        gate.check_baseline_config(config, committed, BASELINE_FILE)


# --------------------------------------------------------------- the worker, its protocol, revisions


class FakePipeline:
    """The Pipeline contract (harness/run/pipeline.py) without a model: 2 batches, 7 decode tokens a call."""

    made: list = []

    def __init__(self, exp, device):
        self.exp, self.device, self.calls, self.closed = exp, device, [], False
        FakePipeline.made.append(self)

    def preflight(self):
        pass

    def load(self):
        self.batches = [[[1, 2]], [[3]]]

    def generate(self, i):
        from harness.measure import Generation

        self.calls.append(i % len(self.batches))
        return Generation(sequences=[[0] * 8], prompt_tokens=2, ttft_s=0.01, step_s=[0.001] * 7, decode_tokens=7,
                          decode_wall_s=0.01)

    def accuracy(self):
        return {"perplexity": 2.5, "record": "not a number: left out"}

    def greedy_tokens(self):
        return [[5, 6], [7]]

    def info(self):
        return {"run_name": "fake", "threads": 1, "config": {}}

    def close(self):
        self.closed = True


def test_worker_protocol_measures_whole_generate_calls():
    from harness.gate.worker import PROTOCOL, Worker, serve

    ov = SMOKE.split() + ["accuracy.enabled=false"]
    requests = [{"cmd": "hello"}, {"cmd": "block", "min_tokens": 2}, {"cmd": "check", "overrides": ov},
                {"cmd": "block", "min_tokens": 2}, {"cmd": "load"}, {"cmd": "block", "min_tokens": 16},
                {"cmd": "block", "min_tokens": 1}, {"cmd": "accuracy"}, {"cmd": "nope"}, {"cmd": "quit"},
                {"cmd": "hello"}]
    out = io.StringIO()
    FakePipeline.made.clear()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), out, Worker(FakePipeline))
    r = [json.loads(x) for x in out.getvalue().splitlines()]
    assert r[0]["ok"] and r[0]["protocol"] == PROTOCOL == gate.PROTOCOL == 1
    assert r[1] == {"ok": False, "error": "'block' before 'check'"}
    assert r[2]["ok"] and r[2]["config"]["measure"]["max_new_tokens"] == 32  # composed by the worker's own code
    assert r[3] == {"ok": False, "error": "'block' before 'load'"}
    assert r[4]["ok"] and r[4]["info"]["run_name"] == "fake"
    # 16 tokens at least: 3 whole calls of 7; speed = decode tokens / decode wall clock of those calls
    assert r[5]["block"]["decode_tokens"] == 21 and r[5]["block"]["generations"] == 3
    assert r[5]["block"]["decode_wall_s"] == pytest.approx(0.03)
    assert r[6]["block"]["decode_tokens"] == 7
    assert FakePipeline.made[0].calls == [0, 1, 0, 1]  # the batches in turn, cycling, as run.py decodes them
    assert r[7]["metrics"] == {"perplexity": 2.5, "greedy_tokens": [[5, 6], [7]]}
    assert not r[8]["ok"] and "use hello, check, load" in r[8]["error"]
    assert r[9] == {"ok": True} and len(r) == 10  # nothing answered after quit
    assert FakePipeline.made[0].closed


def test_worker_refuses_a_config_without_decode_phase():
    from harness.gate.worker import Worker, answer

    FakePipeline.made.clear()
    with pytest.raises(QuantbenchError, match="no decode phase"):
        answer(Worker(FakePipeline), {"cmd": "check", "overrides": [*SMOKE.split(), "measure.max_new_tokens=1"]})
    assert not FakePipeline.made  # refused before a pipeline exists


def test_an_unknown_option_is_one_line_in_the_worker_and_before_any_worker_starts(capsys):
    """Not Hydra's MissingConfigException after a worker started (~9 s): the option and what is allowed."""
    from harness.gate.worker import Worker, answer

    with pytest.raises(QuantbenchError, match="quantizer='int3' is not an option; choose one of: .*bf16"):
        answer(Worker(FakePipeline), {"cmd": "check", "overrides": [*SMOKE.split(), "quantizer=int3"]})
    with pytest.raises(GateError, match=r"^candidate \(this checkout\): quantizer='int3' is not an option"):
        gate.parse_args(["--baseline", SMOKE, "--candidate", f"{SMOKE} quantizer=int3"])
    # a revision's options are its own: its worker checks them, not this checkout's conf/
    assert gate.parse_args(["--baseline", "quantizer=int3", "--baseline-rev", "HEAD", "--candidate", SMOKE])
    assert gate.main(["--baseline", SMOKE, "--candidate", "strategy=nope", "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: candidate (this checkout): strategy='nope' is not an option; choose one of: "
                   f"{', '.join(sorted(p.stem for p in (ROOT / 'conf' / 'strategy').glob('*.yaml')))}"]


def git_repo(path: Path, commits: list[tuple[str, dict[str, str]]]) -> list[str]:
    """A throwaway repository: each commit writes its files; returns the shas, oldest first."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": str(path)}
    subprocess.run(["git", "init", "-q", str(path)], check=True, env=env)
    shas = []
    for subject, files in commits:
        for name, text in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(text)
        subprocess.run(["git", "-C", str(path), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(path), "commit", "-q", "-m", subject], check=True, env=env)
        shas.append(subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    return shas


def test_a_revision_without_the_protocol_is_refused_naming_the_first_that_speaks_it(tmp_path):
    worker = "harness/gate/worker.py"
    old, first, later, future = git_repo(tmp_path, [
        ("old code", {"README": "x"}),
        ("gate protocol 1", {worker: "PROTOCOL = 1\n"}),
        ("later", {"README": "y"}),
        ("protocol 2", {worker: "PROTOCOL = 2\n"}),
    ])
    problem = gate.protocol_problem("baseline", "HEAD~3", old, tmp_path)
    assert problem == (f"--baseline-rev HEAD~3 ({old[:12]}) predates gate protocol 1; the first revision that speaks "
                       f"it is {first} gate protocol 1; pick that or a later one")
    assert gate.protocol_problem("baseline", "x", first, tmp_path) == ""
    assert gate.protocol_problem("baseline", "x", later, tmp_path) == ""
    assert "speaks gate protocol 2, this gate speaks 1" in gate.protocol_problem("candidate", "y", future, tmp_path)
    bare = tmp_path / "bare"
    (old2,) = git_repo(bare, [("no worker anywhere", {"README": "x"})])
    assert "the first revision that speaks it is not yet committed" in gate.protocol_problem("baseline", "HEAD", old2,
                                                                                             bare)


def test_an_old_baseline_rev_exits_2_in_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    root_commit = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                                 text=True, check=True).stdout.split()[0]

    def no_start(self):
        raise AssertionError("a worker started for a refused revision")

    monkeypatch.setattr(gate.WorkerSide, "start", no_start)
    code = gate.main(["--baseline", SMOKE, "--baseline-rev", root_commit, "--candidate", SMOKE, "--no-mlflow",
                      "--output", str(tmp_path / "g.json")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(err) == 1
    assert f"--baseline-rev {root_commit} ({root_commit[:12]}) predates gate protocol 1" in err[0]
    assert "pick that or a later one" in err[0]


def test_injected_work_is_sized_from_measured_steps():
    from harness.measure import now
    from strategies.base import DecodeOptions
    from strategies.inject import SIZING_STEPS, injected_step

    opts = DecodeOptions(inject_work=0.5)
    for _ in range(SIZING_STEPS):
        assert injected_step(opts, now(), 0.004) == 0.004  # sizing steps run no extra work
    work = opts.__dict__["_extra_work"]
    # a typical step: the smaller of the wall times given (4 ms) and this thread's CPU between calls (~0)
    assert 0 <= work.sizer.step_s <= 0.004
    assert work.unit_s > 0 and work.reps == max(1, round(0.5 * work.sizer.step_s / work.unit_s))
    t = now()
    assert injected_step(opts, t, 0.0) > 0  # from now on every step does the work, inside its timing
    assert work.out.abs().sum() > 0


def test_injected_spin_is_a_share_of_each_steps_cpu_time():
    import time

    from harness.measure import now
    from strategies.base import DecodeOptions
    from strategies.inject import injected_step

    def burn(seconds: float) -> None:
        cpu = time.thread_time()
        while time.thread_time() - cpu < seconds:
            pass

    opts = DecodeOptions(inject_slowdown=0.5)
    injected_step(opts, now(), 0.0)  # the first step only sets the CPU clock's mark
    burn(0.004)  # a step of 4 ms CPU, reported as 4 ms of wall time
    cpu = time.thread_time()
    assert injected_step(opts, now(), 0.004) >= 0.002 - 1e-4
    assert 0.0019 <= time.thread_time() - cpu < 0.004  # it burnt 0.5 x (4 ms + a little bookkeeping) of CPU
    burn(0.004)  # a starved step: 40 ms of wall, 4 ms of CPU: still ~2 ms of spin, not 20
    cpu = time.thread_time()
    injected_step(opts, now(), 0.040)
    assert 0.0019 <= time.thread_time() - cpu < 0.005


# ------------------------------------------------------------------------------ exit codes, runs


def run_main(args: list[str], tmp_path: Path) -> tuple[int, str]:
    summary = tmp_path / "summary.md"
    code = gate.main([*args, "--summary", str(summary), "--output", str(tmp_path / "gate.json")]
                     + ["--resamples", "1000"])
    return code, summary.read_text() if summary.exists() else ""


def overrides(mlflow_dir: Path, tmp_path: Path, extra: str = "") -> str:
    return f"{SMOKE} tracking.uri=sqlite:///{mlflow_dir}/mlflow.db tracking.results_dir={tmp_path} {extra}".strip()


def test_accuracy_regression_exits_1(tmp_path, mlflow_dir):
    doctored = json.loads(BASELINE_FILE.read_text())
    doctored["metrics"]["perplexity"] /= 1.05  # the candidate now looks 5% worse than "before"
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(doctored))
    code, md = run_main(["--baseline", overrides(mlflow_dir, tmp_path), "--skip-speed", "--no-mlflow",
                         "--accuracy-baseline", str(path)], tmp_path)
    assert code == 1, md
    assert "| perplexity | FAIL |" in md and "| greedy_tokens | ok |" in md


def _fake_sides(monkeypatch, slowdown: float, **host) -> None:
    """Replace the workers' model work with the synthetic host (the CLI wiring is what is tested)."""
    h = Host(11, **host)
    monkeypatch.setattr(gate.WorkerSide, "start", lambda self: None)
    monkeypatch.setattr(gate.WorkerSide, "check", lambda self: {})
    monkeypatch.setattr(gate.WorkerSide, "load", lambda self: {"config": {}})
    monkeypatch.setattr(gate.WorkerSide, "block", lambda self, min_tokens: FakeSide(
        h, self.label, slowdown if self.label == "candidate" else 0.0).block(min_tokens))


def test_speed_regression_exits_1(tmp_path, mlflow_dir, monkeypatch):
    _fake_sides(monkeypatch, 0.10)
    code, md = run_main(["--baseline", overrides(mlflow_dir, tmp_path), "--candidate",
                         overrides(mlflow_dir, tmp_path), "--no-mlflow", "--allow-same"], tmp_path)  # fake sides differ
    assert code == 1 and "FAIL (regression)" in md and "| regression |" in md
    assert "Stopped: decided: regression" in md
    cpu = env.cpu_info(with_torch=False)
    assert f"Measured on: {cpu.describe()}." in md  # a speed names its CPU (family and model)
    tags = json.loads((tmp_path / "gate.json").read_text())["tags"]
    assert tags["cpu.family"] == cpu.family and tags["cpu.model"] == cpu.model and tags["cpu.isa"] == cpu.isa


def test_undecided_is_a_pass_that_says_so(tmp_path, mlflow_dir, monkeypatch):
    _fake_sides(monkeypatch, 0.0526, jitter=0.3)
    code, md = run_main(["--baseline", overrides(mlflow_dir, tmp_path), "--candidate",
                         overrides(mlflow_dir, tmp_path), "--no-mlflow", "--max-blocks", "64", "--confidence", "0.99",
                         "--allow-same"],
                        tmp_path)  # a drop right at the threshold: at 99% one look of 64 blocks cannot decide it
    assert code == 0 and "PASS (speed undecided)" in md and "**Undecided:**" in md and "| undecided |" in md


@pytest.mark.parametrize("candidate, message", [
    ("measure.max_new_tokens=1", "zero decode tokens"),  # only the prefill token: nothing to time
    ("model=hf model.name_or_path=/nonexistent/model", "no such directory"),  # a model that cannot load
    ("measure.repetitions=0", "measure.repetitions"),  # invalid config
])
def test_errors_exit_2_never_pass_and_come_before_anything_loads(tmp_path, mlflow_dir, candidate, message):
    res = gate.run_gate(gate.parse_args(["--baseline", overrides(mlflow_dir, tmp_path), "--candidate",
                                         overrides(mlflow_dir, tmp_path, candidate), "--no-mlflow"]))
    md = gate.summary_markdown(res)
    assert res.code == 2 and "ERROR" in md and message in md and "candidate (this checkout)" in res.error, md
    assert res.info == {} and res.speed is None  # refused by the side's check: neither side loaded anything


def test_missing_metric_or_baseline_exits_2(tmp_path, mlflow_dir):
    ov = overrides(mlflow_dir, tmp_path)
    code, md = run_main(["--baseline", ov, "--skip-speed", "--no-mlflow", "--accuracy-baseline",
                         str(tmp_path / "missing.json")], tmp_path)
    assert code == 2 and "--write-baseline" in md
    broken = json.loads(BASELINE_FILE.read_text())
    del broken["greedy_tokens"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    code, md = run_main(["--baseline", ov, "--skip-speed", "--no-mlflow", "--accuracy-baseline",
                         str(tmp_path / "broken.json")], tmp_path)
    assert code == 2 and "greedy_tokens" in md


def test_an_accuracy_baseline_without_what_it_compares_is_refused_when_read(tmp_path):
    """load_baseline runs before both sides load; a file with no metrics or no greedy tokens was refused only by
    compare_accuracy, after the whole speed measurement."""
    from harness.gate.accuracy import load_baseline

    good = json.loads(BASELINE_FILE.read_text())
    assert load_baseline(BASELINE_FILE) == good
    for drop in ("metrics", "greedy_tokens"):
        (tmp_path / "b.json").write_text(json.dumps({k: v for k, v in good.items() if k != drop}))
        with pytest.raises(GateError, match="has no 'metrics' or no 'greedy_tokens'"):
            load_baseline(tmp_path / "b.json")


def test_a_password_in_the_overrides_is_masked_in_the_summary_and_the_record(tmp_path):
    """The config check refuses a tracking URI with a password, but the summary ($GITHUB_STEP_SUMMARY) and the
    JSON record repeated the raw overrides."""
    uri = "postgresql://qb:hunter2@db.example/mlflow"
    code, md = run_main(["--baseline", f"model=tiny_random tracking.uri={uri}", "--candidate",
                         f"model=tiny_random strategy=static_batch tracking.uri={uri}", "--no-mlflow"], tmp_path)
    record = (tmp_path / "gate.json").read_text()
    assert code == 2 and "qb:***@db.example" in md and "holds a password" in md
    assert "hunter2" not in md and "hunter2" not in record and "qb:***@db.example" in record


def test_bad_options_exit_2(tmp_path, capsys):
    assert gate.main(["--baseline", SMOKE, "--candidate", SMOKE, "--repetitions", "3", "--no-mlflow"]) == 2
    assert gate.main(["--baseline", SMOKE]) == 2  # no candidate at all
    capsys.readouterr()
    # speed skipped and no accuracy baseline: nothing would be checked (it loaded the model and said PASS)
    assert gate.main(["--baseline", SMOKE, "--skip-speed", "--no-mlflow"]) == 2
    assert "--skip-speed needs --accuracy-baseline" in capsys.readouterr().err
    # an unbalanced quote: one line, exit 2 (Python's own exit 1 read as a regression)
    assert gate.main(["--baseline", "model=tiny_random 'x", "--candidate", SMOKE, "--no-mlflow"]) == 2
    assert capsys.readouterr().err.startswith("error: --baseline \"model=tiny_random 'x\": No closing quotation")
    with pytest.raises(GateError, match="--max-blocks 65: give an even number"):  # a second, uncorrected look at 64
        GateOptions(baseline=[], candidate=[], max_blocks=65)
    assert gate.main(["--baseline", SMOKE, "--candidate-rev", "no-such-rev-xyz", "--no-mlflow",
                      "--output", str(tmp_path / "g.json")]) == 2


def test_write_baseline_round_trip(tmp_path, mlflow_dir):
    path = tmp_path / "b.json"
    ov = overrides(mlflow_dir, tmp_path)
    assert run_main(["--baseline", ov, "--accuracy-baseline", str(path), "--write-baseline", "--no-mlflow"],
                    tmp_path)[0] == 0
    written = json.loads(path.read_text())
    committed = json.loads(BASELINE_FILE.read_text())
    # the committed file is what this code computes for the smoke config: same tokens, same numbers
    assert written["greedy_tokens"] == committed["greedy_tokens"]
    for k in gate.ACCURACY_METRICS:
        assert math.isclose(written["metrics"][k], committed["metrics"][k], rel_tol=1e-6, abs_tol=1e-9)
    assert written["metrics"]["scored_tokens"] == committed["metrics"]["scored_tokens"]  # compared since: the same


def test_an_undecided_speed_under_a_failed_accuracy_check_does_not_say_it_passes():
    from harness.gate.accuracy import Check

    edge = fake_gate(2, 0.0526, max_pairs=128, jitter=0.3)
    assert edge.verdict == "undecided"
    opts = asdict(GateOptions(baseline=["a=1"], candidate=["a=2"]))
    failed = gate.GateResult(code=1, verdict="regression", options=opts, speed=edge,
                             accuracy=[Check("perplexity", False, "worse")])
    md = gate.summary_markdown(failed)
    assert "FAIL (regression)" in md and "passes" not in md and "comes from the accuracy check" in md
    passed = gate.GateResult(code=0, verdict="pass", options=opts, speed=edge)
    assert "so this passes without a decision" in gate.summary_markdown(passed)


@pytest.mark.serial  # a revision worktree of this repository and two workers: not beside tests/test_gate_ci.py's
def test_a_gate_stopped_by_sigterm_removes_its_worktree_and_temporary_folders(tmp_path):
    """SIGTERM (a CI job cancelled or timed out) skipped run_gate's `finally`: the revision's worktree stayed in git's
    list and both temporary folders in /tmp."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "harness.gate", "--baseline", "model=tiny_random", "--baseline-rev",
                             "HEAD", "--candidate", "model=tiny_random strategy=static_batch", "--no-mlflow",
                             "--output", str(tmp_path / "g.json")], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("qb-gate-*/tree")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    trees = list(tmp_path.glob("qb-gate-*/tree"))
    assert trees, "the gate made no worktree"
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "stopped (SIGTERM) before a verdict" in err, err[-2000:]
    assert not list(tmp_path.glob("qb-gate-*"))
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(trees[0]) not in listed


def test_a_worker_that_does_not_answer_quit_is_killed_without_a_second_timeout(monkeypatch):
    """After a request timed out (up to --timeout, 900 s), close() waited a full --timeout again for 'quit'."""
    import threading

    from harness.gate import sides

    monkeypatch.setattr(sides, "QUIT_WAIT_S", 0.5)
    side = sides.WorkerSide("baseline", [], timeout_s=60.0)
    side.proc = subprocess.Popen(["sleep", "120"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    threading.Thread(target=side._pump, daemon=True).start()
    t0 = time.monotonic()
    side.close()
    assert time.monotonic() - t0 < 10 and side.proc is None


@pytest.mark.serial  # a revision worktree of this repository and a worker: not beside tests/test_gate_ci.py's
def test_a_revision_side_runs_its_own_code_even_under_pythonsafepath(monkeypatch):
    """PYTHONSAFEPATH keeps `python -m`'s cwd off sys.path: the editable install then served this checkout's code to
    the revision's worker (a gate of HEAD against itself), and its hello still named the worktree."""
    from harness.gate.sides import WorkerSide

    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    side = WorkerSide("baseline", ["model=tiny_random"], "HEAD", repo=ROOT)
    side.validate()
    try:
        side.start()  # refused (GateError) when the worker's code is not the worktree's
        assert side.root is not None and side.root.is_dir()
    finally:
        side.close()


def test_the_gate_refuses_to_compare_a_commit_with_itself(tmp_path):
    """Same revision and overrides on both sides: refused (such a gate cannot fail), unless the candidate tree has
    changes, the revisions or the configs differ; --allow-same is the A/A check's way round it (tests/test_gate_ci.py)."""
    from harness.gate.sides import WorkerSide, same_config, self_comparison

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t"})

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    (tmp_path / "a.py").write_text("x = 2\n")
    git("commit", "-q", "-am", "two")

    def sides(base_rev: str, cand_rev: str = "", cand: str = "quantizer=bf16") -> str:
        base = WorkerSide("baseline", ["quantizer=bf16"], base_rev, repo=tmp_path)
        other = WorkerSide("candidate", [cand], cand_rev, repo=tmp_path)
        if base_rev:
            base.sha = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", base_rev], capture_output=True,
                                      text=True, check=True).stdout.strip()  # what validate() sets
        if cand_rev:
            other.sha = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", cand_rev], capture_output=True,
                                       text=True, check=True).stdout.strip()
        return self_comparison(base, other)

    assert "compare a commit with itself" in sides("HEAD")  # a clean checkout against its own commit
    assert "--allow-same" in sides("HEAD") and sides("HEAD~1") == ""  # the parent: a real comparison
    assert "compare a commit with itself" in sides("HEAD~1", cand_rev="HEAD~1")  # two revisions that are one
    assert sides("HEAD", cand="quantizer=fp32") == ""  # another config is a comparison too
    # the candidate at a revision, the baseline this clean checkout at it; both sides this checkout (no revision)
    assert "compare a commit with itself" in sides("", cand_rev="HEAD")
    assert "compare a commit with itself" in sides("") and sides("", cand="quantizer=fp32") == ""
    # the same run asked for in other words: Hydra's last value of a key wins, the order of keys is no matter
    assert same_config(["quantizer=bf16", "a=1"], ["a=1", "quantizer=fp32", "quantizer=bf16"])
    assert not same_config(["quantizer=bf16", "a=1"], ["a=1", "quantizer=bf16", "quantizer=fp32"])
    (tmp_path / "a.py").write_text("x = 3\n")  # the candidate has local changes: its code differs from HEAD
    assert sides("HEAD") == ""
    assert "compare a commit with itself" in sides("")  # ... but both sides of this checkout still run one code


def test_calibration_report_names_the_cpu_and_the_whole_date_range(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gate_calibration", ROOT / "benchmarks" / "gate_calibration.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    cpu = env.cpu_info(with_torch=False).describe()
    row = {"scenario": "aa", "verdict": "no regression", "change": 0.0, "ci_low": -0.01, "ci_high": 0.01, "pairs": 64,
           "looks": 1, "speed_s": 4.0, "seconds": 10.0, "order_effect": 0.0, "lag1": 0.0}
    lines = [{"scenario": "meta", "cpu": cpu, "date": "2026-12-06 06:56", "command": "python b.py --only aa"},
             {**row, "run": 0, "date": "2026-12-06 06:57"}, {**row, "run": 1, "date": "2026-12-06 07:08"}]
    (tmp_path / "cal.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cal.report(tmp_path / "cal.jsonl")
    assert f"CPU: {cpu}; 2026-12-06 06:56 .. 2026-12-06 07:08" in capsys.readouterr().out  # the last run's end
