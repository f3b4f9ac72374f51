"""Experiments quantbench creates are tagged as model development; `make ui` links to the runs table.

The browser check of the landing page is tests/test_mlflow_ui.py; these check the store and the links.
"""

from __future__ import annotations

from harness.config import TrackingConfig
from harness.records import mlflow_runs, ui

KIND = "mlflow.experimentKind"


def _client(mlflow_dir, tmp_path):
    """The session's store (one schema migration for all tests); names made unique per test."""
    tcfg = TrackingConfig(uri=f"sqlite:///{mlflow_dir}/mlflow.db", results_dir=str(tmp_path))
    return tcfg, mlflow_runs.client(tcfg), tmp_path.name


def test_new_and_existing_experiments_get_the_kind_and_a_chosen_kind_stays(mlflow_dir, tmp_path):
    tcfg, c, u = _client(mlflow_dir, tmp_path)
    new = mlflow_runs.experiment_id(c, tcfg, f"fresh-{u}")
    assert c.get_experiment(new).tags[KIND] == "custom_model_development"

    old = c.create_experiment(f"made_before_the_tag-{u}")  # as an older quantbench left it
    assert KIND not in c.get_experiment(old).tags
    assert mlflow_runs.experiment_id(c, tcfg, f"made_before_the_tag-{u}") == old
    assert c.get_experiment(old).tags[KIND] == "custom_model_development"

    chosen = c.create_experiment(f"a_person_chose-{u}", tags={KIND: "genai_development"})
    assert mlflow_runs.experiment_id(c, tcfg, f"a_person_chose-{u}") == chosen
    assert c.get_experiment(chosen).tags[KIND] == "genai_development"


def test_a_store_that_refuses_the_tag_still_gives_the_experiment(mlflow_dir, tmp_path):
    tcfg, c, u = _client(mlflow_dir, tmp_path)
    exp_id = c.create_experiment(f"quantbench-{u}")

    class Refusing:
        def __getattr__(self, name):
            return getattr(c, name)

        def set_experiment_tag(self, *a, **k):
            raise PermissionError("read-only store")

    assert mlflow_runs.experiment_id(Refusing(), tcfg, f"quantbench-{u}") == exp_id
    assert KIND not in c.get_experiment(exp_id).tags


def test_ui_links_open_the_runs_table_of_each_experiment_with_runs(mlflow_dir, tmp_path, capsys):
    tcfg, c, u = _client(mlflow_dir, tmp_path)
    store = tcfg.resolved_uri()
    assert ui.experiment_links(f"sqlite:///{tmp_path}/nothing_yet.db", "http://x") == []
    assert not (tmp_path / "nothing_yet.db").exists()

    exp_id = mlflow_runs.experiment_id(c, tcfg, f"quantbench-{u}")
    c.create_run(exp_id, run_name="sweep:smoke")
    mlflow_runs.experiment_id(c, tcfg, f"empty-{u}")  # no runs: no link
    links = dict(ui.experiment_links(store, "http://127.0.0.1:5001/"))
    assert links[f"quantbench-{u}"] == \
        f"http://127.0.0.1:5001/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    assert f"empty-{u}" not in links

    assert ui.main(["--backend-store-uri", store, "--port", "5001", "--links"]) == 0
    out = capsys.readouterr().out
    assert "http://127.0.0.1:5001" in out and links[f"quantbench-{u}"] in out and f"empty-{u}" not in out
