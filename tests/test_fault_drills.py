"""Fault drills: each ends with a clear message and no lost result.

(a) the disk fills while a cell's result is written; (b) the MLflow server dies mid-sweep; (c) SIGKILL
while a result JSON is being written; (d) two sweeps resume the same folder at once; (e) Ctrl-C or SIGTERM
stops a single run while it measures. Cells run on the tiny model, as a sweep runs them (a) (b) or through
the real CLI (d) (e).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT

from harness.config import TrackingConfig
from harness.records import results, tracking
from harness.records.results import RESCUE_ENV, invocation_cells
from harness.run.runner import Result
from harness.sweep import resume
from harness.sweep.cell import run_cell
from harness.sweep.parent import finish_sweep, mark_stale, open_parent_run
from harness.sweep.settings import FAULT_ENV, STATE_ENV, SweepState, owner_id

# the drills that race real processes against timeouts run in the serial pass, never beside another test;
# the disk-full drills are in-process and race nothing
serial = pytest.mark.serial

TINY = ["model=tiny_random", "measure.max_new_tokens=2", "measure.repetitions=1", "measure.warmup=0",
        "accuracy.enabled=false"]


def _state(tmp_path: Path, name: str, tcfg: TrackingConfig, monkeypatch) -> SweepState:
    st = SweepState(name=name, folder=str(tmp_path / name), invocation="inv1", commit="c",
                    owner=owner_id(), tracking=vars(tcfg).copy(), code="c0ffee0000aa", planned=1)
    if tcfg.enabled:
        st.parent_run_id = open_parent_run(st, "")
    monkeypatch.setenv(STATE_ENV, str(st.save()))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return st


# ------------------------------------------------------------------------------------------- (a) ENOSPC
def test_disk_full_while_a_result_is_written_keeps_it_and_says_where(compose, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="enospc", results_dir=str(tmp_path))
    st = _state(tmp_path, "full", tcfg, monkeypatch)
    rescue = tmp_path / "rescue"
    monkeypatch.setenv(RESCUE_ENV, str(rescue))
    cells = Path(st.folder) / "cells"
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:  # the results folder's disk is full: its writes fail, others work
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(cells)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    cfg = compose([*TINY, "name=full", f"tracking.results_dir={tmp_path}", f"tracking.uri={tcfg.uri}",
                   "tracking.experiment=enospc"])
    assert run_cell(cfg) == 1  # the cell ran OK but is not in the sweep's folder
    out = capsys.readouterr()
    text = out.out + out.err
    (kept,) = rescue.glob("*.json")
    assert "[OK] " in text and "No space left on device" in text and str(kept) in text, text
    data = json.loads(kept.read_text())
    target = cells / f"{data['config_hash']}.json"
    assert f"cp {kept} {target}" in text, text  # what to do once there is space again
    assert data["status"] == "OK" and data["metrics"]["decode_tokens_per_s"] > 0
    assert not list(cells.glob("*")), list(cells.glob("*"))  # no partial file left behind
    run = MlflowClient(tcfg.uri).get_run(data["mlflow_run_id"])  # MLflow got the numbers too
    assert run.data.metrics["decode_tokens_per_s"] == data["metrics"]["decode_tokens_per_s"]

    # space again: the copy the message names goes back, and resume reuses it (nothing measured twice)
    monkeypatch.setattr(os, "fsync", real_fsync)
    subprocess.run(["cp", str(kept), str(target)], check=True)
    assert run_cell(cfg) == 0
    assert "[skip]" in capsys.readouterr().out


def test_disk_full_everywhere_prints_the_result_itself(tmp_path, monkeypatch, capsys):
    def no_space(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(results, "write_json_atomic", no_space)  # what save_result calls
    monkeypatch.setenv(RESCUE_ENV, str(tmp_path / "rescue"))
    result = Result(status="OK", config={"model": "m"}, metrics={"decode_tokens_per_s": 42.5}, run_name="r",
                    config_hash="abcd" * 4, started=time.time(), ended=time.time())
    tracking.record(result, TrackingConfig(enabled=False, results_dir=str(tmp_path)))
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):])["metrics"]["decode_tokens_per_s"] == 42.5
    assert "could not write the result anywhere" in err, err


def test_a_bug_in_a_cells_preflight_is_a_failed_cell_not_a_lost_one(compose, tmp_path, monkeypatch, capsys):
    """An exception that is not a QuantbenchError (a library's own import error, a bug) fails that cell, recorded
    with its error, and returns to the sweep like any failed cell."""
    from quantizers.base import Quantizer

    def broken(self, device):
        raise ModuleNotFoundError("No module named 'optimum'")

    monkeypatch.setattr(Quantizer, "preflight", broken)
    st = _state(tmp_path, "bug", TrackingConfig(enabled=False, results_dir=str(tmp_path)), monkeypatch)
    assert run_cell(compose([*TINY, "name=bug", f"tracking.results_dir={tmp_path}", "tracking.enabled=false"])) == 1
    (cell,) = (Path(st.folder) / "cells").glob("*.json")
    data = json.loads(cell.read_text())
    assert data["status"] == "FAILED" and data["error"] == "ModuleNotFoundError: No module named 'optimum'"
    assert data["tags"]["cpu.family"] and data["tags"]["version.torch"]  # where and with what it was tried
    assert "[FAILED]" in capsys.readouterr().out


# -------------------------------------------------------------------------------- (b) MLflow server dies
SERVER = textwrap.dedent("""
    # The real MLflow tracking app in one process (`mlflow server` takes ~17 s to start its workers here)
    import os, sys
    os.environ["_MLFLOW_SERVER_FILE_STORE"] = sys.argv[1]
    os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = sys.argv[2]
    os.environ["_MLFLOW_SERVER_SERVE_ARTIFACTS"] = "false"
    from werkzeug.serving import make_server
    from mlflow.server import app
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    print(srv.server_port, flush=True)
    srv.serve_forever()
""")


@serial
def test_mlflow_server_dies_mid_sweep_results_stay_and_upload_later(compose, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    db = f"sqlite:///{tmp_path}/server.db"
    server = subprocess.Popen([sys.executable, "-c", SERVER, db, str(tmp_path / "artifacts")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        MlflowClient(url).search_experiments()  # its first request migrates the fresh store (seconds): not under test
        tcfg = TrackingConfig(uri=url, experiment="dies", results_dir=str(tmp_path), retries=1, timeout_s=10)
        st = _state(tmp_path, "dies", tcfg, monkeypatch)  # the sweep's parent run, on the live server
        st.planned = 2
        st.save()
        base = [*TINY, "name=dies", f"tracking.results_dir={tmp_path}", f"tracking.uri={url}",
                "tracking.experiment=dies", "tracking.retries=1", "tracking.timeout_s=10"]
        assert run_cell(compose([*base, "quantizer=none"])) == 0  # logged while the server lives
        os.killpg(server.pid, signal.SIGKILL)  # the server dies mid-sweep
        server.wait(10)
        t0 = time.monotonic()
        assert run_cell(compose([*base, "quantizer=bf16"])) == 0  # the cell is OK; only MLflow failed
        assert finish_sweep(st) == 0
        assert time.monotonic() - t0 < 60
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "not in MLflow" in ln]
    assert lines == [f"sweep dies: 1 cell(s) not in MLflow (logging to {url} failed); their results are in "
                     f"{st.folder}/cells; re-send with: python -m harness.records.tracking upload {st.folder} --uri {url}"], out
    cells = {c["tags"]["quantizer.name"]: c for c in invocation_cells(Path(st.folder))}
    assert cells["bf16"]["status"] == "OK" and not cells["bf16"]["mlflow_run_id"]
    assert url in cells["bf16"]["tags"]["tracking_error"]

    # the server is back (here: its store, read directly): one upload sends what was missing, under the parent
    store = TrackingConfig(uri=db, experiment="dies")
    assert tracking.main(["upload", st.folder, "--uri", db, "--experiment", "dies"]) == 0
    assert "uploaded 1, failed 0" in capsys.readouterr().out
    c = MlflowClient(db)
    runs = c.search_runs([c.get_experiment_by_name("dies").experiment_id])
    kids = {r.data.tags["quantizer.name"]: r for r in runs if r.data.tags.get("quantbench.role") == "cell"}
    assert sorted(kids) == ["bf16", "none"]
    assert kids["bf16"].data.tags["mlflow.parentRunId"] == st.parent_run_id
    assert kids["bf16"].data.metrics["decode_tokens_per_s"] == cells["bf16"]["metrics"]["decode_tokens_per_s"]
    # the sweep could not close its parent run (the server was dead): upload closed it as the sweep ended
    parent = c.get_run(st.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["status"] == "OK", parent.data.tags
    assert tracking.upload(Path(st.folder), store) == (0, 0)  # nothing sent twice


# --------------------------------------------------------------------------- (c) SIGKILL during the write
WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from harness.records.results import write_json_atomic
    path, n = Path(sys.argv[1]), int(sys.argv[2])
    k = 0
    while True:
        k += 1
        # json.dump writes a big document in many small pieces: a kill lands inside it
        write_json_atomic(path, {"k": k, "values": list(range(n)), "end": k})
        print(k, flush=True)
""")


@serial
def test_sigkill_while_the_result_is_written_leaves_old_or_whole_json(tmp_path):
    target = tmp_path / "cells" / "abc.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = random.Random(26)
    seen: set[int] = set()
    partial_seen = 0
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), "200000"], env=env,
                                stdout=subprocess.PIPE, text=True)
        if target.exists() or rng.random() < 0.5:
            proc.stdout.readline()  # at least one whole write done in this process
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.wait(10)
        partial_seen += bool(list(target.parent.glob("*.tmp")))
        if target.exists():
            data = json.loads(target.read_text())  # never a partial document
            assert data["k"] == data["end"] and data["values"] == list(range(200000))
            seen.add(data["k"])
    assert target.exists() and partial_seen, "no kill landed inside a write; the drill proved nothing"
    # the leftovers of interrupted writes are not results: the next sweep start removes them
    removed = resume.remove_partial_writes(tmp_path)
    assert removed and not list(target.parent.glob("*.tmp"))
    assert json.loads(target.read_text())["k"] in seen


# ----------------------------------------------------------------------------- (d) two sweeps at once
def _sweep_cmd(tmp: Path, *args: str) -> list[str]:
    return [sys.executable, "run.py", "-m", *TINY, "name=twice", "quantizer=fp32", "tracking.experiment=twice",
            f"tracking.results_dir={tmp}", *args]


def _cell_process(sweep_pid: int, manifest: Path, wait_s: float = 240) -> int:
    """The running cell's process under sweep `sweep_pid`: a fork (same command line) of the sweep's forkserver,
    started after the cell's manifest line. A helper the forkserver's imports run (`ldconfig -p` from
    ctypes.util.find_library) is its child too, but execs another program, and comes before any cell."""
    import psutil

    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if manifest.exists():
            for p in psutil.Process(sweep_pid).children(recursive=True):
                try:
                    server = p.parent()
                    if (server.pid != sweep_pid and "forkserver" in " ".join(server.cmdline())
                            and p.cmdline() == server.cmdline()):
                        return p.pid
                except (psutil.Error, AttributeError):
                    continue
        time.sleep(0.3)
    raise AssertionError("the sweep never started a cell")


@serial
def test_two_sweeps_on_one_folder_the_second_refuses_then_a_sigkilled_sweep_is_cleaned_up(tmp_path):
    """(d), then the fast form of test_sweep.py's heavy SIGKILL drill on the same (hanging) first sweep:
    its cell exits by itself, the next start's call marks its MLflow runs KILLED, its folder is free."""
    import psutil
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    first = subprocess.Popen(_sweep_cmd(tmp_path, f"hydra.sweep.dir={tmp_path}/h1"), cwd=ROOT,
                             env={**env, FAULT_ENV: json.dumps({"hang": {"quantizer.dtype": "float32"}})},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cell = _cell_process(first.pid, tmp_path / "twice" / "manifest.jsonl")  # the first sweep's cell is running (and hangs)
        second = subprocess.run(_sweep_cmd(tmp_path, f"hydra.sweep.dir={tmp_path}/h2"), cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        host = __import__("socket").gethostname()
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        (line,) = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
        assert line.startswith(f"error: sweep twice is already running on {tmp_path / 'twice'} (pid {first.pid} on "
                               f"{host}, since "), line
        assert line.endswith("wait for it to finish, or stop it; a sweep resumes by running it again"), line
        assert "Launching" not in second.stdout + second.stderr  # refused before any cell
    finally:
        first.kill()  # SIGKILL: no cleanup of its own
        first.wait(60)
    deadline = time.monotonic() + 30  # the cell checks for its sweep every second
    while psutil.pid_exists(cell) and psutil.Process(cell).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the cell's child outlived its killed sweep"
        time.sleep(0.3)
    folder = tmp_path / "twice"
    entries = [json.loads(ln) for ln in (folder / "manifest.jsonl").read_text().splitlines()]
    assert len(entries) == 1  # one cell, started once, by the first sweep; its manifest line is intact
    assert not list((folder / "cells").glob("*.json"))  # no cell ran to the end: none twice

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(uri)
    (parent,) = c.search_runs([c.get_experiment_by_name("twice").experiment_id])
    assert parent.info.status == "RUNNING"  # what a SIGKILL leaves behind
    assert mark_stale(TrackingConfig(uri=uri, experiment="twice")) == [parent.info.run_id]  # any next start
    run = c.get_run(parent.info.run_id)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"
    assert "marked KILLED on the next start" in run.data.tags["error"]
    resume.hold_folder(folder, "twice").release()  # the dead sweep's hold on its folder went with it


# ------------------------------------------------------------------ (e) Ctrl-C or SIGTERM during a single run
# not `serial`: no race to time (the run measures for hours after its log says it loaded), so it shares the cores
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_single_run_stopped_while_it_measures_is_recorded_killed(tmp_path, sig):
    """`python run.py` (no sweep) stopped after its model loaded: result JSON and MLflow run KILLED, the line
    saying where they are, exit 130/143, as an interrupted sweep's cell."""
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    args = [sys.executable, "run.py", "model=tiny_random", "measure.max_new_tokens=64", "measure.repetitions=100000",
            "measure.warmup=0", "accuracy.enabled=false", "tracking.experiment=stopped",
            f"tracking.results_dir={tmp_path}", f"hydra.run.dir={tmp_path}/run"]
    # SIGINT as a terminal's Ctrl-C sends it, even where the test runner ignores SIGINT (a background job)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        log = tmp_path / "run" / "run.log"  # the weights' loading bar goes to the run's log
        deadline = time.monotonic() + 240
        while not (log.exists() and "Loading weights" in log.read_text(errors="replace")):
            assert proc.poll() is None, f"the run ended before it measured: {proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "the run never loaded its model"
            time.sleep(0.2)
        time.sleep(2.0)  # loaded: the timed repetitions (hours of them) run now
        proc.send_signal(sig)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + sig, out[-3000:]
    files = list((tmp_path / "runs").glob("*.json"))
    assert len(files) == 1, f"no result JSON: {out[-3000:]}"
    data = json.loads(files[0].read_text())
    name = signal.Signals(sig).name
    assert data["status"] == "KILLED" and data["tags"]["status"] == "KILLED", data["status"]
    assert data["error"].startswith(f"interrupted ({name}") and " during " in data["error"], data["error"]
    assert "decode_tokens_per_s" not in data["metrics"]  # no repetition was timed to its end: no speed
    assert f"result: {files[0]}" in out, out[-3000:]  # one line says where the record is
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(data["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED", run.data.tags
