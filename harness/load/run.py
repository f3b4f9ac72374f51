"""A load run (`load.profile=rates|sweep`): open the target, offer each rate, summarize, find the capacity.

    python run.py load.profile=sweep                          # in process: transformers' continuous batching
    python run.py engine=llama_cpp engine.format=Q4_0 load.profile=rates 'load.rates=[1,2,4]'   # llama-server
    python run.py load.profile=sweep load.url=http://127.0.0.1:8080   # a server that is already running

Target: `load.url` when set; else `engine=llama_cpp` starts llama-server on the format's GGUF
(harness/load/server.py), and `engine=transformers` feeds the quantized model's continuous-batching manager in
this process (harness/load/inprocess.py). Rates: `load.rates`, or the sweep (guidellm's): a synchronous run
(one request at a time), a maximum-throughput run (every request at once), then `load.sweep_rates` rates
evenly between the two. Each rate is a nested MLflow run; the parent holds the capacity under the SLO (the
knee: the highest offered rate whose goodput is at least `load.goodput_share` of it, every lower rate passing
too) and the latencies at that rate. Every rate offers the same drawn lengths on the same seeded arrivals, time-
scaled to its rate, with prompts cut from other places of the text (no prefix cache hit carries over from one
rate to the next), except `load.lengths=workload`: the run's own prompts, the same at every rate (tagged
`load.prefix_reuse=true`; llama-server is asked not to reuse its cache, `cache_prompt: false`).
"""

from __future__ import annotations

import itertools
import logging
import math
import signal
import statistics
from pathlib import Path
from typing import Any

from harness import measure, run_log, third_party_output
from harness.analysis.roofline import shape_from_gguf
from harness.config import Experiment
from harness.errors import QuantbenchError
from harness.interrupts import sigterm_interrupts
from harness.load import lengths
from harness.load.driver import Request, TargetDied, drive, schedule
from harness.load.http import HttpTarget
from harness.load.inprocess import InProcessTarget
from harness.load.server import LlamaServer, binary, system_info_line, version
from harness.load.stats import CLOSED, QUANTILES, above_knee, capacity, summarize, sweep_rates
from harness.measure import memory, workloads
from harness.models import load_tokenizer
from harness.run.hooks import Outcome
from harness.run.llama_cpp import convert, linear_bits, system_info

log = logging.getLogger("quantbench")
SWEEP_ENDS = ("synchronous", "throughput")  # the sweep's first two points, which set its rates


class LoadFailed(QuantbenchError):
    """A load run that ended early (a dead target): `outcome` keeps every rate answered before it."""

    def __init__(self, message: str, outcome: Outcome, threads: int):
        super().__init__(message)
        self.outcome, self.threads = outcome, threads


def target_kind(exp: Experiment) -> str:
    return "url" if exp.load.url else ("llama-server" if exp.engine.name == "llama_cpp" else "in-process")


def ran_tags(exp: Experiment) -> dict[str, str]:
    """What a load target ran, in the tags an ordinary run fills from its strategy and decode settings (a load run
    reads neither: harness/load/config.py `conflicts`); with load.url the weights are the server's own."""
    kind, n = target_kind(exp), exp.load.parallel
    if kind == "in-process":
        return {"strategy.name": f"continuous batching (load.parallel={n})", "measure.compile": "false",
                "measure.cache": "paged"}
    if kind == "llama-server":
        return {"strategy.name": f"llama-server slots (load.parallel={n})"}
    return {"strategy.name": "external server (load.url)", "quantizer.name": "external", "quantizer.backend": ""}


class LoadRun:
    """One experiment under open-loop load (module docstring)."""

    def __init__(self, exp: Experiment, device: str):
        self.exp, self.device, self.cfg = exp, device, exp.load
        self.kind = target_kind(exp)
        self.log_file = run_log(exp.tracking.results_dir)
        self.metrics: dict[str, float] = {}
        self.tags: dict[str, str] = {"load.target": self.kind, "load.profile": self.cfg.profile,
                                     "load.arrival": self.cfg.arrival, "load.lengths": str(self.cfg.lengths)}
        self.children: list[dict] = []
        self.target: Any = None
        self.session: Any = None
        self.server: LlamaServer | None = None
        self.estimate = None
        self.threads = 0
        self.tokenizer: Any = None
        self.lengths: list[tuple[int, int]] = []  # (prompt tokens, output tokens) of each request, every rate
        self.fixed: list[list[int]] | None = None  # load.lengths=workload: the run's own prompts
        self.stream: list[int] | None = None  # the text prompts are cut from (lengths.text_ids)

    def preflight(self) -> None:
        """Cheap checks before anything loads or starts: the server binary, the engine, memory."""
        exp = self.exp
        if self.kind == "llama-server":
            binary()
        if self.kind != "url":
            exp.engine.preflight(exp, self.device)
        if self.kind == "in-process":
            self.estimate = memory.check(exp, self.device)

    # ---------------------------------------------------------------------------------------- requests
    def requests(self) -> None:
        """The run's request lengths (the same at every rate), and what their prompts are cut from."""
        cfg, n = self.cfg, self.cfg.requests
        if cfg.lengths == "workload":
            wl = workloads.resolve(self.exp.measure, self.tokenizer)
            self.fixed = [wl.prompts[i % len(wl.prompts)] for i in range(n)]
            self.lengths = [(len(p), wl.limits[i % len(wl.limits)]) for i, p in enumerate(self.fixed)]
            self.tags["load.prefix_reuse"] = "true"
            log.warning("load.lengths=workload sends the run's own %d prompt(s) again at every rate (and the warmup): "
                        "a server that caches prompts answers repeats without their prefill%s", len(wl.prompts),
                        "; llama-server is sent cache_prompt=false" if self.kind == "llama-server" else "")
        else:
            self.lengths = lengths.draw(str(cfg.lengths), n, cfg.seed)
            self.stream = lengths.text_ids(self.tokenizer)

    def prompts_for(self, k: int, count: int | None = None) -> list[Request]:
        """Rate k's requests (the first `count`): the same lengths, prompts from other offsets of the text."""
        pairs = self.lengths[:count]
        if self.fixed is not None:
            return [Request(i, list(p), o, tag=f"r{k}") for i, (p, (_, o)) in enumerate(zip(self.fixed, pairs, strict=False))]
        seed = self.cfg.seed + 1000 * (k + 1) + 10**6 * self.cfg.prompt_seed
        ids = lengths.prompts(self.tokenizer, self.stream, [p for p, _ in pairs], seed)
        return [Request(i, ids[i], o, tag=f"r{k}") for i, (_, o) in enumerate(pairs)]

    # ------------------------------------------------------------------------------------------ target
    def open(self, max_len: int) -> None:
        exp, cfg, tokenizer, threads = self.exp, self.cfg, self.tokenizer, self.threads
        if self.kind == "url":
            self.target = HttpTarget(cfg.url, tokenizer=tokenizer, api_model=cfg.api_model,
                                     timeout_s=cfg.request_timeout_s, name="url")
            return
        if self.kind == "llama-server":
            src = Path(exp.model.gguf_path)
            if not src.is_file():
                exp.model.make_gguf()  # random weights: the float GGUF, once per preset and seed (cached)
            with third_party_output(self.log_file):
                gguf = convert(src, exp.engine.format, threads)
            self.tags.update({"engine.format": exp.engine.format, "kernel_path": f"llama.cpp[{gguf.name}]"})
            self.metrics.update({"weight_bytes": shape_from_gguf(gguf).weight_bytes, "bits_per_weight": linear_bits(gguf)})
            eng = exp.engine  # the in-process engine's settings, alike for the server (harness/run/llama_cpp.py)
            self.server = LlamaServer(gguf, threads=threads, parallel=cfg.parallel, batch=eng.n_batch,
                                      flash_attn=eng.flash_attn, ctx_per_slot=-(-(max_len + 16) // 256) * 256,
                                      log_file=self.log_file)
            self.tags.update({"llama.n_batch": str(eng.n_batch), "llama.n_ubatch": str(eng.n_batch),
                              "llama.flash_attn": str(eng.flash_attn).lower(), "llama.server_version": version(),
                              "llama.system_info": system_info(system_info_line()) or "?"})  # as in-process runs
            t0 = measure.now()
            self.server.start()
            self.metrics["load_s"] = measure.now() - t0
            self.tags["log_file"] = str(self.log_file)
            # workload prompts repeat at every rate: ask llama-server not to reuse their KV cache (a field it knows)
            self.target = HttpTarget(self.server.url, tokenizer=tokenizer, timeout_s=cfg.request_timeout_s,
                                     server=self.server, name="llama-server",
                                     body={"cache_prompt": False} if self.fixed is not None else None)
            return
        session = exp.engine.open(exp, self.device, threads)
        metrics, tags = session.load(tokenizer, None, self.log_file)
        self.metrics.update(metrics)
        self.tags.update(tags)
        self.session = session
        self.target = InProcessTarget(session.model, parallel=cfg.parallel, max_len=max_len)

    def close(self) -> None:
        try:
            if self.target is not None:
                self.target.close()
        finally:
            if self.server is not None:
                self.server.stop()
            if self.session is not None:
                self.session.close()
            self.target = self.server = self.session = None

    # ------------------------------------------------------------------------------------------- rates
    def point(self, label: str, reqs: list[Request], rate: float, concurrency: int = 0) -> dict[str, float]:
        """Offer one rate (or a concurrency); record it as a child run; its metrics."""
        cfg = self.cfg
        # one seed for every rate: each rate's gaps are the same draws scaled by 1/rate, so the rates differ by
        # their rate only (a seed per rate moved the actual offered rate by ~20% between neighbours)
        times = schedule(cfg.arrival if not concurrency else "concurrency", rate, len(reqs), cfg.seed, cfg.burstiness)
        offered = rate if not concurrency and math.isfinite(rate) else math.nan
        died = ""
        try:
            records, end = drive(self.target, reqs, times, cfg.request_timeout_s, concurrency=concurrency)
        except TargetDied as exc:
            records, end, died = exc.records, exc.end, str(exc)
        # every request at once (the throughput point) has no arrival schedule to keep: its "lag" is the client
        # handing out the burst, so no send lag and no open-loop verdict, as for a closed loop
        burst = not concurrency and math.isinf(rate)
        metrics, tags = summarize(records, offered, cfg.slo.limits(), cfg.max_send_lag_ms, end,
                                  closed=concurrency > 0 or burst)
        if burst:
            tags.update({"load.open_loop": "n/a (all at once)", "load.loop": "all at once"})
        if not died and records and all(r.error for r in records):  # nothing was served: not a measurement
            died = (f"load point {label}: all {len(records)} requests failed (first: {records[0].error}); is the "
                    "server at load.url up and serving this model?")
        elif not died and records and not any(r.ok for r in records) and label not in SWEEP_ENDS:
            # none answered (timed out, or failed and timed out): the target is stuck or broken, and such a rate is no
            # capacity point ("below lowest rate"); the sweep's two ends are judged together in rates(), both kept
            first = next((f"; first error: {r.error}" for r in records if r.error), "")
            died = (f"load point {label}: none of {len(records)} requests was answered "
                    f"({int(metrics['failed_requests'])} failed, {int(metrics['unfinished_requests'])} unfinished "
                    f"within load.request_timeout_s={cfg.request_timeout_s:g} s{first}); check the target, or raise "
                    "load.request_timeout_s")
        tags.update({"load.point": label, "load.target": self.kind})
        if concurrency:
            metrics["concurrency"] = float(concurrency)
        self.children.append({"label": label, "status": "FAILED" if died else "OK", "error": died,
                              "metrics": metrics, "tags": tags})
        log.info("load %s: offered %s, %.2f req/s done, goodput %.2f req/s, p90 TTFT %.0f ms, p90 TPOT %.1f ms",
                 label, "-" if math.isnan(offered) else f"{offered:.2f}/s", metrics["request_throughput_rps"],
                 metrics["goodput_rps"], metrics["serve_ttft_ms_p90"], metrics["serve_tpot_ms_p90"])
        if died:
            raise QuantbenchError(died)
        return metrics

    def rates(self) -> None:
        cfg, k = self.cfg, itertools.count()  # rate k's prompts: their own text windows
        if cfg.warmup_requests:  # untimed: first calls allocate and pick kernels
            warm = self.prompts_for(-1, cfg.warmup_requests)
            drive(self.target, warm, [0.0] * len(warm), cfg.request_timeout_s, concurrency=1)
        if cfg.arrival == "concurrency":
            self.point(f"concurrency {cfg.concurrency}", self.prompts_for(next(k)), math.inf,
                       concurrency=cfg.concurrency)
            return
        offered = list(cfg.rates)
        if cfg.profile == "sweep":
            sync = self.point("synchronous", self.prompts_for(next(k)), math.inf, concurrency=1)
            top = self.point("throughput", self.prompts_for(next(k)), math.inf)
            self.metrics["sync_rps"] = sync["request_throughput_rps"]
            self.metrics["sync_output_tokens_per_s"] = sync["output_tokens_per_s"]
            self.metrics["max_rps"] = top["request_throughput_rps"]
            if not (sync["request_throughput_rps"] > 0 and top["request_throughput_rps"] > 0):
                raise QuantbenchError(  # one line, the two points kept in the FAILED record (not a ZeroDivisionError)
                    "load: no request was answered within load.request_timeout_s="
                    f"{cfg.request_timeout_s:g} s at the {'synchronous' if not sync['request_throughput_rps'] > 0 else 'throughput'}"
                    " point, so there are no rates to offer; raise load.request_timeout_s or check the target")
            offered = sweep_rates(sync["request_throughput_rps"], top["request_throughput_rps"], cfg.sweep_rates)
        for rate in offered:
            self.point(f"{rate:.3g}/s", self.prompts_for(next(k)), float(rate))

    def conclude(self) -> None:
        """The parent's metrics: capacity under the SLO and the latencies at that rate."""
        pts = [c for c in self.children if c["tags"]["load.point"] not in SWEEP_ENDS
               and not math.isnan(c["metrics"]["offered_rps"])]
        passes = [(c["metrics"]["offered_rps"], c["metrics"]["goodput_rps"]) for c in pts]
        cap = capacity(passes, self.cfg.goodput_share)
        self.metrics["max_rps"] = max([self.metrics.get("max_rps", 0.0)]
                                      + [c["metrics"]["request_throughput_rps"] for c in self.children])
        if pts:
            self.metrics["capacity_rps"] = cap
            top = max(c["metrics"]["offered_rps"] for c in pts)
            # below the lowest rate, at the highest one offered (every rate passed: the SLO did not bind), or between
            # the knee and the first rate that failed
            self.tags["load.capacity_bound"] = ("below lowest rate" if cap == 0 else
                                                "at least (highest rate offered)" if cap == top else "bracketed")
            stray = above_knee(passes, self.cfg.goodput_share)
            self.tags["load.capacity_pattern"] = ("monotone" if not stray else "non-monotone: " + ", ".join(
                f"{r:.3g}/s" for r in stray) + " passed above a failing rate (noise: raise load.requests)")
        at = next((c for c in pts if c["metrics"]["offered_rps"] == cap), None)
        if at is not None:
            for q in QUANTILES:
                for name in ("ttft", "tpot"):
                    self.metrics[f"capacity_{name}_ms_p{q}"] = at["metrics"][f"serve_{name}_ms_p{q}"]
        lags = [c["metrics"]["send_lag_ms_p99"] for c in self.children if not math.isnan(c["metrics"]["send_lag_ms_p99"])]
        if lags:
            self.metrics["send_lag_ms_p99"] = max(lags)
        self.metrics["load_points"] = float(len(self.children))
        # open loop or not is a question for offered rates only; a closed-loop run has none
        self.tags["load.open_loop"] = str(all(c["metrics"]["open_loop"] == 1.0 for c in pts)).lower() if pts else CLOSED
        self.tags["load.slo"] = ", ".join(f"{k}<={v:g}" for k, v in self.cfg.slo.limits().items()) or "none"

    def outcome(self) -> Outcome:
        return Outcome(metrics=self.metrics, tags=self.tags, samples=[], children=self.children)

    def run(self) -> Outcome:
        self.preflight()
        self.threads = measure.set_threads(self.exp.measure.threads)
        self.tokenizer = load_tokenizer(self.exp.model)
        self.requests()
        self.metrics.update({"prompt_len_tokens": statistics.median(p for p, _ in self.lengths),
                             "decode_len_tokens": statistics.median(o for _, o in self.lengths)})
        previous = sigterm_interrupts()  # SIGTERM: Ctrl-C's stop, so `finally` stops the server, then KILLED
        try:
            self.open(max(p + o for p, o in self.lengths))
            self.rates()
        except QuantbenchError as exc:
            self.conclude()
            raise LoadFailed(str(exc), self.outcome(), self.threads) from exc
        except KeyboardInterrupt:  # the rates that finished are summarized: the KILLED record holds them (runner)
            try:
                self.conclude()
            except Exception:  # noqa: BLE001 - the stop wins; a summary that fails leaves the rates unsummarized
                log.exception("load run: the finished rates could not be summarized")
            raise
        finally:
            self.close()  # the server is stopped and reaped here, SIGTERM included
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self.conclude()
        if self.estimate is not None:
            self.metrics.update(memory.metrics(self.estimate))
        return self.outcome()
