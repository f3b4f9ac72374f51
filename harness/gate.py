"""Regression gate for CI: fails on a real slowdown or accuracy loss, not on measurement noise.

    python -m harness.gate --baseline "<hydra overrides>" --candidate "<hydra overrides>"
    python -m harness.gate --baseline "<overrides>" --candidate-rev <git rev>   # compare code

Exit codes: 0 pass, 1 regression, 2 error. Anything that makes a comparison impossible (a side that
fails to load or run, NaN, zero decode tokens, a metric missing on either side, a baseline file that
does not exist or was written for another config) is an error, never a pass.

Speed (the statistics)
----------------------
Absolute tokens/s never transfer between machines, so the gate measures both sides in the same job
and compares the ratio. Each side is loaded once (in this process, or for a git revision in a worker
process running that revision's code from a temporary `git worktree`, see harness/gate_worker.py) and
then measured in adjacent pairs, A B, B A, A B ... (ABBA order), after one untimed warm-up round per side. One repetition is
a fresh measurement: the side's `measure.repetitions` timed passes over its prompt set, summarised by
the runner's own metric, decode_tokens_per_s (median over the timed generations). That gives n pairs
(a_i, b_i), n >= 5.

- Estimate: the relative change of the median, d = median(b) / median(a) - 1.
- Interval: a paired percentile bootstrap. Each resample draws n pair indices with replacement and
  recomputes d; the 2.5% and 97.5% quantiles of `--resamples` such d (seeded) bound the 95% interval.
  Resampling pairs, not each side alone, keeps what a pair shares (the machine's load at that moment)
  inside the pair, so slow drift of a shared machine does not widen or shift the interval. Medians and
  the bootstrap need no normality: tokens/s are skewed by preemption outliers, which the median resists.
- Threshold: tau = max(--threshold (default 5%), 3 x CV), CV being the coefficient of variation of
  the per-pair ratios b_i / a_i, i.e. of the quantity the gate compares, estimated robustly as
  1.4826 x MAD / median (equal to std / mean for normal scatter). On a machine where one comparison
  scatters by 3%, a change below 9% is not distinguishable from noise, and the gate says so (the
  summary prints tau) instead of alarming. Why the pair ratio: load that hits both sides of a pair
  (a slow phase of a shared host lasting seconds) cancels in the ratio, exactly as it does in the
  interval; the per-side CVs include it and would raise tau for noise the design already removed.
  On a quiet machine the ratio's CV is about sqrt(2) x the per-side CV, so this is then the stricter
  reading. Why robust: the compared statistic is a median, which ignores a repetition hit by one
  preemption; the classic std / mean does not, and a single such outlier in 10 lifted it from ~2% to
  20% on a quiet machine (tau 60%). Per-side and classic CVs are still recorded and printed.
- Verdict: regression only when the whole interval lies below -tau (upper bound < -tau): the change
  is both statistically clear (95%) and practically large (beyond tau). An interval entirely above +tau
  is reported as an improvement; anything else passes as "no significant change".
  If the interval's coverage holds, an A/A comparison alarms with probability < 2.5% even at tau = 0;
  requiring it to clear tau >= 5% as well makes a false alarm need a > 5% spurious shift.
  benchmarks/gate_calibration.py measures the real false-alarm rate and power on this machine.

Accuracy (deterministic, against a committed file)
--------------------------------------------------
With `--accuracy-baseline results/baselines/<name>.json`, the candidate's deterministic metrics are
compared with the file (written by `--write-baseline` from the candidate config):
- perplexity: fails above 1.01 x the baseline (MLPerf's "99% of reference" rule);
- kl_div_mean (vs the unquantized reference): fails above 1.10 x baseline + 0.001 nats (an absolute
  slack, since a float config's KL is ~0 and a relative bound alone would flag rounding);
- top1_agreement: fails below baseline - 0.01 (one percentage point);
- greedy tokens of the fixed prompts: every prompt's greedy output must equal the baseline's, token
  for token over the first `--greedy-tokens` tokens (default: all of them). Greedy decoding of the same
  weights is deterministic, so a difference means the numerics changed; when that is intended, rewrite
  the file with `--write-baseline` (the diff shows it in review). Relax with `--greedy-tokens N` where
  float reassociation across machines flips late near-ties.
Metrics present in the file must all be produced by the candidate (else error 2). The file records
the accuracy-relevant config; a candidate whose values differ on a recorded key is an error (2).

Output: a short markdown summary printed and written to $GITHUB_STEP_SUMMARY (appended, when set) and
to `--summary PATH`; a JSON record under `<tracking.results_dir>/gate/` (or `--output PATH`); and one
MLflow run (experiment `<tracking.experiment>-gate`) holding the interval, the thresholds and the verdict.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import QuantbenchError

log = logging.getLogger("quantbench")

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "gate_worker.py"
PASS, REGRESSION, ERROR = 0, 1, 2
MIN_REPETITIONS = 5

# accuracy bounds (module docstring); the file stores the values it was checked against
PPL_RATIO = 1.01
KL_RATIO, KL_SLACK = 1.10, 1e-3
AGREEMENT_DROP = 0.01
ACCURACY_METRICS = ("perplexity", "kl_div_mean", "top1_agreement")
# config keys that decide the deterministic metrics (speed-only and tracking settings excluded)
ACCURACY_KEYS = ("model", "quantizer", "strategy", "accuracy", "measure.max_new_tokens", "measure.prompts",
                 "measure.chat_template", "measure.stop_at_eos", "measure.seed")


class GateError(QuantbenchError):
    """The comparison cannot be made (exit code 2)."""


# ----------------------------------------------------------------------------------------- statistics


@dataclass
class SpeedStats:
    """The speed comparison of n interleaved repetition pairs (module docstring)."""

    n: int
    baseline_median: float
    candidate_median: float
    change: float  # median(candidate) / median(baseline) - 1
    ci_low: float
    ci_high: float
    confidence: float
    cv_baseline: float  # robust CV (1.4826 x MAD / median) of the baseline's per-repetition tokens/s
    cv_candidate: float
    threshold: float  # as configured
    effective_threshold: float  # max(threshold, 3 x cv_ratio)
    resamples: int
    verdict: str  # regression | improvement | no significant change
    cv_ratio: float = 0.0  # robust CV of the pair ratios candidate_i / baseline_i: the one tau uses
    cv_baseline_classic: float = 0.0  # sample std / mean, for reference (outlier-sensitive)
    cv_candidate_classic: float = 0.0


def _cv(x: np.ndarray) -> float:
    """Classic coefficient of variation, sample std / mean."""
    return float(x.std(ddof=1) / x.mean()) if x.size > 1 and x.mean() > 0 else 0.0


def robust_cv(x: np.ndarray) -> float:
    """Coefficient of variation from the median absolute deviation: 1.4826 x MAD / median.

    1.4826 makes MAD a consistent estimator of the standard deviation for normal data, so this equals
    std / mean on well-behaved samples but ignores the few preemption outliers a shared machine adds.
    """
    med = float(np.median(x))
    return float(1.4826 * np.median(np.abs(x - med)) / med) if x.size > 1 and med > 0 else 0.0


def check_samples(name: str, values: list[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        raise GateError(f"{name}: no speed measurements")
    bad = [v for v in values if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)]
    if bad:
        raise GateError(f"{name}: decode tokens/s {bad[0]!r} is not a positive number (NaN or zero decode "
                        "tokens: the run produced nothing to time); check measure.max_new_tokens >= 2")
    return arr


def speed_stats(baseline: list[float], candidate: list[float], threshold: float = 0.05, resamples: int = 2000,
                seed: int = 0, confidence: float = 0.95) -> SpeedStats:
    """Paired bootstrap interval of the relative change of median tokens/s, and the verdict."""
    a, b = check_samples("baseline", baseline), check_samples("candidate", candidate)
    if a.size != b.size:
        raise GateError(f"unpaired samples: {a.size} baseline vs {b.size} candidate repetitions")
    if a.size < 2:
        raise GateError("at least 2 repetition pairs are needed for an interval")
    if not 0 < confidence < 1:
        raise GateError(f"confidence={confidence} must be between 0 and 1")
    if resamples < 100:
        raise GateError(f"resamples={resamples} is too few for a 95% interval; use >= 1000")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(resamples, a.size))  # pair indices: a_i and b_i move together
    boot = np.median(b[idx], axis=1) / np.median(a[idx], axis=1) - 1.0
    alpha = 1.0 - confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    cv_a, cv_b, cv_r = robust_cv(a), robust_cv(b), robust_cv(b / a)
    tau = max(threshold, 3.0 * cv_r)
    verdict = "regression" if hi < -tau else ("improvement" if lo > tau else "no significant change")
    return SpeedStats(n=int(a.size), baseline_median=float(np.median(a)), candidate_median=float(np.median(b)),
                      change=float(np.median(b) / np.median(a) - 1.0), ci_low=float(lo), ci_high=float(hi),
                      confidence=confidence, cv_baseline=cv_a, cv_candidate=cv_b, threshold=threshold,
                      effective_threshold=tau, resamples=resamples, verdict=verdict, cv_ratio=cv_r,
                      cv_baseline_classic=_cv(a), cv_candidate_classic=_cv(b))


# ------------------------------------------------------------------------------------------- accuracy


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def accuracy_config(config: dict) -> dict[str, Any]:
    """The flattened config keys that decide the deterministic metrics."""
    flat = _flatten(config)
    return {k: v for k, v in flat.items() if any(k == key or k.startswith(key + ".") for key in ACCURACY_KEYS)}


def _finite(name: str, value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise GateError(f"{where}: metric {name} is {value!r}, not a finite number")
    return float(value)


def compare_accuracy(current: dict, baseline: dict, greedy_tokens: int = 0) -> list[Check]:
    """Check the candidate's deterministic metrics against a baseline file's content (module docstring).

    Raises GateError for anything that prevents the comparison (missing or non-finite metrics).
    """
    base_metrics = baseline.get("metrics")
    base_greedy = baseline.get("greedy_tokens")
    if not isinstance(base_metrics, dict) or not isinstance(base_greedy, list) or not base_greedy:
        raise GateError("accuracy baseline file has no 'metrics' or no 'greedy_tokens'; rewrite it with "
                        "--write-baseline")
    checks: list[Check] = []
    for name in ACCURACY_METRICS:
        if name not in base_metrics:
            continue
        if name not in current:
            raise GateError(f"candidate did not produce metric {name!r}, which the accuracy baseline has; "
                            "enable it (accuracy.enabled=true, accuracy.kl=true) or rewrite the baseline")
        ref = _finite(name, base_metrics[name], "accuracy baseline")
        val = _finite(name, current[name], "candidate")
        if name == "perplexity":
            bound = PPL_RATIO * ref
            checks.append(Check(name, val <= bound, f"{val:.4f} vs baseline {ref:.4f} (fail above {bound:.4f}, "
                                                   f"{PPL_RATIO:g}x)"))
        elif name == "kl_div_mean":
            bound = KL_RATIO * ref + KL_SLACK
            checks.append(Check(name, val <= bound, f"{val:.5f} vs baseline {ref:.5f} (fail above {bound:.5f})"))
        else:
            bound = ref - AGREEMENT_DROP
            checks.append(Check(name, val >= bound, f"{val:.4f} vs baseline {ref:.4f} (fail below {bound:.4f})"))
    got = current.get("greedy_tokens")
    if not isinstance(got, list) or not got:
        raise GateError("candidate produced no greedy tokens for the fixed prompts")
    if len(got) != len(base_greedy):
        raise GateError(f"candidate generated for {len(got)} prompts, the baseline for {len(base_greedy)}; "
                        "the prompt set changed: rewrite the baseline with --write-baseline")
    diffs = []
    for i, (x, y) in enumerate(zip(got, base_greedy, strict=True)):
        x, y = (x[:greedy_tokens], y[:greedy_tokens]) if greedy_tokens else (x, y)
        if x != y:
            first = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            diffs.append(f"prompt {i} differs at token {first}")
    scope = f"first {greedy_tokens} tokens" if greedy_tokens else "all tokens"
    checks.append(Check("greedy_tokens", not diffs,
                        f"{len(got) - len(diffs)}/{len(got)} prompts identical ({scope})"
                        + (f": {'; '.join(diffs)}" if diffs else "")))
    return checks


def check_baseline_config(current: dict, baseline: dict, path: Path) -> None:
    """Refuse a baseline written for a different config (keys recorded in both must agree)."""
    recorded = baseline.get("config") or {}
    mine = accuracy_config(current)
    differ = [f"{k}: {recorded[k]!r} in the file, {mine[k]!r} now" for k in sorted(recorded)
              if k in mine and mine[k] != recorded[k]]
    if differ:
        raise GateError(f"{path} was written for a different config ({'; '.join(differ[:3])}); use the same "
                        "overrides, or rewrite it with --write-baseline")


def load_baseline(path: Path) -> dict:
    if not path.is_file():
        raise GateError(f"accuracy baseline {path} does not exist; create it with --write-baseline")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GateError(f"accuracy baseline {path} is not valid JSON ({exc}); rewrite it with --write-baseline") \
            from exc
    if not isinstance(data, dict):
        raise GateError(f"accuracy baseline {path} is not a JSON object; rewrite it with --write-baseline")
    return data


# ---------------------------------------------------------------------------------------------- sides


class InProcessSide:
    """A side measured in this process (current checkout)."""

    def __init__(self, label: str, overrides: list[str]):
        self.label, self.overrides, self.rev = label, overrides, ""
        self._side: Any = None

    def validate(self) -> dict:
        """Compose + build without loading (every config problem at once); returns the plain config."""
        from harness.config import build, compose

        exp = build(compose(self.overrides))
        exp.model.preflight()
        return exp.config

    def load(self) -> dict:
        from harness.gate_worker import LoadedSide

        self._side = LoadedSide(self.overrides)
        return self._side.info()

    def measure(self) -> dict:
        return self._side.measure()

    def accuracy(self) -> dict:
        return self._side.accuracy()

    def close(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None


class WorktreeSide:
    """A side measured by a worker process running a git revision's code from a temporary worktree."""

    def __init__(self, label: str, overrides: list[str], rev: str, timeout_s: float):
        self.label, self.overrides, self.rev, self.timeout_s = label, overrides, rev, timeout_s
        self.tmp: Path | None = None
        self.root: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_path: Path | None = None

    def validate(self) -> dict:
        sha = _git("rev-parse", "--verify", "--quiet", f"{self.rev}^{{commit}}")
        if not sha:
            raise GateError(f"--{self.label}-rev {self.rev!r} is not a commit in {REPO}; give a branch, tag or sha")
        self.sha = sha
        return {}

    def load(self) -> dict:
        self.tmp = Path(tempfile.mkdtemp(prefix="qb-gate-"))
        self.root = self.tmp / "tree"
        out = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(self.root), self.sha],
                             capture_output=True, text=True)
        if out.returncode:
            raise GateError(f"git worktree add {self.rev} failed: {out.stderr.strip().splitlines()[-1:]}")
        self.stderr_path = self.tmp / "worker.log"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTHONPATH", None)
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), str(self.root)], cwd=self.root, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        return self._ask({"cmd": "load", "overrides": self.overrides})["info"]

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _ask(self, request: dict) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        where = f"{self.label} at {self.rev}"
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty as exc:
            raise GateError(f"{where}: no answer to {request['cmd']!r} within {self.timeout_s:.0f} s; raise "
                            "--timeout") from exc
        except OSError:
            line = None
        if line is None:
            raise GateError(f"{where}: worker exited ({self._tail()})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise GateError(f"{where}: {reply.get('error', 'failed')}")
        return reply

    def _tail(self) -> str:
        try:
            lines = [x for x in (self.stderr_path.read_text().splitlines() if self.stderr_path else []) if x.strip()]
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"

    def measure(self) -> dict:
        return self._ask({"cmd": "measure"})["metrics"]

    def accuracy(self) -> dict:
        return self._ask({"cmd": "accuracy"})["metrics"]

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.poll() is None:
                    self._ask({"cmd": "quit"})
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a stuck worker is killed, the gate's verdict stands
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.root is not None:
            out = subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(self.root)],
                                 capture_output=True, text=True)
            if out.returncode:
                shutil.rmtree(self.root, ignore_errors=True)
                subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
            self.root = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def make_side(label: str, overrides: list[str], rev: str, timeout_s: float):
    return WorktreeSide(label, overrides, rev, timeout_s) if rev else InProcessSide(label, overrides)


# ---------------------------------------------------------------------------------------------- gate


@dataclass
class GateOptions:
    baseline: list[str]
    candidate: list[str]
    baseline_rev: str = ""
    candidate_rev: str = ""
    threshold: float = 0.05
    repetitions: int = 10
    resamples: int = 2000
    seed: int = 0
    confidence: float = 0.95
    accuracy_baseline: str = ""
    write_baseline: bool = False
    greedy_tokens: int = 0
    skip_speed: bool = False
    summary: str = ""
    output: str = ""
    mlflow: bool = True
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        problems = []
        if self.repetitions < MIN_REPETITIONS:
            problems.append(f"--repetitions {self.repetitions}: at least {MIN_REPETITIONS} are needed per side")
        if not 0 <= self.threshold < 1:
            problems.append(f"--threshold {self.threshold}: give a fraction, e.g. 0.05 for 5%")
        if self.resamples < 1000:
            problems.append(f"--resamples {self.resamples}: use >= 1000 for a stable 95% interval")
        if not 0.5 <= self.confidence < 1:
            problems.append(f"--confidence {self.confidence}: give e.g. 0.95")
        if self.write_baseline and not self.accuracy_baseline:
            problems.append("--write-baseline needs --accuracy-baseline PATH (where to write it)")
        if self.greedy_tokens < 0:
            problems.append("--greedy-tokens must be >= 0 (0 = all tokens)")
        if problems:
            raise GateError("; ".join(problems))


@dataclass
class GateResult:
    code: int
    verdict: str  # pass | regression | error
    options: dict
    speed: SpeedStats | None = None
    samples: dict = field(default_factory=dict)
    accuracy: list[Check] = field(default_factory=list)
    accuracy_metrics: dict = field(default_factory=dict)
    error: str = ""
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    wrote_baseline: str = ""


def _describe(overrides: list[str], rev: str) -> str:
    text = " ".join(overrides) or "(defaults)"
    return f"`{text}` at `{rev}`" if rev else f"`{text}`"


def run_gate(opts: GateOptions) -> GateResult:
    """Measure, compare and decide. Never raises for a failed comparison: the result carries code 2."""
    t0 = time.perf_counter()
    res = GateResult(code=ERROR, verdict="error", options=asdict(opts))
    sides = [make_side("baseline", opts.baseline, opts.baseline_rev, opts.timeout_s),
             make_side("candidate", opts.candidate, opts.candidate_rev, opts.timeout_s)]
    try:
        for side in sides:  # every config problem before any model loads
            side.validate()
        base, cand = sides
        if opts.write_baseline:
            res.info["candidate"] = cand.load()
            res.wrote_baseline = write_baseline(Path(opts.accuracy_baseline), cand, res.info["candidate"])
            res.code, res.verdict = PASS, "pass"
            return res
        if not opts.skip_speed or opts.accuracy_baseline:
            res.info["candidate"] = cand.load()
        if not opts.skip_speed:
            res.info["baseline"] = base.load()
            a, b = measure_interleaved(base, cand, opts.repetitions)
            res.samples = {"baseline": a, "candidate": b}
            res.speed = speed_stats(a, b, opts.threshold, opts.resamples, opts.seed, opts.confidence)
        if opts.accuracy_baseline:
            path = Path(opts.accuracy_baseline)
            data = load_baseline(path)
            check_baseline_config(res.info["candidate"].get("config", {}), data, path)
            res.accuracy_metrics = cand.accuracy()
            res.accuracy = compare_accuracy(res.accuracy_metrics, data, opts.greedy_tokens)
        failed = (res.speed is not None and res.speed.verdict == "regression") or any(not c.ok for c in res.accuracy)
        res.code, res.verdict = (REGRESSION, "regression") if failed else (PASS, "pass")
    except Exception as exc:  # noqa: BLE001 - any failure is exit 2 with one line, never a pass
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        res.error = text if isinstance(exc, QuantbenchError) else f"{type(exc).__name__}: {text}"
        res.code, res.verdict = ERROR, "error"
    finally:
        for side in sides:
            try:
                side.close()
            except Exception as exc:  # noqa: BLE001 - cleanup must not hide the verdict
                log.warning("closing %s failed: %s", side.label, exc)
        res.seconds = time.perf_counter() - t0
    return res


def measure_interleaved(base: Any, cand: Any, repetitions: int) -> tuple[list[float], list[float]]:
    """Per-repetition decode tokens/s of two loaded sides, measured in adjacent pairs after a warm-up round.

    Pairs alternate their order, A B, B A, A B, ... (ABBA counterbalancing): a machine that speeds up or
    slows down steadily would otherwise favour whichever side always goes second.
    """
    base.measure()  # untimed warm-up round: the first measurement after loading runs cold
    cand.measure()
    a: list[float] = []
    b: list[float] = []
    for i in range(repetitions):
        if i % 2 == 0:
            a.append(_tps(base.measure(), "baseline"))
            b.append(_tps(cand.measure(), "candidate"))
        else:
            b.append(_tps(cand.measure(), "candidate"))
            a.append(_tps(base.measure(), "baseline"))
    return a, b


def _tps(metrics: dict, label: str) -> float:
    if "decode_tokens_per_s" not in metrics:
        raise GateError(f"{label}: the measurement has no decode_tokens_per_s")
    value = metrics["decode_tokens_per_s"]
    if not metrics.get("decode_tokens"):
        raise GateError(f"{label}: zero decode tokens were generated; use measure.max_new_tokens >= 2")
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise GateError(f"{label}: decode tokens/s is {value!r}")
    return float(value)


def write_baseline(path: Path, side: Any, info: dict) -> str:
    """Write the candidate's deterministic metrics as the committed accuracy baseline."""
    from harness import env
    from harness.tracking import write_json_atomic

    metrics = side.accuracy()
    greedy = metrics.pop("greedy_tokens")
    for name, value in metrics.items():
        _finite(name, value, "candidate")
    data = {
        "overrides": side.overrides,
        "rev": side.rev or env.git_commit(),
        "config": accuracy_config(info.get("config", {})),
        "metrics": {k: v for k, v in metrics.items() if k in ACCURACY_METRICS or k == "scored_tokens"},
        "greedy_tokens": greedy,
        "rules": {"perplexity_max_ratio": PPL_RATIO, "kl_max_ratio": KL_RATIO, "kl_slack": KL_SLACK,
                  "top1_agreement_max_drop": AGREEMENT_DROP, "greedy": "identical tokens"},
        "written_on": {"torch": info.get("torch", ""), "cpu": env.cpu_model(), "threads": info.get("threads")},
    }
    write_json_atomic(path, data)
    os.chmod(path, 0o644)  # a file meant to be committed: mkstemp's private 0600 would surprise reviewers
    return str(path)


# -------------------------------------------------------------------------------------------- output


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def summary_markdown(res: GateResult) -> str:
    o = res.options
    icon = {"pass": "PASS", "regression": "FAIL (regression)", "error": "ERROR"}[res.verdict]
    lines = [f"## quantbench gate: {icon}", "",
             f"- baseline: {_describe(o['baseline'], o['baseline_rev'])}",
             f"- candidate: {_describe(o['candidate'], o['candidate_rev'])}"]
    if res.wrote_baseline:
        lines.append(f"- wrote accuracy baseline `{res.wrote_baseline}`")
    if res.error:
        lines += ["", f"**error:** {res.error}"]
    s = res.speed
    if s is not None:
        lines += ["", "| speed (decode tok/s, median) | baseline | candidate | change | "
                  f"{s.confidence:.0%} CI | threshold | verdict |", "|---|---|---|---|---|---|---|",
                  f"| {s.n} interleaved repetitions each | {s.baseline_median:.1f} | {s.candidate_median:.1f} | "
                  f"{_pct(s.change)} | [{_pct(s.ci_low)}, {_pct(s.ci_high)}] | -{s.effective_threshold:.1%} "
                  f"(max of {s.threshold:.0%} and 3 x CV {s.cv_ratio:.1%}) | {s.verdict} |",
                  "", f"CV = robust coefficient of variation of the {s.n} pair ratios; per side: baseline "
                  f"{s.cv_baseline:.1%}, candidate {s.cv_candidate:.1%} (classic std/mean {s.cv_baseline_classic:.1%}, "
                  f"{s.cv_candidate_classic:.1%})."]
    if res.accuracy:
        lines += ["", "| accuracy vs committed baseline | result | detail |", "|---|---|---|"]
        lines += [f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {c.detail} |" for c in res.accuracy]
    lines += ["", f"exit code {res.code} ({res.seconds:.1f} s). Speed fails only when the whole interval lies "
              "below -threshold; accuracy rules: docs/gate.md."]
    return "\n".join(lines) + "\n"


def _tracking_config(opts: GateOptions):
    from harness.config import TrackingConfig, build, compose

    for overrides, rev in ((opts.baseline, opts.baseline_rev), (opts.candidate, opts.candidate_rev)):
        if not rev:
            try:
                return build(compose(overrides)).tracking
            except Exception:  # noqa: BLE001 - an invalid config is reported by the gate itself
                continue
    return TrackingConfig()


def record(res: GateResult, opts: GateOptions, markdown: str) -> str:
    """Result JSON (atomic) + one MLflow run with the interval and the verdict; returns the JSON path."""
    import dataclasses

    from harness import env, tracking
    from harness.runner import Result

    tcfg = _tracking_config(opts)
    tcfg = dataclasses.replace(tcfg, experiment=f"{tcfg.experiment}-gate", enabled=tcfg.enabled and opts.mlflow)
    metrics: dict[str, float] = {"exit_code": float(res.code), "gate_seconds": res.seconds}
    if res.speed is not None:
        s = res.speed
        metrics.update({"speed_change": s.change, "speed_ci_low": s.ci_low, "speed_ci_high": s.ci_high,
                        "speed_threshold": s.threshold, "speed_effective_threshold": s.effective_threshold,
                        "baseline_decode_tokens_per_s": s.baseline_median,
                        "candidate_decode_tokens_per_s": s.candidate_median,
                        "speed_cv_ratio": s.cv_ratio, "baseline_cv": s.cv_baseline, "candidate_cv": s.cv_candidate,
                        "baseline_cv_classic": s.cv_baseline_classic,
                        "candidate_cv_classic": s.cv_candidate_classic, "repetitions": float(s.n)})
    metrics.update({f"candidate_{k}": float(v) for k, v in res.accuracy_metrics.items()
                    if isinstance(v, (int, float)) and k in ACCURACY_METRICS})
    tags = {"gate.verdict": res.verdict, "gate.speed_verdict": res.speed.verdict if res.speed else "not measured",
            "gate.baseline": " ".join(opts.baseline), "gate.candidate": " ".join(opts.candidate),
            "gate.baseline_rev": opts.baseline_rev, "gate.candidate_rev": opts.candidate_rev,
            "git_commit": env.git_commit(), "cpu_model": env.cpu_model()}
    tags.update({f"gate.accuracy.{c.name}": ("ok " if c.ok else "FAIL ") + c.detail for c in res.accuracy})
    now = time.time()
    result = Result(status="OK" if res.code != ERROR else "FAILED", config={"gate": res.options},
                    metrics={k: v for k, v in metrics.items() if math.isfinite(v)}, tags=tags, error=res.error,
                    run_name=f"gate-{res.verdict}", config_hash="gate", started=now - res.seconds, ended=now)
    result.samples = []
    path = Path(opts.output) if opts.output else tracking.json_path(result, tcfg, folder="gate")
    data_artifacts = {"gate_summary.md": markdown,
                      "gate_samples.json": json.dumps({"samples": res.samples, "speed": asdict(res.speed)
                                                       if res.speed else None}, indent=2)}
    tracking.record(result, tcfg, path=path, artifacts=data_artifacts)
    return str(path)


def emit(markdown: str, summary_path: str) -> None:
    print(markdown)
    targets = [p for p in (os.environ.get("GITHUB_STEP_SUMMARY", ""), summary_path) if p]
    for i, target in enumerate(targets):
        try:
            with open(target, "a" if i == 0 and os.environ.get("GITHUB_STEP_SUMMARY") else "w") as fh:
                fh.write(markdown)
        except OSError as exc:
            print(f"warning: could not write the summary to {target}: {exc}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> GateOptions:
    ap = argparse.ArgumentParser(prog="python -m harness.gate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Exit codes: 0 pass, 1 regression, 2 error. Details: docs/gate.md")
    ap.add_argument("--baseline", default="", help="Hydra overrides of the baseline, in one string")
    ap.add_argument("--candidate", default=None, help="Hydra overrides of the candidate (default: the baseline's)")
    ap.add_argument("--candidate-rev", default="", help="measure the candidate with this git revision's code")
    ap.add_argument("--baseline-rev", default="", help="measure the baseline with this git revision's code")
    ap.add_argument("--threshold", type=float, default=0.05, help="smallest slowdown that fails (fraction; 0.05)")
    ap.add_argument("--repetitions", type=int, default=10, help="interleaved repetitions per side (>= 5)")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--accuracy-baseline", default="", help="committed baseline file results/baselines/<name>.json")
    ap.add_argument("--write-baseline", action="store_true", help="write the candidate's metrics to that file")
    ap.add_argument("--greedy-tokens", type=int, default=0, help="compare only the first N greedy tokens (0=all)")
    ap.add_argument("--skip-speed", action="store_true", help="accuracy check only")
    ap.add_argument("--summary", default="", help="also write the markdown summary here")
    ap.add_argument("--output", default="", help="gate JSON record (default: <results_dir>/gate/...)")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the comparison to MLflow")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a revision worker may take per request")
    args = ap.parse_args(argv)
    baseline = shlex.split(args.baseline)
    candidate = baseline if args.candidate is None else shlex.split(args.candidate)
    if args.candidate is None and not (args.candidate_rev or args.write_baseline or args.skip_speed):
        raise GateError("give --candidate \"<overrides>\" and/or --candidate-rev <git rev>")
    return GateOptions(baseline=baseline, candidate=candidate, baseline_rev=args.baseline_rev,
                       candidate_rev=args.candidate_rev, threshold=args.threshold, repetitions=args.repetitions,
                       resamples=args.resamples, seed=args.seed, confidence=args.confidence,
                       accuracy_baseline=args.accuracy_baseline, write_baseline=args.write_baseline,
                       greedy_tokens=args.greedy_tokens, skip_speed=args.skip_speed, summary=args.summary,
                       output=args.output, mlflow=not args.no_mlflow, timeout_s=args.timeout)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from harness import quiet_third_party

    quiet_third_party()
    try:
        opts = parse_args(argv)
    except GateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ERROR
    res = run_gate(opts)
    markdown = summary_markdown(res)
    emit(markdown, opts.summary)
    try:
        where = record(res, opts, markdown)
        print(f"gate record: {where}")
    except Exception as exc:  # noqa: BLE001 - the verdict stands without the record
        print(f"warning: could not record the gate result: {exc}", file=sys.stderr)
    if res.error:
        print(f"error: {res.error}", file=sys.stderr)
    return res.code


if __name__ == "__main__":
    raise SystemExit(main())
