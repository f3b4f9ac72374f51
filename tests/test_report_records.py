"""`python -m harness.report` on records (folders and MLflow), and the records' own command-line edges: the same
ratios from both sources, one error line (exit 2) for bad input or an unreachable store, result files that never
replace each other. The sweeps are written the way a sweep writes them, without a model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.config import TrackingConfig
from harness.records import report
from harness.records.results import cell_path, json_path, summary_line
from harness.records.tracking import main as tracking_main
from harness.records.tracking import record
from harness.run.result import Result
from harness.sweep.cell import append_manifest, record_cell
from harness.sweep.parent import open_parent_run
from harness.sweep.settings import SweepState, owner_id

CPU = {"cpu_model": "Test CPU 9000", "cpu.vendor": "GenuineTest", "cpu.family": "6", "cpu.model": "85",
       "cpu.isa": "avx2", "cpu.bf16": "False"}


def write_sweep(tmp: Path, name: str, cells: list[tuple[str, dict, dict, float]]) -> TrackingConfig:
    """A finished sweep `name` in tmp/<name> and tmp/mlflow.db: cells of (label, config, tags, tok/s)."""
    tcfg = TrackingConfig(uri=f"sqlite:///{tmp}/mlflow.db", experiment="rec", results_dir=str(tmp))
    state = SweepState(name=name, folder=str(tmp / name), invocation="inv1", commit="abc", owner=owner_id(),
                       tracking=vars(tcfg).copy())
    state.parent_run_id = open_parent_run(state, "")
    for i, (label, config, tags, tps) in enumerate(cells):
        r = Result(status="OK", config=config, metrics={"decode_tokens_per_s": tps},
                   tags={"strategy.name": "Greedy", "model.name": "m", **tags}, config_hash=f"h{i}",
                   started=time.time(), ended=time.time())
        append_manifest(state, r.config_hash, label)
        record_cell(r, cell_path(Path(state.folder), r.config_hash), state, label, {}, None, tcfg)
    state.save()
    return tcfg


def both_reports(tmp: Path, name: str, pairs: list[tuple[str, dict, float, float]]) -> tuple[dict, dict]:
    """A sweep of a none and a bf16 cell per (label, measure settings, none tok/s, bf16 tok/s), reported from its
    folder and from MLflow: the `× none` column of each (`ratios`)."""
    cells = [(f"quantizer={q},{label}", {"quantizer": {"name": q}, "measure": measure, "model": {"dtype": "float32"},
                                         "sweep": {"baseline": "none"}}, {"quantizer.name": q, **CPU}, tps)
             for label, measure, base, bf16 in pairs for q, tps in (("none", base), ("bf16", bf16))]
    tcfg = write_sweep(tmp, name, cells)
    assert report.main([str(tmp / name), "--out", str(tmp / f"{name}-dir")]) == 0
    assert report.main(["--mlflow-experiment", "rec", "--tracking-uri", tcfg.uri, "--out", str(tmp / f"{name}-ml")]) == 0
    return ratios(tmp / f"{name}-dir" / "report.md"), ratios(tmp / f"{name}-ml" / "report.md")


def ratios(md: Path) -> dict[str, str]:
    """cell -> its `× baseline` column, from a report.md."""
    out = {}
    for line in md.read_text().splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) > 6 and cols[1].startswith("quantizer="):
            out[cols[1]] = cols[6]
    return out


def test_mlflow_rows_compare_like_the_folder_rows(tmp_path):
    """Cells that differ in a speed setting (max_new_tokens) are each compared with their own baseline cell, from
    MLflow as from the folder: MLflow's cells carry the whole config, not only the baseline and batch size."""
    pairs = [(f"measure.max_new_tokens={n}", {"max_new_tokens": n, "prompts": "default"}, base, bf16)
             for n, base, bf16 in ((4, 10.0, 12.0), (16, 20.0, 30.0))]
    folder, mlflow = both_reports(tmp_path, "tok", pairs)
    assert folder == {"quantizer=none,measure.max_new_tokens=4": "1.00", "quantizer=bf16,measure.max_new_tokens=4":
                      "1.20", "quantizer=none,measure.max_new_tokens=16": "1.00",
                      "quantizer=bf16,measure.max_new_tokens=16": "1.50"}
    assert mlflow == folder


def test_a_tracking_uri_with_a_password_or_a_dead_server_is_one_line(tmp_path, capsys):
    """A password in --tracking-uri is refused before MLflow is contacted, and a server that is down costs seconds
    and one line (MLflow's own retries turned off), never a traceback that prints the URI."""
    for uri in ("http://u:pw-secret@127.0.0.1:1", "http://127.0.0.1:1"):
        start = time.monotonic()
        assert report.main(["--mlflow-experiment", "rec", "--tracking-uri", uri, "--out", str(tmp_path / "o")]) == 2
        assert time.monotonic() - start < 20
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert "pw-secret" not in err
    assert "cannot read MLflow at http://127.0.0.1:1" in err
    assert report.main(["--frontier", "--sweep", "s", "--tracking-uri", "http://127.0.0.1:1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_two_runs_of_one_config_in_one_second_keep_both_files(tmp_path):
    tcfg = TrackingConfig(enabled=False, results_dir=str(tmp_path))
    runs = [Result(status="OK", config={"q": 1}, metrics={"decode_tokens_per_s": tps}, run_name="same",
                   config_hash="abcdef0123", started=1_700_000_000.1 + 0.8 * i, ended=1_700_000_001.0 + i)
            for i, tps in enumerate((10.0, 11.0))]
    paths = [json_path(r, tcfg) for r in runs]
    assert paths[0] != paths[1] and paths[0].parent == paths[1].parent == tmp_path / "runs"
    assert json_path(runs[0], tcfg) == paths[0]  # one result, one name (written before and after MLflow)
    for r in runs:
        record(r, tcfg)
    kept = sorted(json.loads(p.read_text())["metrics"]["decode_tokens_per_s"] for p in (tmp_path / "runs").glob("*"))
    assert kept == [10.0, 11.0]


def test_one_cpu_with_two_thread_counts_is_one_machine():
    cells = [{"status": "OK", "metrics": {"decode_tokens_per_s": 10.0 * t}, "config": {},
              "tags": {"sweep.cell": f"threads={t}", "quantizer.name": "none", "threads": t, **CPU}} for t in (1, 2)]
    text = report.markdown(report.rows_for(cells, "none"), "none")
    assert "Measured on Test CPU 9000 (family 6 model 85, avx2, bf16 False), 1/2 threads." in text, text
    assert "different machines" not in text
    other = {**cells[1], "tags": {**cells[1]["tags"], "cpu.model": "86"}}  # another CPU model still is another
    assert "Cells ran on 2 different machines" in report.markdown(report.rows_for([cells[0], other], "none"), "none")


def test_a_baseline_that_is_no_quantizer_of_the_sweep_is_refused_before_writing(tmp_path, capsys):
    cells = [(f"quantizer={q}", {"quantizer": {"name": q}}, {"quantizer.name": q, **CPU}, tps)
             for q, tps in (("none", 10.0), ("bf16", 20.0))]
    write_sweep(tmp_path, "b", cells)
    folder = tmp_path / "b"
    assert report.main([str(folder)]) == 0
    before = (folder / "report.md").read_text()
    capsys.readouterr()
    assert report.main([str(folder), "--baseline", "nonee"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --baseline 'nonee'") and "choose one of: bf16, none" in err and err.count("\n") == 1
    assert (folder / "report.md").read_text() == before
    # --frontier reads --baseline too: refused when absent, the speedups against it when present
    assert report.main(["--frontier", str(folder), "--baseline", "nonee", "--out", str(tmp_path / "f0")]) == 2
    assert not (tmp_path / "f0").exists()
    assert report.main(["--frontier", str(folder), "--baseline", "bf16", "--out", str(tmp_path / "f")]) == 0
    assert "| none | quantizer=none | 0.50x" in (tmp_path / "f" / "frontier.md").read_text()


def test_upload_refuses_bad_options_and_a_missing_folder_in_one_line(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for args, says in ((["--uri", "http://u:pw-secret@127.0.0.1:1"], "holds a password"),
                       (["--uri", uri, "--retries", "-1"], "tracking.retries=-1 must be >= 0")):
        assert tracking_main(["upload", str(tmp_path), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1 and "pw-secret" not in err, err
    assert tracking_main(["upload", str(tmp_path / "nope"), "--uri", uri]) == 2
    out = capsys.readouterr()
    assert "nope is not a folder" in out.err and out.err.count("\n") == 1 and "uploaded" not in out.out
    assert not (tmp_path / "mlflow.db").exists()


def test_a_local_store_that_does_not_exist_is_not_created(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default store: results/mlflow.db here
    for args in (["--mlflow-experiment", "rec"], ["--frontier", "--sweep", "s", "--tracking-uri",
                                                  f"sqlite:///{tmp_path}/elsewhere/mlflow.db"]):
        assert report.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: no MLflow store at ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no results/, no mlflow.db, no folders


def test_the_printed_result_line_names_its_machine_and_threads():
    metrics = {"decode_tokens_per_s": 12.5, "weight_bytes": 1e6}
    line = summary_line(Result(status="OK", config={}, metrics=metrics, run_name="r",
                               tags={**CPU, "cpu.uarch": "zen4", "threads": "2", "device": "cpu"}))
    assert line.startswith("[OK] r: decode 12.5 tok/s") and "\n" not in line
    assert line.endswith("; measured on Test CPU 9000 (zen4, family 6 model 85, avx2), 2 threads"), line
    gpu = summary_line(Result(status="OK", config={}, metrics=metrics, run_name="r",
                              tags={**CPU, "device": "cuda", "device_name": "NVIDIA H100"}))
    assert gpu.endswith("; measured on NVIDIA H100"), gpu
    prefill = summary_line(Result(status="OK", config={}, run_name="pp512", tags={},  # llama-bench's pp512: no decode
                                  metrics={"decode_tokens_per_s": float("nan"), "prompt_tokens_per_s": 812.3,
                                           "ttft_ms": 630.5, "weight_bytes": 1e6, "bits_per_weight": 16.0}))
    assert prefill.startswith("[OK] pp512: prefill 812.3 tok/s, TTFT 630.5 ms, weights") and "nan" not in prefill, prefill


def test_a_quote_in_sweep_or_tag_is_refused_in_one_line_before_mlflow(capsys):
    dead = "http://127.0.0.1:1"  # never contacted: the name is refused first
    for args in (["--mlflow-experiment", "rec", "--sweep", "it's"],
                 ["--frontier", "--sweep", "s", "--tag", "quantbench.label=lab'a"]):
        assert report.main([*args, "--tracking-uri", dead]) == 2
        err = capsys.readouterr().err
        assert "holds a quote" in err and err.count("\n") == 1, err


def test_a_setting_over_mlflows_param_limit_is_logged_cut_with_a_marker_and_read_back_whole(tmp_path):
    """MLflow keeps a param's first 6000 characters: a longer setting is logged visibly cut (CUT_MARK), the run's
    config.yaml artifact holds it whole, and the report from MLflow reads that, not the cut value: cells whose
    prompt lists differ after 6000 characters are each compared with their own baseline, as from the folder."""
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from harness.records.mlflow_runs import CUT_MARK, MAX_PARAM_CHARS, run_config, unflatten

    long = ",".join(f"prompt number {i}" for i in range(500))  # ~8000 characters
    assert len(long) > 7000
    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/one.db", experiment="long", results_dir=str(tmp_path / "one"))
    result = Result(status="OK", config={"measure": {"prompts": long, "max_new_tokens": 4}},
                    metrics={"decode_tokens_per_s": 1.0}, run_name="long", started=time.time(), ended=time.time())
    record(result, tcfg)
    c = MlflowClient(tcfg.uri)
    run = c.get_run(result.mlflow_run_id)
    cut = run.data.params["measure.prompts"]
    assert cut.endswith(CUT_MARK) and len(cut) == MAX_PARAM_CHARS and long.startswith(cut[:-len(CUT_MARK)])
    assert run.data.params["measure.max_new_tokens"] == "4"  # a short one as it was
    config = OmegaConf.load(c.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert config.measure.prompts == long
    assert run_config(c, run.info.run_id, run.data.params)["measure"] == {"prompts": long, "max_new_tokens": "4"}
    with pytest.raises(ValueError, match="measure.prompts are cut"):  # never taken for the setting itself
        unflatten(run.data.params)

    class NoArtifacts:
        def download_artifacts(self, *args):
            raise OSError("artifact store down")

    unread = run_config(NoArtifacts(), "r1", run.data.params)["measure"]["prompts"]
    assert unread == "[cut by MLflow; config.yaml of run r1 unreadable]"

    pairs = [(f"prompts={end}", {"max_new_tokens": 4, "prompts": long + end}, base, bf16)
             for end, base, bf16 in (("a", 10.0, 12.0), ("b", 20.0, 30.0))]
    folder, mlflow = both_reports(tmp_path, "long", pairs)
    assert folder["quantizer=bf16,prompts=b"] == "1.50"
    assert mlflow == folder


def test_the_report_lists_each_cells_warnings_under_the_table():
    cells = [{"status": "OK", "metrics": {"decode_tokens_per_s": 10.0}, "config": {},
              "tags": {"sweep.cell": "quantizer=none", "quantizer.name": "none", **CPU}},
             {"status": "OK", "metrics": {"decode_tokens_per_s": 8.0}, "config": {},
              "tags": {"sweep.cell": "quantizer=int8", "quantizer.name": "int8", **CPU,
                       "warning.slow_kernel": "slow kernel path? int8 [aten]\n at 15% of its bound",
                       "warning.forced_slow": "measure.gemv=aten: this CPU defaults to rows8", "warning.spread": ""}}]
    text = report.markdown(report.rows_for(cells, "none"), "none")
    section = text.split("## Warnings", 1)[1]
    assert "- **quantizer=int8** `warning.forced_slow`: measure.gemv=aten: this CPU defaults to rows8" in section
    assert "- **quantizer=int8** `warning.slow_kernel`: slow kernel path? int8 [aten] at 15% of its bound" in section
    assert "quantizer=none" not in section and "warning.spread" not in section  # none, and an empty tag, not listed
    assert "## Warnings" not in report.markdown(report.rows_for(cells[:1], "none"), "none")


def test_a_tag_over_the_limit_is_logged_cut_with_a_marker_and_an_interrupted_log_leaves_no_run(tmp_path, monkeypatch):
    """A long tag (a failed run's error) is held cut by MLflow, visibly (TAG_CUT_MARK; result.json holds it whole);
    a Ctrl-C while the run is logged deletes the half-made MLflow run as an error does, none is left RUNNING."""
    from mlflow.tracking import MlflowClient

    from harness.records import mlflow_runs
    from harness.records.mlflow_runs import MAX_TAG_CHARS, TAG_CUT_MARK, log_to_mlflow

    error = "x" * 9000
    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/t.db", experiment="tags", results_dir=str(tmp_path))
    result = Result(status="FAILED", config={"measure": {"max_new_tokens": 4}}, error=error, run_name="long-error",
                    tags={"error": error, "short": "kept"}, started=time.time(), ended=time.time())
    run = MlflowClient(tcfg.uri).get_run(log_to_mlflow(result, tcfg))
    held = run.data.tags["error"]
    assert held.endswith(TAG_CUT_MARK) and len(held) == MAX_TAG_CHARS and error.startswith(held[:-len(TAG_CUT_MARK)])
    assert run.data.tags["short"] == "kept"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(mlflow_runs.tempfile, "TemporaryDirectory", interrupted)  # after the run was created
    with pytest.raises(KeyboardInterrupt):
        log_to_mlflow(Result(status="OK", config={}, run_name="cut-short", started=time.time(), ended=time.time()),
                      tcfg)
    c = MlflowClient(tcfg.uri)
    names = [r.info.run_name for r in c.search_runs([c.get_experiment_by_name("tags").experiment_id])]
    assert names == ["long-error"], names  # the interrupted one was deleted, not left RUNNING


def test_result_files_are_readable_by_others_as_the_umask_allows(tmp_path):
    """mkstemp made every cell JSON and sweep.json 0600 (the rename keeps the mode): another user's report or a CI
    job read nothing back, silently. They now get the mode an open() would, 0644 under umask 022."""
    import os
    import stat

    from harness.records.results import write_json_atomic

    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "cells" / "x.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_reopened_parent_run_loses_its_stale_error_tag(tmp_path):
    """A parent run marked KILLED with tag `error` by the next start (sweep/parent.py mark_stale) and then finished OK
    by a resumed sweep kept `error` beside status OK."""
    from mlflow.tracking import MlflowClient

    from harness.records.sweep_runs import open_parent

    tcfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="stale")
    rid = open_parent(tcfg, {"quantbench.sweep": "stale"}, [])
    c = MlflowClient(tcfg.resolved_uri())
    c.set_tag(rid, "error", "sweep process x ended without closing this run; marked KILLED on the next start")
    c.set_terminated(rid, status="KILLED")
    assert open_parent(tcfg, {"quantbench.sweep": "stale"}, [rid]) == rid
    run = c.get_run(rid)
    assert run.info.status == "RUNNING" and "error" not in run.data.tags


def test_a_store_error_quoting_a_query_password_is_masked():
    """sweeps._reading masked urlsplit's password only: a libpq `?password=` (or one holding `/`) came through."""
    from harness.errors import QuantbenchError
    from harness.records.sweeps import _reading
    from harness.secret_uri import secrets

    uri = "postgresql://qb@db.example/mlflow?password=s3cr%2Ft"
    assert secrets(uri) == ["s3cr/t"]
    with pytest.raises(QuantbenchError) as err, _reading(uri):
        raise RuntimeError("connection to db.example failed for password s3cr/t (s3cr%2Ft)")
    assert "s3cr" not in str(err.value) and "***" in str(err.value)


def test_a_resumed_sweep_reports_against_its_own_baseline_and_counts_jobs_not_hashes(tmp_path):
    """(1) `sweep` is not in the config hash, so reused cells keep the sweep.baseline of the invocation that measured
    them: the report (and the drift probe) compared with that one, not the one this invocation names. (2) Two jobs
    of one config hash share one result; the sweep said "1 never reported" and exited 1."""
    from harness.records.results import reported_jobs, sweep_baseline

    cells = [(f"quantizer={q}", {"quantizer": {"name": q}, "measure": {"threads": 1}, "sweep": {"baseline": "none"}},
              {"quantizer.name": q, **CPU}, tps) for q, tps in (("none", 100.0), ("bf16", 150.0))]
    write_sweep(tmp_path, "rb", cells)
    folder = tmp_path / "rb"
    state = json.loads((folder / "sweep.json").read_text())
    state["sweep"] = {"baseline": "bf16"}  # this invocation's setting; the cells keep "none"
    (folder / "sweep.json").write_text(json.dumps(state))
    assert sweep_baseline([json.loads(p.read_text()) for p in (folder / "cells").glob("*.json")], state["sweep"]) == "bf16"
    assert report.main([str(folder), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "× bf16" in md and "× none" not in md
    assert ratios(tmp_path / "out" / "report.md")["quantizer=none"] == "0.67"
    # a second job of the first cell's hash (e.g. sweep.timeout_s=300,301): reported, not missing
    with (folder / "manifest.jsonl").open("a") as fh:
        fh.write(json.dumps({"invocation": "inv1", "hash": "h0", "label": "quantizer=none,sweep.timeout_s=301"}) + "\n")
    assert reported_jobs(folder) == 3 and reported_jobs(folder, "other") == 0


def test_a_reused_cell_is_reported_under_this_invocations_name(tmp_path):
    """A cell measured by `... quantizer=none` (label quantizer=none) and reused by a later invocation whose cells
    vary nothing (label default) was reported under the earlier label, and the other way round."""
    from harness.records.results import invocation_cells

    write_sweep(tmp_path, "rn", [("default", {"quantizer": {"name": "none"}}, {"quantizer.name": "none", **CPU}, 1.0)])
    folder = tmp_path / "rn"
    with (folder / "manifest.jsonl").open("a") as fh:
        fh.write(json.dumps({"invocation": "inv2", "hash": "h0", "label": "quantizer=none"}) + "\n")
    assert [c["tags"]["sweep.cell"] for c in invocation_cells(folder, "inv2")] == ["quantizer=none"]
    assert [c["tags"]["sweep.cell"] for c in invocation_cells(folder, "inv1")] == ["default"]


def test_sections_that_compare_cells_do_so_within_one_machine(tmp_path):
    """A report over two CPUs (the CPU changes between sessions): Zen 4 ran only bf16, Zen 3 only int4. The scaling
    section paired one CPU's int4 with the other's bf16 (0.50x, a made-up speedup) and fitted both as one line."""
    zen4 = {"cpu.vendor": "AuthenticAMD", "cpu.family": "25", "cpu.model": "17", "cpu.isa": "avx512",
            "cpu_model": "EPYC 9004"}
    zen3 = {**zen4, "cpu.model": "1", "cpu.isa": "avx2", "cpu_model": "EPYC 7003"}

    def cell(size, params, q, tps, gb, cpu):
        return {"status": "OK", "metrics": {"decode_tokens_per_s": tps, "bytes_per_step": gb * 1e9, "params": params,
                                            "bandwidth_gb_per_s": 20.0},
                "tags": {"sweep.cell": f"{size}-{q}-{cpu['cpu.model']}", "model.name": size, "model.arch": size,
                         "quantizer.name": q, "quantizer.resolved": "bf16" if q == "auto16" else q,
                         "engine": "transformers", "threads": "2", "decode_path": "best", **cpu}}

    cells = [cell("1b", 1e9, "auto16", 20.0, 2.5, zen4), cell("3b", 3e9, "auto16", 8.0, 6.5, zen4),
             cell("1b", 1e9, "int4", 10.0, 0.8, zen3), cell("3b", 3e9, "int4", 4.0, 2.0, zen3)]
    paths = report.write_report(tmp_path, cells, baseline="auto16")
    text = (tmp_path / "report.md").read_text()
    heads = [ln for ln in text.splitlines() if ln.startswith("## Scaling")]
    assert len(heads) == 2 and "family 25 model 17" in heads[0] and "family 25 model 1)" in heads[1], heads
    assert "0.50" not in text  # no int4 row divided by the other CPU's bf16 row
    figs = sorted(str(p.relative_to(tmp_path)) for p in paths if p.name == "scaling.png")
    assert len(figs) == 2 and all("/" in f for f in figs) and f"{figs[0]}" in text.replace("Figure: ", "")


def test_report_all_skips_an_unreadable_cell_file_with_one_line(tmp_path, caplog):
    """`--all` read every cells/*.json with json.loads: one truncated file (a copy cut short) ended in a traceback."""
    write_sweep(tmp_path, "ra", [(f"quantizer={q}", {"quantizer": {"name": q}}, {"quantizer.name": q, **CPU}, 1.0)
                                 for q in ("none", "bf16")])
    cut = cell_path(tmp_path / "ra", "h1")
    cut.write_text(cut.read_text()[:40])
    assert report.main([str(tmp_path / "ra"), "--all", "--out", str(tmp_path / "out")]) == 0
    assert [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()] == \
        [f"skipped {cut}: not a readable result JSON (truncated, or not a cell result)"]
    assert "1 cell(s): 1 OK" in (tmp_path / "out" / "report.md").read_text()
