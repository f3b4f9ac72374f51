"""The gate's accuracy side: deterministic metrics of the candidate against a committed baseline file.

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
the accuracy-relevant config; a candidate whose values differ on a recorded key is an error (2), and so
is one that scored another number of corpus tokens than the file's `scored_tokens` (the corpus text or
the tokenizer changed under the same config): its perplexity and KL are over other tokens.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import env, metrics
from harness.gate.errors import GateError
from harness.records.results import write_json_atomic

# accuracy bounds (module docstring); the file stores the values it was checked against
PPL_RATIO = 1.01
KL_RATIO, KL_SLACK = 1.10, 1e-3
AGREEMENT_DROP = 0.01
ACCURACY_METRICS = tuple(metrics.gate_accuracy_metrics())  # perplexity, kl_div_mean, top1_agreement
# config keys that decide the deterministic metrics (speed-only and tracking settings excluded)
ACCURACY_KEYS = ("model", "quantizer", "strategy", "accuracy", "measure.max_new_tokens", "measure.prompts",
                 "measure.chat_template", "measure.stop_at_eos", "measure.seed")


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

    Raises GateError for anything that prevents the comparison (missing or non-finite metrics, metrics over
    another number of scored tokens than the baseline's).
    """
    base_metrics = baseline.get("metrics")
    base_greedy = baseline.get("greedy_tokens")
    if not isinstance(base_metrics, dict) or not isinstance(base_greedy, list) or not base_greedy:
        raise GateError("accuracy baseline file has no 'metrics' or no 'greedy_tokens'; rewrite it with "
                        "--write-baseline")
    # the config check cannot see the corpus text or the tokenizer change: the number of scored tokens can
    scored, got = base_metrics.get("scored_tokens"), current.get("scored_tokens")
    if isinstance(scored, (int, float)) and got != scored and any(name in current for name in ACCURACY_METRICS):
        got = format(got, "g") if isinstance(got, (int, float)) else "no"
        raise GateError(f"candidate scored {got} corpus tokens, the accuracy baseline {scored:g}: its perplexity, KL "
                        "and top-1 are over other text (the corpus or the tokenizer changed); rewrite the baseline "
                        "with --write-baseline")
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
    if not isinstance(data.get("metrics"), dict) or not isinstance(data.get("greedy_tokens"), list) \
            or not data["greedy_tokens"]:  # what compare_accuracy reads: refused now, not after the speed run
        raise GateError(f"accuracy baseline {path} has no 'metrics' or no 'greedy_tokens'; rewrite it with "
                        "--write-baseline")
    return data


def write_baseline(path: Path, side: Any, info: dict) -> str:
    """Write the candidate's deterministic metrics as the committed accuracy baseline."""
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

