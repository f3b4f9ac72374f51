"""Resume keys (a done cell is reused only for the same code, CPU and library versions; `unknown` never
matches) and exit codes (a sweep or run in which nothing ran OK exits 1 with one line saying why).

The resume tests call `run_cell` in-process (as a Hydra job does) on the tiny model; each run of a
cell is a real forkserver child, so a reuse or a rerun is what a user's sweep does.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from harness.cache import LOCK_ENV
from harness.config import TrackingConfig
from harness.records.results import cell_path
from harness.run.runner import Result
from harness.sweep import resume
from harness.sweep.cell import append_manifest, record_cell, run_cell
from harness.sweep.parent import finish_sweep
from harness.sweep.settings import FAULT_ENV, STATE_ENV, SweepState, owner_id

TINY = ["model=tiny_random", "measure.max_new_tokens=2", "measure.repetitions=1", "measure.warmup=0",
        "accuracy.enabled=false", "name=resume"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_code_version_hashes_the_uncommitted_diff_and_untracked_python(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / "README.md").write_text("doc\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "c")
    sha = _git(repo, "rev-parse", "HEAD")
    clean = resume.code_version(repo)
    assert clean == sha[:12]
    (repo / "a.py").write_text("x = 2\n")
    one = resume.code_version(repo)
    (repo / "a.py").write_text("x = 3\n")
    two = resume.code_version(repo)
    # git_commit says "<sha>-dirty" for both edits; the code version tells them apart
    assert one.startswith(sha[:12] + "-dirty.") and two.startswith(sha[:12] + "-dirty.") and one != two
    (repo / "new_quantizer.py").write_text("y = 1\n")  # untracked code runs too
    three = resume.code_version(repo)
    assert three not in (one, two)
    (repo / "README.md").write_text("other doc\n")  # documentation does not change a number
    assert resume.code_version(repo) == three
    assert resume.code_version(tmp_path / "not_a_repo") == "unknown"


def test_resume_key_parts_and_unknown_never_matches():
    key = {"code": "abc123", "cpu": "AMD EPYC (AuthenticAMD family 26 model 2, avx512_bf16)", "torch": "2.13.0",
           "torchao": "0.18.0"}
    tags = {resume.KEY_TAG: json.dumps(key)}
    assert resume.differences(tags, key) == []
    moved = {**key, "cpu": "AMD EPYC (AuthenticAMD family 25 model 1, avx2)", "torch": "2.14.0"}
    why = resume.differences(tags, moved)
    assert any(w.startswith("cpu differs") and "family 25" in w for w in why)
    assert "torch differs (stored 2.13.0, now 2.14.0)" in why
    unknown = {**key, "code": "unknown"}
    assert resume.differences({resume.KEY_TAG: json.dumps(unknown)}, unknown) == [
        "code version unknown (not a git checkout?): never reused"]
    assert resume.differences({"git_commit": "abc123"}, key) == [
        "the stored result has no resume key (recorded by an older quantbench)"]
    key_lib = resume.differences(tags, {**key, "torchao": "0.19.0"})
    assert key_lib == ["torchao differs (stored 0.18.0, now 0.19.0)"]


@pytest.fixture()
def state(tmp_path, monkeypatch):
    from harness.config import TrackingConfig

    st = SweepState(name="resume", folder=str(tmp_path / "resume"), invocation="inv1", commit="c0ffee-dirty",
                    owner=owner_id(), tracking=vars(TrackingConfig(enabled=False)).copy(),
                    code="c0ffee0000aa")
    monkeypatch.setenv(STATE_ENV, str(st.save()))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return st


def _cell(st: SweepState) -> dict:
    (path,) = (Path(st.folder) / "cells").glob("*.json")
    return json.loads(path.read_text())


def test_a_done_cell_is_reused_only_for_the_same_code_cpu_and_versions(compose, state, tmp_path, capsys,
                                                                       monkeypatch):
    cfg = compose([*TINY, f"tracking.results_dir={tmp_path}", "tracking.enabled=false"])
    assert run_cell(cfg) == 0
    first = _cell(state)
    assert first["status"] == "OK", first["error"]
    key = json.loads(first["tags"][resume.KEY_TAG])
    assert key["code"] == "c0ffee0000aa" and key["torch"] and "family" in key["cpu"]
    capsys.readouterr()

    # same key: reused, and the line and the tag say why
    assert run_cell(cfg) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("[skip]"))
    assert "same code c0ffee0000aa" in line and f"torch {key['torch']}" in line and key["cpu"] in line, out
    again = _cell(state)
    assert again["started"] == first["started"]  # not rerun
    assert "same code c0ffee0000aa" in again["tags"]["resume.reused"]

    # other code (another uncommitted diff) now, another CPU and torch in the stored result: rerun, naming each
    path = next((Path(state.folder) / "cells").glob("*.json"))
    moved = {**again, "tags": {**again["tags"], resume.KEY_TAG: json.dumps(
        {**key, "cpu": "Other CPU (x family 1 model 1, avx2)", "torch": "1.0"})}}
    path.write_text(json.dumps(moved))
    state.code = "c0ffee0000aa-dirty.123456789abc"
    state.save()
    assert run_cell(cfg) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("[rerun]")]
    assert "code differs (stored c0ffee0000aa, now c0ffee0000aa-dirty.123456789abc)" in line, out
    assert "cpu differs (stored Other CPU" in line and f"torch differs (stored 1.0, now {key['torch']})" in line, out
    third = _cell(state)
    assert third["started"] > first["started"] and "torch differs" in third["tags"]["resume.rerun"]

    # the same cell where fewer cores may be used now (taskset; measure.threads=0 takes them all): rerun
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7, 8}, raising=True)
    assert run_cell(cfg) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[rerun]")]
    assert f"threads differs (stored {key['threads']}, now 9)" in line

    # outside git: `unknown` is never reused, not even against a result recorded as `unknown`
    state.code = "unknown"
    state.save()
    path.write_text(json.dumps({**third, "tags": {**third["tags"], resume.KEY_TAG: json.dumps(
        {**json.loads(third["tags"][resume.KEY_TAG]), "code": "unknown"})}}))
    assert run_cell(cfg) == 0
    out = capsys.readouterr().out
    assert "[rerun]" in out and "code version unknown (not a git checkout?): never reused" in out, out
    assert _cell(state)["started"] > third["started"]


def test_a_speculative_drafts_library_is_part_of_the_key(compose, state, tmp_path, monkeypatch):
    """A torchao upgrade changes a cell whose draft is torchao_int8 (the target's quantizer is torch's own)."""
    import harness.sweep.cell as cell

    def no_child(config, settings, fault="", exclusive=True):  # the key is made before the child: no run needed
        return Result(status="OK", config=config, started=time.time(), ended=time.time())

    monkeypatch.setattr(cell, "run_isolated", no_child)
    cfg = compose([*TINY, "strategy=speculative", "quantizer@strategy.draft_quantizer=torchao_int8",
                   f"tracking.results_dir={tmp_path}", "tracking.enabled=false"])
    assert run_cell(cfg) == 0
    key = json.loads(_cell(state)["tags"][resume.KEY_TAG])
    assert key["torchao"] not in ("", resume.UNKNOWN) and "gpu" not in key  # a CPU cell: no GPU part


def test_a_cuda_cells_key_names_its_gpu_model(monkeypatch):
    from quantizers.dtype import Dtype

    calls = []

    def smi(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="NVIDIA H100 80GB HBM3\n", stderr="")

    monkeypatch.setattr(resume.subprocess, "run", smi)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    key = resume.cell_key("abc", Dtype(), cuda=True)
    assert key["gpu"] == "NVIDIA H100 80GB HBM3" and calls[0][:3] == ["nvidia-smi", "-i", "3"]
    assert "gpu" not in resume.cell_key("abc", Dtype())
    why = resume.differences({resume.KEY_TAG: json.dumps({**key, "gpu": "NVIDIA H200"})}, key)
    assert why == ["gpu differs (stored NVIDIA H200, now NVIDIA H100 80GB HBM3)"]  # same CPU, another GPU: rerun
    monkeypatch.setattr(resume.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("smi")))
    assert resume.cell_key("abc", Dtype(), cuda=True)["gpu"] == resume.UNKNOWN  # no nvidia-smi: never reused


# ------------------------------------------------------------------------------------ exit codes (item 2)
def test_a_sweep_in_which_nothing_ran_exits_1_with_one_line(tmp_path, capsys):
    """All cells SKIPPED (measure.device=cuda on a CPU machine): nothing was measured, so exit 1."""
    from harness.config import TrackingConfig

    folder = tmp_path / "empty"
    st = SweepState(name="empty", folder=str(folder), invocation="inv", commit="c", owner=owner_id(),
                    tracking=vars(TrackingConfig(enabled=False)).copy(), planned=2)
    why = "needs CUDA: measure.device=cuda but no CUDA device is visible; use measure.device=cpu"
    for q in ("fp32", "bf16"):
        r = Result(status="SKIPPED", config={"quantizer": q}, error=why, config_hash=q * 4, started=time.time(),
                   ended=time.time(), tags={"status": "SKIPPED", "quantizer.name": q})
        append_manifest(st, r.config_hash, f"quantizer={q}")
        record_cell(r, cell_path(folder, r.config_hash), st, f"quantizer={q}", {}, None, st.tcfg)
    st.save()
    capsys.readouterr()
    assert finish_sweep(st) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"sweep empty: nothing ran: all 2 cell(s) SKIPPED ({why}); exit 1", last

    # one OK cell beside the SKIPPED ones: the sweep measured something, exit 0
    ok = Result(status="OK", config={"quantizer": "none"}, metrics={"decode_tokens_per_s": 1.0}, config_hash="ok" * 4,
                started=time.time(), ended=time.time(), tags={"quantizer.name": "none"})
    append_manifest(st, ok.config_hash, "quantizer=none")
    record_cell(ok, cell_path(folder, ok.config_hash), st, "quantizer=none", {}, None, st.tcfg)
    st.planned = 3
    assert finish_sweep(st) == 0
    assert "nothing ran" not in capsys.readouterr().out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a CPU-only host (SKIPPED = needs CUDA)")
def test_a_single_run_that_cannot_run_here_exits_1_saying_nothing_ran(compose, tmp_path, capsys):
    from harness import cli

    cfg = compose([*TINY, "measure.device=cuda", f"tracking.results_dir={tmp_path}", "tracking.enabled=false"])
    assert cli.run_one(cfg) == 1
    err = capsys.readouterr().err
    assert ("nothing ran: the run was SKIPPED (needs CUDA: measure.device=cuda but no CUDA device is visible; "
            "use measure.device=cpu); exit 1") in err, err


def test_a_cell_on_this_machine_holds_its_turn_through_its_record(compose, state, tmp_path, monkeypatch):
    """The measuring turn covers the whole cell, its MLflow record included: a submitit_local job recording its
    cell must not load the cores under the next cell's timing. The child itself takes no second turn."""
    import fcntl

    import harness.sweep.cell as cell

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(LOCK_ENV, raising=False)  # the lock in the cache root, not this test worker's own
    held: dict[str, bool] = {}

    def turn_taken() -> bool:  # another open file description cannot take the lock while the cell holds it
        fd = os.open(tmp_path / "cache" / "measure.lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def no_child(config, settings, fault="", exclusive=True):
        held["child"], held["child_exclusive"] = turn_taken(), exclusive
        return Result(status="OK", config=config, started=time.time(), ended=time.time())

    def recording(*args, **kwargs):
        held["record"] = turn_taken()
        return real_record(*args, **kwargs)

    real_record = cell.record_cell
    monkeypatch.setattr(cell, "run_isolated", no_child)
    monkeypatch.setattr(cell, "record_cell", recording)
    assert run_cell(compose([*TINY, f"tracking.results_dir={tmp_path}", "tracking.enabled=false"])) == 0
    assert held == {"child": True, "child_exclusive": False, "record": True}
    assert not turn_taken()  # released when the cell ends


# --------------------------------------------------------------------------------- upload and the report
def _finished_sweep(tmp_path: Path, planned: int = 2) -> tuple[SweepState, TrackingConfig]:
    """A sweep of a none and a bf16 cell, logged to tmp_path/mlflow.db under its parent run (finish_sweep ends it)."""
    from harness.sweep.parent import open_parent_run

    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="up", results_dir=str(tmp_path))
    st = SweepState(name="up", folder=str(tmp_path / "up"), invocation="inv1", commit="c", owner=owner_id(),
                    tracking=vars(tcfg).copy(), planned=planned)
    st.parent_run_id = open_parent_run(st, "")
    for q in ("none", "bf16"):
        r = Result(status="OK", config={"quantizer": {"name": q}}, metrics={"decode_tokens_per_s": 1.0},
                   config_hash=q * 4, started=time.time(), ended=time.time(), tags={"quantizer.name": q})
        append_manifest(st, r.config_hash, f"quantizer={q}")
        record_cell(r, cell_path(Path(st.folder), r.config_hash), st, f"quantizer={q}", {}, None, tcfg)
    st.save()
    return st, tcfg


def test_an_upload_that_cannot_send_a_cell_still_ends_the_parent_run_as_the_sweep_ended(tmp_path, monkeypatch):
    """A finished sweep (parent FINISHED, status OK) with one cell unsent: `upload` re-opened the parent run to nest
    the cell and ended it only once every cell was in, so one cell MLflow refused left it RUNNING (and the next
    sweep's start marked it KILLED)."""
    from mlflow.tracking import MlflowClient

    from harness.records import tracking

    st, tcfg = _finished_sweep(tmp_path)
    assert finish_sweep(st) == 0
    path = cell_path(Path(st.folder), "none" * 4)  # its run never reached MLflow (another result key: no match)
    data = json.loads(path.read_text())
    data["mlflow_run_id"], data["tags"]["result_key"] = "", "unsent-key"
    path.write_text(json.dumps(data))
    real = tracking.log_to_mlflow

    def refuse(*args, **kwargs):
        raise RuntimeError("simulated: database is locked")

    monkeypatch.setattr(tracking, "log_to_mlflow", refuse)
    assert tracking.upload(tmp_path, tcfg) == (0, 1)
    run = MlflowClient(tcfg.uri).get_run(st.parent_run_id)
    assert (run.info.status, run.data.tags["status"]) == ("FINISHED", "OK")
    assert run.data.tags["summary"].startswith("2 OK; 1 cell(s) not sent to MLflow by upload"), run.data.tags
    assert json.loads((Path(st.folder) / "sweep.json").read_text())["parent_closed"] is True

    monkeypatch.setattr(tracking, "log_to_mlflow", real)  # the store takes it now: sent, and ended again
    assert tracking.upload(tmp_path, tcfg) == (1, 0)
    run = MlflowClient(tcfg.uri).get_run(st.parent_run_id)
    assert (run.info.status, run.data.tags["status"], run.data.tags["summary"]) == ("FINISHED", "OK", "2 OK")
    assert json.loads(path.read_text())["mlflow_run_id"]


def test_jobs_that_never_reported_are_listed_and_counted_in_the_report(tmp_path, capsys):
    """4 jobs planned, 2 reported, one died after adding itself to the manifest, one before: the terminal and the
    parent's summary said "2 never reported", but report.md (logged to the parent too) showed 2 cells, all OK."""
    from harness.records import report

    st, _ = _finished_sweep(tmp_path, planned=4)
    append_manifest(st, "int8" * 4, "quantizer=int8")  # a job that died before writing cells/<hash>.json
    assert finish_sweep(st) == 1
    out = capsys.readouterr().out
    assert report.main([st.folder, "--out", str(tmp_path / "again")]) == 0  # regenerated from the folder: the same
    for md in (Path(st.folder) / "report.md", tmp_path / "again" / "report.md"):
        text = md.read_text()
        assert "4 cell(s): 2 NOT REPORTED, 2 OK." in text, text
        did_not_finish = text.split("## Cells that did not finish", 1)[1]
        assert "- **quantizer=int8** [NOT REPORTED]: the job died, or could not write its result" in did_not_finish
        assert "- **unnamed job 1** [NOT REPORTED]: the job never started" in did_not_finish
    assert "2 OK, 2 never reported" in out and "  [NOT REPORTED] quantizer=int8: the job died" in out, out


def test_a_resumed_sweeps_parent_run_gives_back_only_the_drift_probes_of_its_latest_invocation(tmp_path):
    """A resumed sweep keeps one parent run: inv1 probed both cells, inv2 only the none cell. bf16's drift_probe.*
    metrics from inv1 stayed on the run and the MLflow report read them back as inv2's."""
    from harness.records import sweeps
    from harness.sweep.parent import close_parent_run, open_parent_run

    st, tcfg = _finished_sweep(tmp_path)

    def probe(chash: str, tps: float) -> dict:
        return {"status": "OK", "metrics": {"decode_tokens_per_s": tps}, "tags": {sweeps.OF_TAG: chash}}

    assert close_parent_run(st, "OK", "2 OK", [], [probe("none" * 4, 10.0), probe("bf16" * 4, 20.0)])
    first = st.parent_run_id
    st.invocation = "inv2"
    st.parent_run_id = open_parent_run(st, first)
    assert st.parent_run_id == first  # a resume re-opens the one parent run
    assert close_parent_run(st, "OK", "2 OK", [], [probe("none" * 4, 11.0)])
    got = sweeps.latest_from_mlflow(tcfg.uri, "up", "up")
    assert {p["tags"][sweeps.OF_TAG]: p["metrics"]["decode_tokens_per_s"] for p in got.probes} == {"none" * 4: 11.0}


def test_upload_nests_the_cells_logged_while_the_sweeps_parent_run_was_missing(tmp_path):
    """MLflow was down when the sweep started (no parent run) and up when its cells ended: they were logged
    top-level. `upload` made the sweep a parent run but nested only unsent cells under it, so the sweep's MLflow
    report found no cells."""
    from mlflow.tracking import MlflowClient

    from harness.records import tracking

    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="up", results_dir=str(tmp_path))
    st = SweepState(name="up", folder=str(tmp_path / "up"), invocation="inv1", commit="c", owner=owner_id(),
                    tracking=vars(tcfg).copy(), planned=2)
    st.parent_run_id = ""  # the store refused the parent run at the start
    for q in ("none", "bf16"):
        r = Result(status="OK", config={"quantizer": {"name": q}}, metrics={"decode_tokens_per_s": 1.0},
                   config_hash=q * 4, started=time.time(), ended=time.time(), tags={"quantizer.name": q})
        append_manifest(st, r.config_hash, f"quantizer={q}")
        record_cell(r, cell_path(Path(st.folder), r.config_hash), st, f"quantizer={q}", {}, None, tcfg)
    st.status, st.summary = "OK", "2 OK"
    st.save()
    c = MlflowClient(tcfg.uri)
    runs = {q: json.loads(cell_path(Path(st.folder), q * 4).read_text())["mlflow_run_id"] for q in ("none", "bf16")}
    assert all(runs.values()) and not any("mlflow.parentRunId" in c.get_run(r).data.tags for r in runs.values())
    assert tracking.upload(tmp_path, tcfg) == (0, 0)
    parent = json.loads((Path(st.folder) / "sweep.json").read_text())["parent_run_id"]
    assert parent and c.get_run(parent).info.status == "FINISHED"
    for q, rid in runs.items():
        assert c.get_run(rid).data.tags.get("mlflow.parentRunId") == parent, q
        assert json.loads(cell_path(Path(st.folder), q * 4).read_text())["tags"]["parent_run_id"] == parent
