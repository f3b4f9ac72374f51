"""Workloads (harness/measure/workloads.py): prompt files, synthetic ids, context depth, bad input before any model
loads, the recorded workload, and the crossover map (harness/analysis/crossover.py) on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from harness.analysis import crossover
from harness.config import MeasureConfig, build
from harness.errors import ConfigError, QuantbenchError
from harness.measure import workloads
from harness.models import TinyRandom, byte_tokenizer, load_pretrained
from harness.records import report
from harness.records.results import invocation_cells
from harness.sweep.settings import FAULT_ENV, STATE_ENV
from strategies.base import DecodeOptions
from strategies.decode import DepthContext, greedy_generate

TINY = ["model=tiny_random", "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0",
        "accuracy.enabled=false"]
EXAMPLES = ROOT / "docs" / "examples"


# ------------------------------------------------------------------------------------------- sources
def test_text_file_prompts_are_separated_by_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\nfirst prompt\n\n\nsecond prompt,\n  on two lines\n\nthird\n")
    src = workloads.parse(str(f))
    assert src.kind == "text" and src.texts == ["first prompt", "second prompt,\n  on two lines", "third"]
    assert src.lines == [2, 5, 8] and src.limits == [None, None, None]
    shipped = workloads.parse(str(EXAMPLES / "prompts.txt"))
    assert len(shipped.texts) == 3 and "\n" in shipped.texts[1]


def test_jsonl_prompts_with_optional_lengths():
    src = workloads.parse(str(EXAMPLES / "prompts.jsonl"))
    assert src.kind == "jsonl" and len(src.texts) == 4
    assert src.limits == [16, None, 32, None] and src.lines == [1, 2, 3, 4]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("", "holds no prompts (the file is empty)"),
    ('{"prompt": "ok"}\n\n{"prompt": "x",}\n', ":3: not valid JSON"),
    ('{"prompt": "ok", "max_tokens": 5}\n', ":1: unknown key(s) 'max_tokens'; allowed: prompt, max_new_tokens"),
    ('{"prompt": "ok", "max_new_tokens": 0}\n', ':1: "max_new_tokens" must be an integer >= 1'),
    ('{"prompt": ""}\n', ':1: "prompt" must be a non-empty string'),
    ('["a list"]\n', ":1: expected a JSON object"),
])
def test_bad_prompt_files_are_one_line_each(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError) as err:
        MeasureConfig(prompts=str(f))
    assert message in str(err.value) and str(f) in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompts": "synthetic"}, "needs the prompt length: add measure.prompt_tokens=<n>"),
    ({"prompts": "default", "prompt_tokens": 8}, "measure.prompt_tokens=8 applies to measure.prompts=synthetic only"),
    ({"prompts": "synthetic:0", "prompt_tokens": 8}, "the count after 'synthetic:' must be an integer >= 1"),
    ({"prompts": "nope"}, "measure.prompts='nope' is not allowed; choose one of: default, edit, synthetic"),
    ({"context_depth": -1}, "measure.context_depth=-1 must be >= 0"),
])
def test_workload_settings_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        MeasureConfig(**kwargs)


# ---------------------------------------------------------------------------------- bad input: exit 2
@pytest.mark.parametrize("overrides, message", [
    (["measure.prompts=docs/examples/missing.jsonl"], "no such file"),
    (["measure.prompts=synthetic", "measure.prompt_tokens=1000", "measure.max_new_tokens=64"],
     "measure.prompt_tokens=1000 + 64 new tokens = 1064 positions, beyond the model's context of 1024"),
    (["measure.context_depth=1000", "measure.max_new_tokens=64"],
     "measure.context_depth=1000 + 64 new tokens = 1064 positions, beyond the model's context of 1024"),
    (["measure.context_depth=8", "strategy=speculative"], "measure.context_depth=8 is not supported by strategy Speculative"),
])
def test_bad_workload_exits_2_before_any_model_loads(compose, results_overrides, tmp_path, capsys, overrides, message):
    from harness.cli import run_one

    assert run_one(compose(["model=tiny_random", *results_overrides, *overrides])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not list(tmp_path.rglob("*.json"))  # nothing ran, nothing recorded


def test_a_prompt_longer_than_the_context_is_named_with_its_line(compose, tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("short one\n\n" + "x" * 1100 + "\n")  # the tiny model's byte tokenizer: 1 token per byte
    with pytest.raises(QuantbenchError, match=rf"prompt {f}:3 is 1100 tokens \+ 4 new tokens = 1104 positions, "
                                               "beyond the model's context of 1024"):
        build(compose([*TINY, f"measure.prompts={f}"]))


def test_a_tokenizer_that_does_not_load_in_the_context_check_is_one_line(compose, tmp_path, monkeypatch):
    """A prompt near the context needs the tokenizer at config time; transformers' ValueError (a GGUF without a
    vocabulary) came out of run.py as a traceback."""
    def broken(model):
        raise ValueError("Cannot build a tokenizer from a GGUF file stating tokenizer None.\nSupported: ['llama']")

    monkeypatch.setattr(workloads, "load_tokenizer", broken)
    f = tmp_path / "long.txt"
    f.write_text("x" * 1100 + "\n")
    with pytest.raises(QuantbenchError) as info:
        build(compose([*TINY, f"measure.prompts={f}"]))
    line = str(info.value)
    assert "\n" not in line and ("the tokenizer of model tiny_random does not load (ValueError: Cannot build a "
                                 "tokenizer from a GGUF file stating tokenizer None.)") in line


def test_gguf_context_is_read_from_the_header_only(compose):
    exp = build(compose(["accuracy.enabled=false"]))  # the embedded SmolLM2 GGUF (no weights are read)
    assert workloads.gguf_context_length(exp.model.gguf_path) == 8192
    with pytest.raises(QuantbenchError, match="measure.context_depth=8150 \\+ 64 new tokens = 8214 positions, "
                                              "beyond the model's context of 8192"):
        build(compose(["measure.context_depth=8150"]))


# ------------------------------------------------------------------------------------ synthetic ids
def test_the_memory_estimate_holds_a_long_file_prompt_and_a_rows_own_length(compose, tmp_path):
    """The KV cache and activations were sized for 512 prompt tokens and measure.max_new_tokens whatever the file
    held: a ~5,000-token prompt got 9x too small a KV cache, a JSONL row's 4,000 new tokens none of theirs."""
    from harness.measure import memory

    def kv(prompts):
        exp = build(compose(["accuracy.enabled=false", "measure.device=cpu", f"measure.prompts={prompts}"]))
        est = memory.transformers_estimate(exp, "cpu")
        return est.parts["KV cache"], est.parts["activations"]

    per_position = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers, K+V, kv heads, head dim, bf16
    short, long_ = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text(json.dumps({"prompt": "Hi there.", "max_new_tokens": 64}) + "\n")
    long_.write_text(json.dumps({"prompt": "Hi there.", "max_new_tokens": 4000}) + "\n")
    assert kv(short)[0] < 600 * per_position and kv(long_)[0] >= 4000 * per_position
    text = tmp_path / "long.txt"
    text.write_text(" ".join(["word"] * 4000) + "\n")  # 4,000 tokens at least, 20,000 bytes at most
    got, act = kv(text)
    assert 4000 * per_position <= got <= 8192 * per_position  # the byte bound, capped at the model's context
    assert act > 2 * kv(short)[1]


def test_synthetic_ids_are_seeded_ordinary_and_the_same_for_every_quantizer(compose):
    tok = byte_tokenizer()
    m = build(compose([*TINY, "measure.prompts=synthetic:3", "measure.prompt_tokens=50",
                       "measure.context_depth=20"])).measure
    a, b = workloads.resolve(m, tok), workloads.resolve(m, tok)
    assert a.prompts == b.prompts and a.context == b.context and a.hash == b.hash
    assert [len(p) for p in a.prompts] == [50, 50, 50] and len(a.context) == 20
    assert len({tuple(p) for p in a.prompts}) == 3  # distinct prompts
    flat = [i for p in a.prompts for i in p] + a.context
    assert not set(flat) & set(tok.all_special_ids) and min(flat) >= 3 and max(flat) < len(tok)
    assert len(set(flat)) > 50  # spread over the vocabulary, not one repeated id
    m2 = build(compose([*TINY, "quantizer=bf16", "measure.prompts=synthetic:3", "measure.prompt_tokens=50",
                        "measure.context_depth=20"])).measure
    assert workloads.resolve(m2, tok).hash == a.hash  # another quantizer: the same ids
    m3 = build(compose([*TINY, "measure.prompts=synthetic:3", "measure.prompt_tokens=50", "measure.seed=1"])).measure
    assert workloads.resolve(m3, tok).prompts != a.prompts


# ------------------------------------------------------------------------------------ context depth
@pytest.fixture(scope="module")
def tiny():
    return load_pretrained(TinyRandom(), "float32", "cpu")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decoding_at_depth_equals_decoding_the_concatenated_prompt(tiny, cache):
    """Depth d + prompt p computes what the prompt (d + p) computes; the reused (cropped) cache too."""
    context = [7 + (i * 37) % 250 for i in range(600)]  # > one prefill chunk (512)
    batch = [[11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33]]  # left padding after the context
    opts = DecodeOptions(max_new_tokens=6, cache=cache)
    want = greedy_generate(tiny, [context + p for p in batch], opts).sequences
    depth_opts = DecodeOptions(max_new_tokens=6, cache=cache, context=DepthContext(context))
    for _ in range(2):  # the second call reuses the prefilled context (dynamic cache: cropped back to it)
        gen = greedy_generate(tiny, batch, depth_opts)
        assert gen.sequences == want
        assert gen.prompt_tokens == 11 and gen.decode_tokens == 3 * 5
    single = greedy_generate(tiny, [batch[1]], depth_opts)  # another batch size from the same context
    assert single.sequences == [want[1]]


def test_run_with_prompt_file_records_the_workload(compose, results_overrides, mlflow_dir):
    from mlflow.tracking import MlflowClient

    from harness.config import TrackingConfig
    from harness.records import tracking
    from harness.run import runner

    cfg = compose([*TINY, "measure.prompts=docs/examples/prompts.jsonl", "measure.repetitions=2",
                   *results_overrides])
    res = runner.run(cfg)
    assert res.status == "OK", res.error
    assert res.metrics["generated_tokens"] == 2 * (16 + 4 + 32 + 4)  # per-prompt lengths, default 4 for the rest
    assert res.tags["workload.kind"] == "jsonl" and res.tags["workload.tg"] == "tg4-32"
    assert "4 prompts" in res.tags["workload"] and len(res.tags["workload.hash"]) == 16
    saved = [json.loads(x) for x in open(res.tags["workload.file"]).read().splitlines()]
    assert [s["max_new_tokens"] for s in saved] == [16, 4, 32, 4]
    assert saved[0]["prompt"] == "What is the capital of France?" and all(s["ids"] for s in saved)
    tcfg = TrackingConfig(**{k: v for k, v in res.config["tracking"].items()})
    tracking.record(res, tcfg)
    arts = {a.path for a in MlflowClient(tcfg.resolved_uri()).list_artifacts(res.mlflow_run_id)}
    assert "workload.jsonl" in arts


def test_synthetic_run_at_depth_reports_pp_and_tg_by_length(compose, results_overrides):
    from harness.run import runner

    res = runner.run(compose([*TINY, "measure.prompts=synthetic:2", "measure.prompt_tokens=16",
                              "measure.context_depth=40", "measure.max_new_tokens=6", "measure.warmup=1",
                              "tracking.enabled=false", *results_overrides]))
    assert res.status == "OK", res.error
    m, t = res.metrics, res.tags
    assert t["workload.pp"] == "pp16 @ d40" and t["workload.tg"] == "tg6 @ d56"
    assert m["prompt_len_tokens"] == 16 and m["decode_len_tokens"] == 6 and m["context_depth_tokens"] == 40
    assert m["kv_context_mean"] == pytest.approx(40 + 16 + 3)  # the 5 steps attend over depth + prompt + 1..5
    for key in ("prompt_tokens_per_s_mean", "decode_tokens_per_s_mean", "prefill_flops_per_s", "flops_per_token"):
        assert m[key] > 0, key
    assert m["prompt_tokens_per_s_sd"] >= 0 and m["generated_tokens"] == 2 * 6


# ---------------------------------------------------------------------------------- report sections
def _cell(q, batch, depth, tps, **extra):
    m = {"decode_tokens_per_s": tps, "batch_size": batch, "context_depth_tokens": depth, "bytes_per_step": 2e8,
         "bandwidth_gb_per_s": 20.0, "kv_context_mean": depth + 20.0, "flops_per_token": 2.7e8,
         "attn_flops_per_token_ctx": 6.9e4, "prefill_flops_per_s": 1e12, **extra}
    return {"status": "OK", "metrics": m, "error": "",
            # as a run tags them: the strategy's name holds the batch size, its Hydra choice does not (one curve)
            "tags": {"sweep.cell": f"{q},{batch},{depth}", "quantizer.name": q, "strategy.name": f"StaticBatch{batch}",
                     "choice.strategy": "static_batch"}}


def test_crossover_ratio_and_roofline_prediction():
    cells = []
    for depth in (0, 1024):
        for b in (1, 16):
            cells.append(_cell("none", b, depth, 40.0 * b))
            # int4 reads a quarter of the bytes but its kernels compute 5x slower
            cells.append(_cell("int4", b, depth, 60.0 * b if b == 1 else 20.0 * b, bytes_per_step=5e7,
                               prefill_flops_per_s=2e11))
    rows = report.rows_for(cells, "none")
    assert {r["cell"]: r["ratio"] for r in rows}["int4,16,1024"] == pytest.approx(0.5)  # matched on depth too
    pts = crossover.points(rows, "none")["int4"]
    assert [(p["batch"], p["depth"], p["measured"]) for p in pts] == [(1, 0, 1.5), (16, 0, 0.5), (1, 1024, 1.5),
                                                                      (16, 1024, 0.5)]
    # batch 1: memory-bound for both: the byte ratio; batch 16: int4 compute-bound, none still memory-bound
    assert pts[0]["predicted"] == pytest.approx(4.0, rel=0.01)
    bound16 = 16 / max(5e7 / 20e9, 16 * (2.7e8 + 6.9e4 * 20) / 2e11)
    assert pts[1]["predicted"] == pytest.approx(bound16 / (16 / (2e8 / 20e9)), rel=0.01)
    assert pts[1]["predicted"] < 1  # the roofline predicts the turn as well
    text = crossover.section(rows, "none")
    assert "## Crossover" in text and "| int4 | 1024 | 1.50 (4.00) | **0.50** (" in text


def test_crossover_keeps_one_curve_per_thread_count():
    """`+experiment=crossover measure.threads=1,2`: the curve's key was quantizer (+ model, machine), so the
    1-thread batch-4 cell (0.80: where int8 stops paying) was replaced by the 2-thread one."""
    cells = []
    for threads, (n1, i1, n4, i4) in {1: (10, 15, 30, 24), 2: (18, 36, 50, 60)}.items():
        for q, b, tps in (("none", 1, n1), ("int8", 1, i1), ("none", 4, n4), ("int8", 4, i4)):
            c = _cell(q, b, 0, float(tps))
            c["tags"].update({"threads": str(threads), "sweep.cell": f"{q},{b},t{threads}"})
            cells.append(c)
    pts = crossover.points(report.rows_for(cells, "none"), "none")
    assert {k: [(p["batch"], p["measured"]) for p in v] for k, v in pts.items()} == {
        "int8 [threads 1]": [(1, 1.5), (4, 0.8)], "int8 [threads 2]": [(1, 2.0), (4, 1.2)]}


def test_crossover_figure_and_bench_table_in_the_report(tmp_path):
    cells = [_cell(q, b, d, 30.0 * b * (1.3 if q == "int8" else 1.0)) for q in ("none", "int8") for b in (1, 4)
             for d in (0, 64)]
    paths = report.write_report(tmp_path, cells, "none", "t")
    assert tmp_path / "crossover.png" in paths and (tmp_path / "crossover.png").stat().st_size > 10_000
    bench = [{"status": "OK", "error": "", "metrics": {"prompt_len_tokens": 512, "prompt_tokens_per_s_mean": 900.0,
                                                       "prompt_tokens_per_s_sd": 12.0, "weight_bytes": 2**20 * 85,
                                                       "params": 134.5e6},
              "tags": {"workload.kind": "synthetic", "workload.pp": "pp512", "workload.tg": "tg1",
                       "engine": "llama_cpp", "kernel_path": "llama.cpp[gguf:x.gguf]", "model.name": "m",
                       "threads": "2", "quantizer.name": "none", "sweep.cell": "a"}}]
    text = report.bench_table(report.rows_for(bench, "none"))
    assert "| m | llama.cpp gguf | 85.00 MiB | 134.50 M | 2 | 1 | pp512 | 900.00 ± 12.00 |" in text
    assert "tg1" not in text  # no decode in a pp cell
    assert report.bench_table(report.rows_for(cells, "none")) == ""  # not synthetic: no bench table


@pytest.mark.heavy  # heavy tier (make test-heavy): keeps CI well inside 30 min on a cold machine
def test_crossover_sweep_on_the_tiny_model(tmp_path):
    """The experiment itself, narrowed: 2 quantizers x 2 batch sizes at one depth, warm cells."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    done = subprocess.run([sys.executable, "run.py", "+experiment=crossover", *TINY, "quantizer=none,bf16",
                           "strategy.batch_size=1,2", "measure.context_depth=24", "measure.prompt_tokens=8",
                           f"tracking.results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/hydra",
                           "tracking.experiment=crossover_test"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    cells = invocation_cells(tmp_path / "crossover")
    assert len(cells) == 4 and {c["status"] for c in cells} == {"OK"}
    assert {c["tags"]["sweep.start_method"] for c in cells} == {"forkserver"}
    assert {c["tags"]["workload.hash"] for c in cells} == {cells[0]["tags"]["workload.hash"]}  # same ids everywhere
    assert all(c["metrics"]["context_depth_tokens"] == 24 for c in cells)
    text = (tmp_path / "crossover" / "report.md").read_text()
    assert "## Crossover: decode speed relative to `none`" in text and "| bf16 | 24 |" in text
    assert (tmp_path / "crossover" / "crossover.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------ llama.cpp (the peer)
needs_llama = pytest.mark.skipif(not __import__("harness.run.llama_cpp", fromlist=["available"]).available(),
                                 reason="llama-cpp-python extra not installed (scripts/setup.sh --all; CI has it)")


@pytest.mark.heavy  # heavy tier (make test-heavy): keeps CI well inside 30 min on a cold machine
@needs_llama
@pytest.mark.slow
def test_llama_bench_narrowed_on_both_engines_at_depth(tmp_path):
    """+experiment=llama_bench narrowed to one workload with tiny lengths (pp8 + tg6 at depth 40): both engines,
    the same ids, one table; llama.cpp's tokens at depth are its own greedy on the concatenated ids."""
    import llama_cpp

    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    done = subprocess.run([sys.executable, "run.py", "+experiment=llama_bench", "workload=tg128",
                           "measure.prompt_tokens=8", "measure.context_depth=40", "measure.max_new_tokens=6",
                           "measure.repetitions=2", "measure.warmup=1", "measure.kernel_profile=false",
                           f"tracking.results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/hydra",
                           "tracking.experiment=llama_bench_test"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    cells = {c["tags"]["engine"]: c for c in invocation_cells(tmp_path / "llama_bench")}
    assert sorted(cells) == ["llama_cpp", "transformers"]
    assert len({c["tags"]["workload.hash"] for c in cells.values()}) == 1  # the same ids for both engines
    assert all(c["metrics"]["context_depth_tokens"] == 40 for c in cells.values())
    text = (tmp_path / "llama_bench" / "report.md").read_text()
    table = text.split("## Prompt processing and generation")[1]
    assert table.count("| llama.cpp gguf |") == 2 and table.count("| quantbench none") == 2  # a pp and a tg row each
    assert "| pp8 @ d40 |" in table and "| tg6 @ d48 |" in table and " ± " in table

    cpp = cells["llama_cpp"]
    lines = [json.loads(x) for x in open(cpp["tags"]["workload.file"]).read().splitlines()]
    context, prompt = lines[0]["context_ids"], lines[1]["ids"]
    assert len(context) == 40 and len(prompt) == 8
    exp = build(cpp["config"])
    llm = llama_cpp.Llama(model_path=str(exp.model.gguf_path), n_ctx=128, n_threads=2, logits_all=False,
                          verbose=False)
    try:
        ref = []
        for t in llm.generate(context + prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            ref.append(t)
            if len(ref) == 6:
                break
    finally:
        llm.close()
    # the sample is the first timed call, after the warmup: the second call on the depth cache evaluated once
    assert cpp["samples"][0]["tokens"] == ref
