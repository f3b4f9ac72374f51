"""Tracking that survives: a dead or hung server costs seconds, the JSON keeps the numbers, `upload`
re-sends them exactly once, and concurrent writers into one SQLite store lose nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import warm
from conftest import ROOT

from harness.config import TrackingConfig
from harness.records import tracking
from harness.records.results import RESULT_KEY_TAG
from harness.run.runner import Result
from harness.sweep.parent import mark_stale


def fake_result(name: str, value: float, tcfg: TrackingConfig | None = None) -> Result:
    """A finished result as the runner returns it (tracking does not care how the numbers were made)."""
    now = time.time()
    config = {"model": {"name": name}, "measure": {"repetitions": 2},
              "tracking": dataclasses.asdict(tcfg or TrackingConfig(enabled=False))}
    return Result(status="OK", config=config,
                  metrics={"decode_tokens_per_s": value, "ttft_ms": 2 * value}, tags={"status": "OK"},
                  run_name=name, config_hash=uuid.uuid4().hex[:16], started=now - 1, ended=now)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runs_of(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id], max_results=1000)


@pytest.fixture()
def live_uri(mlflow_dir) -> str:
    return f"sqlite:///{mlflow_dir}/mlflow.db"


def test_dead_server_costs_seconds_then_upload_sends_once(tmp_path, live_uri, capsys):
    import mlflow  # noqa: F401 - import time is not the retry budget under test

    dead = TrackingConfig(uri=f"http://127.0.0.1:{closed_port()}", results_dir=str(tmp_path),
                          experiment=f"dead-{uuid.uuid4().hex[:8]}")
    result = fake_result("dead-server", 12.5)
    t0 = time.monotonic()
    path = tracking.record(result, dead)
    elapsed = time.monotonic() - t0
    # MLflow alone (7 retries, backoff 2, per call) would take minutes; ours: 3 quick retries
    assert elapsed < 8, f"a refused connection took {elapsed:.1f}s"
    data = json.loads(path.read_text())
    assert data["mlflow_run_id"] == ""
    assert "MlflowException" in data["tags"]["tracking_error"] and dead.uri in data["tags"]["tracking_error"]
    assert data["metrics"]["decode_tokens_per_s"] == 12.5
    assert os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") is None  # restored after the call

    # the server "comes back": the CLI re-sends to the live store
    assert tracking.main(["upload", str(tmp_path), "--uri", live_uri, "--experiment", dead.experiment]) == 0
    assert "uploaded 1, failed 0" in capsys.readouterr().out
    runs = runs_of(live_uri, dead.experiment)
    assert len(runs) == 1
    run = runs[0]
    data = json.loads(path.read_text())
    assert data["mlflow_run_id"] == run.info.run_id and "tracking_error" not in data["tags"]
    assert run.info.status == "FINISHED" and run.data.metrics["ttft_ms"] == 25.0
    assert "tracking_error" not in run.data.tags
    # a second upload has nothing to send, nor does MLflow's own copy of a logged result in results/mlartifacts
    copy = tmp_path / "mlartifacts" / "1" / run.info.run_id / "artifacts" / "result.json"
    copy.parent.mkdir(parents=True)
    copy.write_text(json.dumps({**data, "mlflow_run_id": ""}))  # logged before the run id was known
    assert tracking.upload(tmp_path, TrackingConfig(uri=live_uri, experiment=dead.experiment)) == (0, 0)
    assert len(runs_of(live_uri, dead.experiment)) == 1


def test_hung_server_is_bounded_by_the_timeout(tmp_path):
    import mlflow  # noqa: F401

    with socket.socket() as srv:  # accepts connections, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        tcfg = TrackingConfig(uri=f"http://127.0.0.1:{srv.getsockname()[1]}", results_dir=str(tmp_path),
                              timeout_s=1.0, retries=5)
        result = fake_result("hung-server", 3.0)
        t0 = time.monotonic()
        path = tracking.record(result, tcfg)
        elapsed = time.monotonic() - t0
    # one request timeout ends the retries (no 5 x 1 s, no MLflow 120 s default)
    assert elapsed < 4, f"a hung server took {elapsed:.1f}s"
    assert "tracking_error" in json.loads(path.read_text())["tags"]


def test_upload_adopts_a_run_whose_json_update_was_lost(tmp_path, live_uri):
    tcfg = TrackingConfig(uri=live_uri, results_dir=str(tmp_path), experiment=f"lost-{uuid.uuid4().hex[:8]}")
    result = fake_result("lost-update", 7.0, tcfg)
    path = tracking.record(result, tcfg)
    sent = json.loads(path.read_text())
    assert sent["mlflow_run_id"]
    sent["mlflow_run_id"] = ""  # as if the process died between MLflow and the JSON write-back
    path.write_text(json.dumps(sent))
    # the store is named explicitly; the experiment is each JSON's own (no --experiment)
    assert tracking.upload(tmp_path, TrackingConfig(uri=live_uri), own_experiment=True) == (1, 0)
    runs = runs_of(live_uri, tcfg.experiment)
    assert len(runs) == 1 and json.loads(path.read_text())["mlflow_run_id"] == runs[0].info.run_id


def test_upload_without_uri_refuses_and_never_follows_the_uri_inside_a_result(tmp_path, capsys):
    """A result JSON copied from elsewhere names a store of someone else's choosing: `upload` sends only where
    its user says (--uri), and without it says so in one line (exit 2), contacting nothing."""
    import threading

    contacted: list[bytes] = []
    with socket.socket() as srv:  # a store "elsewhere": records whoever connects, answers nothing
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        srv.settimeout(0.2)
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(0.5)
                    contacted.append(conn.recv(200) or b"?")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        elsewhere = TrackingConfig(uri=f"http://127.0.0.1:{srv.getsockname()[1]}", results_dir=str(tmp_path),
                                   experiment="copied", enabled=False, retries=0, timeout_s=1.0)
        path = tracking.record(fake_result("copied", 1.0, elsewhere), elsewhere)  # JSON only, never sent
        code = tracking.main(["upload", str(tmp_path)])
        code_experiment_only = tracking.main(["upload", str(tmp_path), "--experiment", "copied"])
        stop.set()
        thread.join(2)
    out, err = capsys.readouterr()
    assert contacted == [], contacted
    assert code == code_experiment_only == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and lines[0].startswith("error: upload needs --uri"), err
    assert repr(elsewhere.uri) in lines[0]  # what the files named, for a user who trusts them to copy
    assert json.loads(path.read_text())["mlflow_run_id"] == ""


def test_upload_replaces_a_half_logged_run(tmp_path, live_uri):
    from mlflow.tracking import MlflowClient

    tcfg = TrackingConfig(uri=live_uri, results_dir=str(tmp_path), experiment=f"half-{uuid.uuid4().hex[:8]}",
                          enabled=False)
    result = fake_result("half-logged", 5.0)
    path = tracking.record(result, tcfg)  # JSON only
    c = MlflowClient(live_uri)
    exp_id = c.create_experiment(tcfg.experiment)
    c.create_run(exp_id, tags={RESULT_KEY_TAG: result.tags[RESULT_KEY_TAG]})  # left RUNNING
    assert tracking.upload(tmp_path, TrackingConfig(uri=live_uri, experiment=tcfg.experiment)) == (1, 0)
    runs = runs_of(live_uri, tcfg.experiment)
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert runs[0].info.run_id == json.loads(path.read_text())["mlflow_run_id"]


WRITER = textwrap.dedent("""
    import sys, time, uuid
    from harness.records import tracking
    from harness.config import TrackingConfig
    from harness.run.runner import Result
    uri, out, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tcfg = TrackingConfig(uri=uri, results_dir=out, retries=0)  # no retries: only the lock can save us
    for k in range(n):
        r = Result(status="OK", config={"writer": who, "k": k}, metrics={"value": float(who * 100 + k)},
                   run_name=f"w{who}-{k}", config_hash=uuid.uuid4().hex[:16], started=time.time(),
                   ended=time.time())
        tracking.record(r, tcfg)
        print("ERR" if "tracking_error" in r.tags else "OK", r.tags.get("tracking_error", ""), flush=True)
""")


def test_four_concurrent_writers_into_a_fresh_sqlite_store_lose_nothing(tmp_path):
    # A fresh store is the worst case: every writer races MLflow's schema migration (without the lock
    # this run lost most results to "table _alembic_tmp_runs already exists" and "database is locked").
    # Four processes of their own, forked at once from the pre-imported server (tests/warm.py): they reach the store
    # together, where cold interpreters spent ~5 s each importing MLflow first (20 s of the test on one core).
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    with ThreadPoolExecutor(4) as pool:
        procs = list(pool.map(lambda i: warm.run([str(script), uri, str(tmp_path / f"w{i}"), str(i), "2"], ROOT, env,
                                                 tmp_path / f"procs{i}", timeout=300), range(4)))
    for p in procs:
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.split().count("OK") == 2 and "ERR" not in p.stdout, p.stdout + p.stderr[-2000:]
    runs = runs_of(uri, "quantbench")
    values = sorted(r.data.metrics["value"] for r in runs)
    assert values == [float(w * 100 + k) for w in range(4) for k in range(2)]
    assert all(r.info.status == "FINISHED" for r in runs)
    for w in range(4):  # every JSON points at its run
        for f in Path(tmp_path / f"w{w}").rglob("*.json"):
            assert json.loads(f.read_text())["mlflow_run_id"] in {r.info.run_id for r in runs}


def test_sweep_parent_run_calls_are_bounded_too():
    import mlflow  # noqa: F401



    dead = TrackingConfig(uri=f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    with pytest.raises(Exception, match="127.0.0.1"):
        mark_stale(dead)  # goes through mlflow_runs.client(): MLflow's own retries are off there too
    assert time.monotonic() - t0 < 8


def test_a_new_local_store_is_a_copy_of_an_empty_one_and_mlflow_migrates_nothing(tmp_path, monkeypatch):
    """harness/records/sqlite_seed.py: MLflow's ~60 migrations run once per MLflow version, into the cache."""
    import mlflow.store.db.utils as dbutils
    from mlflow.tracking import MlflowClient

    from harness.records.sqlite_seed import seeded

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    first = f"sqlite:///{tmp_path}/a/mlflow.db"
    (tmp_path / "a").mkdir()
    assert seeded(first) == first and (tmp_path / "a" / "mlflow.db").is_file()
    assert len(list((tmp_path / "cache" / "mlflow").glob("empty-*.db"))) == 1  # built by MLflow, once

    def no_migrations(*a, **k):
        raise AssertionError("MLflow migrated a seeded store")

    monkeypatch.setattr(dbutils, "_upgrade_db", no_migrations)
    (tmp_path / "b").mkdir()
    c = MlflowClient(tracking_uri=seeded(f"sqlite:///{tmp_path}/b/mlflow.db"))  # from the template: no migration
    exp = c.create_experiment("e")
    run = c.create_run(exp)
    c.log_metric(run.info.run_id, "decode_tokens_per_s", 12.5)
    assert c.get_run(run.info.run_id).data.metrics == {"decode_tokens_per_s": 12.5}
    default = c.get_experiment("0")  # where MLflow itself would have put it, from this folder
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    kept = tmp_path / "b" / "other.db"
    kept.write_bytes(b"not touched")
    assert seeded(f"sqlite:///{kept}") and kept.read_bytes() == b"not touched"  # an existing file stays as it is


def test_a_sweep_recorded_while_mlflow_was_down_uploads_under_one_parent_run_closed_as_it_ended(
        tmp_path, live_uri, capsys):
    """MLflow down for a whole sweep: no parent run, cells unsent. `upload` nests the cells under one parent
    run, ends it with the status the sweep recorded, and writes its id back so a resume re-opens it."""
    from mlflow.tracking import MlflowClient

    from harness.records.results import cell_path
    from harness.sweep import resume
    from harness.sweep.cell import append_manifest, record_cell
    from harness.sweep.parent import finish_sweep, open_parent_run
    from harness.sweep.settings import SweepState, owner_id

    dead = TrackingConfig(uri=f"http://127.0.0.1:{closed_port()}", results_dir=str(tmp_path), retries=1,
                          timeout_s=2, experiment=f"down-{uuid.uuid4().hex[:8]}")
    state = SweepState(name="down", folder=str(tmp_path / "down"), invocation="inv1", commit="c", owner=owner_id(),
                       tracking=dataclasses.asdict(dead), code="c0", planned=2)
    state.save()
    for label, value in (("quantizer=none", 10.0), ("quantizer=bf16", 20.0)):
        result = fake_result(label, value, dead)
        append_manifest(state, result.config_hash, label)
        record_cell(result, cell_path(Path(state.folder), result.config_hash), state, label, {}, None, dead)
    assert finish_sweep(state) == 0
    ended = json.loads((tmp_path / "down" / "sweep.json").read_text())
    assert ended["status"] == "OK" and not ended["parent_closed"] and not ended["parent_run_id"]

    held = resume.hold_folder(Path(state.folder), "down")  # a sweep running there: its folder is not touched
    try:
        assert tracking.upload(tmp_path, TrackingConfig(uri=live_uri, experiment=dead.experiment)) == (0, 2)
    finally:
        held.release()
    assert runs_of(live_uri, dead.experiment) == []

    assert tracking.main(["upload", str(tmp_path), "--uri", live_uri, "--experiment", dead.experiment]) == 0
    assert "uploaded 2, failed 0" in capsys.readouterr().out
    runs = runs_of(live_uri, dead.experiment)
    parents = [r for r in runs if r.data.tags.get("quantbench.role") == "sweep"]
    cells = [r for r in runs if r.data.tags.get("quantbench.role") == "cell"]
    assert len(parents) == 1 and len(cells) == 2 and len(runs) == 3
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["status"] == "OK"
    assert parent.data.tags["quantbench.invocation"] == "inv1" and parent.data.tags["summary"] == "2 OK"
    assert {c.data.tags["mlflow.parentRunId"] for c in cells} == {parent.info.run_id}
    assert "report.md" in {a.path for a in MlflowClient(live_uri).list_artifacts(parent.info.run_id)}
    settled = json.loads((tmp_path / "down" / "sweep.json").read_text())
    assert settled["parent_run_id"] == parent.info.run_id and settled["parent_closed"]

    # nothing left to send, and the next invocation of the sweep re-opens the same parent run
    assert tracking.upload(tmp_path, TrackingConfig(uri=live_uri, experiment=dead.experiment)) == (0, 0)
    again = SweepState(name="down", folder=state.folder, invocation="inv2", commit="c", owner=owner_id(),
                       tracking=dataclasses.asdict(dataclasses.replace(dead, uri=live_uri)), code="c0")
    assert open_parent_run(again, settled["parent_run_id"]) == parent.info.run_id
    assert len(runs_of(live_uri, dead.experiment)) == 3


def test_an_explicit_sqlite_store_keeps_its_artifacts_beside_the_database(tmp_path, monkeypatch):
    """Not MLflow's default ./mlruns under the folder the run started in (a checkout, a home folder)."""
    from harness.records.mlflow_runs import artifacts_beside

    assert artifacts_beside("sqlite:////data/x/m.db") == "file:///data/x/mlartifacts"
    assert artifacts_beside("http://127.0.0.1:5000") is None and artifacts_beside("sqlite:///:memory:") is None
    start = tmp_path / "elsewhere"
    start.mkdir()
    monkeypatch.chdir(start)
    store = tmp_path / "store"
    tcfg = TrackingConfig(uri=f"sqlite:///{store}/m.db", results_dir=str(tmp_path / "results"), experiment="beside")
    store.mkdir()
    path = tracking.record(fake_result("beside", 3.0, tcfg), tcfg)
    run = runs_of(tcfg.uri, "beside")[0]
    assert json.loads(path.read_text())["mlflow_run_id"] == run.info.run_id
    assert run.info.artifact_uri.startswith((store / "mlartifacts").as_uri()), run.info.artifact_uri
    assert (store / "mlartifacts").is_dir() and not (start / "mlruns").exists()


def test_a_down_database_store_is_bounded_by_the_timeout_too(tmp_path):
    """MLflow makes a database store's engine in 10 attempts with ~100 s of sleep between them (was 103 s here, with
    timeout_s=1): one attempt per call of ours, the result kept and the error recorded within seconds."""
    tcfg = TrackingConfig(uri=f"postgresql://qb@127.0.0.1:{closed_port()}/mlflow", results_dir=str(tmp_path),
                          timeout_s=1.0, retries=1, experiment="pg-down")
    t0 = time.monotonic()
    path = tracking.record(fake_result("pg-down", 1.0, tcfg), tcfg)
    assert time.monotonic() - t0 < 20
    data = json.loads(path.read_text())
    assert data["mlflow_run_id"] == "" and "OperationalError" in data["tags"]["tracking_error"]
    from mlflow.store.db import utils as db_utils

    assert db_utils.MAX_RETRY_COUNT == 10  # MLflow's own default is back after our calls


def test_upload_leaves_a_result_alone_while_its_run_is_sending_it(tmp_path, live_uri, monkeypatch):
    # A result JSON is on disk, unsent, while `record` logs its run (RUNNING): an upload at that moment deleted
    # the run as a dead attempt and sent the result again, under the feet of the process still logging it.
    from mlflow.tracking import MlflowClient

    tcfg = TrackingConfig(uri=live_uri, results_dir=str(tmp_path), experiment=f"live-{uuid.uuid4().hex[:8]}")
    result = fake_result("being-sent", 6.0)
    path = tracking.json_path(result, tcfg)
    seen: dict = {}
    real_log = tracking.log_to_mlflow

    def log_while_an_upload_runs(res, target, *args, **kwargs):
        c = MlflowClient(live_uri)
        exp = c.get_experiment_by_name(target.experiment)
        exp_id = exp.experiment_id if exp else c.create_experiment(target.experiment)
        half = c.create_run(exp_id, tags={RESULT_KEY_TAG: res.tags[RESULT_KEY_TAG]})  # this process's run, RUNNING
        seen["unsent_on_disk"] = json.loads(path.read_text())["mlflow_run_id"] == ""
        seen["upload"] = tracking.upload(tmp_path, dataclasses.replace(target, enabled=True))
        seen["half_status"] = c.get_run(half.info.run_id).info.lifecycle_stage
        c.delete_run(half.info.run_id)  # (the real logger finishes its own run; this one stands in for it)
        return real_log(res, target, *args, **kwargs)

    monkeypatch.setattr(tracking, "log_to_mlflow", log_while_an_upload_runs)
    assert tracking.record(result, tcfg) == path
    assert seen == {"unsent_on_disk": True, "upload": (0, 1), "half_status": "active"}, seen
    runs = [r for r in runs_of(live_uri, tcfg.experiment)]
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert json.loads(path.read_text())["mlflow_run_id"] == runs[0].info.run_id
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the lock file went with the lock
    with tracking.sending(path, wait=False) as held:  # and nothing holds it now
        assert held
