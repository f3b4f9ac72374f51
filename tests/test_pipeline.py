"""The measurement pipeline (harness/run/pipeline.py): the phases run.py, sweep cells and the gate share, its
piecewise API (as the gate's worker drives it), and runs whose headline metric is NaN ending FAILED."""

from __future__ import annotations

import math

import pytest
from conftest import FAST

from harness.config import build
from harness.errors import QuantbenchError
from harness.run import pipeline as pl
from harness.run import runner
from harness.run.llama_cpp import available as llama_cpp_available
from harness.run.pipeline import Pipeline

NO_ACC = ["accuracy.enabled=false"]
ONE_PROMPT = ["measure.prompts=synthetic:1", "measure.prompt_tokens=8"]


def test_max_new_tokens_1_ends_failed_in_one_line_before_anything_loads(compose, results_overrides, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer loaded: the refusal came too late")

    monkeypatch.setattr(pl, "load_tokenizer", no_load)
    res = runner.run(compose([*FAST, *NO_ACC, "measure.max_new_tokens=1", *results_overrides,
                              "tracking.enabled=false"]))
    assert res.status == "FAILED" and "\n" not in res.error
    assert res.error.startswith("no decode phase (zero decode tokens): measure.max_new_tokens=1") \
        and "use measure.max_new_tokens >= 2" \
        in res.error
    assert not res.metrics


def test_prefill_only_synthetic_workload_is_ok_with_its_own_headline(compose, results_overrides):
    """conf/workload/pp512.yaml (llama-bench's pp test) asks for the prefill alone: its headline is prompt tok/s."""
    res = runner.run(compose([*FAST, *NO_ACC, *ONE_PROMPT, "measure.max_new_tokens=1", *results_overrides,
                              "tracking.enabled=false"]))
    assert res.status == "OK", res.error
    assert res.metrics["prompt_tokens_per_s"] > 0 and math.isnan(res.metrics["decode_tokens_per_s"])
    assert res.metrics["generated_tokens"] == 2  # 1 token x 1 prompt x 2 repetitions


def test_every_row_at_eos_on_its_first_token_ends_failed(compose, results_overrides, monkeypatch):
    """stop_at_eos with an EOS that is every prompt's first greedy token: zero decode tokens, so the run fails."""
    cfg = compose([*FAST, *NO_ACC, *ONE_PROMPT, *results_overrides, "tracking.enabled=false"])
    free = runner.run(cfg)
    assert free.status == "OK", free.error
    first = free.samples[0]["tokens"][0]

    real = pl.DecodeOptions

    def eos_is_first(**kwargs):  # the token the model emits first becomes EOS (the prompt ids stay the same)
        return real(**{**kwargs, "eos_token_id": first})

    monkeypatch.setattr(pl, "DecodeOptions", eos_is_first)
    res = runner.run(compose([*FAST, *NO_ACC, *ONE_PROMPT, "measure.stop_at_eos=true", *results_overrides,
                              "tracking.enabled=false"]))
    assert res.status == "FAILED" and "\n" not in res.error
    assert res.error.startswith("no decode tokens: every row stopped at EOS at its first token"), res.error


def test_headline_problem_names_the_metric_and_the_cause():
    from harness.config import MeasureConfig
    from harness.measure import Generation

    gen = Generation(sequences=[[3]], prompt_tokens=4, ttft_s=0.01, step_s=[], decode_tokens=0, decode_wall_s=0.0)
    m = MeasureConfig()
    assert pl.headline_problem("decode_tokens_per_s", {"decode_tokens_per_s": 12.5}, [gen], m) == ""
    assert "no decode tokens were generated" in pl.headline_problem("decode_tokens_per_s", {}, [gen], m)
    missing = pl.headline_problem("prompt_tokens_per_s", {"prompt_tokens_per_s": float("nan")}, [gen], m)
    assert missing.startswith("the run's headline metric prompt_tokens_per_s is nan")


def test_pipeline_pieces_measure_what_run_measures(compose, results_overrides):
    """The gate's view (preflight, load, generate(i), accuracy, greedy_tokens) against a whole run."""
    overrides = [*FAST, "strategy=static_batch", "strategy.batch_size=2", "accuracy.kl=false", *results_overrides,
                 "tracking.enabled=false"]
    whole = runner.run(compose(overrides))
    assert whole.status == "OK", whole.error
    exp = build(compose(overrides))
    pipe = Pipeline(exp, "cpu")
    pipe.preflight()
    assert pipe.session is None  # nothing loaded by the preflight
    try:
        pipe.load()
        assert [len(b) for b in pipe.batches] == [2, 2]  # 4 default prompts, batch 2
        gens = [pipe.generate(i) for i in range(3)]  # batch 0, 1, then 0 again
        for g in gens:
            assert g.decode_tokens == 2 * 7  # 2 rows x (8 - 1 prefill token)
            assert g.decode_wall_s is not None and g.decode_wall_s >= sum(g.step_s) > 0
        assert gens[0].sequences == gens[2].sequences != gens[1].sequences
        scores = pipe.accuracy()
        assert scores["perplexity"] == pytest.approx(whole.metrics["perplexity"], rel=1e-9)
        assert pipe.greedy_tokens() == [s["tokens"] for s in whole.samples]
        info = pipe.info()
        assert info["run_name"] == whole.run_name and info["engine"] == "transformers" and info["threads"] >= 1
    finally:
        pipe.close()
    assert pipe.session is None


def test_a_config_without_decode_phase_is_refused_by_its_build(compose):
    with pytest.raises(QuantbenchError, match="no decode phase"):  # before any Pipeline: run.py's precheck says it
        build(compose([*FAST, *NO_ACC, "measure.max_new_tokens=1"]))
    build(compose(["model=tiny_random", "measure.max_new_tokens=1", "load.profile=rates", "load.rates=[1]"]))  # a load
    # run sends its own lengths to a target: it has no decode phase of the pipeline's to refuse


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python extra not installed (scripts/setup.sh --all)")
def test_llama_cpp_loop_records_the_decode_wall_clock(compose, results_overrides):
    """engine=llama_cpp through the same pipeline: depth context, decode wall clock, greedy tokens of the run."""
    overrides = ["engine=llama_cpp", "measure.device=cpu", "measure.prompts=synthetic:2", "measure.prompt_tokens=6",
                 "measure.context_depth=8", "measure.max_new_tokens=4", "measure.warmup=0", "measure.repetitions=1",
                 *NO_ACC, *results_overrides, "tracking.enabled=false"]
    whole = runner.run(compose(overrides))
    assert whole.status == "OK", whole.error
    assert whole.tags["workload.pp"] == "pp6 @ d8" and whole.metrics["context_depth_tokens"] == 8
    assert whole.metrics["generated_tokens"] == 2 * 4 and whole.metrics["batch_size"] == 1
    pipe = Pipeline(build(compose(overrides)), "cpu")
    pipe.preflight()
    try:
        pipe.load()
        gen = pipe.generate(1)
        assert gen.decode_tokens == 3 and gen.decode_wall_s >= sum(gen.step_s) > 0
        assert pipe.greedy_tokens() == [s["tokens"] for s in whole.samples]
    finally:
        pipe.close()


def test_the_heap_is_handed_back_after_the_kernel_profile_before_the_accuracy_pass(compose, results_overrides,
                                                                                   monkeypatch):
    """The profiler's freed event tables stayed in glibc's heap (~150 MB on SmolLM2's default run) under the
    accuracy pass that follows, which then peaked that much higher: a trim comes between the two."""
    from harness import measure
    pipeline = pl

    events: list[str] = []
    trim, report, accuracy = measure.trim_heap, pipeline.floor.step_report, Pipeline.accuracy
    monkeypatch.setattr(measure, "trim_heap", lambda: (events.append("trim"), trim())[1])
    monkeypatch.setattr(pipeline.floor, "step_report", lambda *a: (events.append("profile"), report(*a))[1])
    monkeypatch.setattr(Pipeline, "accuracy", lambda self: (events.append("accuracy"), accuracy(self))[1])
    res = runner.run(compose([*FAST, *results_overrides, "tracking.enabled=false"]))
    assert res.status == "OK", res.error
    after_profile = events[events.index("profile"):]
    assert "trim" in after_profile[:after_profile.index("accuracy")], events
