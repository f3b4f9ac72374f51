"""What run.py does with a composed config (kept out of run.py so tests can call it in-process).

`precheck(argv)` is run.py's gate before Hydra starts: it composes the config of every run the command
line asks for (each cell of a multirun sweep too) and validates it, so every bad input ends in one line
and exit 2 before any model loads, instead of Hydra's multi-line report (exit 1) or a FAILED run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    GrammarParseError,
    InterpolationResolutionError,
    ValidationError,
)

from harness.config import Experiment, build, register_configs
from harness.errors import ConfigError, QuantbenchError, Unsupported
from harness.interrupts import sigterm_interrupts
from harness.measure import memory
from harness.options import CONF_DIR as CONF
from harness.options import KINDS, unknown_key
from harness.records import tracking
from harness.records.results import DEFAULT_BASELINE, summary_line
from harness.run import runner
from harness.sweep.launchers import LOCAL_LAUNCHERS, launcher_name, time_limit_problem
from harness.sweep.settings import SweepSettings, planned_cells, settings_from

HYDRA_RUN_FLAGS = ("-m", "--multirun")  # other Hydra flags (--help, --cfg, --info, -c ...) skip the precheck
GROUPS = ("model", "quantizer", "strategy", "engine")
JOB_NAME = "run"  # hydra.job.name of run.py's jobs (Hydra names a job after its script)


def _compose(overrides: list[str], hydra: bool = False) -> DictConfig:
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name=JOB_NAME):
            return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)
    finally:
        GlobalHydra.instance().clear()


def compose_problem(exc: BaseException, overrides: list[str]) -> str:
    """One line for a Hydra/OmegaConf composition error: the key, and what it allows."""
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None)
    schema = getattr(cause, "object_type", None)
    fields = {f.name: str(f.type) for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    allowed = ", ".join(f for f in fields if not f.startswith("_"))
    value = next((o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+~") == key), None)
    if key and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        section = str(key).split(".")[0]
        if not allowed and section in GROUPS:  # an option's own keys: those of the class it names
            rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
            try:
                parent, name = str(key).rsplit(".", 1)
                node = _compose(rest)
                for part in parent.split("."):  # strategy.draft_quantizer.x: the nested option's class
                    node = node[part]
                return unknown_key(parent, name, node["_target_"], value)
            except Exception:  # noqa: BLE001 - only enriches the message
                pass
        if section == "sweep":  # an untyped section in the schema: its keys are SweepSettings'
            allowed = ", ".join(f for f in SweepSettings.__dataclass_fields__ if not f.startswith("_"))
        return f"{key} is not a known key" + (f"; allowed: {allowed}" if allowed else "")
    name = str(key).rsplit(".", 1)[-1]
    if key and isinstance(cause, ValidationError) and name in fields and fields[name] in KINDS:
        return f"{key}={value!r} must be {KINDS[fields[name]]}"
    first = (getattr(cause, "msg", None) or str(cause) or type(cause).__name__).splitlines()[0]
    return f"{key}: {first}" if key else " ".join(str(exc).split()) or first


def precheck(argv: list[str]) -> str | None:
    """Compose and validate every run `argv` asks for (no model loads); the first problem as one line."""
    if any(a.startswith("-") and a not in HYDRA_RUN_FLAGS for a in argv):
        return None  # Hydra's own flags: let Hydra answer
    overrides = [a for a in argv if not a.startswith("-")]
    parser = OverridesParser.create()
    parsed = []
    for o in overrides:
        try:
            parsed += parser.parse_overrides([o])
        except OverrideParseException as exc:
            return (f"could not parse the override {o!r} ({str(exc).splitlines()[0]}); write key=value, see "
                    "https://hydra.cc/docs/advanced/override_grammar/basic/")
    sweeps = [o for o, p in zip(overrides, parsed, strict=True) if p.is_sweep_override()]
    base = [o for o, p in zip(overrides, parsed, strict=True) if not p.is_sweep_override()]
    try:
        cfg = _compose(base, hydra=True)
    except Exception as exc:  # noqa: BLE001 - every composition error becomes one line
        if not sweeps:
            return compose_problem(exc, base)
        # a key of a swept group's options (quantizer=rtn_int4,gptq_int4 ++quantizer.calibration_samples=2) needs
        # one of the swept choices to compose: take each sweep's first value; every cell is validated below
        firsts = [f"{p.get_key_element()}={next(iter(p.sweep_string_iterator()))}" for p in parsed
                  if p.is_sweep_override()]
        try:
            cfg = _compose(base + firsts, hydra=True)
        except Exception:  # noqa: BLE001
            return compose_problem(exc, base)
        if (plain := not_in_base(exc, base)):  # a swept option's key, but written without ++: Hydra would fail
            return plain
    multirun = any(a in HYDRA_RUN_FLAGS for a in argv) or str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    out = "sweep" if multirun else "run"
    if (problem := output_dir_problem(f"hydra.{out}.dir", OmegaConf.to_container(cfg.hydra[out])["dir"])):
        return problem
    if sweeps and not multirun:
        return (f"{sweeps[0]!r} lists several values: add -m (--multirun) to sweep them, or write key=[a,b] for a "
                "list value")
    cells, planned = [overrides], None
    if multirun:
        cfg.hydra.overrides.task = overrides
        planned = planned_cells(cfg.hydra)
        cells = planned or [base]  # another sweeper: validate what composes without it
    cores = launcher_cores(cfg.hydra.launcher) if multirun else None
    built: list[Experiment] = []
    fixed = {o.split("=", 1)[0].lstrip("+~") for o in base}
    for num, cell in enumerate(cells):
        if (problem := validate(cell, cores, built, num if multirun else None)):
            # what the cell sets beyond the command line's fixed overrides, by key (Hydra hands those back re-escaped:
            # tracking.uri=sqlite\:///... is the command line's sqlite:///..., not a value of the cell's own)
            label = ",".join(o for o in cell if o.split("=", 1)[0].lstrip("+~") not in fixed) or "default"
            return f"sweep cell {label}: {problem}" if len(cells) > 1 else problem
    # a load setting no cell reads (harness/load/config.py unread): judged over the whole sweep, where a sweep over
    # load.arrival=poisson,gamma reads load.burstiness in one cell
    unread = [exp.load.unread() for exp in built]
    if unread and (common := [k for k in unread[0] if all(k in u for u in unread)]):
        return unread[0][common[0]] + (" (in every cell of this sweep)" if len(unread) > 1 else "")
    try:  # the base config's settings (each cell's were checked above), in a single run too
        with as_job(cfg, 0 if multirun else None) as task:
            settings = sweep_settings(task)
    except QuantbenchError as exc:
        return str(exc)
    # a baseline typed on this command line; an experiment's own (auto16, bf16) stays valid when the command narrows
    # its cells to formats without it (+experiment=scaling format=int4): that report just has no ratio column
    typed = any(o.split("=", 1)[0].lstrip("+~") == "sweep.baseline" for o in overrides)
    if planned and typed and (problem := baseline_problem(settings.baseline, built)):
        return problem
    if multirun:
        return time_limit_problem(cfg.hydra.launcher, settings.timeout_s, settings.startup_timeout_s,
                                  len(planned or []) or 1)
    return None


def output_dir_problem(key: str, raw: str) -> str | None:
    """One line when Hydra could not write its output folder `raw` (Hydra fails there with a traceback, after a
    sweep opened its MLflow parent run). The part before any interpolation (`${now:...}` resolves later) is made, as
    Hydra would make it, and written to."""
    static = str(raw).split("${", 1)[0]
    folder = Path(static if static == raw or static.endswith("/") else os.path.dirname(static) or ".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"{key}={raw} cannot be written ({exc.strerror or exc}); pick a folder you can write to"
    return None


def sweep_settings(cfg: DictConfig) -> SweepSettings:
    """The `sweep:` section, validated (QuantbenchError). A single run does not read it, but a nonsense value there
    (sweep.timeout_s=true) is refused as a sweep refuses it, not accepted in silence."""
    node = cfg.get("sweep")
    return settings_from({"sweep": OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node})


def not_in_base(exc: BaseException, base: list[str]) -> str | None:
    """One line when a plain override (no + or ++) names a key the sweep's base config lacks: Hydra composes that
    config (the groups' defaults, no swept value) before any cell, and fails there in several lines. `++` adds the
    key there and sets it in every cell; None for any other error (the caller tries the swept choices)."""
    key = getattr(exc.__cause__ or exc, "full_key", None)
    culprit = next((o for o in base if "=" in o and o.split("=", 1)[0] == key), None)  # as typed: no + in front
    section = str(key).split(".")[0]
    if culprit is None or section not in GROUPS:
        return None
    value = culprit.split("=", 1)[1]
    try:
        choice = _compose([o for o in base if o != culprit], hydra=True).hydra.runtime.choices.get(section)
    except Exception:  # noqa: BLE001 - only names the base option
        choice = None
    where = f" ({section}={choice})" if choice else ""
    return f"{key} is not in the sweep's base config{where}; write ++{key}={value}"


def launcher_cores(launcher: DictConfig) -> int | None:
    """The cores a sweep cell will have: None (this machine's) under a local launcher; under one that runs cells
    elsewhere (SLURM) its cpus_per_task, or 0 (unknown: the cell checks measure.threads on its node)."""
    if launcher_name(launcher) in LOCAL_LAUNCHERS:
        return None
    cpus = launcher.get("cpus_per_task")
    return cpus if isinstance(cpus, int) and cpus > 0 else 0


@contextlib.contextmanager
def as_job(cfg: DictConfig, num: int | None = None) -> Iterator[DictConfig]:
    """`cfg` (composed with its hydra node) as its job will read it: the task config, with HydraConfig set, so
    `${hydra:job.name}` in an override resolves as in the run, with the values Hydra sets only when the job starts
    (the output dir; in a multirun the job's id and number, `num`) filled in as it will. An interpolation that does
    not resolve (`${oops}`, `${oc.env:UNSET}`) is a one-line ConfigError naming its key, not a traceback."""
    hydra, previous = cfg.hydra, HydraConfig.instance().cfg
    with read_write(hydra), open_dict(hydra):
        for key, value in (("id", str(num)), ("num", num)) if num is not None else ():  # a single run has none
            if OmegaConf.is_missing(hydra.job, key):
                hydra.job[key] = value
        try:  # Hydra's run_job: the run dir, or the sweep dir and the cell's subdir
            where = [hydra.run.dir] if num is None else [hydra.sweep.dir, hydra.sweep.subdir]
            hydra.runtime.output_dir = os.path.abspath(os.path.join(*map(str, where)))
        except (InterpolationResolutionError, GrammarParseError):
            pass  # left unset: only an override that reads it is refused, naming its own key
    task = copy.deepcopy(cfg)
    with read_write(task), open_dict(task):
        del task["hydra"]
    HydraConfig.instance().set_config(cfg)
    try:
        yield task
    except (InterpolationResolutionError, GrammarParseError) as exc:
        first = (getattr(exc, "msg", None) or str(exc) or type(exc).__name__).splitlines()[0]
        raise ConfigError([f"{getattr(exc, 'full_key', None) or 'an override'} does not resolve ({first}); give "
                           "a plain value, or an interpolation that resolves"]) from None
    finally:
        HydraConfig.instance().cfg = previous


def validate(overrides: list[str], cores: int | None = None, built: list[Experiment] | None = None,
             num: int | None = None) -> str | None:
    """Compose, build and preflight one run's config (nothing loads); its problem as one line, or None.
    `cores`: those the run will have (harness.config.build); `built` gets the experiment when it is valid; `num`:
    the cell's number in a multirun (None: a single run). Its `sweep:` section is checked too: a swept
    sweep.start_method=spawn,fork is refused before the first cell runs, not at its fork cell."""
    try:
        cfg = _compose(overrides, hydra=True)
    except Exception as exc:  # noqa: BLE001
        return compose_problem(exc, overrides)
    try:
        with as_job(cfg, num) as task:
            exp = build(task, cores)
            sweep_settings(task)
        preflight(exp)
    except QuantbenchError as exc:
        return str(exc)
    if built is not None:
        built.append(exp)
    return None


def baseline_problem(baseline: str, cells: list[Experiment]) -> str | None:
    """One line when `sweep.baseline` names no quantizer of the sweep's cells: the report would have no speed ratio
    and drift_probe=baseline would probe nothing, found only after the whole sweep ran (the report's --baseline is
    refused alike). The default (none) is not checked: a sweep of quantized cells only has no ratio column, as
    documented; nor a llama.cpp format, whose name the run settles (engine.format=gguf is the file's own)."""
    if baseline == DEFAULT_BASELINE or baseline.startswith("llama_cpp:") or not cells:
        return None
    names = sorted({e.quantizer.name for e in cells if e.engine.name != "llama_cpp"})
    if baseline in names:
        return None
    return (f"sweep.baseline={baseline!r} is no quantizer of this sweep's cells; choose one of: {', '.join(names)}"
            + (" (or a llama_cpp:<format>)" if any(e.engine.name == "llama_cpp" for e in cells) else ""))


def preflight(exp: Experiment) -> None:
    """The checks of input that need no model loaded; raises QuantbenchError. What cannot run on this machine
    (Unsupported: a CUDA-only draft quantizer) is left to the run, which records it SKIPPED as for the target's."""
    exp.model.preflight()  # a missing file, package or hub model (harness/models/hub.py)
    try:
        exp.strategy.preflight()  # speculative: a missing draft model, or one with another vocabulary
    except Unsupported:
        pass
    exp.accuracy.preflight()  # a corpus that cannot be read: refused now, not after the timing


def run_one(cfg: DictConfig) -> int:
    """Validate, run, record one experiment. Returns the exit code: 0 OK, 1 not OK, 2 invalid input, 130/143 stopped
    by Ctrl-C/SIGTERM (recorded KILLED, with the metrics of the phases it finished)."""
    try:
        exp = build(cfg)  # every config problem, at once, before anything heavy
        preflight(exp)
        sweep_settings(cfg)
    except QuantbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if (too_big := memory.refusal(exp)):  # the estimated peak exceeds free memory: refused before loading
        print(f"error: {too_big}", file=sys.stderr)
        return 2
    previous = sigterm_interrupts()  # SIGTERM: the same clean stop as Ctrl-C, as in a sweep
    try:
        try:
            result, code = runner.run(cfg), None
        except KeyboardInterrupt as exc:  # the run as it stood, recorded KILLED below; exit 130 (Ctrl-C), 143
            result, code = getattr(exc, "result", None), getattr(exc, "exit_code", 130)
            if result is None:  # stopped outside the run's own code: nothing to record (run.py exits 130/143)
                raise
        # bounded as every record (tracking.retries, tracking.timeout_s); a second Ctrl-C here ends it (run.py)
        path = tracking.record(result, exp.tracking)
        print(summary_line(result))
        if result.samples:
            print(f"sample: {result.samples[0]['prompt'][-60:]!r} -> {result.samples[0]['output'][:120]!r}")
        where = exp.tracking.resolved_uri() if exp.tracking.enabled else "(MLflow disabled)"
        log = f"  log: {result.tags['log_file']}" if result.tags.get("log_file") else ""
        print(f"result: {path}  mlflow: {where} run {result.mlflow_run_id or '-'}{log}")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code is not None:
        return code
    if result.status == "SKIPPED":  # exit 1 like a failure: a CI job must not pass having measured nothing
        print(f"nothing ran: the run was SKIPPED ({result.error}); exit 1", file=sys.stderr)
    return 0 if result.status == "OK" else 1
