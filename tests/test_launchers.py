"""Hydra's submitit launcher: the SLURM config renders the sbatch array we document (no cluster needed),
and the smoke sweep under submitit_local (every cell its own process) records what the basic launcher
records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def compose_with_hydra(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def sbatch_script(overrides: list[str], cells: int, tmp_path: Path, monkeypatch) -> str:
    """What the slurm launcher would hand to sbatch for a sweep of `cells` cells."""
    import submitit
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    cfg = compose_with_hydra(["hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}/sweep", *overrides])
    HydraConfig.instance().set_config(cfg)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=lambda c: 0, config=cfg)
    captured = {}

    class Submitted(Exception):
        pass

    def capture(self, fn, *iterables):  # the launcher's real executor, stopped just before sbatch runs
        captured["executor"], captured["n"] = self, len(iterables[0])
        raise Submitted

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    # submitit only builds a SLURM executor where `srun` exists: pretend to be a login node
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\necho 'not a cluster' >&2; exit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(Submitted):
        launcher.launch([[f"quantizer=q{i}"] for i in range(cells)], initial_job_idx=0)
    slurm = captured["executor"]._executor
    assert isinstance(slurm, submitit.SlurmExecutor) and captured["n"] == cells
    slurm.parameters["map_count"] = cells  # what submitit sets for an array submission
    return slurm._make_submission_file_text(slurm._submitit_command_str, "test")


def test_slurm_launcher_defaults_render_a_gpu_job_array(tmp_path, monkeypatch):
    script = sbatch_script([], cells=20, tmp_path=tmp_path, monkeypatch=monkeypatch)
    lines = set(script.splitlines())
    assert "#SBATCH --gpus-per-task=1" in lines
    assert "#SBATCH --cpus-per-task=8" in lines
    assert "#SBATCH --mem=64GB" in lines
    assert "#SBATCH --time=180" in lines  # above task_accuracy's 7200 + 600 s per cell
    assert "#SBATCH --array=0-19%8" in lines  # 20 cells, at most 8 at once
    assert not any(line.startswith("#SBATCH --partition") for line in lines)  # the cluster's default
    assert "#SBATCH --signal=USR2@120" in lines  # submitit's warning before the time limit
    # job logs under the sweep's folder, one per array task
    assert f"#SBATCH --output={tmp_path}/sweep/.submitit/%A_%a/%A_%a_0_log.out" in lines
    assert sys.executable in script and "submitit.core._submit" in script


def test_slurm_launcher_overrides_reach_sbatch(tmp_path, monkeypatch):
    script = sbatch_script(["hydra.launcher.partition=a100", "hydra.launcher.account=team-llm",
                            "hydra.launcher.gpus_per_task=2", "hydra.launcher.timeout_min=30",
                            "hydra.launcher.array_parallelism=2"], cells=3, tmp_path=tmp_path,
                           monkeypatch=monkeypatch)
    lines = set(script.splitlines())
    assert {"#SBATCH --partition=a100", "#SBATCH --account=team-llm", "#SBATCH --gpus-per-task=2",
            "#SBATCH --time=30", "#SBATCH --array=0-2%2"} <= lines


def test_launcher_configs_compose_and_unknown_fields_fail():
    from hydra.errors import ConfigCompositionException

    local = compose_with_hydra(["hydra/launcher=local"]).hydra.launcher
    # a week, no requeue: the local launcher's cells wait for each other's turn within their jobs' limit
    assert local._target_.endswith("LocalLauncher") and local.timeout_min == 10080 and local.max_num_timeout == 0
    bare = compose_with_hydra(["hydra/launcher=submitit_slurm"]).hydra.launcher
    assert bare._target_.endswith("SlurmLauncher") and bare.gpus_per_task is None
    with pytest.raises(ConfigCompositionException, match="partitoin"):  # typed schema: typos fail early
        compose_with_hydra(["hydra/launcher=slurm", "hydra.launcher.partitoin=a100"])


def mlflow_cells(uri: str, experiment: str) -> tuple[list, list]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    runs = c.search_runs([c.get_experiment_by_name(experiment).experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("quantbench.role") == "sweep"]
    cells = [r for r in runs if r.data.tags.get("quantbench.role") == "cell"]
    return parents, cells


# heavy tier (make test-heavy, ~50 s): CI runs the documented submitit_local smoke sweep (tests/test_docs.py)
@pytest.mark.heavy
def test_smoke_sweep_under_submitit_local_matches_the_basic_launcher(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = ["+experiment=smoke", f"tracking.results_dir={tmp_path}", f"tracking.uri={uri}",
              "tracking.experiment=launchers"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "run.py", *common, "hydra/launcher=submitit_local",
                           f"hydra.sweep.dir={tmp_path}/multirun"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Submitit 'local' sweep output dir" in proc.stdout + proc.stderr

    # every cell ran as its own submitit job: a local job's id is its process id, one log folder each
    jobs = [p for p in (tmp_path / "multirun" / ".submitit").iterdir() if p.is_dir() and p.name.isdigit()]
    assert len(jobs) == 3 and all(list(j.glob("*_result.pkl")) for j in jobs)
    cells = [json.loads(p.read_text()) for p in (tmp_path / "smoke" / "cells").glob("*.json")]
    assert sorted(c["tags"]["quantizer.name"] for c in cells) == ["bf16", "fp16", "none"]
    assert all(c["status"] == "OK" and c["metrics"]["decode_tokens_per_s"] > 0 for c in cells)
    # the three jobs started at once, yet measured one at a time (the host's measuring lock): no two overlap
    spans = sorted((c["started"], c["ended"]) for c in cells)
    assert all(end <= later_start for (_, end), (later_start, _) in zip(spans, spans[1:], strict=False)), spans
    assert {c["tags"]["sweep.launcher"] for c in cells} == {"LocalLauncher"}

    parents, runs = mlflow_cells(uri, "launchers")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(runs) == 3
    by_id = {r.info.run_id: r for r in runs}
    for c in cells:  # each JSON points at its nested run, which holds the same numbers
        run = by_id[c["mlflow_run_id"]]
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.info.status == "FINISHED"
        assert run.data.metrics["decode_tokens_per_s"] == pytest.approx(c["metrics"]["decode_tokens_per_s"])
        assert run.data.tags["quantizer.name"] == c["tags"]["quantizer.name"]
        assert run.data.params["quantizer.dtype"] == str(c["config"]["quantizer"]["dtype"])

    # the basic launcher sees the very same cells (same config hashes): resume skips all three, and
    # the sweep's MLflow record stays one parent run with three children
    proc = subprocess.run([sys.executable, "run.py", *common, f"hydra.sweep.dir={tmp_path}/multirun-basic"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[skip]") == 3, proc.stdout[-3000:]
    parents2, runs2 = mlflow_cells(uri, "launchers")
    assert [p.info.run_id for p in parents2] == [parents[0].info.run_id]
    assert sorted(r.info.run_id for r in runs2) == sorted(by_id)


def test_a_launcher_job_limit_below_the_sweeps_timeouts_is_refused_in_one_line():
    from harness.cli import precheck

    tiny = ["-m", "quantizer=none,bf16", "model=tiny_random"]
    problem = precheck([*tiny, "hydra/launcher=local", "hydra.launcher.timeout_min=1", "sweep.timeout_s=240"])
    # 2 cells in turn, each up to 240 + 600 s, plus submitit's 30 s warning: 1710 s
    assert problem and "\n" not in problem and "set hydra.launcher.timeout_min=29 or more" in problem, problem
    assert "hydra.launcher.timeout_min=141" in precheck([*tiny, "hydra/launcher=submitit_local"])  # bare: 60 min
    assert precheck([*tiny, "hydra/launcher=local"]) is None
    assert precheck(["+experiment=smoke", "hydra/launcher=submitit_local"]) is None  # the documented smoke: fits
    slurm = precheck([*tiny, "hydra/launcher=slurm", "hydra.launcher.timeout_min=60"])  # one cell per node
    assert "a cell may take sweep.startup_timeout_s + sweep.timeout_s = 4200 s" in slurm, slurm
    assert "hydra.launcher.timeout_min=73 or more" in slurm  # 4200 s + its 120 s signal_delay_s


def test_a_launcher_error_out_of_the_sweep_closes_it(tmp_path, monkeypatch):
    """submitit raising out of Hydra's sweep (a job past its limit) skips the callback's end: run.py closes the
    sweep through launcher_failed, so sweep.json gets a status and the report is written."""
    from harness.records.results import cell_path
    from harness.run.result import Result
    from harness.sweep import parent
    from harness.sweep.cell import append_manifest, record_cell
    from harness.sweep.settings import SweepState, owner_id

    state = SweepState(name="lim", folder=str(tmp_path / "lim"), invocation="inv1", commit="c", owner=owner_id(),
                       tracking={"enabled": False, "results_dir": str(tmp_path)}, planned=2,
                       sweep={"drift_probe": "all"})
    ok = Result(status="OK", config={"quantizer": {"q": "none"}}, metrics={"decode_tokens_per_s": 9.0},
                tags={"quantizer.name": "none"}, config_hash="aa" * 6, started=1.0, ended=2.0)
    append_manifest(state, ok.config_hash, "quantizer=none")
    record_cell(ok, cell_path(Path(state.folder), ok.config_hash), state, "quantizer=none", {}, None, state.tcfg)
    monkeypatch.setitem(parent._OPEN, "state", state)
    monkeypatch.setattr(parent.drift, "run_probes", lambda *a, **k: pytest.fail("no probe after a launcher error"))
    UncompletedJobError = type("UncompletedJobError", (RuntimeError,), {"__module__": "submitit.core.utils"})

    line = parent.launcher_failed(UncompletedJobError("Job 123 has not produced any output\n(state: FINISHED)"))
    assert line and "\n" not in line and "UncompletedJobError: Job 123 has not produced any output" in line
    saved = json.loads((tmp_path / "lim" / "sweep.json").read_text())
    assert saved["status"] == "FAILED" and "1 never reported" in saved["summary"]
    assert (tmp_path / "lim" / "report.md").is_file() and parent.exit_code() == 1
    assert parent.launcher_failed(RuntimeError("not a sweep's")) is None  # closed already: nothing open
