"""Serving load (harness/load/): the open loop, a dead server, no orphan server, bad `load.*` values, and the
arithmetic behind goodput and capacity. The llama-server tests run the real binary that `scripts/setup.sh --all`
builds, on the tiny random model's GGUF (seconds); the narrowed `+experiment=serving` sweep against both targets
runs in tests/test_docs.py (docs/serving.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT

from harness.cli import precheck
from harness.config import build, to_plain
from harness.errors import ConfigError
from harness.interrupts import Interrupted
from harness.load import lengths, report
from harness.load import run as run_module
from harness.load import server as server_module
from harness.load.config import LoadConfig
from harness.load.driver import Request, drive, schedule
from harness.load.run import LoadRun
from harness.load.server import LlamaServer
from harness.load.stats import RequestRecord, above_knee, capacity, meets, summarize, sweep_rates
from harness.records import tracking
from harness.run import runner
from harness.run.hooks import Outcome
from harness.run.llama_cpp import system_info
from harness.sweep.isolated import run_isolated
from harness.sweep.settings import SweepSettings

TINY_SERVER = ["+size=tiny", "engine=llama_cpp", "engine.format=Q8_0", "load.profile=rates", "load.lengths=fixed:16/4",
               "load.warmup_requests=0", "accuracy.enabled=false", "measure.device=cpu"]


# ------------------------------------------------------------------------------------------ arithmetic
def test_arrivals_are_seeded_and_keep_the_asked_mean_rate_and_burstiness():
    poisson = schedule("poisson", 10.0, 4001, seed=1)
    assert poisson == schedule("poisson", 10.0, 4001, seed=1) != schedule("poisson", 10.0, 4001, seed=2)
    gaps = {a: [b - x for x, b in zip(t, t[1:], strict=False)] for a, t in
            {"poisson": poisson, "gamma": schedule("gamma", 10.0, 4001, seed=1, burstiness=0.25),
             "constant": schedule("constant", 10.0, 4001, seed=1)}.items()}
    for arrival, g in gaps.items():
        assert statistics.mean(g) == pytest.approx(0.1, rel=0.06), arrival
    cv = {a: statistics.pstdev(g) / statistics.mean(g) for a, g in gaps.items()}
    assert cv["constant"] < 1e-9 and 0.9 < cv["poisson"] < 1.1 and cv["gamma"] > 1.7  # gamma CV = 1/sqrt(shape) = 2
    assert schedule("poisson", math.inf, 3, seed=0) == [0.0, 0.0, 0.0]


def _rec(ttft: float, tpot: float, tokens: int = 5, **kw) -> RequestRecord:
    kw = {"scheduled": 0.0, "sent": 0.0, **kw}
    r = RequestRecord(index=0, prompt_tokens=8, max_tokens=tokens, finished=True, **kw)
    r.chunks = [ttft + i * tpot for i in range(tokens)]
    r.output_tokens = tokens
    return r


def test_a_request_meets_the_slo_only_within_every_limit_and_goodput_counts_the_share_that_did():
    slo = {"ttft_ms": 100.0, "tpot_ms": 10.0}
    assert meets(_rec(0.05, 0.005), slo)
    assert not meets(_rec(0.2, 0.005), slo) and not meets(_rec(0.05, 0.02), slo)
    assert not meets(_rec(0.05, 0.005, error="HTTP 500"), slo)
    recs = [_rec(0.05, 0.005), _rec(0.05, 0.005), _rec(0.2, 0.005), _rec(0.05, 0.02)]
    m, tags = summarize(recs, offered=4.0, slo=slo, lag_limit_ms=50, end=1.0)
    assert m["goodput_share"] == 0.5 and m["goodput_rps"] == 2.0 and m["requests_ok"] == 4
    assert m["serve_tpot_ms_p50"] == pytest.approx(5.0) and tags["load.open_loop"] == "true"
    late = _rec(0.05, 0.005)
    late.sent = 0.2  # 200 ms after its scheduled time: the client fell behind
    m, tags = summarize([late], offered=1.0, slo={}, lag_limit_ms=50, end=1.0)
    assert m["open_loop"] == 0.0 and "not open-loop" in tags["warning.open_loop"]
    empty = _rec(0.05, 0.005)
    empty.chunks, empty.output_tokens = [], 0  # finished with no text (the in-process batcher's EOS at once)
    m, _ = summarize([empty, _rec(0.05, 0.005)], offered=1.0, slo={}, lag_limit_ms=50, end=1.0)
    assert (m["requests_ok"], m["failed_requests"], m["unfinished_requests"]) == (1, 1, 0)


def test_capacity_is_the_knee_the_highest_passing_rate_below_the_first_that_fails():
    """The rule used to be "the highest passing rate", so 4.0 below counted although 3.0 failed. A target that
    cannot hold 3 req/s cannot hold 4: 4.0 passing is the noise of a 32-request window (kinder arrivals), and
    the report's `≥` then claimed the SLO did not bind where it did. So the knee counts: the highest rate below
    the first failing one; the passes above it are named (above_knee) and tagged, not counted."""
    points = [(1.0, 1.0), (2.0, 1.95), (3.0, 2.5), (4.0, 3.7)]  # 4.0 passes again above a failing 3.0
    assert capacity(points, 0.9) == 2.0 and above_knee(points, 0.9) == [4.0]
    assert capacity(list(reversed(points)), 0.9) == 2.0  # the order offered does not matter
    assert capacity([(1.0, 0.5), (2.0, 2.0)], 0.9) == 0.0  # the lowest rate failed
    assert capacity([(math.nan, 5.0), (2.0, 2.0)], 0.9) == 2.0 and above_knee([(2.0, 2.0)], 0.9) == []
    assert sweep_rates(1.0, 4.0, 3) == [2.0, 3.0, 4.0]  # the maximum is offered too: it brackets the capacity


def _child(rate: float, share: float) -> dict:
    m = {"offered_rps": rate, "goodput_rps": rate * share, "goodput_share": share, "request_throughput_rps": rate,
         "send_lag_ms_p99": 1.0, "open_loop": 1.0,
         **{f"serve_{n}_ms_p{q}": float(q) for n in ("ttft", "tpot") for q in (50, 90, 99)}}
    return {"label": f"{rate}/s", "status": "OK", "error": "", "metrics": m, "tags": {"load.point": f"{rate}/s"}}


def _bare_run(children: list[dict], **cfg) -> LoadRun:
    run = object.__new__(LoadRun)  # only what conclude() and point() read
    run.cfg, run.metrics, run.tags, run.children = LoadConfig(**cfg), {}, {}, children
    return run


def test_a_pass_above_a_failing_rate_is_not_the_capacity_and_is_tagged_non_monotone():
    run = _bare_run([_child(1, 1.0), _child(2, 0.97), _child(3, 0.5), _child(4, 0.91)], profile="rates",
                    rates=[1, 2, 3, 4])
    run.conclude()
    assert run.metrics["capacity_rps"] == 2 and run.tags["load.capacity_bound"] == "bracketed"
    assert run.tags["load.capacity_pattern"].startswith("non-monotone: 4/s passed above a failing rate")
    assert report.capacity_cell({"metrics": run.metrics, "tags": run.tags, "children": run.children}) == "2.00"
    run = _bare_run([_child(1, 1.0), _child(2, 0.95)], profile="rates", rates=[1, 2])
    run.conclude()
    assert run.metrics["capacity_rps"] == 2 and run.tags["load.capacity_bound"].startswith("at least")
    assert run.tags["load.capacity_pattern"] == "monotone"


def test_every_rate_offers_the_same_arrivals_scaled_to_its_rate_and_records_the_rate_they_offer(monkeypatch):
    """Gaps drawn with one seed and scaled by 1/rate: expovariate and gammavariate draw the same uniforms whatever
    the rate and multiply by the scale, so rate 2's schedule is rate 4's stretched twofold."""
    for arrival in ("poisson", "gamma"):
        fast, slow = schedule(arrival, 4.0, 32, 7, 0.5), schedule(arrival, 2.0, 32, 7, 0.5)
        assert slow == pytest.approx([2 * t for t in fast])
    seen: list[list[float]] = []
    monkeypatch.setattr(run_module, "drive", lambda target, reqs, times, *a, **k: (seen.append(times) or (
        [_rec(0.01, 0.01, scheduled=t, sent=t) for t in times], times[-1] + 0.1)))
    run = _bare_run([], profile="rates", rates=[2, 4], requests=8)
    run.target, run.kind = SlowTarget(), "fake"
    a = run.point("2/s", [Request(i, [1], 5) for i in range(8)], 2.0)
    b = run.point("4/s", [Request(i, [1], 5) for i in range(8)], 4.0)
    assert seen[0] == pytest.approx([2 * t for t in seen[1]])
    assert a["offered_actual_rps"] == pytest.approx(7 / seen[0][-1]) and a["offered_actual_rps"] != 2.0
    assert b["offered_actual_rps"] == pytest.approx(2 * a["offered_actual_rps"])


def test_a_closed_loop_is_tagged_closed_not_open_loop():
    run = _bare_run([], profile="rates", arrival="concurrency", concurrency=2, warmup_requests=0, requests=4)
    run.target, run.kind = SlowTarget(), "fake"
    run.prompts_for = lambda k, count=None: [Request(i, [1, 2, 3], 2, tag=f"r{k}") for i in range(4)]
    run.rates()
    run.conclude()
    child = run.children[0]
    assert child["tags"]["load.open_loop"] == "n/a (closed loop)" and child["tags"]["load.loop"] == "closed"
    assert math.isnan(child["metrics"]["open_loop"]) and math.isnan(child["metrics"]["send_lag_ms_p99"])
    assert run.tags["load.open_loop"] == "n/a (closed loop)" and "capacity_rps" not in run.metrics


def test_workload_lengths_resend_the_same_prompts_so_the_run_says_so(monkeypatch, caplog):
    wl = type("Workload", (), {"prompts": [[5, 6, 7], [8, 9]], "limits": [4, 4]})()
    monkeypatch.setattr(run_module.workloads, "resolve", lambda measure, tokenizer: wl)
    run = _bare_run([], profile="rates", rates=[1], lengths="workload", requests=4)
    run.exp, run.kind, run.tokenizer, run.fixed = SimpleNamespace(measure=None), "llama-server", None, None
    with caplog.at_level(logging.WARNING, logger="quantbench"):
        run.requests()
    assert run.prompts_for(0)[0].prompt == run.prompts_for(1)[0].prompt  # the same at every rate
    assert run.tags["load.prefix_reuse"] == "true"
    assert [r.message.count("\n") for r in caplog.records if "workload" in r.message] == [0]
    assert "cache_prompt=false" in caplog.text


def test_chat_lengths_are_long_tailed_prompts_with_shorter_outputs():
    pairs = lengths.draw("chat", 400, seed=0)
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert statistics.mean(prompts) > 2 * statistics.mean(outputs)
    assert max(prompts) > 3 * statistics.median(prompts)  # the long tail
    assert lengths.draw("uniform:4-8/2-3", 50, 1) == lengths.draw("uniform:4-8/2-3", 50, 1)
    assert all(4 <= p <= 8 and 2 <= o <= 3 for p, o in lengths.draw("uniform:4-8/2-3", 50, 1))


# ------------------------------------------------------------------------------------------- open loop
class SlowTarget:
    """One request at a time, 0.1 s each, first token at its start: a server that is far too slow."""

    name = "slow"

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def cancel(self, request) -> None:
        pass

    def submit(self, request, record, done) -> None:
        def serve() -> None:
            with self.lock:
                record.chunks.append(record.now())
                time.sleep(0.1)
                record.chunks.append(record.now())
            record.output_tokens, record.finished = 2, True
            done()
        threading.Thread(target=serve, daemon=True).start()

    def problem(self) -> str:
        return ""

    def close(self) -> None:
        pass


def test_open_loop_a_slow_target_meets_a_growing_queue_and_arrivals_keep_their_clock():
    n, rate = 12, 50.0  # 50 requests/s offered to a target that serves 10/s
    reqs = [Request(i, [1, 2, 3], 2) for i in range(n)]
    records, end = drive(SlowTarget(), reqs, schedule("constant", rate, n, 0), timeout_s=30)
    sends = [r.sent for r in records]
    assert max(r.lag for r in records) < 0.05  # every request left on its own clock, none waited for an answer
    assert sends[-1] < 0.4 < end  # all sent within ~0.22 s while serving them takes ~1.2 s
    ttfts = [r.ttft for r in records]
    assert ttfts[-1] > ttfts[0] + 0.8  # the queue grew: the last request waited for the eleven before it
    m, _ = summarize(records, rate, {"ttft_ms": 300.0}, 50.0, end)
    assert m["goodput_share"] < 0.5 and m["open_loop"] == 1.0


class RefusingTarget(SlowTarget):
    """Every request fails at once (a server that is not there)."""

    def submit(self, request, record, done) -> None:
        record.error = "connection refused"
        done()


def test_a_load_point_whose_every_request_failed_is_a_failed_point_not_a_zero_capacity():
    from harness.errors import QuantbenchError

    run = object.__new__(LoadRun)  # only what point() reads: the config, the target and the points so far
    run.cfg, run.target, run.kind, run.children = LoadConfig(), RefusingTarget(), "refusing", []
    with pytest.raises(QuantbenchError, match="load point rate 5: all 3 requests failed .first: connection refused."):
        run.point("rate 5", [Request(i, [1, 2, 3], 2) for i in range(3)], 5.0)
    assert run.children[0]["status"] == "FAILED" and run.children[0]["metrics"]["failed_requests"] == 3


class SilentTarget(SlowTarget):
    """Takes every request and never answers (each expires at load.request_timeout_s, unfinished, not failed)."""

    def submit(self, request, record, done) -> None:
        pass


def test_a_sweep_whose_first_points_answer_nothing_fails_in_one_line_keeping_them():
    """Both rates 0: the offered rates were 0 and scheduling them raised a bare ZeroDivisionError, which lost the
    two measured points from the FAILED record."""
    from harness.errors import QuantbenchError

    run = _bare_run([], profile="sweep", warmup_requests=0, requests=2, request_timeout_s=0.2)
    run.target, run.kind = SilentTarget(), "silent"
    run.prompts_for = lambda k, count=None: [Request(i, [1, 2, 3], 2, tag=f"r{k}") for i in range(2)]
    with pytest.raises(QuantbenchError, match=r"^load: no request was answered within load.request_timeout_s=0.2 s "
                                              r"at the synchronous point, so there are no rates to offer"):
        run.rates()
    assert [c["label"] for c in run.children] == ["synchronous", "throughput"]
    assert all(c["metrics"]["unfinished_requests"] == 2 for c in run.children)
    with pytest.raises(ValueError, match="must be > 0"):
        schedule("poisson", 0.0, 3, seed=0)


def test_a_rate_that_answered_nothing_is_a_failed_point_not_a_capacity_below_the_lowest_rate():
    """Every request unfinished (timed out, or its thread died without an error): the point was recorded OK and the
    capacity 0, 'below lowest rate', as if the target had been measured and found too slow."""
    from harness.errors import QuantbenchError

    run = _bare_run([], profile="rates", rates=[5.0], warmup_requests=0, requests=2, request_timeout_s=0.2)
    run.target, run.kind = SilentTarget(), "silent"
    with pytest.raises(QuantbenchError, match=r"^load point 5/s: none of 2 requests was answered \(0 failed, 2 "
                                              r"unfinished within load.request_timeout_s=0.2 s\)"):
        run.point("5/s", [Request(i, [1, 2, 3], 2) for i in range(2)], 5.0)
    assert run.children[0]["status"] == "FAILED" and run.children[0]["metrics"]["unfinished_requests"] == 2


def test_the_all_at_once_point_has_no_send_lag_and_the_run_takes_its_lag_from_offered_rates():
    """Every request at t=0 has no schedule to keep: its 'lag' was the client handing out the burst, which made the
    throughput point 'not open-loop' and set the parent's send_lag_ms_p99 while it was tagged open loop."""
    run = _bare_run([], profile="rates", rates=[20.0], warmup_requests=0, requests=6)
    run.target, run.kind = SlowTarget(), "slow"
    run.point("throughput", [Request(i, [1, 2, 3], 2) for i in range(6)], math.inf)
    run.point("20/s", [Request(i, [1, 2, 3], 2) for i in range(6)], 20.0)
    burst, rate = run.children
    assert math.isnan(burst["metrics"]["send_lag_ms_p99"]) and math.isnan(burst["metrics"]["open_loop"])
    assert burst["tags"]["load.loop"] == "all at once" and "warning.open_loop" not in burst["tags"]
    run.conclude()
    assert run.metrics["send_lag_ms_p99"] == rate["metrics"]["send_lag_ms_p99"]


def test_request_lengths_and_arrival_gaps_are_independent_draws():
    """One seed feeds both, but not one stream: from random.Random(seed) twice, each prompt's length and the gap
    after it were the same uniforms (correlation 0.87 for uniform:1-255/1-255), so long prompts came with long
    quiet gaps and queueing looked 40-70% shorter than it is."""
    n = 4000
    prompts = [p for p, _ in lengths.draw("uniform:1-255/1-255", n, 1)]
    times = schedule("poisson", 10.0, n + 1, 1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert abs(statistics.correlation(prompts, gaps)) < 0.1


# ------------------------------------------------------------------------------------------ llama-server
def test_llama_server_answers_every_request_is_gone_after_the_run_and_each_rate_is_a_nested_mlflow_run(
        compose, results_overrides, monkeypatch):
    started: list[LlamaServer] = []
    original = LlamaServer.start

    def start(self, *a, **k):
        started.append(self)
        return original(self, *a, **k)

    monkeypatch.setattr(LlamaServer, "start", start)
    cfg = compose([*TINY_SERVER, "load.rates=[40,80]", "load.requests=4", *results_overrides])
    result = runner.run(cfg)
    assert result.status == "OK", result.error
    assert [c["metrics"]["requests_ok"] for c in result.children] == [4, 4]
    assert all(c["metrics"]["output_tokens_per_s"] > 0 for c in result.children)  # usage counted the tokens
    assert result.metrics["capacity_rps"] in (40.0, 80.0) and result.tags["load.target"] == "llama-server"
    assert started and started[0].proc.poll() is not None  # stopped with the run
    from mlflow import MlflowClient  # slow to import: only this test needs it

    exp = build(cfg)
    tracking.record(result, exp.tracking)
    client = MlflowClient(exp.tracking.resolved_uri())
    nested = client.search_runs([client.get_experiment_by_name(exp.tracking.experiment).experiment_id],
                                f"tags.mlflow.parentRunId = '{result.mlflow_run_id}'")
    assert sorted(r.data.tags["load.point"] for r in nested) == ["40/s", "80/s"]
    assert all(r.data.metrics["requests_ok"] == 4 and "serve_ttft_ms_p90" in r.data.metrics for r in nested)


def test_workload_prompts_reach_llama_server_with_cache_prompt_off(compose, tmp_path, monkeypatch):
    """load.lengths=workload repeats the run's prompts at every rate: llama-server is asked to prefill them again."""
    bodies: list[dict] = []
    original = run_module.HttpTarget.__init__

    def init(self, *a, **k):
        original(self, *a, **k)
        bodies.append(self.body)

    monkeypatch.setattr(run_module.HttpTarget, "__init__", init)
    result = runner.run(compose([*TINY_SERVER, "load.lengths=workload", "load.rates=[40,40]", "load.requests=2",
                                 f"tracking.results_dir={tmp_path}"]))
    assert result.status == "OK", result.error
    assert bodies == [{"cache_prompt": False}] and result.tags["load.prefix_reuse"] == "true"
    assert [c["metrics"]["requests_ok"] for c in result.children] == [2, 2]


def test_llama_server_gets_the_engines_batch_and_attention_path_and_the_run_tags_them(compose, tmp_path, monkeypatch):
    """engine.n_batch and engine.flash_attn reach llama-server as in-process (-b/-ub, explicit -fa: its default is
    'auto'), and the run records them with the server's build."""
    commands: list[list[str]] = []
    original = LlamaServer.start

    def start(self, *a, **k):
        commands.append(self.command())
        original(self, *a, **k)

    monkeypatch.setattr(LlamaServer, "start", start)
    result = runner.run(compose([*TINY_SERVER, "engine.n_batch=64", "engine.flash_attn=true", "load.rates=[40]",
                                 "load.requests=2", f"tracking.results_dir={tmp_path}"]))
    assert result.status == "OK", result.error
    (cmd,) = commands
    flags = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert (flags["-b"], flags["-ub"], flags["-fa"]) == ("64", "64", "on") and flags["--host"] == "127.0.0.1"
    tags = result.tags
    assert (tags["llama.n_batch"], tags["llama.n_ubatch"], tags["llama.flash_attn"]) == ("64", "64", "true")
    assert tags["llama.server_version"] not in ("", "?")
    assert tags["llama.system_info"].startswith("CPU:")  # the server binary's CPU features, as in-process runs record


def test_the_server_binarys_cpu_features_are_read_from_its_verbose_startup_line(tmp_path, monkeypatch):
    """llama-server prints `system_info:` only at -lv 4, before it loads a model: a stand-in binary prints it so
    (threads first, then llama_print_system_info) when asked at that verbosity, and nothing otherwise."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n"
                    'case " $* " in *" -lv 4 "*) echo "0.00.003.319 I cmn  common_param: system_info: n_threads = 2 '
                    '(n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | REPACK = 1 | " ;; esac\n'
                    'echo "0.00.006.293 E srv    load_model: failed to load model"; exit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("QUANTBENCH_LLAMA_SERVER", str(fake))
    assert server_module.system_info_line() == "CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | REPACK = 1 |"
    assert system_info(server_module.system_info_line()) == "CPU: SSE3 AVX REPACK"
    fake.write_text("#!/bin/sh\necho 'nothing said'; exit 1\n")
    assert server_module.system_info_line() == ""


def test_a_server_that_dies_mid_run_fails_the_run_in_one_line_and_keeps_what_was_answered(compose, tmp_path,
                                                                                         monkeypatch):
    original = LoadRun.point

    def point(self, *a, **k):  # the second rate finds its server killed
        if self.children:
            self.server.proc.kill()
            self.server.proc.wait()
        return original(self, *a, **k)

    monkeypatch.setattr(LoadRun, "point", point)
    result = runner.run(compose([*TINY_SERVER, "load.rates=[40,40]", "load.requests=4",
                                 f"tracking.results_dir={tmp_path}"]))
    assert result.status == "FAILED"
    assert "llama-server died mid-run (killed by signal 9); log tail" in result.error and "\n" not in result.error
    first, second = result.children
    assert first["status"] == "OK" and first["metrics"]["requests_ok"] == 4  # answered before the death: kept
    assert second["status"] == "FAILED" and second["metrics"]["requests_ok"] == 0


def test_a_load_run_stopped_by_sigterm_keeps_the_rates_it_finished_in_its_killed_record(compose, tmp_path,
                                                                                        monkeypatch):
    original, procs = LoadRun.point, []

    def point(self, *a, **k):  # SIGTERM (harness.interrupts turns it into Interrupted) as the second rate starts
        procs.append(self.server.proc)
        if self.children:
            raise Interrupted(signal.SIGTERM)
        return original(self, *a, **k)

    monkeypatch.setattr(LoadRun, "point", point)
    with pytest.raises(KeyboardInterrupt) as stopped:
        runner.run(compose([*TINY_SERVER, "load.rates=[40,40]", "load.requests=4", f"tracking.results_dir={tmp_path}"]))
    result = stopped.value.result
    assert result.status == "KILLED" and result.error == "interrupted (SIGTERM) during the serving load run"
    (first,) = result.children  # the rate answered before the stop: kept, and summarized on the parent
    assert first["status"] == "OK" and first["metrics"]["requests_ok"] == 4
    assert result.metrics["load_points"] == 1 and result.metrics["capacity_rps"] == first["metrics"]["offered_rps"]
    assert result.tags["status"] == "KILLED" and result.tags["load.target"] == "llama-server"
    assert procs[0].poll() is not None  # the server was stopped on the way out


def _marked(mark: str) -> list[int]:
    """Pids of llama-server processes whose environment carries `mark` (inherited from the run we started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"llama-server" in (proc / "cmdline").read_bytes() \
                    and mark.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def test_no_server_outlives_a_run_ended_by_sigterm_and_the_run_is_recorded_killed(tmp_path):
    mark = f"QB_SERVING_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), mark.split("=")[0]: mark.split("=")[1]}
    args = [sys.executable, "run.py", *TINY_SERVER, "load.rates=[2]", "load.requests=400",
            f"tracking.results_dir={tmp_path}", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait(lambda: _marked(mark) or proc.poll() is not None, 120), "no llama-server started"
        servers = _marked(mark)
        assert servers, f"the run ended before its server started: {proc.stdout.read()[-2000:]}"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
        # a clean stop: the run stopped and reaped its server (no zombie left to init)
        assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
        assert not any(Path(f"/proc/{pid}").exists() for pid in servers)
        # and recorded, as a single run stopped by SIGTERM is (harness/interrupts.py): KILLED, in its load phase
        (record,) = [json.loads(f.read_text()) for f in (tmp_path / "runs").glob("*.json")]
        assert record["status"] == "KILLED", record["status"]
        assert record["error"] == "interrupted (SIGTERM) during the serving load run", record["error"]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)


def test_no_server_outlives_a_sweep_cell_killed_by_its_timeout(compose, tmp_path, monkeypatch):
    """The sweep's own cell runner (harness/sweep/isolated.py): SIGKILL to the cell's process group at the timeout."""
    key, value = "QB_SERVING_TEST", uuid.uuid4().hex
    monkeypatch.setenv(key, value)  # the cell gets the sweep's environment, and its server the cell's
    config = to_plain(compose([*TINY_SERVER, "load.rates=[2]", "load.requests=400", f"tracking.results_dir={tmp_path}"]))
    config.pop("hydra", None)
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(_marked(f"{key}={value}"))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_isolated(config, SweepSettings(timeout_s=5), "")
    finally:
        stop.set()
        watcher.join()
    assert result.status == "TIMEOUT" and "sweep.timeout_s=5s" in result.error
    assert seen, "the cell was killed before its server started"
    try:
        assert _wait(lambda: not _marked(f"{key}={value}"), 10), "llama-server outlived its killed cell"
    finally:
        for pid in _marked(f"{key}={value}"):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("override", "says"), [
    ("load.rates=[-1]", "must hold finite request rates > 0 (requests/s)"),
    ("load.profile=burst", "load.profile='burst' is not allowed; choose one of: off, rates, sweep"),
    ("load.slo.ttft_ms=0", "load.slo.ttft_ms=0.0 must be > 0"),
    ("load.lengths=fixed:0/4", "load.lengths='fixed:0/4': lengths must be >= 1"),
    ("load.arrival=weibull", "load.arrival='weibull' is not allowed"),
    ("load.arrival=concurrency load.profile=sweep", "load.profile=sweep offers rates, and load.arrival=concurrency"),
    # a socket timeout of inf raised OverflowError in every request; NaN passed `> 0` too
    ("load.request_timeout_s=inf", "load.request_timeout_s=inf must be a finite number > 0"),
    ("load.request_timeout_s=nan", "load.request_timeout_s=nan must be a finite number > 0"),
    ("load.request_timeout_s=2e6", "load.request_timeout_s=2000000.0 must be a finite number of seconds"),
    # settings the profile or arrival does not read were accepted, recorded as params, and ignored
    ("load.arrival=concurrency", "load.rates=[1.0] would not be read; drop load.rates"),
    ("load.profile=sweep", "load.profile=sweep picks its own rates: load.rates=[1.0] would not be read; drop "
                           "load.rates"),
    ("load.burstiness=0.2", "load.burstiness=0.2 is read by load.arrival=gamma only (this run: load.arrival=poisson); "
                            "drop it"),
    ("load.concurrency=16", "load.concurrency=16 is read by load.arrival=concurrency only"),
    ("load.sweep_rates=6", "load.sweep_rates=6 is read by load.profile=sweep only; drop it"),
])
def test_a_bad_load_value_is_refused_in_one_line_before_anything_starts(override, says):
    problem = precheck(["load.profile=rates", "load.rates=[1]", *override.split()])
    assert problem is not None and says in problem and "\n" not in problem


@pytest.mark.parametrize(("override", "says"), [
    ("strategy=static_batch strategy.batch_size=16", "strategy StaticBatch16 does nothing there; drop the strategy and "
                                                     "set load.parallel"),
    ("strategy=continuous_batch", "strategy ContinuousBatch does nothing there"),
    ("measure.compile=true", "measure.compile=true would not apply"),
    ("measure.path=compiled", "measure.path=compiled would not apply"),
    ("measure.gemv=aten", "measure.gemv=aten would not apply"),
    ("measure.repetitions=10", "does not read measure.repetitions=10: load.requests governs a load run"),
    ("measure.context_depth=64", "does not read measure.context_depth=64"),
    ("load.url=http://127.0.0.1:9 quantizer=int4", "load.url measures the server already running there, on its own "
                                                  "weights: quantizer=int4 would only label its numbers"),
])
def test_a_setting_a_load_run_does_not_read_is_refused_in_one_line_naming_what_governs(override, says):
    problem = precheck(["model=tiny_random", "load.profile=rates", "load.rates=[1]", *override.split()])
    assert problem is not None and says in problem and "\n" not in problem and "config problems" not in problem


def test_a_load_run_tags_what_its_target_ran_not_the_strategy_it_does_not_use(compose):
    """The in-process target decodes eager continuous batching at load.parallel; a URL serves its own weights."""
    outcome = Outcome(metrics={}, tags={"load.target": "in-process"}, samples=[])
    exp = build(compose(["model=tiny_random", "load.profile=sweep", "load.parallel=4", "measure.path=eager"]))
    tags = runner._result(exp, "cpu", 1, outcome).tags
    assert (tags["strategy.name"], tags["measure.compile"], tags["measure.cache"]) == (
        "continuous batching (load.parallel=4)", "false", "paged")
    assert runner.identity_tags(exp)["strategy.name"] == tags["strategy.name"]  # what a failed cell of it says
    url = build(compose(["model=tiny_random", "load.profile=sweep", "load.url=http://127.0.0.1:9"]))
    tags = runner._result(url, "cpu", 1, outcome).tags
    assert tags["quantizer.name"] == "external" and tags["strategy.name"] == "external server (load.url)"
    plain = build(compose(["model=tiny_random"]))  # not a load run: the strategy's own name
    assert runner._result(plain, "cpu", 1, outcome).tags["strategy.name"] == "Greedy"


def test_a_concurrency_needs_no_rates():
    assert precheck(["load.profile=rates", "load.arrival=concurrency"]) is None


def test_a_sweep_refuses_an_unread_load_setting_only_where_no_cell_reads_it():
    """Judged cell by cell, a sweep over load.arrival=poisson,gamma refused load.burstiness in its poisson cell, and a
    sweep over arrivals with load.concurrency could not be written at all."""
    for override in (["load.arrival=poisson,gamma", "load.burstiness=0.5"],
                     ["load.arrival=poisson,concurrency", "load.concurrency=8"]):
        assert precheck(["-m", "model=tiny_random", "load.profile=rates", "load.rates=[1,2]", *override]) is None
    problem = precheck(["-m", "model=tiny_random", "load.profile=rates", "load.rates=[1,2]",
                        "load.arrival=poisson,constant", "load.burstiness=0.5"])
    assert problem is not None and "load.burstiness=0.5 is read by load.arrival=gamma only" in problem \
        and problem.endswith("(in every cell of this sweep)")


def test_settings_each_arrival_and_profile_reads_are_accepted():
    for override in (["load.profile=rates", "load.arrival=concurrency", "load.concurrency=16"],
                     ["load.profile=rates", "load.rates=[1]", "load.arrival=gamma", "load.burstiness=0.2"],
                     ["load.profile=sweep", "load.sweep_rates=6", "load.request_timeout_s=1e6"]):
        assert precheck(override) is None, override


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1?api_key=sk-live-SECRET",
                                 "http://127.0.0.1:8000/v1?token=sk-live-SECRET", "http://sk-live-SECRET@127.0.0.1:8000",
                                 "http://127.0.0.1:8000/v1#sk-live-SECRET"])
def test_a_load_url_with_a_token_is_refused_without_showing_it(url):
    """A token in the query or the user info passed the password check, became an MLflow param, and was not sent
    (HttpTarget sends to the URL's path only): refused, naming the part, never its value."""
    problem = precheck(["load.profile=rates", "load.rates=[1]", f"load.url='{url}'"])
    assert problem is not None and problem.startswith("load.url holds ") and "\n" not in problem
    assert "SECRET" not in problem and "would record as a param" in problem
    with pytest.raises(ConfigError) as info:
        LoadConfig(profile="rates", rates=[1.0], url=url)
    assert "SECRET" not in str(info.value)
    assert LoadConfig(profile="rates", rates=[1.0], url="http://127.0.0.1:8000/v1").url  # the base URL alone is fine


@pytest.mark.parametrize(("line", "says"), [("5", "line 2 of bad.jsonl is not a JSON object"),
                                            ("null", "line 2 of bad.jsonl is not a JSON object"),
                                            ("[1, 2]", "line 2 of bad.jsonl is not a JSON object"),
                                            ("{oops", "line 2 of bad.jsonl is not JSON"),
                                            ('{"prompt_tokens": true, "output_tokens": 3}',
                                             "line 2 of bad.jsonl: prompt_tokens and output_tokens must be integers")])
def test_a_lengths_file_line_that_is_not_an_object_of_integers_is_named(tmp_path, line, says):
    """A number or null raised a bare TypeError ("load: 'int' object is not iterable", no file, no line), and JSON
    true was taken as the length 1."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_tokens": 4, "output_tokens": 2}\n' + line + "\n")
    problem = lengths.spec_problem(str(path))
    assert problem is not None and says in problem and "\n" not in problem


def test_the_cli_refuses_a_bad_load_value_with_exit_2_and_starts_no_server(tmp_path):
    mark = f"QB_SERVING_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), mark.split("=")[0]: mark.split("=")[1]}
    out = subprocess.run([sys.executable, "run.py", *TINY_SERVER, "load.rates=[-2]", f"tracking.results_dir={tmp_path}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("error: load.rates=") and "must hold finite request rates > 0" in out.stderr
    assert not _marked(mark) and not list(tmp_path.iterdir())  # nothing started, nothing written
