"""The regression gate: its statistics on synthetic samples, the accuracy rules, exit codes, errors,
and real gate runs on the smoke config (tiny model) against the committed baseline."""

from __future__ import annotations

import copy
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from harness import gate
from harness.gate import GateError, GateOptions, compare_accuracy, speed_stats

# The CI gate's config (.ci/run): the smoke experiment, 32 tokens a prompt, 1 thread.
SMOKE = "+experiment=smoke measure.max_new_tokens=32 measure.repetitions=1 measure.threads=1"
BASELINE_FILE = ROOT / "results" / "baselines" / "smoke.json"


def noisy(n: int, centre: float, cv: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(centre * (1 + cv * rng.standard_normal(n)))


# ------------------------------------------------------------------------------------ statistics


def test_known_shift_is_detected():
    s = speed_stats(noisy(10, 100, 0.01, 1), noisy(10, 85, 0.01, 2))
    assert s.verdict == "regression"
    assert s.ci_high < -s.effective_threshold
    assert s.ci_low < s.change < s.ci_high
    assert s.change == pytest.approx(-0.15, abs=0.02)


def test_no_shift_passes():
    for seed in range(20):
        s = speed_stats(noisy(10, 100, 0.02, seed), noisy(10, 100, 0.02, 100 + seed), seed=seed)
        assert s.verdict == "no significant change", s
        assert s.ci_low <= 0.0 <= s.ci_high or abs(s.change) < 0.05


def test_ci_width_shrinks_with_n():
    # one interval's width is itself random (a small sample can look tight), so compare mean widths
    widths = []
    for n in (5, 20, 80):
        runs = [speed_stats(noisy(n, 100, 0.03, 10 * n + k), noisy(n, 100, 0.03, 5000 + 10 * n + k), resamples=1000)
                for k in range(30)]
        widths.append(float(np.mean([s.ci_high - s.ci_low for s in runs])))
    assert widths[0] > widths[1] > widths[2] > 0
    assert widths[2] < widths[0] / 2  # roughly 1/sqrt(n): 4x the pairs, about half the width


def test_threshold_is_never_below_three_cv():
    # a 10% slowdown inside 5% noise: 3 x CV = 15% > 10%, so the gate refuses to call it
    s = speed_stats(noisy(10, 100, 0.05, 3), noisy(10, 90, 0.05, 4), threshold=0.05)
    assert s.effective_threshold >= 3 * s.cv_ratio > 0.05
    assert s.verdict == "no significant change"
    # the same slowdown on a quiet machine is caught
    assert speed_stats(noisy(10, 100, 0.005, 3), noisy(10, 90, 0.005, 4)).verdict == "regression"


def test_cv_is_robust_to_one_preemption_outlier():
    # one repetition of ten hit by a preemption (half speed): the medians ignore it, and so must tau
    a, b = noisy(10, 100, 0.005, 11), noisy(10, 88, 0.005, 12)
    b[3] = 44.0
    s = speed_stats(a, b)
    assert s.cv_candidate_classic > 0.15  # std / mean would have raised tau above 45%
    assert s.cv_ratio < 0.02 and s.effective_threshold == 0.05
    assert s.verdict == "regression"


def test_load_shared_by_a_pair_cancels_in_the_threshold():
    # a shared host: each pair runs in a slow or fast phase (+-20%), both sides alike; a real 12% drop
    rng = np.random.default_rng(5)
    phase = 1 + 0.2 * rng.choice([-1, 1], 12)
    a = list(100 * phase * (1 + 0.005 * rng.standard_normal(12)))
    b = list(88 * phase * (1 + 0.005 * rng.standard_normal(12)))
    s = speed_stats(a, b)
    assert s.cv_baseline > 0.1 and s.cv_candidate > 0.1  # per side the phases look like huge noise
    assert s.cv_ratio < 0.02  # the comparison itself is precise
    assert s.verdict == "regression"


def test_pairs_alternate_their_order():
    calls: list[str] = []

    class Side:
        def __init__(self, label):
            self.label = label

        def measure(self):
            calls.append(self.label)
            return {"decode_tokens_per_s": 100.0, "decode_tokens": 10.0}

    a, b = gate.measure_interleaved(Side("A"), Side("B"), 4)
    assert a == b == [100.0] * 4
    assert "".join(calls) == "AB" + "AB" + "BA" + "AB" + "BA"  # warm-up round, then ABBA pairs


def test_improvement_is_not_a_regression():
    s = speed_stats(noisy(10, 100, 0.01, 5), noisy(10, 130, 0.01, 6))
    assert s.verdict == "improvement" and s.ci_low > s.effective_threshold


def test_bootstrap_is_reproducible_with_a_seed():
    a, b = noisy(8, 100, 0.02, 7), noisy(8, 97, 0.02, 8)
    assert speed_stats(a, b, seed=3) == speed_stats(a, b, seed=3)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_nan_or_zero_speed_is_an_error(bad):
    with pytest.raises(GateError, match="not a positive number"):
        speed_stats([100.0] * 5, [100.0, 101.0, bad, 99.0, 100.0])


def test_unpaired_samples_are_an_error():
    with pytest.raises(GateError, match="unpaired"):
        speed_stats([100.0] * 5, [100.0] * 6)


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


def test_baseline_for_another_config_is_an_error(committed):
    config = {"model": {"_target_": "harness.models.TinyRandom", "seed": 1}}
    with pytest.raises(GateError, match="model.seed"):
        gate.check_baseline_config(config, committed, BASELINE_FILE)


def test_options_are_validated_before_any_work():
    with pytest.raises(GateError, match="at least 5"):
        GateOptions(baseline=[], candidate=[], repetitions=4)
    with pytest.raises(GateError, match="write-baseline needs"):
        GateOptions(baseline=[], candidate=[], write_baseline=True)


# ------------------------------------------------------------------------------ exit codes, runs


def run_main(args: list[str], tmp_path: Path, mlflow_dir: Path) -> tuple[int, str]:
    summary = tmp_path / "summary.md"
    code = gate.main([*args, "--summary", str(summary), "--output", str(tmp_path / "gate.json")]
                     + ["--resamples", "1000"])
    return code, summary.read_text() if summary.exists() else ""


def overrides(mlflow_dir: Path, tmp_path: Path, extra: str = "") -> str:
    return f"{SMOKE} tracking.uri=sqlite:///{mlflow_dir}/mlflow.db tracking.results_dir={tmp_path} {extra}".strip()


def test_real_gate_on_smoke_config_passes_against_committed_baseline(tmp_path, mlflow_dir, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    ov = overrides(mlflow_dir, tmp_path)
    code, md = run_main(["--baseline", ov, "--candidate", ov, "--repetitions", "5",
                         "--accuracy-baseline", str(BASELINE_FILE)], tmp_path, mlflow_dir)
    record = json.loads((tmp_path / "gate.json").read_text())
    # A/A on the same code: the interval contains 0 or the change is within the noise threshold
    assert code == 0, md
    assert "PASS" in md and "95% CI" in md and "4/4 prompts identical" in md
    m = record["metrics"]
    assert m["speed_ci_low"] <= m["speed_change"] <= m["speed_ci_high"]
    assert m["speed_effective_threshold"] >= 0.05 and m["repetitions"] == 5
    assert record["tags"]["gate.verdict"] == "pass" and record["mlflow_run_id"]
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{mlflow_dir}/mlflow.db").get_run(record["mlflow_run_id"])
    assert run.data.tags["gate.verdict"] == "pass"
    assert run.data.metrics["speed_ci_high"] == pytest.approx(m["speed_ci_high"])


def test_accuracy_regression_exits_1(tmp_path, mlflow_dir):
    doctored = json.loads(BASELINE_FILE.read_text())
    doctored["metrics"]["perplexity"] /= 1.05  # the candidate now looks 5% worse than "before"
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(doctored))
    code, md = run_main(["--baseline", overrides(mlflow_dir, tmp_path), "--skip-speed", "--no-mlflow",
                         "--accuracy-baseline", str(path)], tmp_path, mlflow_dir)
    assert code == 1, md
    assert "| perplexity | FAIL |" in md and "| greedy_tokens | ok |" in md


def test_speed_regression_exits_1(tmp_path, mlflow_dir, monkeypatch):
    # the wiring from verdict to exit code, with the sides' measurements replaced by known samples
    samples = {"baseline": iter([100.0] * 6), "candidate": iter([80.0, 79.0, 81.0, 80.5, 79.5, 80.0])}
    monkeypatch.setattr(gate.InProcessSide, "load", lambda self: {"config": {}})
    monkeypatch.setattr(gate.InProcessSide, "measure", lambda self: {
        "decode_tokens_per_s": next(samples[self.label]), "decode_tokens": 100.0})
    code, md = run_main(["--baseline", overrides(mlflow_dir, tmp_path), "--candidate",
                         overrides(mlflow_dir, tmp_path), "--repetitions", "5", "--no-mlflow"], tmp_path, mlflow_dir)
    assert code == 1 and "FAIL (regression)" in md and "| regression |" in md


@pytest.mark.parametrize("candidate, message", [
    ("measure.max_new_tokens=1", "zero decode tokens"),  # only the prefill token: nothing to time
    ("model=hf model.name_or_path=/nonexistent/model", "no such directory"),  # a failed cell
    ("measure.repetitions=0", "measure.repetitions"),  # invalid config, before anything loads
])
def test_errors_exit_2_never_pass(tmp_path, mlflow_dir, candidate, message):
    code, md = run_main(["--baseline", overrides(mlflow_dir, tmp_path), "--candidate",
                         overrides(mlflow_dir, tmp_path, candidate), "--repetitions", "5", "--no-mlflow"],
                        tmp_path, mlflow_dir)
    assert code == 2, md
    assert "ERROR" in md and message in md


def test_missing_metric_or_baseline_exits_2(tmp_path, mlflow_dir):
    ov = overrides(mlflow_dir, tmp_path)
    code, md = run_main(["--baseline", ov, "--skip-speed", "--no-mlflow", "--accuracy-baseline",
                         str(tmp_path / "missing.json")], tmp_path, mlflow_dir)
    assert code == 2 and "--write-baseline" in md
    broken = json.loads(BASELINE_FILE.read_text())
    del broken["greedy_tokens"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    code, md = run_main(["--baseline", ov, "--skip-speed", "--no-mlflow", "--accuracy-baseline",
                         str(tmp_path / "broken.json")], tmp_path, mlflow_dir)
    assert code == 2 and "greedy_tokens" in md


def test_bad_options_exit_2(tmp_path, mlflow_dir):
    assert gate.main(["--baseline", SMOKE, "--candidate", SMOKE, "--repetitions", "3", "--no-mlflow"]) == 2
    assert gate.main(["--baseline", SMOKE]) == 2  # no candidate at all
    assert gate.main(["--baseline", SMOKE, "--candidate-rev", "no-such-rev-xyz", "--no-mlflow",
                      "--output", str(tmp_path / "g.json")]) == 2


def test_write_baseline_round_trip(tmp_path, mlflow_dir):
    path = tmp_path / "b.json"
    ov = overrides(mlflow_dir, tmp_path)
    assert run_main(["--baseline", ov, "--accuracy-baseline", str(path), "--write-baseline", "--no-mlflow"],
                    tmp_path, mlflow_dir)[0] == 0
    written = json.loads(path.read_text())
    committed = json.loads(BASELINE_FILE.read_text())
    # the committed file is what this code computes for the smoke config: same tokens, same numbers
    assert written["greedy_tokens"] == committed["greedy_tokens"]
    for k in gate.ACCURACY_METRICS:
        assert math.isclose(written["metrics"][k], committed["metrics"][k], rel_tol=1e-6, abs_tol=1e-9)


def test_candidate_rev_runs_in_a_temporary_worktree(tmp_path, mlflow_dir):
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    plain = "model=tiny_random measure.max_new_tokens=16 measure.repetitions=1 measure.threads=1 accuracy.enabled=false"
    code, md = run_main(["--baseline", plain, "--candidate", plain, "--candidate-rev", "HEAD", "--repetitions", "5",
                         "--no-mlflow"], tmp_path, mlflow_dir)
    assert code in (0, 1), md  # measured and compared (A/A code: a pass unless the machine is wild)
    assert "at `HEAD`" in md and "5 interleaved repetitions" in md
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before  # the temporary worktree is gone
