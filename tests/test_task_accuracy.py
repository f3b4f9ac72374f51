"""Task accuracy (BIG-bench multiple choice through lm-eval, paired with the reference) on the tiny model, with
task files made here: the cache and its index, the bad-input lines (exit 2 before any model loads), McNemar and
the flips on a hand-made pairing, a run's metrics and their consistency, the cached reference, the report, and
(with the llama.cpp extra) the peer engine's log-likelihoods against transformers'."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FAST, ROOT
from standin_tasks import mc_task as _mc  # BIG-bench-shaped multiple choice

from harness.analysis import task_accuracy as ta
from harness.analysis import tasks as T
from harness.config import build
from harness.errors import ConfigError, QuantbenchError
from harness.records import tracking
from harness.run import runner

TASKS = {
    "toy": _mc(12),
    "toy_b": _mc(5, seed=1),
    "grp": {"name": "grp"},  # a parent: its subtasks carry the examples
    "grp/sub": _mc(3),
    "gen": {"examples": [{"input": "2+2=", "target": "4"}]},
}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A private cache root holding the tasks above (and, as in a real fetch, a programmatic one)."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(T.TASKS_DIR_ENV)  # this test's own tasks, not the suite's stand-in (tests/standin_tasks.py)
    T.build_cache([*((n, json.dumps(d).encode()) for n, d in TASKS.items()), ("prog", None)], T.data_dir(), "test")
    return tmp_path / "cache"


def test_the_cache_holds_an_index_of_every_task_and_the_multiple_choice_files(cache):
    index = T.read_index()
    kinds = {n: i["kind"] for n, i in index["tasks"].items()}
    assert kinds == {"toy": "multiple_choice", "toy_b": "multiple_choice", "grp": "group", "grp/sub": "multiple_choice",
                     "gen": "generative", "prog": "programmatic"}
    assert index["tasks"]["grp"]["subtasks"] == ["grp/sub"]
    assert sorted(p.relative_to(T.data_dir()).as_posix() for p in T.data_dir().rglob("*.gz")) == \
        ["tasks/grp/sub.json.gz", "tasks/toy.json.gz", "tasks/toy_b.json.gz"]
    task = T.load("toy")
    assert len(task.examples) == 12 and task.examples[1].gold == (0, 1)  # both highest-scored choices count
    assert task.chance == pytest.approx(sum(len(e.gold) / len(e.choices) for e in task.examples) / 12)
    assert T.subset(12, 5, 0) == T.subset(12, 5, 0) != T.subset(12, 5, 1)
    assert T.subset(12, 5, 0) == sorted(T.subset(12, 5, 0)) and len(set(T.subset(12, 5, 0))) == 5
    assert T.subset(12, None, 0) == T.subset(12, 99, 0) == list(range(12))
    with gzip.open(T.data_dir() / "tasks" / "toy.json.gz", "wb") as f:  # a damaged file is refused, not misread
        f.write(json.dumps(_mc(12, seed=5)).encode())
    with pytest.raises(QuantbenchError, match="does not match its checksum"):
        T.load("toy")


@pytest.mark.parametrize("overrides, message", [
    (["accuracy.tasks=[toyy]"], "accuracy.tasks: unknown task 'toyy'; did you mean toy"),
    (["accuracy.tasks=[gen]"], "accuracy.tasks: 'gen' is not multiple choice (generative)"),
    (["accuracy.tasks=[prog]"], "'prog' is not multiple choice (programmatic)"),
    (["accuracy.tasks=[grp]"], "'grp' is a group of subtasks; name one of: grp/sub"),
    (["accuracy.tasks=[toy]", "accuracy.task_limit=0"], "accuracy.task_limit=0 must be > 0 (or null: every example)"),
    (["accuracy.tasks=[toy]", "accuracy.num_fewshot=-1"], "accuracy.num_fewshot=-1 must be >= 0"),
    # lm-eval draws the shots from the task's other examples: this failed mid-run ("Sample larger than population")
    (["accuracy.tasks=[toy,toy_b]", "accuracy.num_fewshot=5", "accuracy.task_limit=2"],
     "accuracy.num_fewshot=5 is too many: task toy_b has 5 examples; give accuracy.num_fewshot < 5"),
    # the task pass runs inside the accuracy pass: these were dropped silently, the names never checked
    (["accuracy.tasks=[toyy]", "accuracy.enabled=false"],
     "accuracy.tasks=[toyy] needs accuracy.enabled=true (or drop accuracy.tasks)"),
    (["accuracy.tasks=[default,toy]", "accuracy.enabled=false"],
     "accuracy.tasks=[default,toy] needs accuracy.enabled=true (or drop accuracy.tasks)"),
])
def test_bad_task_input_is_one_line_at_validation(compose, cache, overrides, message):
    from harness.cli import precheck

    with pytest.raises(ConfigError) as err:
        build(compose([*FAST, *overrides]))
    assert err.value.problems == [message] or message in err.value.problems[0]
    assert message in precheck(["model=tiny_random", *overrides])
    build(compose([*FAST, "accuracy.tasks=[toy,grp/sub]", "accuracy.task_limit=3"]))  # the good ones pass
    build(compose([*FAST, "accuracy.tasks=[toy,toy_b]", "accuracy.num_fewshot=4"]))  # all but the question: enough
    build(compose([*FAST, "accuracy.enabled=false", "accuracy.tasks=[]"]))  # no tasks: nothing to refuse


@pytest.mark.parametrize("arg, message", [
    ("accuracy.tasks=social_iqa", "accuracy.tasks='social_iqa' must be a list in brackets, e.g. '[a,b]'"),
    ("accuracy.task_limit=abc", "accuracy.task_limit='abc' must be an integer or null"),
])
def test_a_value_of_the_wrong_kind_is_one_line(arg, message):
    from harness.cli import precheck

    assert precheck(["model=tiny_random", arg]) == message


@pytest.mark.parametrize("args, fresh, message", [
    (["accuracy.tasks=[nope]"], False, "unknown task 'nope'"),
    (["accuracy.tasks=[default]"], True, "not in {cache}/bigbench-1.0.0: fetch them once with `scripts/setup.sh --tasks`"),
])
def test_run_py_refuses_in_one_line_and_exits_2_before_any_model_loads(cache, tmp_path, args, fresh, message):
    env = {**{k: v for k, v in os.environ.items() if k != T.TASKS_DIR_ENV},
           "QUANTBENCH_CACHE": str(tmp_path / "empty" if fresh else cache)}
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "run.py", "model=tiny_random", *args, f"tracking.results_dir={results}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stdout == "", proc.stderr[-2000:]
    assert message.format(cache=tmp_path / "empty") in proc.stderr
    assert not results.exists() and not (tmp_path / "empty" / "models").exists()  # nothing ran, nothing loaded


def test_mcnemar_and_flips_on_a_hand_made_pairing():
    # reference right on 0-3 and 8-9; the run loses 0, 1, 2 and gains 5
    ref = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    run = [0, 0, 0, 1, 0, 1, 0, 0, 1, 1]
    m = ta.paired("x", run, ref, stderr=0.1)
    assert (m["x"], m["x_ref"], m["x_diff"]) == (0.4, 0.6, pytest.approx(-0.2))
    assert (m["x_right_to_wrong"], m["x_wrong_to_right"]) == (3.0, 1.0)
    assert m["x_mcnemar_p"] == pytest.approx(0.625)  # exact: 2 x P(Binom(4, 1/2) <= 1) = 2 x 5/16
    d = [a - b for a, b in zip(run, ref, strict=True)]  # paired stderr: sd of the differences / sqrt(n)
    assert m["x_diff_stderr"] == pytest.approx(math.sqrt(sum((x + 0.2) ** 2 for x in d) / 9 / 10))
    assert m["x_stderr"] == 0.1
    assert ta.mcnemar_p(10, 0) == pytest.approx(2 * 0.5 ** 10)  # ten answers lost, none gained: significant
    assert ta.mcnemar_p(0, 0) == 1.0 and ta.mcnemar_p(5, 5) == 1.0  # no change / balanced change: no evidence
    # pooled over tasks: the flips add up and McNemar is taken on the sums
    tasks = [T.Task("a", [T.Example("q", ("x", "y"), (0,))] * 10, ""), T.Task("b", [T.Example("q", ("x", "y"), (0,))] * 10, "")]

    def answers(acc):
        return ta.Answers(indices=list(range(10)), lls=[[0.0, 0.0]] * 10, acc=acc, acc_norm=acc,
                          stderr={"acc": 0.1, "acc_norm": 0.1})

    plan = ta.Plan(tasks=tasks, picks={}, reference={"a": answers(ref), "b": answers([1] * 10)}, cache_hit=True)
    out = ta.compare(plan, {"a": answers(run), "b": answers([0] * 3 + [1] * 7)})
    assert (out["tasks_acc_right_to_wrong"], out["tasks_acc_wrong_to_right"]) == (6.0, 1.0)
    assert out["tasks_acc_mcnemar_p"] == pytest.approx(2 * 8 / 128)  # 2 x P(Binom(7, 1/2) <= 1)
    assert out["tasks_acc_diff_mean"] == pytest.approx((-0.2 - 0.3) / 2) and out["tasks_examples"] == 20
    assert out["task_a_chance"] == 0.5
    # the pooled difference, the one the summed flips and McNemar describe: every example weighs the same
    assert out["tasks_acc_diff_pooled"] == pytest.approx((1 - 6) / 20)
    assert out["tasks_acc_diff_pooled_se"] == pytest.approx(math.sqrt((7 - 20 * 0.25 ** 2) / 19 / 20))


def test_the_pooled_difference_is_not_the_mean_over_tasks_and_the_summary_shows_both():
    """Tasks of unequal size: 10 examples, 1 lost; 40 examples, none lost. Mean over tasks -0.05, pooled -0.02."""
    from harness.records.results import summary_line
    from harness.run.result import Result

    def answers(acc):
        return ta.Answers(indices=list(range(len(acc))), lls=[[0.0, 0.0]] * len(acc), acc=acc, acc_norm=acc,
                          stderr={"acc": 0.1, "acc_norm": 0.1})

    ex = T.Example("q", ("x", "y"), (0,))
    tasks = [T.Task("small", [ex] * 10, ""), T.Task("big", [ex] * 40, "")]
    plan = ta.Plan(tasks=tasks, picks={}, reference={"small": answers([1] * 10), "big": answers([1] * 40)},
                   cache_hit=True)
    out = ta.compare(plan, {"small": answers([0] + [1] * 9), "big": answers([1] * 40)})
    assert out["tasks_acc_diff_mean"] == pytest.approx(-0.05)
    assert out["tasks_acc_diff_pooled"] == pytest.approx(-0.02)
    line = summary_line(Result(status="OK", config={}, metrics=out, run_name="r"))
    assert "mean of tasks -0.050 vs reference; pooled -0.020 ± 0.020, 1 right->wrong, 0 wrong->right, McNemar p 1" \
        in line


def test_a_run_logs_task_accuracy_paired_with_a_cached_reference(compose, cache, results_overrides):
    overrides = [*FAST, "quantizer=bf16", "accuracy.tasks=[toy,toy_b]", "accuracy.task_limit=8",
                 "measure.kernel_profile=false", *results_overrides]
    cfg = compose(overrides)
    result = runner.run(cfg)
    assert result.status == "OK", result.error
    m, tags = result.metrics, result.tags
    assert tags["tasks"] == "toy,toy_b" and tags["tasks.reference_cache"] == "miss"
    assert tags["tasks.source"] == "not the pinned bigbench-1.0.0.tar.gz: test"  # the cache fixture built it
    assert (m["task_toy_examples"], m["task_toy_b_examples"], m["tasks_examples"]) == (8, 5, 13)  # toy_b has 5
    for t in ("toy", "toy_b"):
        n = m[f"task_{t}_examples"]
        for metric in ta.METRICS:
            p = f"task_{t}_{metric}"
            assert m[f"{p}_stderr"] == pytest.approx(math.sqrt(m[p] * (1 - m[p]) / (n - 1)))  # lm-eval's: sd / sqrt(n)
            assert m[p] - m[f"{p}_ref"] == pytest.approx(m[f"{p}_diff"])
            # acc moves by exactly the flips: gained minus lost, over the examples
            assert m[f"{p}_diff"] == pytest.approx((m[f"{p}_wrong_to_right"] - m[f"{p}_right_to_wrong"]) / n)
            assert m[f"{p}_mcnemar_p"] == pytest.approx(ta.mcnemar_p(int(m[f"{p}_right_to_wrong"]),
                                                                   int(m[f"{p}_wrong_to_right"])))
    assert m["tasks_acc_mean"] == pytest.approx((m["task_toy_acc"] + m["task_toy_b_acc"]) / 2)
    assert "kl_div_mean" in m and "perplexity" in m  # beside, not instead of

    # the reference's answers were cached: the next run reads them and loads no reference model for tasks
    records = sorted(ta.records_dir().glob("*.json"))
    assert [p.name.split("-")[0] for p in records] == ["toy", "toy_b"]
    ref = ta.read_record(records[0])
    assert ref.indices == T.subset(12, 8, 0) and len(ref.lls) == 8
    assert m["task_toy_acc_ref"] == pytest.approx(sum(ref.acc) / 8)
    # lm-eval's acc, checked against the rule itself: the highest summed log-likelihood picks a gold choice
    # (acc_norm: per character of the choice, lm-eval's len(choice))
    task = T.load("toy")
    for i, lls, acc, acc_norm in zip(ref.indices, ref.lls, ref.acc, ref.acc_norm, strict=True):
        ex = task.examples[i]
        assert acc == int(int(np.argmax(lls)) in ex.gold)
        per_char = [ll / len(c) for ll, c in zip(lls, ex.choices, strict=True)]
        assert acc_norm == int(int(np.argmax(per_char)) in ex.gold)
    again = runner.run(compose([*overrides, "quantizer=fp32", "accuracy.kl=false"]))  # the reference: nothing flips
    assert again.status == "OK", again.error
    assert again.tags["tasks.reference_cache"] == "hit"
    assert tags["reference.source"] == again.tags["reference.source"] == "random"  # KL's and the tasks' reference
    assert again.metrics["tasks_acc_right_to_wrong"] == again.metrics["tasks_acc_wrong_to_right"] == 0
    assert again.metrics["tasks_acc_mcnemar_p"] == 1.0 and again.metrics["task_toy_acc_diff"] == 0.0

    # MLflow receives all of it, and the sweep report shows the column and the per-task table
    path = tracking.record(result, build(cfg).tracking)
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(build(cfg).tracking.resolved_uri()).get_run(json.loads(path.read_text())["mlflow_run_id"])
    assert logged.data.metrics["task_toy_acc_mcnemar_p"] == pytest.approx(m["task_toy_acc_mcnemar_p"])
    assert logged.data.tags["tasks"] == "toy,toy_b"
    from harness.records.report import markdown, rows_for

    rows = rows_for([result.to_dict(), again.to_dict()])
    table = markdown(rows, "none")
    assert "task acc" in table and "McNemar p" in table and f"{m['tasks_acc_mean']:.3f}" in table
    section = ta.section(rows)
    assert section.count("| toy |") == 2 and section.count("| toy_b |") == 2


def test_a_few_shot_prompt_holds_solved_examples_of_the_task_but_never_the_question(cache):
    task = T.load("toy")
    lm_t = ta.lm_task(task, num_fewshot=2, seed=0)
    doc = lm_t.test_docs()[4]
    ctx = lm_t.fewshot_context(doc, num_fewshot=2)
    shots = ctx.split("\n\n")
    assert len(shots) == 3 and shots[-1] == f"Q: {task.examples[4].input.strip()}\nA:"
    for shot in shots[:2]:
        q, a = shot.split("\nA: ")
        i = next(i for i, e in enumerate(task.examples) if f"Q: {e.input.strip()}" == q)
        assert i != 4 and a == task.examples[i].choices[task.examples[i].gold[0]]
    # the run and its reference build their tasks apart: the same seed gives both the same shots, doc after doc
    run, ref = ta.lm_task(task, num_fewshot=2, seed=0), ta.lm_task(task, num_fewshot=2, seed=0)
    contexts = [[t.fewshot_context(t.test_docs()[i], num_fewshot=2) for i in (4, 0, 7, 9)] for t in (run, ref)]
    assert contexts[0] == contexts[1] and contexts[0][0] == ctx


@pytest.mark.slow
@pytest.mark.skipif(not __import__("harness.run.llama_cpp", fromlist=["available"]).available(),
                    reason="llama-cpp-python extra not installed (scripts/setup.sh --all installs it; CI does)")
def test_llama_cpp_scores_the_same_token_ids_as_transformers(compose, tmp_path, monkeypatch):
    """The embedded model in F32 through llama.cpp against transformers in fp32: the same requests, the same
    answers, log-likelihoods within float rounding (different kernels); then a whole engine=llama_cpp run."""
    from harness.models import EmbeddedGGUF, load_pretrained, load_tokenizer
    from harness.run import llama_cpp as lc
    from harness.run.llama_cpp_lm import LlamaCppLM

    raw = json.dumps({"examples": [
        {"input": "What is the capital of France?", "target_scores": {"Paris": 1, "Berlin": 0, "a banana": 0}},
        {"input": "How many legs does a cat have?", "target_scores": {"four": 1, "two": 0}},
        {"input": "Is the sea salty?", "target_scores": {"Yes": 1, "No": 0}}]}).encode()
    src = EmbeddedGGUF()
    tok = load_tokenizer(src)
    task, picks = T.parse("facts", raw), {"facts": [0, 1, 2]}
    peer = ta.answer(LlamaCppLM(lc.convert(src.gguf_path, "F32", 2), tok, 2), [task], picks, 0, 0)["facts"]
    ref = ta.answer(ta.hf_lm(load_pretrained(src, "float32", "cpu"), tok, 8), [task], picks, 0, 0)["facts"]
    assert peer.acc == ref.acc and peer.acc_norm == ref.acc_norm
    for a, b in zip(peer.lls, ref.lls, strict=True):
        assert a == pytest.approx(b, abs=0.05)

    # the engine: its task column paired with the transformers fp32 reference (task files and records kept here)
    monkeypatch.setattr(T, "data_dir", lambda: tmp_path / "bigbench")
    monkeypatch.setattr(ta, "records_dir", lambda: tmp_path / "records")
    T.build_cache([("facts", raw)], T.data_dir(), "test")
    res = runner.run(compose(["engine=llama_cpp", "engine.format=F32", "accuracy.tasks=[facts]", "accuracy.kl=false",
                              "accuracy.max_tokens=64", "accuracy.context_length=32", "accuracy.stride=32",
                              "measure.max_new_tokens=2", "measure.repetitions=1", "measure.warmup=0",
                              "tracking.enabled=false", f"tracking.results_dir={tmp_path}"]))
    assert res.status == "OK", res.error
    assert res.tags["tasks"] == "facts" and res.tags["tasks.reference_cache"] == "miss"
    assert res.metrics["task_facts_acc"] == sum(peer.acc) / 3 and res.metrics["task_facts_acc_ref"] == sum(ref.acc) / 3
    assert res.metrics["task_facts_examples"] == 3 and 0 < res.metrics["task_facts_acc_mcnemar_p"] <= 1


def test_a_registry_that_no_longer_lists_the_sdist_is_one_line_that_says_what_to_do(tmp_path, monkeypatch):
    """Since 2026-12-05 the registry lists only bigbench 0.0.1: the fetch names what it found and the way out."""
    import http.server
    import threading

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"files": [{"filename": "bigbench-0.0.1.tar.gz", "url": "x"}]}).encode()
            self.send_response(200 if self.path == "/simple/bigbench/" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
        with pytest.raises(QuantbenchError) as err:
            T.download(tmp_path)
    finally:
        server.shutdown()
    msg = str(err.value)
    assert "\n" not in msg and "no longer lists bigbench-1.0.0.tar.gz (it lists bigbench-0.0.1.tar.gz)" in msg
    assert "fetch --archive bigbench-1.0.0.tar.gz" in msg and T.TASKS_DIR_ENV in msg


def test_the_suite_scores_the_stand_in_tasks_and_a_run_says_so(cache, monkeypatch):
    """conftest.py points every test at tests/standin_tasks.py's cache; its source never reads as the real sdist."""
    from standin_tasks import STANDIN, build

    assert T.source() == "not the pinned bigbench-1.0.0.tar.gz: test"  # the `cache` fixture's own tasks
    root = build(cache / "standin")
    monkeypatch.setenv(T.TASKS_DIR_ENV, str(root))
    assert T.data_dir() == root and T.source() == f"not the pinned bigbench-1.0.0.tar.gz: {STANDIN}"
    assert T.problems(["default"]) == [] and T.problems(["arithmetic_gen"]) != []
    assert [T.load(n).name for n in T.DEFAULT_TASKS] == list(T.DEFAULT_TASKS)
