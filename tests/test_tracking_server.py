"""A real PostgreSQL + MLflow server (harness.server), two sweeps writing into it at once through the
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

from harness.server import pg_bin, tracking_server

pytestmark = pytest.mark.slow


def sweep_cmd(name: str, results: Path, uri: str, sweep_dir: Path) -> list[str]:
    return [sys.executable, "run.py", "-m", "model=tiny_random", "quantizer=none,bf16", f"name={name}",
            "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=1", "accuracy.enabled=false",
            "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep_dir}", f"tracking.uri={uri}",
            "tracking.experiment=server-test", f"tracking.results_dir={results}"]


# heavy tier (make test-heavy, ~1 min): CI runs the documented `python -m harness.server --postgres-dir` command
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
