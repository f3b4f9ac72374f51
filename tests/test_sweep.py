"""Sweeps: isolation, fault drills (FAILED / CRASHED / TIMEOUT / OOM / KILLED), resume, report, exit codes.

The drills run the real CLI (`python run.py -m ...`) on the tiny model, so they exercise Hydra's launcher,
the callback, the cells' child processes (forked from a pre-imported forkserver) and MLflow exactly as a
user's sweep does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm
from conftest import ROOT, fresh_cache

from harness.cache import LOCK_ENV
from harness.errors import ConfigError
from harness.records import report
from harness.records.results import cell_path, invocation_cells
from harness.sweep import isolated
from harness.sweep.cell import append_manifest, distinct_label, record_cell, run_cell
from harness.sweep.isolated import fault_for, run_isolated, warm_up
from harness.sweep.parent import open_parent_run
from harness.sweep.settings import (
    FAULT_ENV,
    STATE_ENV,
    SweepSettings,
    SweepState,
    cell_label,
    owner_id,
    planned_cells,
    varying_keys,
)

TINY = ["model=tiny_random", "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0",
        "accuracy.enabled=false", "tracking.experiment=drill"]


def run_cli(args: list[str], tmp: Path, faults: dict | None = None, timeout: int = 600,
            warm_start: bool = False) -> subprocess.CompletedProcess:
    """`python run.py -m <tiny> ...`: a fresh interpreter whose sweep starts its own forkserver, as a user's does;
    `warm_start` forks it from tests/warm.py's server instead, for tests about what the sweep records."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    if faults:
        env[FAULT_ENV] = json.dumps(faults)
    argv = ["run.py", "-m", *TINY, f"tracking.results_dir={tmp}", f"hydra.sweep.dir={tmp}/hydra", *args]
    if warm_start:
        return warm.run(argv, ROOT, env, tmp / "procs", timeout)
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def cells_by_label(folder: Path) -> dict[str, dict]:
    return {c["tags"]["sweep.cell"]: c for c in invocation_cells(folder)}


def mlflow_runs(tmp: Path):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exp = c.get_experiment_by_name("drill")
    return c, c.search_runs([exp.experiment_id], max_results=1000)


@pytest.mark.heavy  # heavy tier (make test-heavy): keeps CI well inside 30 min on a cold machine
def test_fault_drill_then_resume_reruns_only_the_bad_cells(tmp_path):
    # 6 cells: float32 x 2 succeed; bfloat16@seed0 is SIGKILLed, bfloat16@seed1 hangs past the timeout;
    # float16 x 2 run out of memory. (An invalid cell refuses the whole sweep before any cell starts:
    # test_config.py; here every cell is valid and fails while it runs.)
    args = ["name=drill", "quantizer=fp32", "quantizer.dtype=float32,bfloat16,float16", "measure.seed=0,1",
            "sweep.timeout_s=40"]
    faults = {"kill": {"quantizer.dtype": "bfloat16", "measure.seed": 0},
              "hang": {"quantizer.dtype": "bfloat16", "measure.seed": 1},
              "oom": {"quantizer.dtype": "float16"}}
    first = run_cli(args, tmp_path, faults)
    out = first.stdout + first.stderr
    assert first.returncode == 1, out[-3000:]
    folder = tmp_path / "drill"
    cells = cells_by_label(folder)
    assert len(cells) == 6, sorted(cells)
    status = {k: v["status"] for k, v in cells.items()}
    assert status == {"quantizer.dtype=float32,measure.seed=0": "OK", "quantizer.dtype=float32,measure.seed=1": "OK",
                      "quantizer.dtype=bfloat16,measure.seed=0": "CRASHED",
                      "quantizer.dtype=bfloat16,measure.seed=1": "TIMEOUT",
                      "quantizer.dtype=float16,measure.seed=0": "OOM", "quantizer.dtype=float16,measure.seed=1": "OOM"}
    assert "SIGKILL" in cells["quantizer.dtype=bfloat16,measure.seed=0"]["error"]
    assert "sweep.timeout_s=40s" in cells["quantizer.dtype=bfloat16,measure.seed=1"]["error"]
    for label in ("quantizer.dtype=float32,measure.seed=0", "quantizer.dtype=float32,measure.seed=1"):
        assert cells[label]["metrics"]["decode_tokens_per_s"] > 0
        assert cells[label]["metrics"]["generated_tokens"] == 4 * 4  # 4 prompts x 4 tokens, 1 repetition

    # MLflow: one parent run (FAILED), six nested child runs with the same statuses, nothing left RUNNING
    c, runs = mlflow_runs(tmp_path)
    parents = [r for r in runs if r.data.tags.get("quantbench.role") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FAILED"
    assert parents[0].data.tags["status"] == "FAILED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.data.tags["status"] for r in children) == sorted(status.values())
    assert not [r for r in runs if r.info.status == "RUNNING"]
    arts = {a.path for a in c.list_artifacts(parents[0].info.run_id)}
    assert {"report.md", "report.png"} <= arts
    md = (folder / "report.md").read_text()
    assert md.count("| CRASHED |") == 1 and md.count("| TIMEOUT |") == 1 and md.count("| OK |") == 2
    first_ok = {k: v["started"] for k, v in cells.items() if v["status"] == "OK"}

    # resume without the faults: only the 4 bad cells run again, and now succeed
    second = run_cli(args, tmp_path)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-3000:]
    assert out2.count("[skip]") == 2, out2[-3000:]
    cells = cells_by_label(folder)
    assert {k: v["status"] for k, v in cells.items()} == {k: "OK" for k in status}
    assert {k: v["started"] for k, v in cells.items() if k in first_ok} == first_ok  # not rerun
    c, runs = mlflow_runs(tmp_path)
    parents = [r for r in runs if r.data.tags.get("quantbench.role") == "sweep"]
    assert len(parents) == 1  # the resume re-opened the same parent run
    live = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id
            and not r.data.tags.get("superseded_by")]
    assert len(live) == 6
    assert not [r for r in runs if r.info.status == "RUNNING"]


@pytest.mark.serial  # an OK cell must finish inside an 8 s timeout: not beside another test
def test_crashed_and_timed_out_cells_are_classified_then_resume_reruns_only_them(tmp_path, monkeypatch, capsys):
    """The fast form of the drill above, in CI: one cell SIGKILLed, one past a short timeout, one OK."""
    args = ["name=fast", "quantizer=fp32", "measure.seed=0,1,2", "sweep.timeout_s=8"]
    first = run_cli(args, tmp_path, {"kill": {"measure.seed": 0}, "hang": {"measure.seed": 1}})
    out = first.stdout + first.stderr
    assert first.returncode == 1, out[-3000:]
    folder = tmp_path / "fast"
    cells = cells_by_label(folder)
    assert {k: v["status"] for k, v in cells.items()} == {"measure.seed=0": "CRASHED", "measure.seed=1": "TIMEOUT",
                                                           "measure.seed=2": "OK"}, out[-3000:]
    assert "SIGKILL" in cells["measure.seed=0"]["error"]
    assert "sweep.timeout_s=8s" in cells["measure.seed=1"]["error"]
    _, runs = mlflow_runs(tmp_path)
    (parent,) = [r for r in runs if r.data.tags.get("quantbench.role") == "sweep"]
    assert parent.info.status == "FAILED"
    assert sorted(r.data.tags["status"] for r in runs if r.data.tags.get("quantbench.role") == "cell") == \
        ["CRASHED", "OK", "TIMEOUT"]
    assert not [r for r in runs if r.info.status == "RUNNING"]
    ok_started = cells["measure.seed=2"]["started"]

    # resume without the faults: each cell as the next invocation's Hydra job runs it (in-process here,
    # to save a second sweep start): the OK cell is reused, the two bad ones run again and succeed
    from harness.config import compose

    monkeypatch.setenv(STATE_ENV, str(folder / "sweep.json"))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    for seed in range(3):
        cfg = compose([*TINY, f"tracking.results_dir={tmp_path}", *args[:2], f"measure.seed={seed}", args[3]])
        assert run_cell(cfg) == 0
    out2 = capsys.readouterr().out
    (skip,) = [ln for ln in out2.splitlines() if "[skip]" in ln]
    assert "same code" in skip, skip
    cells = {c["config"]["measure"]["seed"]: c for c in invocation_cells(folder)}
    assert {k: v["status"] for k, v in cells.items()} == {0: "OK", 1: "OK", 2: "OK"}
    assert cells[2]["started"] == ok_started  # not rerun


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_oom_in_the_child_is_recorded_as_oom(compose, start_method):
    from harness.config import to_plain

    config = to_plain(compose(TINY))
    config.pop("hydra", None)
    os.environ[FAULT_ENV] = json.dumps({"oom": {"model.hidden_size": 128}})
    try:
        fault = fault_for(config)
    finally:
        del os.environ[FAULT_ENV]
    assert fault == "oom"
    result = run_isolated(config, SweepSettings(timeout_s=120, start_method=start_method), fault)
    assert result.status == "OOM" and "simulated out of memory" in result.error
    assert result.config_hash and result.tags["status"] == "OOM"


def test_warm_cell_runs_with_the_sweeps_environment_of_now(compose, tmp_path, monkeypatch):
    """A forkserver child inherits the server's environment from when the server started; the cell must
    run with the sweep's environment and working directory of the moment it starts (here: the cache root)."""
    from harness.config import to_plain

    warm_up(SweepSettings())  # the server exists before the environment changes
    monkeypatch.setenv("QUANTBENCH_CACHE", str(fresh_cache(tmp_path / "cache")))
    monkeypatch.chdir(tmp_path)
    config = to_plain(compose([*TINY, "tracking.enabled=false", f"tracking.results_dir={tmp_path}/results"]))
    config.pop("hydra", None)
    result = run_isolated(config, SweepSettings(timeout_s=120))
    assert result.status == "OK", result.error
    assert result.tags["sweep.start_method"] == "forkserver"
    assert list((tmp_path / "cache" / "models").glob("tiny_random-*"))  # the child used the new cache root
    assert 0 <= result.metrics["cell_start_s"] <= result.metrics["cell_wall_s"]


def test_start_method_is_validated():
    with pytest.raises(ConfigError, match="sweep.start_method='fork' is not allowed; choose one of: forkserver, spawn"):
        SweepSettings(start_method="fork")


def test_a_swept_sweep_setting_is_checked_in_every_cell_before_any_runs():
    """The precheck read the sweep section of the base config only: -m sweep.start_method=spawn,fork ran the spawn
    cell, then FAILED the fork one, whose record (sweep is not in the config hash) overwrote the OK cell's."""
    from harness.cli import precheck

    assert precheck(["-m", "model=tiny_random", "sweep.start_method=spawn,fork"]) == \
        "sweep cell sweep.start_method=fork: sweep.start_method='fork' is not allowed; choose one of: forkserver, spawn"
    assert precheck(["-m", "model=tiny_random", "sweep.timeout_s=10,-1"]) == \
        "sweep cell sweep.timeout_s=-1: sweep.timeout_s=-1 must be > 0"
    assert precheck(["-m", "model=tiny_random", "sweep.start_method=spawn,forkserver"]) is None


def test_a_launcher_limit_against_a_non_finite_timeout_is_a_line_not_an_overflow():
    from harness.sweep.launchers import time_limit_problem

    local = {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher", "timeout_min": 60}
    for timeout in (float("inf"), float("nan")):  # was OverflowError (inf) from math.floor
        problem = time_limit_problem(local, timeout, 600.0, 2)
        assert problem is not None and "give both as finite numbers of seconds" in problem, problem
    assert time_limit_problem(local, 60.0, 60.0, 2) is None


def test_cells_on_this_machine_take_turns_measuring(tmp_path, monkeypatch, capsys):
    """submitit_local starts every cell at once: each waits for the host's measuring lock, so no two measure on the
    same cores; a cell that runs elsewhere (exclusive=False) does not wait."""
    import threading

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv(LOCK_ENV, raising=False)  # the lock in the cache root, not this test worker's own
    events: list[str] = []

    def second(exclusive: bool) -> None:
        with isolated.measuring_turn(exclusive):
            events.append(f"second in (exclusive={exclusive})")

    with isolated.measuring_turn():
        events.append("first in")
        waiter = threading.Thread(target=second, args=(True,))
        waiter.start()
        elsewhere = threading.Thread(target=second, args=(False,))
        elsewhere.start()
        elsewhere.join(10)
        waiter.join(1.0)
        assert waiter.is_alive()  # still waiting for the first
        events.append("first out")
    waiter.join(10)
    assert events == ["first in", "second in (exclusive=False)", "first out", "second in (exclusive=True)"]
    assert "[wait] another cell on this machine is measuring (pid" in capsys.readouterr().out
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "own.lock"))  # processes on cores of their own: their own lock
    with isolated.measuring_turn():
        assert (tmp_path / "own.lock").read_text().startswith(f"pid {os.getpid()}, since ")


def test_a_lock_file_it_cannot_write_still_takes_turns_and_an_unusable_cache_is_one_warning(tmp_path, monkeypatch,
                                                                                            caplog):
    """Another user's measure.lock (or a read-only cache root) is locked through a read-only descriptor; a cache
    root that cannot be opened at all is warned in one line and the cell runs, never a FAILED cell."""
    import threading

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv(LOCK_ENV, raising=False)
    (tmp_path / "measure.lock").write_text("")
    real_open = os.open

    def read_only(path, flags, *args):  # root ignores file modes: refuse writing as another user's file would
        if str(path).endswith("measure.lock") and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(isolated.os, "open", read_only)
    events: list[str] = []

    def second() -> None:
        with isolated.measuring_turn():
            events.append("second in")

    with isolated.measuring_turn():
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive()  # the read-only lock still makes it wait
        events.append("first out")
    waiter.join(10)
    assert events == ["first out", "second in"]

    monkeypatch.setattr(isolated.os, "open", real_open)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "file" / "cache"))  # under a file: cannot be created
    with caplog.at_level("WARNING", logger="quantbench"), isolated.measuring_turn():
        events.append("ran without a turn")
    assert events[-1] == "ran without a turn"
    (line,) = [r.getMessage() for r in caplog.records if "not taking turns" in r.getMessage()]
    assert "measure.lock" in line and "set QUANTBENCH_CACHE to a writable folder" in line and "\n" not in line


def test_a_cells_child_interrupted_sends_its_killed_run_and_the_interrupt_pickles():
    """A SIGINT sent to a cell's child itself: runner.run re-raises it carrying the run KILLED as it stood, and the
    child sends that result (it sent a FAILED 'KeyboardInterrupt: ' before). In a process of its own: child_main
    takes its own process group."""
    import pickle

    from harness.interrupts import Interrupted

    code = """
import json, multiprocessing, os
from harness.run import runner
from harness.run.result import Result
from harness.sweep import isolated

def stopped(config):
    exc = KeyboardInterrupt()
    exc.result = Result(status="KILLED", config=config, error="interrupted (SIGINT, Ctrl-C) during loading")
    raise exc

runner.run = stopped
recv, send = multiprocessing.Pipe(duplex=False)
isolated.child_main({"name": "x"}, send, "", os.getpid())
recv.recv()  # ready
print(json.dumps(recv.recv()[1]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    sent = json.loads(out.stdout.strip().splitlines()[-1])
    assert (sent["status"], sent["error"]) == ("KILLED", "interrupted (SIGINT, Ctrl-C) during loading"), out.stderr
    again = pickle.loads(pickle.dumps(Interrupted(signal.SIGTERM)))  # a launcher may pickle a job's exception
    assert (again.signame, again.exit_code) == ("SIGTERM", 143)


def test_an_error_raised_in_the_sweep_kills_the_cells_child(compose, monkeypatch):
    """submitit's signal before its job limit raises in the job while the cell's child runs: the child must end
    with it (a live child kept the job in multiprocessing's exit handler forever: the sweep ended in a traceback)."""
    import psutil

    from harness.config import to_plain

    config = to_plain(compose(TINY))
    config.pop("hydra", None)
    real = isolated.mp_context
    seen: dict[str, int] = {}

    class Recv:  # the parent's end of the pipe: raises, as the signal handler would, once the child is ready
        def __init__(self, conn):
            self.conn = conn

        def poll(self, timeout=0.0):
            if "pid" in seen:
                raise RuntimeError("Job not requeued because: timed-out too many times.")
            return self.conn.poll(timeout)

        def recv(self):
            kind, value = self.conn.recv()
            seen["pid"] = value
            return kind, value

        def close(self):
            self.conn.close()

    def context(method):
        ctx = real(method)
        pipe = ctx.Pipe
        monkeypatch.setattr(ctx, "Pipe", lambda duplex: (lambda r, s: (Recv(r), s))(*pipe(duplex)), raising=False)
        return ctx

    monkeypatch.setattr(isolated, "mp_context", context)
    with pytest.raises(RuntimeError, match="timed-out"):
        run_isolated(config, SweepSettings(timeout_s=120), "hang")
    assert not psutil.pid_exists(seen["pid"]) or psutil.Process(seen["pid"]).status() == psutil.STATUS_ZOMBIE


def _spawned_child(pid: int, wait_s: float = 240) -> int:
    """The running cell's process under sweep `pid`: a spawned interpreter, or a child of the forkserver."""
    import psutil

    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        for p in psutil.Process(pid).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                if "spawn_main" in cmd or ("forkserver" in cmd and "forkserver" in " ".join(p.parent().cmdline())):
                    return p.pid
            except (psutil.Error, AttributeError):
                continue
        time.sleep(0.5)
    raise AssertionError("the sweep never started a cell")


def _popen(args: list[str], tmp: Path, faults: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != STATE_ENV}
    env[FAULT_ENV] = json.dumps(faults)
    return subprocess.Popen([sys.executable, "run.py", "-m", *TINY, f"tracking.results_dir={tmp}", f"hydra.sweep.dir={tmp}/hydra", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.serial  # a drill against a live process tree
def test_sigterm_kills_the_cell_and_closes_the_sweep(tmp_path):
    import psutil

    proc = _popen(["name=term", "quantizer=fp32"], tmp_path, {"hang": {"quantizer.dtype": "float32"}})
    child = _spawned_child(proc.pid)
    assert "forkserver" in " ".join(psutil.Process(child).parent().cmdline())  # a warm cell by default
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    (cell,) = invocation_cells(tmp_path / "term")
    assert cell["status"] == "KILLED" and "SIGTERM" in cell["error"]
    _, runs = mlflow_runs(tmp_path)
    assert {r.info.status for r in runs} == {"KILLED"} and len(runs) == 2  # parent + the cell
    assert (tmp_path / "term" / "report.md").exists()


@pytest.mark.heavy  # heavy tier (make test-heavy): keeps CI well inside 30 min on a cold machine
def test_sigkilled_sweep_leaves_no_orphan_and_next_start_marks_it_killed(tmp_path):
    import psutil

    proc = _popen(["name=stale", "quantizer=fp32"], tmp_path, {"hang": {"quantizer.dtype": "float32"}})
    child = _spawned_child(proc.pid)
    proc.kill()
    proc.wait(timeout=60)  # not communicate(): the forkserver and the cell hold the pipe until they notice
    deadline = time.monotonic() + 90
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the cell's child outlived its killed sweep"
        time.sleep(0.5)
    _, runs = mlflow_runs(tmp_path)
    (parent,) = runs
    assert parent.info.status == "RUNNING"  # what a SIGKILL leaves behind
    # the next start of any sweep in the experiment closes it (a cell that fails at once: out of memory)
    again = run_cli(["name=other", "quantizer=fp32"], tmp_path, {"oom": {"quantizer.dtype": "float32"}})
    assert again.returncode == 1
    assert "marked 1 stale run(s) KILLED" in again.stdout + again.stderr
    c, runs = mlflow_runs(tmp_path)
    assert c.get_run(parent.info.run_id).info.status == "KILLED"
    assert c.get_run(parent.info.run_id).data.tags["status"] == "KILLED"
    assert not [r for r in runs if r.info.status == "RUNNING"]


def test_bad_sweep_settings_stop_before_any_cell(tmp_path):
    done = run_cli(["name=bad", "quantizer=fp32,bf16", "sweep.timeout_s=-1"], tmp_path)
    assert done.returncode == 2
    assert "sweep.timeout_s=-1 must be > 0" in done.stderr
    assert not (tmp_path / "bad" / "cells").exists()


def test_cell_names_and_planned_cells(compose):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from harness.config import register_configs

    register_configs()
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=["+experiment=smoke"], return_hydra_config=True)
    from omegaconf import open_dict

    with open_dict(cfg):  # what Hydra holds in multirun mode for `-m +experiment=smoke measure.seed=0,1`
        cfg.hydra.overrides.task = ["+experiment=smoke", "measure.seed=0,1"]
    cells = planned_cells(cfg.hydra)
    assert len(cells) == 6  # 3 quantizers from the experiment's params x 2 seeds from the command line
    assert varying_keys(cells) == ("quantizer", "measure.seed")
    assert cell_label(["quantizer=bf16", "+experiment=smoke", "measure.seed=1"], ("quantizer", "measure.seed")) \
        == "quantizer=bf16,measure.seed=1"
    assert cell_label(["+experiment=smoke", "quantizer=bf16"], ()) == "quantizer=bf16"
    # a sweep of one cell (planned, nothing varies), or cells not known in advance: never where results go
    one = ["quantizer=none", "+sweep.start_method=spawn", "model=tiny_random", "tracking.results_dir=/tmp/r",
           "tracking.uri=sqlite:////tmp/r/mlflow.db", "hydra.sweep.dir=/tmp/r/sw"]
    assert cell_label(one, (), planned=True) == "default"
    unknown = cell_label(one, ())
    assert "tracking." not in unknown and "hydra." not in unknown and unknown.startswith("quantizer=none,")


def test_a_cell_name_an_earlier_invocation_gave_another_config_gets_its_hash(tmp_path):
    """`-m quantizer=none,bf16 strategy=greedy` then `-m quantizer=none,bf16 strategy=static_batch` into one sweep:
    both name a cell `quantizer=none`, and both hang under the one parent run; the second must be told apart."""
    state = SweepState(name="s", folder=str(tmp_path), invocation="inv1", commit="c", owner="o", tracking={})
    assert distinct_label(tmp_path, "quantizer=none", "aaaa1111bbbb") == "quantizer=none"  # no manifest yet
    append_manifest(state, "aaaa1111bbbb", "quantizer=none")
    assert distinct_label(tmp_path, "quantizer=none", "aaaa1111bbbb") == "quantizer=none"  # the same config again
    assert distinct_label(tmp_path, "quantizer=bf16", "cccc2222dddd") == "quantizer=bf16"
    assert distinct_label(tmp_path, "quantizer=none", "cccc2222dddd") == "quantizer=none #cccc222"


def _cell(label, quantizer, tps, kl=None, status="OK", batch=1, **extra):
    m = {"decode_tokens_per_s": tps, "decode_tokens_per_s_p10": tps * 0.9, "decode_tokens_per_s_p90": tps * 1.1,
         "batch_size": batch, "ttft_ms": 10.0, "weight_bytes": 2e6, **extra}
    if kl is not None:
        m["kl_div_mean"] = kl
    return {"status": status, "metrics": m if status == "OK" else {}, "error": "" if status == "OK" else "boom",
            "tags": {"sweep.cell": label, "quantizer.name": quantizer, "strategy.name": "StaticBatch"}}


def test_report_ratios_never_compare_across_models_or_machines():
    """A gpu_scaling sweep runs three shapes: each ratio is against its own shape's baseline, on its own machine;
    a cell whose shape has no baseline gets no ratio (not one against another shape's speed)."""
    cells = []
    for model, base, fast in (("1B", 300.0, 450.0), ("8B", 100.0, 180.0)):
        for q, tps in (("none", base), ("int4", fast)):
            c = _cell(f"{model}-{q}", q, tps, batch=1, batch_size=1)
            c["tags"]["model.name"] = model
            cells.append(c)
    orphan = _cell("3B-int4", "int4", 250.0)
    orphan["tags"]["model.name"] = "3B"
    elsewhere = _cell("8B-int4-h200", "int4", 500.0)
    elsewhere["tags"].update({"model.name": "8B", "device": "cuda", "device_name": "H200"})
    ratio = {r["cell"]: r["ratio"] for r in report.rows_for(cells + [orphan, elsewhere], "none")}
    assert ratio["1B-int4"] == pytest.approx(1.5) and ratio["8B-int4"] == pytest.approx(1.8)
    assert ratio["3B-int4"] is None and ratio["8B-int4-h200"] is None
    from harness.analysis import crossover, frontier

    pts = frontier.points(report.rows_for(cells + [orphan], "none"), "none")
    assert sorted((p.group, round(p.speedup, 2)) for p in pts if p.fmt == "int4") == [
        ("1B / StaticBatch / batch 1", 1.5), ("8B / StaticBatch / batch 1", 1.8)]
    four = _cell("8B-int4-b4", "int4", 200.0, batch=4)
    four["tags"]["model.name"] = "8B"
    four_base = _cell("8B-none-b4", "none", 400.0, batch=4)
    four_base["tags"]["model.name"] = "8B"
    curves = crossover.points(report.rows_for(cells + [four, four_base], "none"), "none")
    assert {k: [(p["batch"], round(p["measured"], 2)) for p in v] for k, v in curves.items()} == {
        "int4 @ 1B": [(1, 1.5)], "int4 @ 8B": [(1, 1.8), (4, 0.5)]}


def test_report_ratios_per_batch_and_optional_columns(tmp_path):
    cells = [_cell("b1-none", "none", 20.0, 0.0), _cell("b1-int8", "int8", 30.0, 0.01),
             _cell("b4-none", "none", 60.0, 0.0, batch=4), _cell("b4-int8", "int8", 45.0, 0.01, batch=4),
             _cell("bad", "int4", 0.0, status="CRASHED")]
    rows = report.rows_for(cells, "none")
    ratio = {r["cell"]: r["ratio"] for r in rows}
    assert ratio["b1-int8"] == pytest.approx(1.5) and ratio["b4-int8"] == pytest.approx(0.75)
    assert ratio["b4-none"] == pytest.approx(1.0) and ratio["bad"] is None
    md, png = report.write_report(tmp_path, cells, "none", "t")[:2]  # + crossover.png: batch sizes vary
    text = md.read_text()
    assert "roofline" not in report.markdown(rows, "none") and "| CRASHED |" in text and "**bad** [CRASHED]: boom" in text
    assert png.stat().st_size > 10_000
    cells[1]["metrics"]["roofline_fraction"] = 0.42
    assert "| 0.420 |" in report.markdown(report.rows_for(cells, "none"), "none") and "roofline" in \
        report.markdown(report.rows_for(cells, "none"), "none")


def test_report_command_regenerates_from_folder_and_mlflow(tmp_path):
    # a finished sweep's folder and store, written the way the sweep writes them (no model needed)
    from harness.config import TrackingConfig
    from harness.run.runner import Result

    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="rep", results_dir=str(tmp_path))
    state = SweepState(name="rep", folder=str(tmp_path / "rep"), invocation="inv1", commit="abc",
                       owner=owner_id(), tracking=vars(tcfg).copy())
    state.parent_run_id = open_parent_run(state, "")
    for label, q, tps in (("quantizer=none", "none", 10.0), ("quantizer=int8", "int8", 15.0)):
        r = Result(status="OK", config={"quantizer": {"q": q}}, metrics={"decode_tokens_per_s": tps,
                                                                        "kl_div_mean": 0.0 if q == "none" else 0.02},
                   tags={"quantizer.name": q, "strategy.name": "Greedy"}, config_hash=q * 2, started=time.time(),
                   ended=time.time())
        append_manifest(state, r.config_hash, label)
        record_cell(r, cell_path(Path(state.folder), r.config_hash), state, label, {}, None, tcfg)
    state.save()
    assert report.main([str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| quantizer=int8 | int8 |" in text and "| 1.50 |" in text
    out = tmp_path / "from_mlflow"
    assert report.main(["--mlflow-experiment", "rep", "--tracking-uri", tcfg.uri, "--out", str(out)]) == 0
    text2 = (out / "report.md").read_text()
    assert "| quantizer=int8 | int8 |" in text2 and "| 1.50 |" in text2
    assert report.main([str(tmp_path / "nope")]) == 2

    # resumed with another setting: the parent run is re-opened; both reports show the latest invocation's cells
    # only (the first invocation's children stay in MLflow), with its own ratio
    again = SweepState(name="rep", folder=str(tmp_path / "rep"), invocation="inv2", commit="abc",
                       owner=owner_id(), tracking=vars(tcfg).copy())
    again.parent_run_id = open_parent_run(again, state.parent_run_id)
    for label, q, tps in (("quantizer=none", "none", 20.0), ("quantizer=int8", "int8", 25.0)):
        r = Result(status="OK", config={"quantizer": {"q": q}, "measure": {"max_new_tokens": 16}},
                   metrics={"decode_tokens_per_s": tps}, tags={"quantizer.name": q, "strategy.name": "Greedy"},
                   config_hash=q * 3, started=time.time(), ended=time.time())
        append_manifest(again, r.config_hash, label)
        record_cell(r, cell_path(Path(again.folder), r.config_hash), again, label, {}, None, tcfg)
    again.save()
    for args in ([str(tmp_path / "rep"), "--out", str(tmp_path / "dir2")],
                 ["--mlflow-experiment", "rep", "--tracking-uri", tcfg.uri, "--out", str(tmp_path / "ml2")]):
        assert report.main(args) == 0
        table = [ln for ln in (Path(args[-1]) / "report.md").read_text().splitlines() if ln.startswith("| quantizer=")]
        assert len(table) == 2 and "| 1.25 |" in table[1], table


@pytest.mark.parametrize("ending", ["TIMEOUT", "FAILED"])
def test_a_failed_cell_names_its_strategy_as_an_ok_cell_does(compose, tmp_path, monkeypatch, ending):
    """A report table or MLflow's `strategy.name` column holds one spelling of a strategy: a cell that timed out
    (no child result) or failed in its run says "Greedy" as an OK cell does, not the option name "greedy"."""
    from harness.records.results import read_json
    from harness.records.rows import describe
    from harness.run import pipeline, runner
    from harness.sweep import cell

    monkeypatch.delenv(STATE_ENV, raising=False)
    monkeypatch.setattr(cell, "_hydra_job", lambda: ([], {"strategy": "greedy", "quantizer": "fp32"}, ""))

    def strategy_of(seed: int) -> str:
        config = compose([*TINY, "name=strat", "quantizer=fp32", "tracking.enabled=false",
                          f"tracking.results_dir={tmp_path}", f"measure.seed={seed}"])
        run_cell(config)
        (path,) = [p for p in (tmp_path / "strat" / "cells").glob("*.json") if read_json(p)["config"]["measure"]
                   ["seed"] == seed]
        return describe(read_json(path))["strategy"]

    monkeypatch.setattr(cell, "run_isolated", lambda config, *a, **k: runner.run(config))
    ok = strategy_of(0)
    if ending == "TIMEOUT":  # what _run_child returns for a cell past sweep.timeout_s
        monkeypatch.setattr(cell, "run_isolated", lambda config, *a, **k: isolated.finish(
            isolated.Result(status="TIMEOUT", config=config, error="cell exceeded sweep.timeout_s"), config, 0.0))
    else:  # the child's runner.run records a failure of the run itself
        def boom(self):
            raise RuntimeError("test fault in the run")
        monkeypatch.setattr(pipeline.Pipeline, "run", boom)
    assert (ok, strategy_of(1)) == ("Greedy", "Greedy")
