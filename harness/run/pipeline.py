"""The measurement pipeline: every phase of a run, written once, for every engine.

    pipe = Pipeline(exp, device)   # nothing heavy
    outcome = pipe.run()           # what `python run.py` measures (harness/run/runner.py records it)

Phases, in order (an engine supplies only what differs, through its `Session`: harness/run/hooks.py):
1. preflight: a run without a decode phase is refused, the engine's and the accuracy corpus's checks, the
   memory estimate (harness/measure/memory.py); nothing has loaded yet.
2. threads and seed; tokenizer; workload (prompt ids, per-prompt lengths, depth context: harness/measure/workloads.py),
   its exact lengths checked before any weights load.
3. references: the KL reference (engine hook) and the task plan (harness/analysis/task_accuracy.py), both before the
   model loads, so they are freed before peak memory is tracked.
4. load (+ quantize, audit), prepare (strategy setup, depth context, compiled fast path), warm-up passes.
5. timed repetitions (every batch, `measure.repetitions` times) under the energy meter.
6. summaries (harness/measure/__init__.py), a check that the headline metric exists, energy, workload metrics,
   strategy metrics, kernel profile, peak memory, roofline, the spread warning, samples.
7. accuracy (perplexity, KL), task accuracy, the memory estimate beside the measured peak.

The gate (harness/gate/worker.py) uses the same phases piecewise: `preflight`, `load`, then `generate(i)`
for its blocks, `accuracy()` and `greedy_tokens()`, `close()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from typing import Any

from harness import measure, run_log, third_party_output
from harness.analysis import roofline, task_accuracy
from harness.config import Experiment
from harness.errors import QuantbenchError
from harness.measure import Generation, floor, memory, workloads
from harness.measure.energy import EnergyMeter
from harness.models import load_tokenizer
from harness.run.hooks import Outcome, Record
from strategies.base import DecodeOptions

log = logging.getLogger("quantbench")

HEADLINE = "decode_tokens_per_s"
PREFILL_HEADLINE = "prompt_tokens_per_s"  # a prefill-only synthetic workload (llama-bench's pp test)


def run_name(exp: Experiment | None, config: dict) -> str:
    """The run's name: tracking.run_name, else model-quantizer-strategy."""
    if config.get("tracking", {}).get("run_name"):
        return config["tracking"]["run_name"]
    if exp is None:
        return "invalid-config"
    return f"{exp.model.name}-{exp.quantizer.name}-{exp.strategy.name}".lower()


def headline(workload: workloads.Workload) -> str:
    """The metric a run exists to measure: decode tokens/s, or prompt tokens/s for a prefill-only workload."""
    return PREFILL_HEADLINE if workloads.prefill_only(workload.kind, workload.limits) else HEADLINE




def headline_problem(name: str, metrics: dict, gens: list[Generation], m: Any) -> str:
    """Why the headline metric is missing or NaN after the timed repetitions ('' when it is a number)."""
    if measure.finite(metrics.get(name, float("nan"))):
        return ""
    if name == HEADLINE and gens and not any(g.decode_tokens for g in gens):
        if m.stop_at_eos:
            return ("no decode tokens: every row stopped at EOS at its first token (measure.stop_at_eos=true), so "
                    "decode_tokens_per_s has nothing to time; use measure.stop_at_eos=false or other prompts")
        return ("no decode tokens were generated, so decode_tokens_per_s has nothing to time; use "
                "measure.max_new_tokens >= 2")
    return f"the run's headline metric {name} is {metrics.get(name, 'missing')}: nothing it measures was timed"


class Pipeline:
    """One experiment's measurement (module docstring). `exp` = harness.config.build(compose(overrides))."""

    def __init__(self, exp: Experiment, device: str):
        self.exp, self.device = exp, device
        self.metrics: dict[str, Any] = {}
        self.tags: dict[str, str] = {}
        self.log_file = run_log(exp.tracking.results_dir)  # what libraries print goes here, not to stdout
        self.estimate: memory.Estimate | None = None
        self.threads = 0
        self.session: Any = None
        self.tokenizer: Any = None
        self.workload: workloads.Workload | None = None
        self.task_plan: Any = None
        self.opts: DecodeOptions | None = None
        self.batches: list[list[list[int]]] = []
        self.opts_for: Any = None
        self._greedy: list[list[int]] | None = None
        self._meter: EnergyMeter | None = None  # running during the timed repetitions
        self._decoding = False  # the strategy is set up (prepare) and not yet torn down (end_decoding)
        self.phase = ""  # the phase `run` is in: what an interrupted run's error names (harness/run/runner.py)

    # ------------------------------------------------------------------------------------------- phases
    def preflight(self) -> None:
        """Cheap checks (files, libraries, device, corpus, memory); raises before anything loads."""
        exp = self.exp  # a config with no decode phase was refused by its build (workloads.no_decode_problem)
        exp.engine.preflight(exp, self.device)
        exp.accuracy.preflight()  # the corpus is read after the timing: check now that it can be
        self.estimate = memory.check(exp, self.device)  # DoesNotFit before loading

    def load(self) -> None:
        """Tokenizer, workload, references, load (+ quantize), prepare, warm-up; nothing here is timed."""
        import torch  # heavy: harness/run/runner.py (imported by run.py's CLI) imports this module

        exp, m = self.exp, self.exp.measure
        self.threads = measure.set_threads(m.threads)
        torch.manual_seed(m.seed)
        self.tokenizer = tokenizer = load_tokenizer(exp.model)
        self.workload = wl = workloads.resolve(m, tokenizer)  # exact lengths checked before any weights load
        workloads.check_resolved(wl, exp.model)
        if problem := exp.strategy.workload_problem(len(wl.prompts)):
            raise QuantbenchError(problem)  # before any weights load
        self.session = exp.engine.open(exp, self.device, self.threads)
        self._add(self.session.references(tokenizer))
        if exp.accuracy.enabled and exp.accuracy.tasks:  # the reference's task answers, cached
            with third_party_output(self.log_file):
                self.task_plan = task_accuracy.prepare(exp.model, tokenizer, exp.accuracy, self.device)
            gc.collect()
            # "unquantized" is the stored weights: a GGUF's own quantization (the default model's Q4_1) included
            self.tags.setdefault("reference.source", exp.model.reference_source())
        self.tags["peak_mem_reset"] = str(measure.reset_peak_memory(self.device))
        self._add(self.session.load(tokenizer, wl, self.log_file))
        self.opts = DecodeOptions(device=self.device, max_new_tokens=wl.max_new_tokens,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  stop_at_eos=m.stop_at_eos, inject_slowdown=m.inject_slowdown,
                                  inject_work=m.inject_work, cache=m.cache, unmetered=self.unmetered,
                                  gemv_aten=getattr(getattr(exp, "decode_choice", None), "gemv", "") in ("aten", "rows8"))
        self.batches = exp.strategy.batches(wl.prompts)
        self._add(self.session.prepare(self.opts, wl, self.batches, self.log_file))
        self._decoding = True
        if self.log_file.exists():
            self.tags["log_file"] = str(self.log_file)
        self.opts_for = wl.opts_for(self.opts)  # per-prompt max_new_tokens (JSONL): a batch decodes its longest
        for _ in range(m.warmup):
            for batch in self.batches:
                self.session.generate(batch, self.opts_for(batch))

    def generate(self, i: int) -> Generation:
        """One timed generate call of batch `i % len(batches)`, exactly as the timed repetitions make it."""
        batch = self.batches[i % len(self.batches)]
        with self.session.timing():
            return self.session.generate(batch, self.opts_for(batch))

    def timed(self) -> list[Generation]:
        """The timed repetitions (every batch, in order, `measure.repetitions` times) under the energy meter."""
        self._meter = meter = EnergyMeter(self.device)  # NVML on CUDA, RAPL on CPU where readable (energy.py)
        meter.start()
        try:
            with self.session.timing():
                gens = [self.session.generate(batch, self.opts_for(batch))
                        for _ in range(self.exp.measure.repetitions) for batch in self.batches]
        finally:
            self._meter = None
        joules = meter.stop()
        self._add(self.session.after_timing(self.batches, self.opts_for, gens))  # each batch at its length
        self.metrics.update(measure.summarize(gens, batches=len(self.batches)))
        if problem := headline_problem(headline(self.workload), self.metrics, gens, self.exp.measure):
            raise QuantbenchError(problem)  # the run ends FAILED with this line, before the scoring
        meter.record(joules, self.metrics["generated_tokens"], self.metrics, self.tags)
        return gens

    def summaries(self, gens: list[Generation]) -> None:
        """Workload and strategy metrics, kernel profile, peak memory, roofline, the spread warning."""
        exp, m, wl, metrics = self.exp, self.exp.measure, self.workload, self.metrics
        metrics.update(workloads.metrics(wl, gens, self.session.model_config, metrics.get("params")))
        self.tags.update(workloads.record(wl))
        metrics.update(exp.strategy.metrics(gens))
        if not exp.strategy.schedules_rows and "tokens_per_verify_step" not in metrics:
            metrics.update(roofline.tokens_per_step(gens))  # the roofline's and the floor's step (rows past EOS)
        # peak memory of loading and timing, read before the side measurements below: the floor row's graph pool
        # and an eager dequantizing profile step (torchao int8 on CUDA) would add their transients to it
        peak = measure.peak_memory_mb(self.device)
        if m.kernel_profile:  # which linear kernel really ran (tag kernel.linear), outside the timing
            first = self.batches[0]
            self._add(self.session.kernel_profile(first, self.opts_for(first), self.log_file))
            # the step against its floor row: linear layers' share and the rest (harness/measure/floor.py)
            self._add(floor.step_report(metrics))
            # the profiler's event tables stay in the C heap after they are freed (~150 MB on SmolLM2's default
            # run), under the accuracy pass that comes next: handed back, that pass peaks lower
            gc.collect()
            measure.trim_heap()
        self.end_decoding()
        metrics["peak_mem_mb"] = peak
        self.roofline(gens)  # after peak memory: the first bandwidth measurement allocates ~1 GB
        if metrics.get("decode_tokens_per_s_cv", 0.0) > m.cv_warn:
            self.tags["warning.spread"] = (f"decode tokens/s CV {metrics['decode_tokens_per_s_cv']:.1%} > "
                                           f"{m.cv_warn:.0%}: noisy machine? raise measure.repetitions")
            log.warning(self.tags["warning.spread"])

    def roofline(self, gens: list[Generation]) -> None:
        """Roofline metrics: bytes a decode step reads at the run's mean context vs the host's bandwidth."""
        depth = self.workload.depth
        flat = self.batches * self.exp.measure.repetitions  # generations are ordered repetition by repetition
        if self.exp.strategy.schedules_rows:
            # continuous batching: step_s pools every request's gaps, so each request is its own row, with its
            # own prompt and steps (sequences come back in request order, the batch's)
            widths = [(depth + len(p), max(len(s) - 1, 0)) for b, g in zip(flat, gens, strict=True)
                      for p, s in zip(b, g.sequences, strict=True)]
        else:  # a step loop: the batch's widest prompt (left padding) and its steps
            widths = [(depth + max(len(p) for p in b), len(g.step_s)) for b, g in zip(flat, gens, strict=True)]
        fast = getattr(self.session, "fast", None)  # the compiled path: one static cache length for the run
        if not self.exp.strategy.schedules_rows and (fast is not None or self.opts.cache == "static"):
            # a static cache is read whole every step (roofline.fixed_context): the compiled path's length (its
            # caches span the widest prompt of the run), else this call's depth + width + max_new_tokens
            lengths = [(fast.max_cache_len if fast is not None and not depth else
                        w + self.opts_for(b).max_new_tokens, n) for b, (w, n) in zip(flat, widths, strict=True)]
            context = roofline.fixed_context(lengths)
        else:
            context = roofline.mean_context(widths)
        # a step of more than one target forward (speculative), or one that emitted fewer tokens than the batch
        # (rows finished at EOS early; continuous batching's varying rows per forward): measured
        work = self.exp.strategy.roofline_step(gens) or roofline.measured_step(
            self.metrics, context, roofline.STEP_ACCOUNTING_CB if self.exp.strategy.schedules_rows else None)
        roofline.annotate(self.metrics, self.tags, self.session.shape(), self.device, self.threads, context,
                          roofline.run_group(self.exp, self.exp.engine.name), self.session.label, work)

    def samples(self, gens: list[Generation]) -> list[dict]:
        """The first repetition's generations, decoded (cut at EOS)."""
        tok, eos, out = self.tokenizer, self.tokenizer.eos_token_id, []
        for batch, gen in zip(self.batches, gens[: len(self.batches)], strict=True):
            for prompt, seq in zip(batch, gen.sequences, strict=True):
                cut = seq.index(eos) if eos in seq else len(seq)
                out.append({"prompt": tok.decode(prompt, skip_special_tokens=False),
                            "output": tok.decode(seq[:cut], skip_special_tokens=True), "tokens": seq})
        return out

    def accuracy(self) -> dict[str, float]:
        """Deterministic metrics on accuracy.corpus: perplexity, KL, top-1 agreement (when enabled).

        Decoding ends first (a strategy's setup may change the model, e.g. continuous batching's attention),
        so the greedy tokens are taken before it, for `greedy_tokens()`.
        """
        if self._decoding and self._greedy is None:
            self._greedy = self._greedy_pass()
        self.end_decoding()
        if not self.exp.accuracy.enabled:
            return {}
        return dict(self.session.score(self.tokenizer))

    def end_decoding(self) -> None:
        """Decoding is over: the engine frees what the strategy set up (the model stays for scoring)."""
        self._decoding = False
        self.session.end_decoding()

    def greedy_tokens(self) -> list[list[int]]:
        """The greedy output of every prompt batch, row by row (injected test slowdowns off: same tokens)."""
        if self._greedy is None:
            self._greedy = self._greedy_pass()
        return self._greedy

    def tasks(self) -> None:
        """Task accuracy with lm-eval on the loaded model (the quantized model is not reloaded)."""
        if self.task_plan is None:
            return
        with third_party_output(self.log_file):
            lm = self.session.task_lm(self.tokenizer)
            task_metrics, task_tags = task_accuracy.score(lm, self.task_plan, self.exp.accuracy)
        self.metrics.update(task_metrics)
        self.tags.update(task_tags)

    def unmetered(self) -> contextlib.AbstractContextManager:
        """`DecodeOptions.unmetered`: a strategy's work beside what it measures (speculative's greedy reference)
        pauses the energy meter of the timed repetitions; elsewhere (warm-up, the gate's blocks) no meter runs."""
        return self._meter.paused() if self._meter is not None else contextlib.nullcontext()

    def info(self) -> dict[str, Any]:
        """Who measured what: run name, device, threads, torch version, engine, config."""
        import torch  # heavy: see load()

        return {"run_name": run_name(self.exp, self.exp.config), "device": self.device, "threads": self.threads,
                "torch": torch.__version__, "engine": self.exp.engine.name, "config": self.exp.config}

    def close(self) -> None:
        """Free the model and whatever the engine holds."""
        if self.session is not None:
            self.session.close()
            self.session = None
        gc.collect()

    def run(self) -> Outcome:
        """The whole `python run.py` measurement (module docstring)."""
        self.phase = "preflight"
        self.preflight()
        try:
            self.phase = "loading"
            self.load()
            self.phase = "the timed repetitions"
            gens = self.timed()
            self.phase = "the summaries"
            self.summaries(gens)
            samples = self.samples(gens)
            self.phase = "the accuracy pass"
            self.metrics.update(self.accuracy())
            self.phase = "task accuracy"
            self.tasks()
        finally:
            self.close()
        self.metrics.update(memory.metrics(self.estimate))  # mem_estimate_mb beside the measured peak_mem_mb
        return Outcome(metrics=self.metrics, tags=self.tags, samples=samples)

    # ------------------------------------------------------------------------------------------ helpers
    def _add(self, record: Record) -> None:
        metrics, tags = record
        self.metrics.update(metrics)
        self.tags.update(tags)

    def _greedy_pass(self) -> list[list[int]]:
        quiet = dataclasses.replace(self.opts, inject_slowdown=0.0, inject_work=0.0)
        opts_for = self.workload.opts_for(quiet)
        return [[int(t) for t in seq] for batch in self.batches
                for seq in self.session.generate(batch, opts_for(batch)).sequences]
