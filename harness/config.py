"""Typed configuration: the dataclass schemas Hydra validates against, and one `validate()`.

The top-level schema (`RunConfig`) and the fixed sections (measure, accuracy, tracking) are typed
dataclasses registered in Hydra's ConfigStore, so an unknown key or a wrong type fails at compose time.
The model, quantizer, strategy and engine groups hold different classes per option, so (as Hydra 1.3
recommends) they are typed `Any` here and validated by instantiating them: each option's YAML names a
plain class through `_target_`, and that class's `__post_init__` checks its own values.

`validate(cfg)` builds every piece (cheap: no model is loaded), collects all problems and raises one
`ConfigError` listing them, before anything expensive starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from harness import corpus
from harness.errors import ConfigError, QuantbenchError, one_of

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_MATCH = ("near_tie", "strict")  # how the compiled-vs-eager token check fails (harness/fast_path.py)
COMPILE_BACKENDS = ("inductor", "zentorch")  # torch.compile backend of the decode step (harness/fast_path.py)


def _positive(problems: list[str], name: str, value: int | float, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        problems.append(f"{name}={value!r} must be a number")
    elif value < 0 or (value == 0 and not allow_zero):
        problems.append(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


class _Validated:
    """Mixin: `__post_init__` runs `problems()` and raises them all at once."""

    _section = ""

    def problems(self) -> list[str]:  # pragma: no cover - overridden
        return []

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ConfigError(found)


@dataclass
class MeasureConfig(_Validated):
    """How speed is measured. Sized so the default experiment takes about a minute on 2 CPU cores."""

    warmup: int = 1  # discarded generations (first calls allocate, pick kernels, compile)
    repetitions: int = 3  # timed passes over the prompt set
    max_new_tokens: int = 64
    stop_at_eos: bool = False  # benchmarks compare fixed lengths; True stops at EOS (recorded)
    prompts: str = "default"  # a set (default, edit), a .txt/.jsonl file, or synthetic[:N] (harness/workloads.py)
    prompt_tokens: int = 0  # with prompts=synthetic: tokens per prompt (llama-bench's -p); else 0
    context_depth: int = 0  # tokens already in the KV cache before each prompt, prefilled untimed (llama-bench's -d)
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    threads: int = 0  # torch intra-op threads; 0 = all cores
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    cv_warn: float = 0.10  # warn when tokens/s coefficient of variation exceeds this
    cache: str = "dynamic"  # KV cache kind: dynamic | static
    compile: bool = False  # torch.compile the decode step
    compile_mode: str = "default"  # default | reduce-overhead (CUDA graphs on CUDA) | max-autotune[-no-cudagraphs]
    compile_freezing: bool = False  # inductor freezing: weights become constants (prepacked on CPU)
    compile_fallback: bool = False  # a quantizer that cannot compile runs eager (tag fast_path) instead of failing
    compile_match: str = "near_tie"  # strict: any compiled != eager token fails | near_tie: only non-tie ones do
    compile_backend: str = "inductor"  # inductor | zentorch (AMD's ZenDNN plugin: optimizes on AVX-512 CPUs only)
    compile_cpp_wrapper: bool = False  # inductor calls its kernels from generated C++ instead of Python
    compile_skip_guards: bool = False  # timed steps skip dynamo's guard checks (docs/fast_path.md says when it is safe)
    kernel_profile: bool = True  # after timing, profile a few decode steps: tag kernel.linear (harness/kernels.py)
    inject_slowdown: float = 0.0  # test-only: stretch each decode step by this fraction (gate power tests)
    inject_work: float = 0.0  # test-only: extra real matrix work per decode step, ~this fraction of a step

    _section = "measure"

    def problems(self) -> list[str]:
        p: list[str] = []
        _positive(p, "measure.warmup", self.warmup, allow_zero=True)
        _positive(p, "measure.repetitions", self.repetitions)
        _positive(p, "measure.max_new_tokens", self.max_new_tokens)
        _positive(p, "measure.threads", self.threads, allow_zero=True)
        _positive(p, "measure.inject_slowdown", self.inject_slowdown, allow_zero=True)
        _positive(p, "measure.inject_work", self.inject_work, allow_zero=True)
        for err in (one_of("measure.device", self.device, DEVICES),
                    one_of("measure.cache", self.cache, ("dynamic", "static"))):
            if err:
                p.append(err)
        if (err := one_of("measure.compile_mode", self.compile_mode, COMPILE_MODES)):
            p.append(err)
        if (err := one_of("measure.compile_match", self.compile_match, COMPILE_MATCH)):
            p.append(err)
        if (err := one_of("measure.compile_backend", self.compile_backend, COMPILE_BACKENDS)):
            p.append(err)
        if self.compile and self.cache != "static":
            p.append("measure.compile=true needs fixed decode shapes: add measure.cache=static")
        _positive(p, "measure.prompt_tokens", self.prompt_tokens, allow_zero=True)
        _positive(p, "measure.context_depth", self.context_depth, allow_zero=True)
        from harness.workloads import source_problems

        p.extend(source_problems(self))  # a missing/empty prompt file, a bad JSONL line (with its number)
        return p


@dataclass
class AccuracyConfig(_Validated):
    """Perplexity and agreement with the unquantized reference, on one corpus."""

    enabled: bool = True
    corpus: str = "builtin"  # builtin | a local text file | an HF datasets id "name[:config[:split]]"
    context_length: int = 512
    stride: int = 512  # < context_length: overlapping windows, each token scored once
    max_tokens: int = 4096  # score at most this many corpus tokens (0 = all)
    reference_dtype: str = "float32"
    kl: bool = True  # KL divergence and top-1 agreement against the reference
    # reference record (harness/accuracy.py): "exact" stores the output layer's input per token and gives the
    # full-vocabulary KL; "topk" stores the top-k log-probs (+ one tail bucket): a lower bound, with a bound
    # on what it hides. exact falls back to topk (with a warning) for logits that are not a plain Linear.
    kl_reference: str = "exact"
    kl_top_k: int = 256  # k of the topk record
    # which tokens of a window are scored: "all" (each token once, the transformers recipe) or
    # "second_half" (llama-perplexity's rule: non-overlapping chunks, only the second half of each)
    scoring: str = "all"
    # task accuracy (harness/task_accuracy.py): BIG-bench multiple-choice tasks scored through lm-eval on the run's
    # model, paired with the reference; [default] = harness.tasks.DEFAULT_TASKS; empty = no task pass
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None  # examples per task: a seeded subset of this many (null = every example)
    num_fewshot: int = 0  # solved examples of the same task before each question
    task_seed: int = 0  # seeds the subset and the few-shot draws
    task_batch_size: int = 8  # requests per forward pass (lm-eval's batch_size)

    _section = "accuracy"

    def problems(self) -> list[str]:
        p: list[str] = []
        _positive(p, "accuracy.context_length", self.context_length)
        _positive(p, "accuracy.stride", self.stride)
        _positive(p, "accuracy.max_tokens", self.max_tokens, allow_zero=True)
        _positive(p, "accuracy.kl_top_k", self.kl_top_k)
        if isinstance(self.stride, int) and isinstance(self.context_length, int) and self.stride > self.context_length:
            p.append(f"accuracy.stride={self.stride} must be <= accuracy.context_length={self.context_length}")
        if (err := one_of("accuracy.reference_dtype", self.reference_dtype, DTYPES)):
            p.append(err)
        if (err := one_of("accuracy.kl_reference", self.kl_reference, ("exact", "topk"))):
            p.append(err)
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
        timing (harness/corpus.py). Not in `problems()`: it may ask the network."""
        if self.enabled:
            corpus.check(str(self.corpus), "accuracy.corpus")

    def _task_problems(self) -> list[str]:
        p: list[str] = []
        if self.task_limit is not None and (not isinstance(self.task_limit, int) or self.task_limit <= 0):
            p.append(f"accuracy.task_limit={self.task_limit!r} must be > 0 (or null: every example)")
        _positive(p, "accuracy.num_fewshot", self.num_fewshot, allow_zero=True)
        _positive(p, "accuracy.task_batch_size", self.task_batch_size)
        if self.enabled and self.tasks:  # the task files' index, read now: not after the model loads
            from harness import task_accuracy, tasks

            if not task_accuracy.installed():
                p.append(task_accuracy.INSTALL_HINT)
            p.extend(tasks.problems(list(self.tasks)))
        return p


# accuracy settings that only the task pass reads (the KL reference record is not keyed by them)
TASK_FIELDS = ("tasks", "task_limit", "num_fewshot", "task_seed", "task_batch_size")


@dataclass
class TrackingConfig(_Validated):
    """Where results go: a JSON per run (always) and MLflow (unless disabled)."""

    enabled: bool = True
    uri: str = ""  # empty = sqlite store under results/ ; any MLflow URI otherwise
    experiment: str = "quantbench"
    results_dir: str = "results"
    run_name: str = ""  # empty = derived from model/quantizer/strategy
    retries: int = 3  # bounded retries when the tracking server is down or the DB is locked
    timeout_s: float = 10.0

    _section = "tracking"

    def problems(self) -> list[str]:
        p: list[str] = []
        _positive(p, "tracking.retries", self.retries, allow_zero=True)
        _positive(p, "tracking.timeout_s", self.timeout_s)
        if not self.experiment:
            p.append("tracking.experiment must not be empty")
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
    name: str = ""  # experiment name (set by experiment overlays; names the sweep folder)
    sweep: Any = None  # sweep settings, used by harness.sweep (timeout, isolation)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (called by run.py and the tests)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(group="schema", name="measure", node=MeasureConfig)
    cs.store(group="schema", name="accuracy", node=AccuracyConfig)
    cs.store(group="schema", name="tracking", node=TrackingConfig)


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
    config: dict  # the resolved config as plain data (params, config hash, child processes)


# A `_target_` (from a YAML or an override) must name a class of these packages: config data never
# chooses arbitrary code to run (os.system, builtins.eval, subprocess.Popen, a look-alike package ...).
TARGET_PACKAGES = ("quantizers", "strategies", "harness")


def _module_parts(parts: list[str]) -> int | None:
    """How many leading `parts` name a module of our packages, found on disk without importing anything
    (a package's `__init__` or a module's top level may run code; `__main__` runs a CLI). None: not ours."""
    import importlib.util

    spec = importlib.util.find_spec(parts[0])  # a top-level name: located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    folder, n = Path(next(iter(spec.submodule_search_locations))), 1
    for part in parts[1:-1]:  # the last part is always the class (or an attribute of it)
        if (folder / part / "__init__.py").is_file():
            folder, n = folder / part, n + 1
        elif (folder / f"{part}.py").is_file():
            return n + 1
        else:
            break
    return n


def target_problem(where: str, target: Any) -> str | None:
    """Why `target` may not be instantiated (None when it names a class defined in TARGET_PACKAGES).

    The dotted path is checked before anything is imported: only public names (no `_x`, no `__main__`,
    whose import runs a command line), in an allowed package, down to an existing module file; then only
    that module is imported and the rest must lead to a class defined in the allowed packages.
    """
    import importlib
    import inspect

    rule = (f"{where}={target!r} is not allowed: a _target_ must name a class in this project's packages "
            f"({', '.join(p + '.' for p in TARGET_PACKAGES)})")
    parts = str(target).split(".") if isinstance(target, str) else []
    if (len(parts) < 2 or parts[0] not in TARGET_PACKAGES or not all(p.isidentifier() for p in parts)
            or any(p.startswith("_") for p in parts)):
        return rule
    n = _module_parts(parts)
    if n is None:
        return rule
    module = ".".join(parts[:n])
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:  # one of our modules imports something that is missing
        return f"{where}={target!r} could not be imported: {exc}"
    for name in parts[n:]:
        obj = getattr(obj, name, None)
    if not inspect.isclass(obj) or str(obj.__module__).split(".")[0] not in TARGET_PACKAGES:
        return rule  # a function, a module, or a class re-exported from elsewhere (harness.config.os.system)
    return None


def _target_problems(section: str, node: Any) -> list[str]:
    """Every `_target_` in `node`, nested ones too (a draft quantizer inside a strategy), checked."""
    if isinstance(node, dict):
        out = [p for p in [target_problem(f"{section}._target_", node["_target_"])] if p] if "_target_" in node else []
        for key, value in node.items():
            out += _target_problems(f"{section}.{key}", value)
        return out
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _target_problems(f"{section}[{i}]", v)]
    return []


def _instantiate(section: str, node: Any, problems: list[str]) -> Any:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if node is None or (isinstance(node, dict) and "_target_" not in node):
        problems.append(f"{section}: no option chosen; pick one with {section}=<option> (see conf/{section}/)")
        return None
    if (bad := _target_problems(section, node)):
        problems.extend(bad)
        return None
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as exc:  # unwrap to the class's own one-line message
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            problems.extend(cause.problems)
        elif isinstance(cause, TypeError) and "unexpected keyword argument" in str(cause):
            key = str(cause).rsplit("argument", 1)[-1].strip(" '")
            target = node.get("_target_", "?")
            allowed = _fields_of(target)
            problems.append(f"{section}.{key} is not a known key for {target.rsplit('.', 1)[-1]}; "
                            f"allowed: {', '.join(allowed)}")
        else:
            problems.append(f"{section}: {cause}")
    except ConfigError as exc:
        problems.extend(exc.problems)
    return None


def _fields_of(target: str) -> list[str]:
    import importlib

    if target_problem("_target_", target):  # never import what the allow-list refuses, not even for a message
        return []
    mod, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name)
        return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    except Exception:  # noqa: BLE001 - only used to enrich an error message
        return []


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


def build(cfg: DictConfig | dict) -> Experiment:
    """Instantiate and validate every section; raise one ConfigError listing all problems."""
    plain = to_plain(cfg)
    plain.pop("hydra", None)
    problems: list[str] = []
    for key in plain:
        if key not in {f.name for f in dataclasses.fields(RunConfig)}:
            problems.append(f"unknown top-level key {key!r}; allowed: "
                            + ", ".join(f.name for f in dataclasses.fields(RunConfig)))
    parts = {s: _instantiate(s, plain.get(s), problems) for s in ("model", "quantizer", "strategy", "engine")}
    measure = _section(MeasureConfig, plain.get("measure"), problems)
    accuracy = _section(AccuracyConfig, plain.get("accuracy"), problems)
    tracking = _section(TrackingConfig, plain.get("tracking"), problems)
    if not problems:
        for part in parts.values():  # cross-field checks that need more than one section
            check = getattr(part, "check_with", None)
            if check is not None:
                try:
                    check(parts=parts, measure=measure, accuracy=accuracy)
                except QuantbenchError as exc:
                    problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    return Experiment(measure=measure, accuracy=accuracy, tracking=tracking,
                      name=plain.get("name") or "", config=plain, **parts)


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose the project config in-process (tests, the gate, benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
