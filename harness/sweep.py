"""Sweeps that survive failures: one isolated child process per cell, resume, one MLflow parent run.

How a Hydra multirun becomes a sweep (any launcher: basic, submitit_local, ...):

- `SweepCallback.on_multirun_start` (registered in conf/config.yaml under hydra.callbacks) runs once in
  the launching process: it validates the sweep settings, takes the sweep folder's lock (one sweep per
  folder: harness/sweep_resume.py), marks stale MLflow runs KILLED, opens (or
  re-opens, on resume) the sweep's MLflow parent run and writes `results/<sweep>/sweep.json`, the
  state every job reads (its path also goes to the jobs through $QUANTBENCH_SWEEP_STATE).
- Each Hydra job calls `run_cell(cfg)` (run.py does this in MULTIRUN mode). It never loads a model:
  it validates the cell, reuses an OK result for the same config hash and resume key (code version, CPU,
  library versions: harness/sweep_resume.py), else runs `harness.runner.run` in a child process of its
  own with a timeout, classifies what happened (OK, FAILED, OOM, TIMEOUT, CRASHED, KILLED), writes
  `results/<sweep>/cells/<hash>.json` and logs a nested MLflow run under the parent. It never raises for
  a failed cell, so the sweep goes on.
- `SweepCallback.on_multirun_end` reads the cells of this invocation back from disk (so the result is
  the same whatever the launcher and wherever the jobs ran), writes report.md / report.png, logs them to
  the parent run, ends it, and sets the exit code run.py returns (non-zero when any cell is not OK, or
  when none is OK: a sweep that measured nothing must not pass).

Warm cells: the child is forked from a `forkserver` that imported torch, transformers and the harness once
(harness/preload.py), so a cell pays no interpreter start or imports (`sweep.start_method=spawn` gives
each cell a fresh interpreter instead). The server only imports, never computes, so every child starts
from the same clean state; the parent's environment and working directory are handed to each child.

Everything a job needs travels through files, never through in-process globals, which is what keeps
results identical under hydra/launcher=submitit_local. The in-process globals below only drive the
progress bar and the exit code of the launching process.

Test-only fault injection: $QUANTBENCH_TEST_FAULTS (JSON, e.g. '{"kill": {"measure.seed": 1}}') makes
the child of every matching cell SIGKILL itself ("kill"), hang ("hang") or raise MemoryError ("oom")
once it is ready. It exists for the fault-drill tests; it is not a config field, so it never changes a
cell's config hash and a resume without it runs the same cells cleanly.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness import sweep_resume
from harness.config import TrackingConfig, _positive, _Validated, to_plain
from harness.errors import ConfigError, QuantbenchError, Unsupported
from harness.measure import resolve_device
from harness.runner import SUCCESS, Result, config_hash
from harness.tracking import WRITE_ERROR_TAG

log = logging.getLogger("quantbench")

STATE_ENV = "QUANTBENCH_SWEEP_STATE"
FAULT_ENV = "QUANTBENCH_TEST_FAULTS"  # test-only, see module docstring
FAULTS = ("kill", "hang", "oom")
START_METHODS = ("forkserver", "spawn")  # forkserver: forked from a pre-imported server; spawn: fresh interpreter
PRELOAD = ("harness.preload",)  # what the forkserver imports once for every cell
DEFAULT_NAME = "adhoc"  # sweep folder for a multirun without an experiment name

_EXIT = {"code": 0}
_PROGRESS: dict[str, Any] = {}
_OPEN: dict[str, Any] = {}  # the sweep this process opened and has not closed (for abort())
_HELD: dict[str, Any] = {}  # the folder lock of that sweep (sweep_resume.hold_folder)


@dataclass
class SweepSettings(_Validated):
    """`sweep:` section (conf/config.yaml; experiments override it). Not part of the config hash."""

    timeout_s: float = 3600.0  # per cell, counted from when the child is ready (imports done)
    startup_timeout_s: float = 600.0  # the child's imports (torch, transformers) under a loaded machine
    resume: bool = True  # reuse cells with an OK result for the same config hash and resume key
    baseline: str = "none"  # quantizer name the report's speed ratio compares with
    start_method: str = "forkserver"  # forkserver (warm: imports done once) | spawn (a fresh interpreter per cell)

    _section = "sweep"

    def problems(self) -> list[str]:
        p: list[str] = []
        _positive(p, "sweep.timeout_s", self.timeout_s)
        _positive(p, "sweep.startup_timeout_s", self.startup_timeout_s)
        if not isinstance(self.resume, bool):
            p.append(f"sweep.resume={self.resume!r} must be true or false")
        if self.start_method not in START_METHODS:
            p.append(f"sweep.start_method={self.start_method!r} is not allowed; choose one of: "
                     f"{', '.join(START_METHODS)}")
        return p


def settings_from(config: dict) -> SweepSettings:
    node = config.get("sweep") or {}
    try:
        return SweepSettings(**node)
    except TypeError as exc:
        allowed = ", ".join(f for f in SweepSettings.__dataclass_fields__ if not f.startswith("_"))
        raise ConfigError([f"sweep: {exc}; allowed keys: {allowed}"]) from None


# ----------------------------------------------------------------------------------------------- state
@dataclass
class SweepState:
    """What every job of one sweep invocation needs (results/<sweep>/sweep.json)."""

    name: str
    folder: str
    invocation: str
    commit: str
    owner: str
    tracking: dict
    parent_run_id: str = ""
    planned: int = 0  # cells the sweeper will launch (0 = unknown, e.g. a non-basic sweeper)
    varying: tuple = ()  # override keys that differ between cells (they name the cells)
    started: float = 0.0
    code: str = ""  # sweep_resume.code_version() at the sweep's start: part of every cell's resume key

    @property
    def tcfg(self) -> TrackingConfig:
        return TrackingConfig(**self.tracking)

    def save(self) -> Path:
        from harness.tracking import write_json_atomic

        return write_json_atomic(Path(self.folder) / "sweep.json", {**asdict(self), "varying": list(self.varying)})

    @classmethod
    def load(cls, path: Path) -> SweepState:
        data = json.loads(Path(path).read_text())
        data["varying"] = tuple(data.get("varying") or ())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def sweep_folder(config: dict) -> Path:
    results = (config.get("tracking") or {}).get("results_dir") or "results"
    return Path(results) / (config.get("name") or DEFAULT_NAME)


def owner_id() -> str:
    """host:pid:start-time of this process (the start time makes a recycled pid harmless)."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{int(psutil.Process().create_time())}"


def owner_alive(owner: str) -> bool | None:
    """True/False for an owner on this host; None when it ran elsewhere (cannot tell)."""
    import psutil

    try:
        host, pid, created = owner.rsplit(":", 2)
        pid_i, created_i = int(pid), int(created)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        return int(psutil.Process(pid_i).create_time()) == created_i
    except psutil.Error:
        return False


def planned_cells(hydra_cfg: Any) -> list[list[str]] | None:
    """The override list of every cell Hydra's basic sweeper will launch (None for other sweepers)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    sweeper = OmegaConf.to_container(hydra_cfg.sweeper, resolve=False) or {}
    if "BasicSweeper" not in str(sweeper.get("_target_", "")):
        return None
    args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    args += list(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))
    parsed = OverridesParser.create().parse_overrides(args)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(cell) for batch in batches for cell in batch]


def varying_keys(cells: list[list[str]]) -> tuple[str, ...]:
    values: dict[str, set[str]] = {}
    order: list[str] = []
    for cell in cells:
        for ov in cell:
            key, _, value = ov.partition("=")
            if key not in values:
                values[key] = set()
                order.append(key)
            values[key].add(value)
    return tuple(k for k in order if len(values[k]) > 1)


def cell_label(task_overrides: list[str], varying: tuple[str, ...]) -> str:
    """A cell's name: its values of the keys the sweep varies (all its overrides when unknown)."""
    chosen = [ov for ov in task_overrides if ov.partition("=")[0] in varying] if varying else \
        [ov for ov in task_overrides if not ov.lstrip("+~").startswith(("experiment=", "hydra."))]
    return ",".join(chosen) or "default"


# ---------------------------------------------------------------------------------------------- mlflow
def _client(tcfg: TrackingConfig):
    from harness.tracking import client

    return client(tcfg)


def mark_stale(tcfg: TrackingConfig) -> list[str]:
    """End as KILLED every RUNNING run of the experiment whose owning sweep process is gone."""
    from harness.tracking import experiment_id, retry

    c = _client(tcfg)
    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    runs = retry(lambda: c.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=5000),
                 tcfg, "mlflow search_runs")
    killed = []
    for run in runs:
        owner = run.data.tags.get("quantbench.owner", "")
        if not owner or owner_alive(owner) is not False:
            continue  # not ours, still running, or on another host
        c.set_tag(run.info.run_id, "status", "KILLED")
        c.set_tag(run.info.run_id, "error", f"sweep process {owner} ended without closing this run "
                                            "(interrupted or killed); marked KILLED on the next start")
        c.set_terminated(run.info.run_id, status="KILLED")
        killed.append(run.info.run_id)
    return killed


def open_parent_run(state: SweepState, previous: str) -> str:
    """Re-open the sweep's previous parent run (resume keeps one run per sweep) or create one."""
    from harness.tracking import experiment_id, retry

    tcfg = state.tcfg
    c = _client(tcfg)
    exp_id = retry(lambda: experiment_id(c, tcfg), tcfg, "mlflow experiment")
    tags = {"quantbench.role": "sweep", "quantbench.sweep": state.name, "quantbench.owner": state.owner,
            "quantbench.invocation": state.invocation, "git_commit": state.commit, "status": "RUNNING"}
    if previous:
        try:
            run = c.get_run(previous)
            if run.info.experiment_id == exp_id and run.info.lifecycle_stage == "active":
                for k, v in tags.items():
                    c.set_tag(previous, k, v)
                c.update_run(previous, status="RUNNING")
                return previous
        except Exception:  # noqa: BLE001 - gone, other store: start a new parent run
            pass
    run = retry(lambda: c.create_run(exp_id, run_name=f"sweep:{state.name}", tags=tags), tcfg, "mlflow create_run")
    return run.info.run_id


def close_parent_run(state: SweepState, status: str, summary: str, artifacts: list[Path]) -> None:
    from harness.tracking import retry

    if not state.parent_run_id or not state.tcfg.enabled:
        return
    tcfg, rid = state.tcfg, state.parent_run_id
    c = _client(tcfg)
    try:
        for path in artifacts:
            if path.exists():
                retry(lambda p=path: c.log_artifact(rid, str(p)), tcfg, "mlflow log_artifact")
        retry(lambda: c.set_tag(rid, "status", status), tcfg, "mlflow set_tag")
        retry(lambda: c.set_tag(rid, "summary", summary[:5000]), tcfg, "mlflow set_tag")
        mlflow_status = {"OK": "FINISHED", "KILLED": "KILLED"}.get(status, "FAILED")
        retry(lambda: c.set_terminated(rid, status=mlflow_status), tcfg, "mlflow set_terminated")
    except Exception as exc:  # noqa: BLE001 - the report files are on disk whatever MLflow does
        log.error("could not close the sweep's MLflow run %s: %s", rid, exc)


# ---------------------------------------------------------------------------------------------- child
def fault_for(config: dict) -> str:
    """Test-only: the fault $QUANTBENCH_TEST_FAULTS assigns to this cell ('' for none)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return ""
    for fault, when in json.loads(spec).items():
        if fault not in FAULTS:
            raise QuantbenchError(f"{FAULT_ENV}: unknown fault {fault!r}; choose one of: {', '.join(FAULTS)}")
        if all(str(_get(config, key)) == str(value) for key, value in when.items()):
            return fault
    return ""


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _alive(pid: int, created: float | None) -> bool:
    import psutil

    try:
        return created is None or psutil.Process(pid).create_time() == created  # a recycled pid is not it
    except psutil.Error:
        return False


def _watch_parent(parent_pid: int) -> None:
    # A SIGKILLed sweep cannot kill its child; the child notices and exits instead of running on. The
    # sweep is the child's parent (spawn) or its grandparent (forkserver: the server outlives the sweep
    # while this child holds its pipe), so watch the sweep's pid itself, and the parent too.
    import psutil

    first_ppid = os.getppid()
    try:
        created: float | None = psutil.Process(parent_pid).create_time()
    except psutil.Error:
        os._exit(70)
    while True:
        if os.getppid() != first_ppid or not _alive(parent_pid, created):
            os._exit(70)
        time.sleep(1.0)


def _child_main(config: dict, conn: Any, fault: str, parent_pid: int, environ: dict | None = None,
                cwd: str | None = None) -> None:
    """Entry point of the cell's child: run one cell and send its Result back."""
    try:
        os.setpgrp()  # own process group: a terminal Ctrl-C goes to the sweep, which ends us cleanly
    except OSError:
        pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if environ is not None:  # a forkserver child inherits the server's environment, not the sweep's of now
        os.environ.clear()
        os.environ.update(environ)
    if cwd:
        os.chdir(cwd)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from harness import quiet_third_party, runner

    quiet_third_party()
    import torch  # noqa: F401 - imports are the slow, load-dependent part; the timeout starts after them

    conn.send(("ready", os.getpid()))
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        while True:
            time.sleep(60)
    try:
        if fault == "oom":
            raise MemoryError("test fault: simulated out of memory")
        result = runner.run(config)
    except BaseException as exc:  # noqa: BLE001 - runner.run never raises; this catches what it lets through
        status = "OOM" if isinstance(exc, MemoryError) else "FAILED"
        result = Result(status=status, config=config, error=f"{type(exc).__name__}: {exc}",
                        traceback=traceback.format_exc(), started=time.time(), ended=time.time())
        result.config_hash = config_hash(config)
        result.tags.update({"config_hash": result.config_hash, "status": status, "error": result.error})
    conn.send(("result", result.to_dict()))
    conn.close()


def _kill_group(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, OSError, ValueError):
        pass
    proc.join(10)


def _crash_message(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name if -exitcode in signal.Signals._value2member_map_ else str(-exitcode)
        why = {"SIGKILL": " (killed from outside, or by the kernel's out-of-memory killer)",
               "SIGSEGV": " (a native library crashed)", "SIGABRT": " (a native library aborted)"}.get(sig, "")
        return f"cell's child process died from {sig}{why}; see the log above, rerun the sweep to retry it"
    return f"cell's child process exited with code {exitcode} before reporting a result"


def mp_context(method: str = "forkserver") -> Any:
    """The multiprocessing context cells start with (module docstring: warm cells)."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (once per process)
    return ctx


def warm_up(settings: SweepSettings) -> None:
    """Start the forkserver now, so its imports overlap the sweep's own start (MLflow, first cell's checks)."""
    if settings.start_method == "forkserver":
        from multiprocessing import forkserver

        mp_context("forkserver")
        forkserver.ensure_running()


def run_isolated(config: dict, settings: SweepSettings, fault: str = "") -> Result:
    """Run one cell in a child process of its own; classify how it ended. Never raises (but re-raises
    KeyboardInterrupt after killing the child, so an interrupted sweep can record and stop).

    Metrics `cell_start_s` (until the child is ready: fork or interpreter start and imports) and
    `cell_wall_s` (the whole cell as the sweep sees it) are added to a result the child returns."""
    ctx = mp_context(settings.start_method)  # one process per cell: no CUDA/thread state or leaks shared
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(config, send, fault, os.getpid(), dict(os.environ), os.getcwd()),
                       name="quantbench-cell")
    started, t0, ready_s = time.time(), time.monotonic(), None
    proc.start()
    send.close()
    deadline = time.monotonic() + settings.startup_timeout_s
    limit, phase, payload = settings.startup_timeout_s, "startup", None
    try:
        while payload is None:
            if recv.poll(0.2):
                try:
                    kind, value = recv.recv()
                except (EOFError, OSError):
                    break  # the child died; its exit code says how
                if kind == "ready":
                    ready_s = time.monotonic() - t0
                    phase, limit = "run", settings.timeout_s
                    deadline = time.monotonic() + settings.timeout_s
                elif kind == "result":
                    payload = value
            elif not proc.is_alive() and not recv.poll(0):
                break
            elif time.monotonic() > deadline:
                _kill_group(proc)
                key = "sweep.timeout_s" if phase == "run" else "sweep.startup_timeout_s"
                result = Result(status="TIMEOUT", config=config,
                                error=f"cell exceeded {key}={limit:g}s and was killed; raise {key} or make "
                                      "the cell smaller")
                return _finish(result, config, started)
    except KeyboardInterrupt:
        _kill_group(proc)
        raise
    finally:
        recv.close()
    if payload is not None:
        proc.join(30)
        if proc.is_alive():
            _kill_group(proc)
        result = Result.from_dict(payload)
        result.started = result.started or started
        result.metrics.update({"cell_start_s": ready_s if ready_s is not None else float("nan"),
                               "cell_wall_s": time.monotonic() - t0})
        result.tags["sweep.start_method"] = settings.start_method
        return result
    proc.join(10)
    return _finish(Result(status="CRASHED", config=config, error=_crash_message(proc.exitcode)), config, started)


def _finish(result: Result, config: dict, started: float) -> Result:
    result.config_hash = config_hash(config)
    result.started, result.ended = started, time.time()
    result.tags.update({"config_hash": result.config_hash, "status": result.status, "error": result.error})
    return result


# ------------------------------------------------------------------------------------------------ cell
def cell_path(folder: Path, chash: str) -> Path:
    return Path(folder) / "cells" / f"{chash}.json"


def _append_manifest(state: SweepState, chash: str, label: str) -> None:
    line = json.dumps({"invocation": state.invocation, "hash": chash, "label": label}) + "\n"
    path = Path(state.folder) / "manifest.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())  # one small O_APPEND write: atomic between concurrent jobs
        finally:
            os.close(fd)
    except OSError as exc:  # disk full: the cell still runs; the report will miss it and say so
        log.error("could not add cell %s to %s (%s); the report will count it as never reported", label, path,
                  exc.strerror or exc)


def _find_state(config: dict) -> SweepState | None:
    for candidate in (os.environ.get(STATE_ENV, ""), str(sweep_folder(config) / "sweep.json")):
        if candidate and Path(candidate).exists():
            try:
                return SweepState.load(Path(candidate))
            except (OSError, ValueError, TypeError):
                continue
    return None


def _hydra_job() -> tuple[list[str], dict]:
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        return list(hc.overrides.task), dict(hc.runtime.choices)
    except ValueError:  # not under Hydra (a test calling run_cell directly)
        return [], {}


def _progress(status: str) -> None:
    bar = _PROGRESS.get("bar")
    if bar is None:
        return
    counts = _PROGRESS.setdefault("counts", {})
    counts[status] = counts.get(status, 0) + 1
    bar.update(1)
    bar.set_postfix({k: v for k, v in sorted(counts.items())}, refresh=True)


def _say(line: str) -> None:
    bar = _PROGRESS.get("bar")
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)


def run_cell(cfg: Any) -> int:
    """One Hydra job of a sweep: resume-or-run the cell in isolation and record it. Returns 0 if OK."""
    from harness import env
    from harness.cli import summary_line
    from harness.config import build

    config = to_plain(cfg)
    config.pop("hydra", None)
    overrides, choices = _hydra_job()
    state = _find_state(config)
    if state is None:  # no callback ran (hydra.callbacks cleared): a standalone sweep without parent run
        folder = sweep_folder(config)
        state = SweepState(name=config.get("name") or DEFAULT_NAME, folder=str(folder), invocation="standalone",
                           commit=env.git_commit(), owner=owner_id(), tracking=dict(config.get("tracking") or {}),
                           code=sweep_resume.code_version())
        log.warning("no sweep state found (is harness.sweep.SweepCallback in hydra.callbacks?); cells are "
                    "recorded without an MLflow parent run")
    label = cell_label(overrides, state.varying)
    chash = config_hash(config)
    path = cell_path(Path(state.folder), chash)
    _append_manifest(state, chash, label)
    tcfg = state.tcfg
    previous = _read_json(path)
    key: dict[str, str] = {}
    rerun_why = ""

    try:
        settings = settings_from(config)
        exp = build(config)  # a config error fails the cell here, in a second, with no child at all
        exp.model.preflight()
        exp.quantizer.preflight(resolve_device(exp.measure.device))  # "needs CUDA" here: SKIPPED, no child started
        key = sweep_resume.cell_key(state.code, exp.quantizer, exp.engine.name)  # code, CPU, library versions
        if settings.resume and previous and previous.get("status") == "OK":
            why = sweep_resume.differences(previous.get("tags") or {}, key)
            if not why:
                _reuse(previous, path, state, label, chash, key)
                return 0
            rerun_why = "; ".join(why)
            _say(f"[rerun] {label}: the OK result for config {chash} is not reused: {rerun_why}")
        result = run_isolated(config, settings, fault_for(config))
    except QuantbenchError as exc:
        skipped = isinstance(exc, Unsupported)  # cannot run on this machine: recorded SKIPPED, the sweep goes on
        result = _finish(Result(status="SKIPPED" if skipped else "FAILED", config=config, error=str(exc),
                                traceback="" if skipped else traceback.format_exc()), config, time.time())
    except KeyboardInterrupt as exc:
        result = _finish(Result(status="KILLED", config=config,
                                error=f"sweep interrupted ({getattr(exc, 'signame', 'SIGINT')}) while this cell ran"),
                         config, time.time())
        _record(result, path, state, label, choices, previous, tcfg)
        _say(summary_line(result))
        raise  # run.py catches it, calls abort() (report + parent run KILLED) and exits 130/143
    if key:
        result.tags[sweep_resume.KEY_TAG] = json.dumps(key)
    if rerun_why:
        result.tags[sweep_resume.RERUN_TAG] = rerun_why
    written = _record(result, path, state, label, choices, previous, tcfg)
    _say(summary_line(result))
    _progress(result.status)
    if written != path:  # disk full (or read-only): the numbers are elsewhere; this cell is not in the folder
        why = result.tags.get(WRITE_ERROR_TAG, "?").rsplit(": ", 1)[-1]
        _say(f"  [{result.status}] {label}: result NOT written to {path} ({why}); "
             + (f"kept in {written}: once there is space, cp {written} {path} (a resumed sweep then reuses it)"
                if written else "printed above as a RESULT line: save it as that file once there is space"))
        return 1
    return 0 if result.status in SUCCESS else 1


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _cell_tags(result: Result, state: SweepState, label: str, choices: dict) -> None:
    result.tags.setdefault("git_commit", state.commit)
    result.tags["status"] = result.status  # the MLflow tag `status` always equals the JSON's
    result.tags.update({"quantbench.role": "cell", "quantbench.sweep": state.name, "quantbench.owner": state.owner,
                        "quantbench.invocation": state.invocation, "sweep.cell": label,
                        "sweep.parent_run_id": state.parent_run_id})
    for group in ("model", "quantizer", "strategy", "engine"):
        if choices.get(group):
            result.tags[f"choice.{group}"] = str(choices[group])


def _record(result: Result, path: Path, state: SweepState, label: str, choices: dict, previous: dict | None,
            tcfg: TrackingConfig) -> Path | None:
    """Record a cell (JSON, then MLflow); returns the file holding it (not `path` when the disk was full)."""
    from harness import tracking

    result.run_name = label
    _cell_tags(result, state, label, choices)
    written: Path | None = tracking.record(result, tcfg, path=path, parent_run_id=state.parent_run_id or None)
    if WRITE_ERROR_TAG in result.tags and written == path:
        written = None  # not at `path`, and nowhere else either: the result was printed (RESULT line)
    old = (previous or {}).get("mlflow_run_id")
    if old and old != result.mlflow_run_id and tcfg.enabled:
        try:  # the rerun replaces it; the old run stays for history, marked so the UI can filter it
            _client(tcfg).set_tag(old, "superseded_by", result.mlflow_run_id or "rerun")
        except Exception:  # noqa: BLE001
            pass
    return written


def _reuse(previous: dict, path: Path, state: SweepState, label: str, chash: str, key: dict[str, str]) -> None:
    """Keep a done cell: say why on the terminal and in tag `resume.reused` (JSON; MLflow best effort)."""
    from harness.tracking import write_json_atomic

    why = sweep_resume.describe(key)
    previous.setdefault("tags", {})[sweep_resume.REUSED_TAG] = f"{state.invocation}: {why}"
    if not _relink(previous, path, state):
        try:
            write_json_atomic(path, previous)
        except OSError as exc:  # the stored result is intact; only the note is missing
            log.warning("could not note the reuse in %s: %s", path, exc)
        if state.tcfg.enabled and previous.get("mlflow_run_id"):
            try:
                _client(state.tcfg).set_tag(previous["mlflow_run_id"], sweep_resume.REUSED_TAG,
                                            previous["tags"][sweep_resume.REUSED_TAG])
            except Exception:  # noqa: BLE001 - a note only; the JSON has it
                pass
    _say(f"[skip] {label}: reusing the OK result for config {chash} ({why}): {path}")
    _progress("resumed")  # a resumed OK cell (not status SKIPPED: that one cannot run here)


def _relink(previous: dict, path: Path, state: SweepState) -> bool:
    """A reused cell belongs to this sweep's parent run too: log a copy if its run hangs elsewhere (True)."""
    from harness import tracking

    if not state.parent_run_id or previous.get("tags", {}).get("sweep.parent_run_id") == state.parent_run_id:
        return False
    result = Result.from_dict(previous)
    result.tags["resumed_from"] = previous.get("mlflow_run_id", "")
    result.tags["sweep.parent_run_id"] = state.parent_run_id
    tracking.record(result, state.tcfg, path=path, parent_run_id=state.parent_run_id)
    return True


# ----------------------------------------------------------------------------------------------- sweep
def start_sweep(config_with_hydra: Any) -> SweepState:
    """Open a sweep (the callback's on_multirun_start). Raises ConfigError for bad settings."""
    from harness import env

    config = _plain_without_hydra(config_with_hydra)
    hydra_cfg = config_with_hydra.hydra if "hydra" in config_with_hydra else None
    settings = settings_from(config)
    tcfg = TrackingConfig(**(config.get("tracking") or {}))
    folder = sweep_folder(config)
    name = config.get("name") or DEFAULT_NAME
    try:  # one sweep per folder at a time: a second would run the same cells again (sweep_resume.py)
        _HELD["lock"] = sweep_resume.hold_folder(folder, name)
    except OSError as exc:
        raise QuantbenchError(f"cannot use the sweep folder {folder}: {exc.strerror or exc}") from None
    if (partial := sweep_resume.remove_partial_writes(folder)):  # a killed sweep's unfinished writes
        log.warning("removed %d unfinished result write(s) a killed sweep left in %s (temporary files, never "
                    "results)", len(partial), folder)
    warm_up(settings)  # the forkserver imports torch & co. while the sweep opens its MLflow run
    cells = None
    if hydra_cfg is not None:
        try:
            cells = planned_cells(hydra_cfg)
        except Exception as exc:  # noqa: BLE001 - only the progress total and cell names depend on it
            log.warning("could not list the sweep's cells in advance: %s", exc)
    old = _read_json(folder / "sweep.json") or {}
    state = SweepState(name=name, folder=str(folder),
                       invocation=f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}", commit=env.git_commit(),
                       owner=owner_id(), tracking=asdict(tcfg), planned=len(cells or []),
                       varying=varying_keys(cells) if cells else (), started=time.time(),
                       code=sweep_resume.code_version())
    if tcfg.enabled:
        try:
            stale = mark_stale(tcfg)
            if stale:
                log.warning("marked %d stale run(s) KILLED (a sweep was interrupted): %s", len(stale),
                            ", ".join(stale))
            state.parent_run_id = open_parent_run(state, old.get("parent_run_id", ""))
        except Exception as exc:  # noqa: BLE001 - cells still write their JSON; upload later
            log.error("MLflow unavailable for the sweep's parent run (%s: %s); cells keep their JSON",
                      type(exc).__name__, str(exc)[:300])
    try:
        state.save()
    except OSError as exc:
        raise QuantbenchError(f"cannot write {folder}/sweep.json ({exc.strerror or exc}): free space in "
                              f"{folder.parent} or set tracking.results_dir") from None
    _OPEN["state"] = state
    os.environ[STATE_ENV] = str(Path(state.folder).resolve() / "sweep.json")
    _EXIT["code"] = 0
    _PROGRESS.clear()
    if state.planned:
        from tqdm import tqdm

        _PROGRESS["bar"] = tqdm(total=state.planned, desc=f"sweep {state.name}", unit="cell", file=sys.stderr,
                                dynamic_ncols=True)
    print(f"sweep {state.name}: {state.planned or '?'} cell(s) -> {folder}/  (MLflow parent run "
          f"{state.parent_run_id or '-'})", flush=True)
    return state


def invocation_cells(folder: Path, invocation: str | None = None) -> list[dict]:
    """The cell results of one invocation (default: the latest), in launch order, one per config hash."""
    folder = Path(folder)
    if invocation is None:
        invocation = (_read_json(folder / "sweep.json") or {}).get("invocation")
    seen: dict[str, dict] = {}
    try:
        lines = (folder / "manifest.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if invocation and entry.get("invocation") != invocation:
            continue
        data = _read_json(cell_path(folder, entry["hash"]))
        if data is not None:
            data.setdefault("tags", {}).setdefault("sweep.cell", entry.get("label", ""))
            seen[entry["hash"]] = data
    return list(seen.values())


def finish_sweep(state: SweepState, interrupted: bool = False) -> int:
    """Close a sweep (on_multirun_end, or an interruption): report, parent run, exit code."""
    from harness import report

    bar = _PROGRESS.pop("bar", None)
    if bar is not None:
        bar.close()
    _OPEN.pop("state", None)
    folder = Path(state.folder)
    cells = invocation_cells(folder, state.invocation)
    missing = max(0, state.planned - len(cells)) if not interrupted else 0
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.get("status", "?")] = counts.get(c.get("status", "?"), 0) + 1
    bad = sum(v for k, v in counts.items() if k not in SUCCESS) + missing  # SKIPPED: cannot run here, not a failure
    nothing = not interrupted and not counts.get("OK")  # all SKIPPED (or none recorded): nothing was measured
    status = "KILLED" if interrupted else ("OK" if bad == 0 and not nothing else "FAILED")
    paths: list[Path] = []
    try:
        paths = report.write_report(folder, cells, baseline=_baseline(cells), title=f"sweep {state.name}")
    except Exception as exc:  # noqa: BLE001 - a report problem must not hide the sweep's outcome
        log.error("could not write the sweep report: %s", exc)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no cells"
    if missing:
        summary += f", {missing} never reported (the job died, or could not write its result)"
    close_parent_run(state, status, summary, paths)
    _EXIT["code"] = 1 if bad or interrupted or nothing else 0
    lock = _HELD.pop("lock", None)
    if lock is not None:
        lock.release()
    where = paths[0] if paths else folder
    print(f"sweep {state.name}: {len(cells)} cell(s): {summary}; report: {where}", flush=True)
    for c in cells:  # every cell that is not OK (failed or skipped), each with its one-line reason
        if c.get("status") != "OK":
            print(f"  [{c.get('status')}] {c.get('tags', {}).get('sweep.cell', c.get('run_name'))}: "
                  f"{c.get('error', '')}", flush=True)
    unsent = [c for c in cells if c.get("tags", {}).get("tracking_error") and not c.get("mlflow_run_id")]
    if unsent and state.tcfg.enabled:
        uri = state.tcfg.resolved_uri()
        print(f"sweep {state.name}: {len(unsent)} cell(s) not in MLflow (logging to {uri} failed); their results are "
              f"in {folder}/cells; re-send with: python -m harness.tracking upload {folder} --uri {uri}", flush=True)
    if nothing:  # all SKIPPED: "nothing ran"; with failures among them the lines above say what failed
        print(f"sweep {state.name}: {'no cell ran OK' if bad else 'nothing ran'}: {_why_nothing(cells)}; exit 1",
              flush=True)
    return _EXIT["code"]


def _why_nothing(cells: list[dict]) -> str:
    """'all 2 cell(s) SKIPPED (needs CUDA: ...)': why a sweep measured nothing, in one line."""
    if not cells:
        return "no cell recorded a result"
    statuses = sorted({str(c.get("status")) for c in cells})
    reasons = list(dict.fromkeys(str(c.get("error") or "") for c in cells if c.get("error")))
    what = f"all {len(cells)} cell(s) {statuses[0]}" if len(statuses) == 1 else \
        f"no cell OK ({', '.join(statuses)})"
    shown = " | ".join(reasons[:3]) + (f" | {len(reasons) - 3} more reasons" if len(reasons) > 3 else "")
    return what + (f" ({shown})" if shown else "")


def _baseline(cells: list[dict]) -> str:
    for c in cells:
        node = (c.get("config") or {}).get("sweep") or {}
        if node.get("baseline"):
            return str(node["baseline"])
    return SweepSettings.baseline


def abort() -> None:
    """After Ctrl-C/SIGTERM in the launching process: close the open sweep as KILLED (no run left RUNNING)."""
    state = _OPEN.get("state")
    if state is not None:
        finish_sweep(state, interrupted=True)


def exit_code() -> int:
    """What run.py exits with after a multirun: 1 when any cell was not OK, or no cell was OK."""
    return _EXIT["code"]


class SweepInterrupted(KeyboardInterrupt):
    """SIGTERM turned into the same clean stop as Ctrl-C (kill the cell, record KILLED, close the sweep)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signame = signal.Signals(signum).name
        self.exit_code = 128 + signum


def _on_sigterm(signum: int, _frame: Any) -> None:
    raise SweepInterrupted(signum)


def _plain_without_hydra(config: Any) -> dict:
    """The job config as plain data, without resolving the `hydra` node (it holds per-job values)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        config = OmegaConf.masked_copy(config, [k for k in config.keys() if k != "hydra"])
    plain = to_plain(config)
    plain.pop("hydra", None)
    return plain


def _callback_base() -> type:
    try:
        from hydra.experimental.callback import Callback

        return Callback
    except ImportError:  # pragma: no cover - hydra < 1.1
        return object


class SweepCallback(_callback_base()):  # type: ignore[misc]
    """Hydra callback (conf/config.yaml hydra.callbacks): opens and closes the sweep around a multirun."""

    def __init__(self) -> None:
        self.state: SweepState | None = None
        self._old_sigterm: Any = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        try:
            self.state = start_sweep(config)
        except QuantbenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None  # SystemExit passes Hydra's callback guard: stop before any cell
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        state = self.state or _find_state(_plain_without_hydra(config))
        if state is not None:
            finish_sweep(state)
        os.environ.pop(STATE_ENV, None)
