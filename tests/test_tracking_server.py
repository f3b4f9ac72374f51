"""A real PostgreSQL + MLflow server (harness.records.server), two sweeps writing into it at once through the
submitit_local launcher: every cell of both is recorded exactly once, with its metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT

from harness.records import server
from harness.records.server import pg_bin, tracking_server

pytestmark = pytest.mark.slow


def sweep_cmd(name: str, results: Path, uri: str, sweep_dir: Path) -> list[str]:
    return [sys.executable, "run.py", "-m", "model=tiny_random", "quantizer=none,bf16", f"name={name}",
            "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=1", "accuracy.enabled=false",
            "sweep.timeout_s=300", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep_dir}", f"tracking.uri={uri}",
            "tracking.experiment=server-test", f"tracking.results_dir={results}"]


# heavy tier (make test-heavy, ~1 min): CI runs the documented `python -m harness.records.server --postgres-dir` command
@pytest.mark.heavy
def test_two_concurrent_sweeps_into_postgres_backed_server(tmp_path):
    pg_bin("initdb")  # a missing PostgreSQL is a setup error (scripts/setup.sh --all), not a skip
    # PostgreSQL runs as the `postgres` user when we are root: its data dir must be reachable by it,
    # which pytest's per-user 0700 tmp root is not
    pg_dir = Path(tempfile.mkdtemp(prefix="qb-pg-"))
    try:
        with tracking_server(tmp_path / "artifacts", tmp_path / "server.log", postgres_dir=pg_dir) as srv:
            assert srv.backend_uri.startswith("postgresql")
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            procs = {name: subprocess.Popen(sweep_cmd(name, tmp_path / name, srv.url, tmp_path / f"hydra-{name}"),
                                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)
                     for name in ("sweep-a", "sweep-b")}
            outs = {name: p.communicate(timeout=600)[0] for name, p in procs.items()}
            for name, p in procs.items():
                assert p.returncode == 0, outs[name][-4000:]
                assert "Submitit 'local' sweep output dir" in outs[name]

            from mlflow.tracking import MlflowClient

            c = MlflowClient(srv.url)
            exp = c.get_experiment_by_name("server-test")
            runs = c.search_runs([exp.experiment_id], max_results=1000)
            parents = {r.data.tags["quantbench.sweep"]: r for r in runs
                       if r.data.tags.get("quantbench.role") == "sweep"}
            cells = [r for r in runs if r.data.tags.get("quantbench.role") == "cell"]
            assert sorted(parents) == ["sweep-a", "sweep-b"]
            assert all(p.info.status == "FINISHED" for p in parents.values())
            assert len(cells) == 4  # 2 sweeps x 2 cells, no duplicates, nothing lost
            by_id = {r.info.run_id: r for r in cells}
            for name in ("sweep-a", "sweep-b"):
                jsons = [json.loads(p.read_text()) for p in (tmp_path / name / name / "cells").glob("*.json")]
                assert sorted(j["tags"]["quantizer.name"] for j in jsons) == ["bf16", "none"]
                for j in jsons:
                    run = by_id[j["mlflow_run_id"]]
                    assert run.data.tags["mlflow.parentRunId"] == parents[name].info.run_id
                    assert run.info.status == "FINISHED" and j["status"] == "OK"
                    assert run.data.tags["quantizer.name"] == j["tags"]["quantizer.name"]
                    assert run.data.metrics["decode_tokens_per_s"] == pytest.approx(j["metrics"]["decode_tokens_per_s"])
                    assert run.data.metrics["generated_tokens"] == j["metrics"]["generated_tokens"] > 0
            # artifacts went through the server into its artifact root
            arts = {a.path for a in c.list_artifacts(cells[0].info.run_id)}
            assert "result.json" in arts
            assert any((tmp_path / "artifacts").rglob("result.json"))
        # torn down: the server's port no longer answers, the database is stopped
        assert srv.proc.poll() is not None
        assert not (pg_dir / "postmaster.pid").exists()
    finally:
        shutil.rmtree(pg_dir, ignore_errors=True)


def _hba_methods(data_dir: Path) -> list[str]:
    lines = [ln.split() for ln in (data_dir / "pg_hba.conf").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return [ln[-1] for ln in lines]


@pytest.fixture()
def pg_dir():
    pg_bin("initdb")  # a missing PostgreSQL is a setup error (scripts/setup.sh --all), not a skip
    path = Path(tempfile.mkdtemp(prefix="qb-pg-"))  # reachable by the `postgres` user when we are root
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def argv_seen(monkeypatch) -> list[list[str]]:
    """Every command line harness.records.server starts (subprocess.run and Popen), as the kernel would show it."""
    seen: list[list[str]] = []
    real_run, real_popen = subprocess.run, subprocess.Popen

    def run(args, *a, **k):
        seen.append([str(x) for x in args])
        return real_run(args, *a, **k)

    class Popen(real_popen):
        def __init__(self, args, *a, **k):
            seen.append([str(x) for x in args])
            super().__init__(args, *a, **k)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(subprocess, "Popen", Popen)
    return seen


def test_local_postgres_asks_for_a_password_that_no_command_line_shows(pg_dir, argv_seen):
    """`--postgres-dir`: scram-sha-256 on every line of pg_hba.conf (no trust: any local user would be
    superuser, and through COPY ... PROGRAM run shell commands as postgres), a generated password in a 0600
    file, and the password on no command line: not ours, not PostgreSQL's processes, not the MLflow server's."""
    import stat

    import psutil

    pg = server.Postgres(pg_dir, server.free_port()).start()
    try:
        methods = _hba_methods(pg_dir)
        assert methods and set(methods) == {"scram-sha-256"}, methods
        secret_file = pg.password_file
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600 and secret_file.stat().st_uid == os.geteuid()
        password = secret_file.read_text().strip().rsplit(":", 1)[-1]
        assert len(password) >= 32
        assert password not in pg.uri() and "@127.0.0.1" in pg.uri()
        cmdlines = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
        assert not [c for c in cmdlines + [" ".join(a) for a in argv_seen] if password in c]
        assert any("postgres" in " ".join(a) for a in argv_seen)  # the recorder saw initdb, pg_ctl, psql ...

        # the door is locked: no password, no entry; the password file lets our clients in
        psql = [pg_bin("psql"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", server.PG_USER, "-d", "mlflow", "-w",
                "-tAc", "SELECT current_user"]
        bare = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        refused = subprocess.run(psql, env={**bare, "PGPASSFILE": os.devnull}, capture_output=True, text=True)
        assert refused.returncode != 0 and "password" in refused.stderr, refused.stderr
        allowed = subprocess.run(psql, env={**bare, **pg.client_env()}, capture_output=True, text=True)
        assert allowed.returncode == 0 and allowed.stdout.strip() == server.PG_USER, allowed.stderr

        # the MLflow server gets the URI by environment, never on its command line
        cmd, env = server.mlflow_launch(pg.uri(), pg_dir / "artifacts", 5000, client_env=pg.client_env())
        assert "--backend-store-uri" not in cmd and not [a for a in cmd if "postgresql" in a or password in a]
        assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://") and password not in str(env)
        assert env["PGPASSFILE"] == str(secret_file)
    finally:
        pg.stop()


def test_a_cluster_made_with_trust_auth_is_locked_on_its_next_start(pg_dir):
    """A cluster an older quantbench made (initdb --auth=trust) gets a password and scram-sha-256 lines."""
    user = server._run_as()
    if user:
        import pwd

        pw = pwd.getpwnam(user)
        os.chown(pg_dir, pw.pw_uid, pw.pw_gid)
    os.chmod(pg_dir, 0o700)
    made = subprocess.run(server._cmd([pg_bin("initdb"), "-D", str(pg_dir), "-U", server.PG_USER, "--auth=trust",
                                       "-E", "UTF8", "--no-instructions"], user), capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert "trust" in _hba_methods(pg_dir)
    pg = server.Postgres(pg_dir, server.free_port()).start()
    try:
        assert set(_hba_methods(pg_dir)) == {"scram-sha-256"}
        psql = [pg_bin("psql"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", server.PG_USER, "-d", "mlflow", "-w",
                "-tAc", "SELECT 1"]
        bare = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        assert subprocess.run(psql, env={**bare, "PGPASSFILE": os.devnull}, capture_output=True).returncode != 0
        assert subprocess.run(psql, env={**bare, **pg.client_env()}, capture_output=True).returncode == 0
    finally:
        pg.stop()


def test_a_password_on_the_command_line_is_refused_and_never_printed(capsys, monkeypatch):
    """`--backend-store-uri` with a password would show it in `ps`: refused in one line (exit 2); the URI may
    come by environment instead, and what is printed of it has no password."""
    assert server.main(["--backend-store-uri", "postgresql://mlflow:s3cret-pw@db.invalid:5432/mlflow"]) == 2
    err = capsys.readouterr().err
    assert "s3cret-pw" not in err and len(err.strip().splitlines()) == 1 and "MLFLOW_BACKEND_STORE_URI" in err, err
    assert server.redact("postgresql+psycopg2://mlflow:s3cret-pw@db:5432/x") == "postgresql+psycopg2://mlflow:***@db:5432/x"
    cmd, env = server.mlflow_launch("postgresql://mlflow:s3cret-pw@db:5432/x", Path("/tmp/a"), 5000)
    assert "s3cret-pw" not in " ".join(cmd) and "s3cret-pw" in env["MLFLOW_BACKEND_STORE_URI"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # the tracking server binds to loopback only


def test_the_ui_refuses_a_store_uri_with_a_password(capsys):
    from harness.records import ui

    assert ui.main(["--backend-store-uri", "postgresql://mlflow:s3cret-pw@127.0.0.1:9/x", "--links"]) == 2
    err = capsys.readouterr().err
    assert "holds a password" in err and "s3cret-pw" not in err and "mlflow:***@" in err
    # in the query string (libpq takes it from there): refused too, and masked, before `mlflow ui` gets it in argv
    assert ui.main(["--backend-store-uri", "postgresql://mlflow@127.0.0.1:9/x?sslmode=off&password=s3cret-pw",
                    "--links"]) == 2
    err = capsys.readouterr().err
    assert "holds a password" in err and "s3cret-pw" not in err and "password=***" in err, err


def test_make_ui_starts_mlflow_without_its_job_runner(tmp_path, monkeypatch):
    """`make ui` (harness.records.ui) serves runs only, as `python -m harness.records.server` does: MLflow's job
    execution (GenAI evaluation jobs, ~6 extra worker processes) is off in the environment it execs the UI with."""
    from harness.records import ui

    monkeypatch.delenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", raising=False)
    started: list[tuple[list[str], dict]] = []
    monkeypatch.setattr(ui.os, "execv", lambda path, argv: started.append((argv, dict(os.environ))))
    monkeypatch.setattr(ui.os, "execve", lambda path, argv, env: started.append((argv, dict(env))), raising=False)
    assert ui.main(["--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db", "--port", "5999"]) == 0
    ((argv, env),) = started
    assert argv[1:4] == ["-m", "mlflow", "ui"] and "5999" in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # the UI can change and delete runs: loopback only
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == server.mlflow_launch("sqlite:///x", tmp_path, 1)[1][
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]
