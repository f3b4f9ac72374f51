"""Engines: what executes an experiment. `transformers` (default) runs PyTorch models through
quantbench's own timed decode loop; other engines (e.g. llama.cpp) plug in with the same `execute()`
contract and return the same metric names.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import Any

from harness import measure, run_log, third_party_output
from harness.config import Experiment
from harness.energy import EnergyMeter
from harness.workloads import encode_prompts  # noqa: F401 - re-exported (gate, benchmarks, tests)

log = logging.getLogger("quantbench")


@dataclass
class Outcome:
    """What an engine measured: metrics, tags and sample generations."""

    metrics: dict
    tags: dict
    samples: list[dict]


@dataclass
class TransformersEngine:
    """Load (+quantize) with transformers, decode with the chosen strategy, score accuracy."""

    @property
    def name(self) -> str:
        return "transformers"

    def preflight(self, exp: Experiment, device: str) -> None:
        exp.model.preflight()
        exp.quantizer.preflight(device)
        exp.strategy.preflight()
        from harness import fast_path

        fast_path.preflight(exp, device)  # compile=true with a non-compilable quantizer fails here, before loading

    def memory_estimate(self, exp: Experiment, device: str) -> Any:
        """The peak this run needs, before anything loads (harness/memory.py)."""
        from harness import memory

        return memory.transformers_estimate(exp, device)

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        """The workload against the model and strategy (harness/workloads.py), at config time."""
        from harness import workloads

        if measure is not None and parts.get("model") is not None:
            workloads.check(parts["model"], measure, parts.get("strategy"))

    def execute(self, exp: Experiment, device: str) -> Outcome:
        from harness import accuracy as acc
        from harness.models import load_tokenizer
        from strategies.base import DecodeOptions

        m, metrics, tags = exp.measure, {}, {}
        tokenizer = load_tokenizer(exp.model)
        from harness import workloads

        wl = workloads.resolve(m, tokenizer)  # measure.prompts as ids; exact lengths checked before any weights load
        workloads.check_resolved(wl, exp.model)
        reference = None
        if exp.accuracy.enabled and exp.accuracy.kl:
            # before the run's model loads: the reference model is freed before peak memory is tracked
            reference, hit = acc.ensure_reference(exp.model, tokenizer, exp.accuracy, device)
            tags["reference_cache"] = "hit" if hit else "miss"
            metrics["reference_perplexity"] = float(reference["perplexity"][0])
            gc.collect()
        task_plan = None
        if exp.accuracy.enabled and exp.accuracy.tasks:  # the reference's task answers, cached (task_accuracy.py)
            from harness import task_accuracy

            with third_party_output(run_log(exp.tracking.results_dir)):
                task_plan = task_accuracy.prepare(exp.model, tokenizer, exp.accuracy, device)
            gc.collect()

        tags["peak_mem_reset"] = str(measure.reset_peak_memory(device))
        log_file = run_log(exp.tracking.results_dir)  # what libraries print while loading goes here, not to stdout
        t0 = measure.now()
        with third_party_output(log_file):
            model = exp.quantizer.load(exp.model, tokenizer=tokenizer, device=device, experiment=exp)
        metrics["load_s"] = measure.now() - t0
        audit = exp.quantizer.audit(model)
        tags["kernel_path"] = audit.pop("kernel_path")
        metrics.update(audit)
        metrics.update(getattr(exp.quantizer, "last_metrics", {}) or {})
        tags.update(getattr(exp.quantizer, "last_tags", {}) or {})

        opts = DecodeOptions(device=device, max_new_tokens=wl.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, stop_at_eos=m.stop_at_eos,
                             inject_slowdown=m.inject_slowdown, inject_work=m.inject_work, cache=m.cache)
        if wl.context:  # measure.context_depth: prefilled untimed, reused across calls (strategies/decode.py)
            from strategies.decode import DepthContext

            opts.context = DepthContext(wl.context)
        with third_party_output(log_file):  # a draft model loads here
            exp.strategy.setup(model=model, tokenizer=tokenizer, opts=opts, experiment=exp)
        if log_file.exists():
            tags["log_file"] = str(log_file)
        try:
            prompts = wl.prompts
            batches = exp.strategy.batches(prompts)
            from harness import fast_path

            path = fast_path.preflight(exp, device)  # compiled | eager | eager-fallback
            tags["fast_path"] = path
            fast = fast_path.prepare(exp, model, opts, batches, path)  # compiles (untimed: metric compile_s)
            if fast is not None:
                tags["fast_path.attention"] = "sdpa, packed GQA" if fast.packed_gqa else model.config._attn_implementation
            opts_for = wl.opts_for(opts)  # per-prompt max_new_tokens (JSONL): a batch decodes its longest
            for _ in range(m.warmup):
                for batch in batches:
                    exp.strategy.generate(model, batch, opts_for(batch))
            gens = []
            meter = EnergyMeter(device)  # NVML on CUDA, RAPL on CPU where readable (harness/energy.py)
            meter.start()
            with fast.timing() if fast else contextlib.nullcontext():  # a recompile here fails the run
                for _ in range(m.repetitions):
                    for batch in batches:
                        gens.append(exp.strategy.generate(model, batch, opts_for(batch)))
            joules = meter.stop()
            if fast:
                metrics["compile_s"] = fast.compile_s
                metrics.update(fast_path.check_match(exp.strategy, model, batches, opts, gens, m.compile_match))
                tags["measure.compile_match"] = m.compile_match
            metrics.update(measure.summarize(gens))
            meter.record(joules, metrics["generated_tokens"], metrics, tags)
            metrics.update(workloads.metrics(wl, gens, model.config, metrics.get("params")))
            tags.update(workloads.record(wl))
            metrics.update(exp.strategy.metrics(gens))
            metrics.update(getattr(exp.strategy, "last_metrics", {}) or {})
            if m.kernel_profile:  # which linear kernel really ran (tag kernel.linear), outside the timing
                from harness import kernels

                with third_party_output(log_file):  # kineto prints USDT profiler_start/stop lines from C++
                    ktags, kmetrics = kernels.profile_linear(exp.strategy, model, batches[0], opts_for(batches[0]))
                tags.update(ktags)
                metrics.update(kmetrics)
        finally:
            exp.strategy.teardown()
        metrics["peak_mem_mb"] = measure.peak_memory_mb(device)
        from harness import roofline  # after peak memory: the first bandwidth measurement allocates ~1 GB

        roofline.annotate_torch_run(metrics, tags, exp, model, batches, gens, device)
        if metrics.get("decode_tokens_per_s_cv", 0.0) > m.cv_warn:
            tags["warning.spread"] = (f"decode tokens/s CV {metrics['decode_tokens_per_s_cv']:.1%} > "
                                      f"{m.cv_warn:.0%}: noisy machine? raise measure.repetitions")
            log.warning(tags["warning.spread"])

        samples = []
        for batch, gen in zip(batches, gens[: len(batches)], strict=True):
            for prompt, seq in zip(batch, gen.sequences, strict=True):
                cut = seq.index(opts.eos_token_id) if opts.eos_token_id in seq else len(seq)
                samples.append({"prompt": tokenizer.decode(prompt, skip_special_tokens=False),
                                "output": tokenizer.decode(seq[:cut], skip_special_tokens=True),
                                "tokens": seq})

        if exp.accuracy.enabled:
            ids = acc.corpus_tokens(tokenizer, exp.accuracy.corpus, exp.accuracy.max_tokens)
            scores = acc.score(model, ids, exp.accuracy, device, reference=reference, progress=True)
            metrics.update({k: v for k, v in scores.items() if k != "record"})
        if task_plan is not None:  # lm-eval on this model object: the quantized model is not reloaded
            with third_party_output(log_file):
                lm = task_accuracy.hf_lm(model, tokenizer, exp.accuracy.task_batch_size)
                task_metrics, task_tags = task_accuracy.score(lm, task_plan, exp.accuracy)
            metrics.update(task_metrics)
            tags.update(task_tags)
        del model
        gc.collect()
        return Outcome(metrics=metrics, tags=tags, samples=samples)
