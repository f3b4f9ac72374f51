"""Typed configuration: the dataclass schemas Hydra validates against, and one `validate()`.

The top-level schema (`RunConfig`) and the fixed sections (measure, accuracy, tracking) are typed
dataclasses registered in Hydra's ConfigStore, so an unknown key or a wrong type fails at compose time.
The model, quantizer, strategy and engine groups hold different classes per option, so (as Hydra 1.3
recommends) they are typed `Any` here and validated by instantiating them: each option's YAML names a
plain class through `_target_`, its node is checked against that class's fields (harness/options.py), and the
class's `__post_init__` checks its own values.

`build(cfg)` builds every piece (cheap: no model is loaded), collects all problems (each section's own, and what
the chosen pieces cannot do together) and raises one `ConfigError` listing them, before anything expensive starts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, OmegaConf

from harness import cgroup
from harness.analysis import corpus, task_accuracy, tasks
from harness.errors import ConfigError, QuantbenchError, one_of
from harness.load.config import LoadConfig, SloConfig, conflicts
from harness.measure.workloads import context_length, no_decode_problem, source_problems
from harness.options import CONF_DIR, instantiate_option, options
from harness.schema import (
    COMPILE_BACKENDS,
    COMPILE_MATCH,
    COMPILE_MODES,
    DECODE_PATHS,
    DEVICES,
    DTYPES,
    GEMV_KERNELS,
    HUGEPAGES,
    Validated,
    positive,
    store_uri,
    unchecked,
)
from harness.sweep import launchers
from harness.targets import TARGET_PACKAGES, target_problem

# names other modules import from here (the schema's constants live in harness/schema.py)
__all__ = ["COMPILE_BACKENDS", "COMPILE_MATCH", "COMPILE_MODES", "DEVICES", "DTYPES", "TARGET_PACKAGES",
           "AccuracyConfig", "Experiment", "MeasureConfig", "RunConfig", "TrackingConfig", "build", "compose",
           "register_configs", "target_problem", "to_plain"]


@dataclass
class MeasureConfig(Validated):
    """How speed is measured. Sized so the default experiment takes about a minute on 2 CPU cores."""

    warmup: int = 1  # discarded generations (first calls allocate, pick kernels, compile)
    repetitions: int = 3  # timed passes over the prompt set
    max_new_tokens: int = 64
    stop_at_eos: bool = False  # benchmarks compare fixed lengths; True stops at EOS (recorded)
    prompts: str = "default"  # a set (default, edit), a .txt/.jsonl file, or synthetic[:N] (harness/measure/workloads.py)
    prompt_tokens: int = 0  # with prompts=synthetic: tokens per prompt (llama-bench's -p); else 0
    context_depth: int = 0  # tokens already in the KV cache before each prompt, prefilled untimed (llama-bench's -d)
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    threads: int = 0  # torch intra-op threads; 0 = all cores
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    cv_warn: float = 0.10  # warn when tokens/s coefficient of variation exceeds this
    path: str = "best"  # decode path: best (measured table, harness/measure/paths.py) | eager | compiled | freezing
    gemv: str = "auto"  # one-row 16-bit matmuls on CPU: auto (measured table) | onednn | aten
    hugepages: str = "off"  # the weights on 2 MiB pages: off | auto (on where a Linux CPU run can) | on
    # auto (the default, harness/measure/paths.py `resolve_auto`): on CUDA static cache + torch.compile with CUDA
    # graphs (eager decode on a GPU measures Python launch, not bytes); on CPU dynamic + eager unless
    # measure.path=best picks the compiled path. An explicit value is honoured; tag measure.auto says what auto became.
    cache: str = "auto"  # KV cache kind: auto | dynamic | static
    compile: Any = "auto"  # torch.compile the decode step: auto | true | false
    compile_mode: str = "auto"  # auto (reduce-overhead on CUDA, default on CPU) | default | reduce-overhead | max-autotune[-no-cudagraphs]
    compile_freezing: bool = False  # inductor freezing: weights become constants (prepacked on CPU)
    compile_fallback: bool = False  # a quantizer that cannot compile runs eager (tag fast_path) instead of failing
    compile_match: str = "near_tie"  # strict: any compiled != eager token fails | near_tie: only non-tie ones do
    compile_backend: str = "inductor"  # inductor | zentorch (AMD's ZenDNN plugin: optimizes on AVX-512 CPUs only)
    compile_cpp_wrapper: bool = False  # inductor calls its kernels from generated C++ instead of Python
    compile_skip_guards: Any = "auto"  # timed steps skip dynamo's guard checks: auto (on where compiled) | true | false
    kernel_profile: bool = True  # after timing, profile a few decode steps: tag kernel.linear (harness/measure/kernels.py)
    inject_slowdown: float = 0.0  # test-only: stretch each decode step by this fraction (gate power tests)
    inject_work: float = 0.0  # test-only: extra real matrix work per decode step, ~this fraction of a step

    _section = "measure"

    def problems(self) -> list[str]:
        p: list[str] = []
        positive(p, "measure.warmup", self.warmup, allow_zero=True)
        positive(p, "measure.repetitions", self.repetitions)
        positive(p, "measure.max_new_tokens", self.max_new_tokens)
        positive(p, "measure.threads", self.threads, allow_zero=True)  # against the cores: build(), which knows where
        positive(p, "measure.cv_warn", self.cv_warn, allow_zero=True)
        positive(p, "measure.inject_slowdown", self.inject_slowdown, allow_zero=True)
        positive(p, "measure.inject_work", self.inject_work, allow_zero=True)
        for err in (one_of("measure.device", self.device, DEVICES),
                    one_of("measure.cache", self.cache, ("auto", "dynamic", "static"))):
            if err:
                p.append(err)
        for name in ("compile", "compile_skip_guards"):
            if not (isinstance(v := getattr(self, name), bool) or v == "auto"):  # 1 == True: no int passes
                p.append(f"measure.{name}={getattr(self, name)!r} is not allowed; choose one of: auto, true, false")
        p.extend(e for e in (one_of("measure.compile_mode", self.compile_mode, ("auto", *COMPILE_MODES)),
                             one_of("measure.compile_match", self.compile_match, COMPILE_MATCH),
                             one_of("measure.compile_backend", self.compile_backend, COMPILE_BACKENDS),
                             one_of("measure.path", self.path, DECODE_PATHS),
                             one_of("measure.gemv", self.gemv, GEMV_KERNELS),
                             one_of("measure.hugepages", self.hugepages, HUGEPAGES)) if e)
        if self.compile is True and self.cache == "dynamic":
            p.append("measure.compile=true needs fixed decode shapes: use measure.cache=static (or auto)")
        positive(p, "measure.prompt_tokens", self.prompt_tokens, allow_zero=True)
        positive(p, "measure.context_depth", self.context_depth, allow_zero=True)
        p.extend(source_problems(self))  # a missing/empty prompt file, a bad JSONL line (with its number)
        return p


# the KL runs on chunks of this many scored tokens in float64 (harness/analysis/accuracy.py; the memory estimate
# counts its temporaries: harness/measure/memory.py): 128 x 49152 x 8 B = 50 MB per temporary
KL_CHUNK_ROWS = 128


@dataclass
class AccuracyConfig(Validated):
    """Perplexity and agreement with the unquantized reference, on one corpus."""

    enabled: bool = True
    corpus: str = "builtin"  # builtin | a local text file | an HF datasets id "name[:config[:split]]"
    context_length: int = 512
    stride: int = 512  # < context_length: overlapping windows, each token scored once (= context: at most once)
    max_tokens: int = 4096  # score at most this many corpus tokens (0 = all)
    reference_dtype: str = "float32"
    kl: bool = True  # KL divergence and top-1 agreement against the reference
    # reference record (harness/analysis/accuracy.py): "exact" stores the output layer's input per token and gives the
    # full-vocabulary KL; "topk" stores the top-k log-probs (+ one tail bucket): a lower bound, with a bound
    # on what it hides. exact falls back to topk (with a warning) for logits that are not a plain Linear.
    kl_reference: str = "exact"
    kl_top_k: int = 256  # k of the topk record
    # which tokens of a window are scored: "all" (each token once, the transformers recipe) or
    # "second_half" (llama-perplexity's rule: non-overlapping chunks, only the second half of each)
    scoring: str = "all"
    # task accuracy (harness/analysis/task_accuracy.py): BIG-bench multiple-choice tasks scored through lm-eval on the run's
    # model, paired with the reference; [default] = harness.analysis.tasks.DEFAULT_TASKS; empty = no task pass
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None  # examples per task: a seeded subset of this many (null = every example)
    num_fewshot: int = 0  # solved examples of the same task before each question
    task_seed: int = 0  # seeds the subset and the few-shot draws
    task_batch_size: int = 8  # requests per forward pass (lm-eval's batch_size)

    _section = "accuracy"

    def problems(self) -> list[str]:
        p: list[str] = []
        positive(p, "accuracy.context_length", self.context_length)
        positive(p, "accuracy.stride", self.stride)
        positive(p, "accuracy.max_tokens", self.max_tokens, allow_zero=True)
        positive(p, "accuracy.kl_top_k", self.kl_top_k)
        if isinstance(self.stride, int) and isinstance(self.context_length, int) and self.stride > self.context_length:
            p.append(f"accuracy.stride={self.stride} must be <= accuracy.context_length={self.context_length}")
        p.extend(e for e in (one_of("accuracy.reference_dtype", self.reference_dtype, DTYPES),
                             one_of("accuracy.kl_reference", self.kl_reference, ("exact", "topk"))) if e)
        if (err := corpus.file_problem("accuracy.corpus", str(self.corpus))):  # not after the model loads
            p.append(err)
        p.extend(self._task_problems())
        if (err := one_of("accuracy.scoring", self.scoring, ("all", "second_half"))):
            p.append(err)
        elif self.scoring == "second_half" and self.stride != self.context_length:
            p.append("accuracy.scoring=second_half scores non-overlapping chunks: set accuracy.stride equal to "
                     "accuracy.context_length")
        return p

    def preflight(self) -> None:
        """A dataset id that is neither in the local cache nor on a reachable hub fails here, not after the
        timing (harness/analysis/corpus.py). Not in `problems()`: it may ask the network."""
        if self.enabled:
            corpus.check(str(self.corpus), "accuracy.corpus")

    def _task_problems(self) -> list[str]:
        p: list[str] = []
        if self.task_limit is not None and (not isinstance(self.task_limit, int) or self.task_limit <= 0):
            p.append(f"accuracy.task_limit={self.task_limit!r} must be > 0 (or null: every example)")
        positive(p, "accuracy.num_fewshot", self.num_fewshot, allow_zero=True)
        positive(p, "accuracy.task_batch_size", self.task_batch_size)
        if self.tasks and not self.enabled:  # the task pass is part of the accuracy pass: it was dropped silently
            p.append(f"accuracy.tasks=[{','.join(map(str, self.tasks))}] needs accuracy.enabled=true (or drop accuracy.tasks)")
        elif self.tasks:  # the task files' index, read now: not after the model loads
            if not task_accuracy.installed():
                p.append(task_accuracy.INSTALL_HINT)
            p.extend(bad := tasks.problems(list(self.tasks)))
            index = {} if bad else tasks.read_index()["tasks"]  # type: ignore[index]  # problems() found it
            n = {t: index[t]["examples"] for t in tasks.expand(self.tasks) if t in index}
            # lm-eval draws a question's shots from its task's other examples: too few failed mid-run, after the KL pass
            if n and isinstance(self.num_fewshot, int) and self.num_fewshot >= (k := min(n.values())):
                p.append(f"accuracy.num_fewshot={self.num_fewshot} is too many: task {min(n, key=n.__getitem__)} has "
                         f"{k} examples; give accuracy.num_fewshot < {k}")
        return p


# accuracy settings that only the task pass reads (the KL reference record is not keyed by them)
TASK_FIELDS = ("tasks", "task_limit", "num_fewshot", "task_seed", "task_batch_size")


@dataclass
class TrackingConfig(Validated):
    """Where results go: a JSON per run (always) and MLflow (unless disabled)."""

    enabled: bool = True
    uri: str = ""  # empty = sqlite store under results/ ; else sqlite:///, postgresql://, http(s):// ...
    experiment: str = "quantbench"
    results_dir: str = "results"
    run_name: str = ""  # empty = derived from model/quantizer/strategy
    retries: int = 3  # bounded retries when the tracking server is down or the DB is locked
    timeout_s: float = 10.0

    _section = "tracking"

    def problems(self) -> list[str]:
        p: list[str] = []
        positive(p, "tracking.retries", self.retries, allow_zero=True)
        positive(p, "tracking.timeout_s", self.timeout_s)
        if not self.experiment:
            p.append("tracking.experiment must not be empty")
        store_uri(p, "tracking.uri", self.uri, self.enabled)  # no password; with tracking on, a scheme MLflow opens
        return p

    def resolved_uri(self) -> str:
        if self.uri:
            return self.uri
        return "sqlite:///" + os.path.abspath(os.path.join(self.results_dir, "mlflow.db"))


@dataclass
class RunConfig:
    """Top-level schema. Group fields are `Any`: each option is its own class (see module docstring)."""

    model: Any = MISSING
    quantizer: Any = MISSING
    strategy: Any = MISSING
    engine: Any = MISSING
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    load: LoadConfig = field(default_factory=LoadConfig)  # serving load (harness/load/); off by default
    name: str = ""  # experiment name (set by experiment overlays; names the sweep folder)
    sweep: Any = None  # sweep settings, used by harness.sweep (timeout, isolation)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (called by run.py and the tests)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(group="schema", name="measure", node=MeasureConfig)
    cs.store(group="schema", name="accuracy", node=AccuracyConfig)
    cs.store(group="schema", name="tracking", node=TrackingConfig)
    cs.store(group="schema", name="load", node=LoadConfig)
    cs.store(group="schema", name="slo", node=SloConfig)
    launchers.register(cs)  # hydra/launcher=local's schema


@dataclass
class Experiment:
    """Every piece of one run, built and validated, with nothing loaded yet."""

    model: Any
    quantizer: Any
    strategy: Any
    engine: Any
    measure: MeasureConfig
    accuracy: AccuracyConfig
    tracking: TrackingConfig
    name: str
    config: dict
    load: LoadConfig = field(default_factory=LoadConfig)  # the resolved config as plain data (params, config hash, child processes)


def _section(cls: type, node: Any, problems: list[str]) -> Any:
    try:
        return cls(**(node or {}))
    except ConfigError as exc:
        problems.extend(exc.problems)
    except TypeError as exc:
        allowed = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        unknown = [k for k in (node or {}) if k not in allowed]
        problems.append(f"{cls._section}.{unknown[0]} is not a known key; allowed: {', '.join(allowed)}" if unknown
                        else f"{cls._section}: {exc}")
    return None


def to_plain(cfg: DictConfig | dict) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]
    return dict(cfg)


def cores_problem(threads: Any, cores: int | None) -> str | None:
    """measure.threads beyond the cores the run will have (`cores`: None = this process's, 0 = unknown)."""
    where = "this process may use" if cores is None else "each cell gets (hydra.launcher.cpus_per_task)"
    cores = cgroup.usable_cpus() if cores is None else cores  # the default threads' count: affinity, CPU quota
    if cores and isinstance(threads, int) and not isinstance(threads, bool) and threads > cores:
        return (f"measure.threads={threads} is more than the {cores} cores {where} (threads beyond them only wait "
                f"for a core and slow every step); give 1-{cores}, or 0 for all")
    return None


def context_check(model: Any, accuracy: Any) -> None:
    """accuracy.context_length within the model's positions (windows past them score garbage, silently)."""
    ctx = context_length(model) if accuracy.enabled and model is not None else None
    if ctx and accuracy.context_length > ctx:
        raise QuantbenchError(f"accuracy.context_length={accuracy.context_length} is beyond the model's context of "
                              f"{ctx} positions; give accuracy.context_length <= {ctx}")


def cross_problems(parts: dict, measure: Any, accuracy: Any, checked: bool) -> list[str]:
    """What the pieces cannot do together (each part's `check_with`, the model's context). They run when every
    part is built, even when a section has problems of its own (`checked` False: `measure`/`accuracy` are then
    unchecked copies), so one run reports every problem; a check that trips over a bad value adds nothing then:
    that value is reported already."""
    built = all(part is not None for part in parts.values())  # a check missing a part would blame the wrong thing
    checks = [functools.partial(part.check_with, parts=parts, measure=measure, accuracy=accuracy)
              for part in parts.values() if built and getattr(part, "check_with", None) is not None]
    problems: list[str] = []
    for check in [*checks, functools.partial(context_check, parts["model"], accuracy)]:
        try:
            check()
        except ConfigError as exc:
            problems.extend(exc.problems)
        except QuantbenchError as exc:
            problems.append(str(exc))
        except Exception:  # noqa: BLE001 - only over a section with problems of its own, reported already
            if checked:
                raise
    return problems


def build(cfg: DictConfig | dict, cores: int | None = None) -> Experiment:
    """Instantiate and validate every section; raise one ConfigError listing all problems.

    `cores`: the cores the run will have (measure.threads may not exceed them); None = this process's, 0 =
    unknown (a cell that a remote launcher starts on another node checks them there)."""
    plain = to_plain(cfg)
    plain.pop("hydra", None)
    problems: list[str] = []
    for key in plain:
        if key not in {f.name for f in dataclasses.fields(RunConfig)}:
            problems.append(f"unknown top-level key {key!r}; allowed: "
                            + ", ".join(f.name for f in dataclasses.fields(RunConfig)))
    parts = {s: instantiate_option(s, plain.get(s), problems) for s in ("model", "quantizer", "strategy", "engine")}
    own: list[str] = []  # the sections' own problems, listed after what the chosen pieces cannot do together
    measure = _section(MeasureConfig, plain.get("measure"), own)
    accuracy = _section(AccuracyConfig, plain.get("accuracy"), own)
    tracking = _section(TrackingConfig, plain.get("tracking"), own)
    load = _section(LoadConfig, plain.get("load"), own)
    if measure is not None and (err := cores_problem(measure.threads, cores)):
        own.append(err)
    checked = measure is not None and accuracy is not None
    # model=random measure.prompts=default: "text prompts need a real model" first, then the
    # measure.prompt_tokens model=random set, which the prompts make wrong
    problems += cross_problems(parts, measure or unchecked(MeasureConfig, plain.get("measure")),
                               accuracy or unchecked(AccuracyConfig, plain.get("accuracy")), checked)
    problems += conflicts(load, parts, measure) + own  # settings a load run would not read (harness/load/)
    problems += [p for p in [measure is not None and no_decode_problem(measure, load)] if p]  # refused, not FAILED
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # a bad value a cross-check trips over too: said once
    return Experiment(measure=measure, accuracy=accuracy, tracking=tracking, load=load,
                      name=plain.get("name") or "", config=plain, **parts)


CHOICE_GROUPS = ("model", "quantizer", "strategy", "engine", "experiment", "workload", "size", "format", "gpu_format")


def group_choice_problem(argv: list[str]) -> str | None:
    """An unknown `group=option` in one line, before Hydra prints a multi-line error (no compose: milliseconds).

    run.py calls it on its command line; the gate on each side's overrides (harness/gate/)."""
    for arg in argv:
        if "=" not in arg or arg.startswith("hydra"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in CHOICE_GROUPS or value.startswith(("choice(", "range(", "glob(")):
            continue
        allowed = options(key)
        for choice in value.split(","):
            if choice and choice not in allowed:
                return f"{key}={choice!r} is not an option; choose one of: {', '.join(allowed)}"
    return None


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the project config in-process (tests, the gate, benchmarks)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
