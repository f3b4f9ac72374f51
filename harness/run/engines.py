"""Engines: what executes an experiment. `transformers` (default) runs PyTorch models through quantbench's own
timed decode loop (the chosen strategy); other engines (llama.cpp: harness/run/llama_cpp.py) plug into the same
pipeline (harness/run/pipeline.py) through a `Session` (harness/run/hooks.py) and record the same metric names.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import measure, third_party_output
from harness.analysis import accuracy, roofline, task_accuracy
from harness.config import Experiment
from harness.measure import compile_diag, fast_path, floor, hugepages, kernels, memory, one_row, paths, workloads
from harness.measure.workloads import encode_prompts  # noqa: F401 - re-exported (benchmarks, tests)
from harness.run.hooks import Outcome, Record, Session
from quantizers import gpu_paths, rows8
from quantizers.base import audit_model
from strategies.decode import DepthContext

log = logging.getLogger("quantbench")
__all__ = ["Outcome", "TransformersEngine", "TransformersSession", "encode_prompts"]


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
        paths.settle(exp, device)  # measure.path / measure.gemv: the measured best path, or the one asked for
        hugepages.preflight(exp.measure.hugepages, device)  # measure.hugepages=on where it cannot be: refused here
        fast_path.preflight(exp, device)  # compile=true with a non-compilable quantizer fails here, before loading

    def memory_estimate(self, exp: Experiment, device: str) -> Any:
        """The peak this run needs, before anything loads (harness/measure/memory.py)."""
        return memory.transformers_estimate(exp, device)

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        """The decode settings against each other and the strategy (harness/measure/paths.py), then the workload
        against the model and strategy (harness/measure/workloads.py), at config time."""
        if measure is not None:
            paths.check(measure, parts.get("strategy"))
        if measure is not None and parts.get("model") is not None:
            workloads.check(parts["model"], measure, parts.get("strategy"))

    def open(self, exp: Experiment, device: str, threads: int) -> TransformersSession:
        """One run's state (harness/run/hooks.py); nothing loads until the pipeline asks."""
        return TransformersSession(exp, device, threads)


class TransformersSession(Session):
    """The transformers engine's hooks: the quantizer loads the model, the strategy decodes it."""

    def __init__(self, exp: Experiment, device: str, threads: int):
        self.exp, self.device, self.threads = exp, device, threads
        self.label = exp.quantizer.name
        self.model: Any = None
        self.tokenizer: Any = None
        self.reference: dict | None = None
        self.fast: fast_path.FastPath | None = None
        self.decoding = False

    def references(self, tokenizer: Any) -> Record:
        cfg = self.exp.accuracy
        if cfg.enabled:
            accuracy.scored_ids(tokenizer, cfg)  # a corpus with no token to score: refused now, not after the timing
        if not (cfg.enabled and cfg.kl):
            return {}, {}
        # before the run's model loads: the reference model is freed before peak memory is tracked
        self.reference, hit = accuracy.ensure_reference(self.exp.model, tokenizer, cfg, self.device)
        gc.collect()
        return ({"reference_perplexity": float(self.reference["perplexity"][0])},
                {"reference_cache": "hit" if hit else "miss", "reference.source": self.exp.model.reference_source()})

    def load(self, tokenizer: Any, workload: Any, log_file: Path) -> Record:
        exp, self.tokenizer = self.exp, tokenizer
        t0 = measure.now()
        with third_party_output(log_file):
            self.model = exp.quantizer.load(exp.model, tokenizer=tokenizer, device=self.device, experiment=exp)
        metrics = {"load_s": measure.now() - t0}
        self.model_config = self.model.config
        audit = exp.quantizer.audit(self.model)
        tags = {"kernel_path": audit.pop("kernel_path")}
        metrics.update(audit)
        metrics.update(getattr(exp.quantizer, "last_metrics", {}) or {})
        tags.update(getattr(exp.quantizer, "last_tags", {}) or {})
        if getattr(getattr(exp, "decode_choice", None), "gemv", "") == "rows8":  # quantizers/rows8.py
            tags["kernel.gemv_layers"] = str(rows8.install(self.model))  # int4 layers get new storages: first
            self.record_rows8(metrics, tags)
        moved = hugepages.move(self.model, exp.measure.hugepages, self.device)  # before compile and timing
        tags["weights.hugepages"] = moved.tag
        if moved.share is not None:
            metrics["weights_hugepage_share"] = moved.share
        return metrics, tags

    def record_rows8(self, metrics: dict, tags: dict) -> None:
        """What rows8.install left is what runs and what is held: its layer classes (kernel_path) and its bytes (a
        tied head keeps the embedding and gains a tiled copy). The bits/weight check stays the quantizer's, made
        before the swap, which keeps the quantizer's values bit for bit (quantizers/vnni.py)."""
        after = audit_model(self.model, getattr(memory.backend_of(self.exp.quantizer), "skip_modules", ("lm_head",)))
        metrics["weight_bytes"] = after["weight_bytes"]
        if after["kernel_path"] != tags["kernel_path"]:
            tags["kernel_path"] = after["kernel_path"]
            if "quantizer.storage" in tags:  # its kernel (e.g. _weight_int4pack_mm_for_cpu) no longer runs
                tags["quantizer.storage"] = (f"re-laid by measure.gemv=rows8 into {after['kernel_path']} (the "
                                             "quantizer's values and scales, bit for bit)")

    def prepare(self, opts: Any, workload: Any, batches: list, log_file: Path) -> Record:
        exp = self.exp
        if workload.context:  # measure.context_depth: prefilled untimed, reused across calls (strategies/decode.py)
            opts.context = DepthContext(workload.context)
        with third_party_output(log_file):  # a draft model loads here
            exp.strategy.setup(model=self.model, tokenizer=self.tokenizer, opts=opts, experiment=exp)
        self.decoding = True
        path = fast_path.preflight(exp, self.device)  # compiled | eager | eager-fallback
        tags = {"fast_path": path, **paths.settle(exp, self.device).tags()}
        breaks = compile_diag.graph_breaks()
        skips = compile_diag.CudagraphSkips()
        try:
            with skips:
                self.fast = fast_path.prepare(exp, self.model, opts, batches, path)  # compiles (untimed: compile_s)
        except Exception as exc:  # noqa: BLE001 - only where asked (measure.compile_fallback, on under auto on CUDA)
            if path != "compiled" or not exp.measure.compile_fallback or isinstance(exc, MemoryError) or \
                    type(exc).__name__ == "OutOfMemoryError":
                raise
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            log.warning("the compiled decode step failed (%s); decoding eager (measure.compile_fallback=true)", why)
            opts.fast_path, self.fast = None, None
            return {}, {**tags, "fast_path": "eager-fallback", "fast_path.error": why}
        if self.fast is not None:
            tags.update(compile_diag.graph_break_tags(breaks, compile_diag.graph_breaks()))
            if getattr(self.fast, "inductor", None):  # the quantizer's inductor flags this compile ran with
                tags["compile.inductor"] = gpu_paths.inductor_tag(self.fast.inductor)
            if self.fast.cudagraphs:  # reduce-overhead on CUDA: did every compiled graph become a CUDA graph?
                tags.update(skips.tags())
            tags["fast_path.attention"] = ("sdpa, packed GQA" if self.fast.packed_gqa
                                           else self.model.config._attn_implementation)
        return {}, tags

    def timing(self) -> contextlib.AbstractContextManager:
        return self.fast.timing() if self.fast else contextlib.nullcontext()  # a recompile here fails the run

    def generate(self, batch: list[list[int]], opts: Any) -> measure.Generation:
        return self.exp.strategy.generate(self.model, batch, opts)

    def after_timing(self, batches: list, opts_for: Callable[[list], Any], gens: list[measure.Generation]) -> Record:
        if not self.fast:
            return {}, {}
        m = self.exp.measure
        metrics = {"compile_s": self.fast.compile_s}
        metrics.update(fast_path.check_match(self.exp.strategy, self.model, batches, opts_for, gens, m.compile_match))
        return metrics, {"measure.compile_match": m.compile_match}

    def kernel_profile(self, batch: list[list[int]], opts: Any, log_file: Path) -> Record:
        with third_party_output(log_file):  # kineto prints USDT profiler_start/stop lines from C++
            tags, metrics = kernels.profile_linear(self.exp.strategy, self.model, batch, opts)
            # the floor row: the model's own linears once at one row, one CUDA graph on a GPU (harness/measure/floor.py)
            compiled = self.fast is not None and self.device.startswith("cuda") and \
                getattr(memory.backend_of(self.exp.quantizer), "eager_dequantizes", False)
            fl_metrics, fl_tags = floor.linear_floor(self.model, self.model.dtype, self.device, opts.gemv_aten,
                                                     inductor=getattr(self.fast, "inductor", {}) if compiled else None)
            metrics.update(fl_metrics)
            tags.update(fl_tags)
            cpu_wall = fl_metrics.get("linear_floor_ms") if self.device.startswith("cpu") else None  # one pass on CPU
            # the kernel's own streaming rate: every weight matrix once at one row (harness/measure/one_row.py)
            try:  # a side measurement, as the floor is: it never fails a run whose speed is already measured
                metrics.update(one_row.stream_rate(self.model, self.model.dtype, self.device, opts.gemv_aten,
                                                   wall_ms=cpu_wall))
            except Exception as exc:  # noqa: BLE001
                tags["kernel.stream"] = f"failed: {floor.first_line(exc)}"
        return metrics, tags

    def end_decoding(self) -> None:
        if self.decoding:
            self.decoding = False
            self.exp.strategy.teardown()

    def shape(self) -> roofline.ModelShape:
        return roofline.shape_from_torch(self.model)

    def score(self, tokenizer: Any) -> dict[str, float]:
        cfg = self.exp.accuracy
        ids = accuracy.corpus_tokens(tokenizer, cfg.corpus, cfg.max_tokens)
        scores = accuracy.score(self.model, ids, cfg, self.device, reference=self.reference, progress=True)
        return {k: v for k, v in scores.items() if k != "record"}

    def task_lm(self, tokenizer: Any) -> Any:
        return task_accuracy.hf_lm(self.model, tokenizer, self.exp.accuracy.task_batch_size)

    def close(self) -> None:
        try:
            self.end_decoding()
        finally:
            self.model = self.fast = self.reference = None
            gc.collect()
