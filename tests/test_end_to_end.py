"""The tiny model end to end into a temporary MLflow store, and the result JSON contract."""

from __future__ import annotations

import json
import math

import pytest
from conftest import FAST

from harness.config import build
from harness.records import tracking
from harness.run import runner

CONTRACT_METRICS = ["decode_tokens_per_s", "decode_tokens_per_s_p10", "decode_tokens_per_s_p90", "ttft_ms",
                    "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "e2e_ms", "peak_mem_mb", "params", "weight_bytes",
                    "perplexity", "kl_div_mean", "kl_div_p99", "top1_agreement", "generated_tokens"]


@pytest.fixture()
def tiny_result(compose, results_overrides):
    cfg = compose([*FAST, "quantizer=fp32", *results_overrides])
    result = runner.run(cfg)
    path = tracking.record(result, build(cfg).tracking)
    return result, path, build(cfg).tracking


def test_tiny_run_is_recorded_with_sane_metrics(tiny_result):
    result, path, tcfg = tiny_result
    assert result.status == "OK", result.error
    m = result.metrics
    for name in CONTRACT_METRICS:
        assert name in m and math.isfinite(m[name]), name
    assert m["decode_tokens_per_s"] > 0 and m["ttft_ms"] > 0
    assert m["itl_ms_p50"] <= m["itl_ms_p90"] <= m["itl_ms_p99"]
    assert m["decode_tokens_per_s_p10"] <= m["decode_tokens_per_s"] <= m["decode_tokens_per_s_p90"]
    # the reference is the same model in the same dtype: identical logits
    assert m["kl_div_mean"] == 0.0 and m["kl_div_p99"] == 0.0 and m["top1_agreement"] == 1.0
    assert m["perplexity"] == pytest.approx(m["reference_perplexity"], rel=1e-9)
    # 4 prompts x 2 repetitions x 8 tokens, nothing else counted
    assert m["generated_tokens"] == 4 * 2 * 8
    assert m["bits_per_weight"] == 32.0
    assert m["params"] > 0 and m["weight_bytes"] >= 4 * m["params"] * 0.99

    data = json.loads(path.read_text())
    assert {"status", "config", "metrics", "tags"} <= set(data)
    assert data["status"] == "OK" and data["mlflow_run_id"]
    assert data["tags"]["quantizer.backend"] == "torch"
    for tag in ("git_commit", "version.torch", "version.transformers", "device_name", "cpu_model", "threads"):
        assert data["tags"][tag]

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tcfg.resolved_uri()).get_run(data["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["decode_tokens_per_s"] == pytest.approx(m["decode_tokens_per_s"])
    assert run.data.params["measure.max_new_tokens"] == "8"
    arts = {a.path for a in MlflowClient(tcfg.resolved_uri()).list_artifacts(run.info.run_id)}
    assert {"config.yaml", "result.json", "samples.txt"} <= arts


def test_greedy_output_is_deterministic_across_runs(compose, results_overrides):
    cfg = compose([*FAST, "accuracy.enabled=false", *results_overrides])
    a, b = runner.run(cfg), runner.run(cfg)
    assert a.status == b.status == "OK"
    assert [s["tokens"] for s in a.samples] == [s["tokens"] for s in b.samples]


def test_stop_at_eos_counts_only_tokens_up_to_eos(compose, results_overrides):
    from harness.models import TinyRandom, load_pretrained
    from strategies.base import DecodeOptions
    from strategies.decode import greedy_generate

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    opts = DecodeOptions(max_new_tokens=12, pad_token_id=0)
    free = greedy_generate(model, [[5, 6, 7]], opts).sequences[0]
    eos = free[3]  # pretend the 4th generated token is EOS
    stopped = greedy_generate(model, [[5, 6, 7]], DecodeOptions(max_new_tokens=12, pad_token_id=0,
                                                                eos_token_id=eos, stop_at_eos=True))
    first = free.index(eos)
    assert stopped.sequences[0] == free[: first + 1]
    assert stopped.decode_tokens == first and stopped.generated_tokens == first + 1


def test_failed_run_is_recorded_failed_with_its_error(compose, results_overrides, monkeypatch):
    from harness.run import engines

    def boom(self, tokenizer, workload, log_file):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engines.TransformersSession, "load", boom)
    cfg = compose([*FAST, *results_overrides])
    result = runner.run(cfg)
    path = tracking.record(result, build(cfg).tracking)
    assert result.status == "FAILED" and "kernel exploded" in result.error
    from mlflow.tracking import MlflowClient

    run = MlflowClient(build(cfg).tracking.resolved_uri()).get_run(json.loads(path.read_text())["mlflow_run_id"])
    assert run.info.status == "FAILED" and "kernel exploded" in run.data.tags["error"]


def test_tracking_disabled_writes_json_only(compose, tmp_path):
    cfg = compose([*FAST, "accuracy.enabled=false", f"tracking.results_dir={tmp_path}", "tracking.enabled=false"])
    result = runner.run(cfg)
    path = tracking.record(result, build(cfg).tracking)
    assert path.is_file() and not (tmp_path / "mlflow.db").exists()
    assert json.loads(path.read_text())["mlflow_run_id"] == ""
