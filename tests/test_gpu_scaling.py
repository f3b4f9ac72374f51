"""The gpu_scaling experiment (issue #29 items 5 and 6) on a machine without a GPU.

The cells need CUDA; here: the experiments' cell lists and configs, gpu_check's `--suite gpu_scaling` cells (the
same cells as the experiments, in parts that fit one 540 s device call by their estimates, the issue's done-when
cells first), its arguments and --dry-run, the table's floor columns and per-shape ratios, a bundle without the
model (the shell script and `--bundle --wheels-only`), and the report section from faked results: the crossover
arithmetic, the table rows, the done-when lines, the figure and the command that merges several parts' folders.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT
from test_gpu_check import NO_GPU, SH, gpu_check

from harness.analysis import gpu_scaling
from harness.config import build, compose, register_configs
from harness.records.rows import describe
from harness.sweep.settings import planned_cells

PART1 = ["8b-fp16", "8b-int4", "8b-int4-tinygemm", "8b-int8"]  # issue #29's done-when reads these (and 8b-gptq_int4)


def _planned(name: str) -> list[list[str]]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        full = hydra_compose("config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    with open_dict(full):
        full.hydra.overrides.task = [f"+experiment={name}"]
    return planned_cells(full.hydra)


def _key(overrides: list[str] | tuple[str, ...]) -> tuple[str, str, int]:
    kv = dict(o.split("=", 1) for o in overrides)
    return kv["size"], kv["gpu_format"], int(kv.get("strategy.batch_size", 1))


# ------------------------------------------------------------------------------------------- the experiments
def test_the_experiments_are_the_issues_grid_and_the_suite_runs_exactly_their_cells():
    grid = {_key(c) for c in _planned("gpu_scaling")}
    batch = {_key(c) for c in _planned("gpu_scaling_batch")}
    assert grid == {(s, f, 1) for s in gpu_scaling.SHAPES for f in gpu_scaling.FORMATS} and len(grid) == 21
    assert batch == {("llama-3.1-8b", f, b) for f in ("fp16", "int8", "int4") for b in (1, 4, 16, 64)}
    suite = [_key(c.overrides) for c in gpu_check.SUITE_CELLS if not c.unless_ok]
    assert len(suite) == len(set(suite)) == 30 and set(suite) == grid | batch  # batch 1 of the 8B shape runs once
    hedges = [c for c in gpu_check.SUITE_CELLS if c.unless_ok]  # runs only where 8b-int4 did not run compiled
    names = [c.name for c in gpu_check.SUITE_CELLS]
    assert [(c.name, c.unless_ok, c.part) for c in hedges] == [("8b-int4-tinygemm", "8b-int4", 1)]
    assert names.index("8b-int4-tinygemm") == names.index("8b-int4") + 1
    exp = build(compose([o for o in hedges[0].overrides if not o.startswith("hydra.")]))
    assert (exp.quantizer.name, exp.quantizer.kernel, exp.quantizer.group_size, exp.model.arch) == (
        "torchao_int4", "tinygemm", 64, "llama-3.1-8b")
    assert gpu_check.suite_baseline("8b-int4-tinygemm") == "8b-fp16" and gpu_check.suite_baseline("8b-int4-b64") == \
        "8b-fp16-b64"
    for cell in gpu_check.SUITE_CELLS:
        exp = "gpu_scaling" if _key(cell.overrides)[2] == 1 else "gpu_scaling_batch"
        assert cell.overrides[:2] == (f"+experiment={exp}", "hydra.mode=RUN")  # one cell with the experiment's settings
        assert gpu_check.cell_overrides(cell) == list(cell.overrides)  # not the 135M model's COMMON
        assert "tracking.enabled=false" in cell.overrides and cell.name in gpu_check.SUITE_NAMES


@pytest.mark.parametrize("name", ["8b-fp16", "8b-gptq_int4", "8b-int4-b64", "1b-awq_int4", "3b-bnb_nf4"])
def test_a_suite_cell_is_the_experiments_config(name):
    cell = next(c for c in gpu_check.SUITE_CELLS if c.name == name)
    exp = build(compose([o for o in cell.overrides if not o.startswith("hydra.")]))
    shape, fmt, batch = _key(cell.overrides)
    m = exp.measure
    assert (exp.model.arch, exp.model.dtype, exp.quantizer.name, exp.strategy.batch_size) == (shape, "float16", fmt,
                                                                                            batch)
    assert (m.device, m.cache, m.compile, m.compile_mode, m.compile_fallback) == ("cuda", "static", True,
                                                                               "reduce-overhead", True)
    assert (m.max_new_tokens, m.warmup, m.repetitions, m.prompt_tokens, m.prompts) == (32, 1, 2, 32, "synthetic:1")
    assert not exp.accuracy.enabled and exp.name == ("gpu_scaling" if batch == 1 else "gpu_scaling_batch")
    if fmt in ("gptq_int4", "awq_int4"):  # small calibration: random weights, speed only
        assert (exp.quantizer.calibration_samples, exp.quantizer.calibration_length) == (8, 128)
    if fmt == "bnb_nf4":  # computes in the activations' dtype: bf16 would cast x twice per linear call
        assert exp.quantizer.compute_dtype == exp.model.dtype


def test_parts_fit_the_budget_and_the_done_when_cells_come_first():
    cells = gpu_check.SUITE_CELLS
    parts = sorted({c.part for c in cells})
    assert parts == list(range(1, gpu_check.SUITE_PARTS + 1))
    assert gpu_check.PACK_S < gpu_check.PART_BUDGET_S <= 540
    for p in parts:
        mine = [c for c in cells if c.part == p]
        # a hedge runs only in place of a cell that failed or fell back, so it is not in the part's estimate
        assert sum(c.estimate_s for c in mine if not c.unless_ok) <= gpu_check.PACK_S, p
        assert all(c.estimate_s < c.timeout_s <= gpu_check.PART_BUDGET_S for c in mine)
    part1 = [c.name for c in cells if c.part == 1]
    assert part1 == PART1  # alone in their part: its call leaves room for a rerun (docs/gpu.md)
    gptq = next(c for c in cells if c.name == "8b-gptq_int4")
    assert gptq.part == 2 and [c.name for c in cells if c.part == 2][0] == "8b-gptq_int4"
    for b in (4, 16, 64):  # a batch size's fp16, int8 and int4 share a part: each part gives ratios
        assert len({c.part for c in cells if c.name.endswith(f"-b{b}")}) == 1
    # estimates: the 8B fp16 compiled cell took 70-100 s on an H200 (docs/gpu.md); quantizing costs more
    est = {c.name: c.estimate_s for c in cells}
    assert 70 <= est["8b-fp16"] <= 120 and est["8b-fp16"] < est["8b-int4"] < est["8b-gptq_int4"] < est["8b-awq_int4"]
    assert est["1b-fp16"] < est["3b-fp16"] < est["8b-fp16"] < est["8b-fp16-b64"]


def test_the_docs_parts_table_is_the_codes():
    """docs/gpu.md's table of parts, cells and estimates is what suite_cells() packs (a reader plans sessions by it)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    want = []
    for part in range(1, gpu_check.SUITE_PARTS + 1):
        mine = [c for c in gpu_check.SUITE_CELLS if c.part == part]
        want.append(f"| {part} | " + ", ".join(f"`{c.name}` {c.estimate_s}" for c in mine)
                    + f" | {sum(c.estimate_s for c in mine if not c.unless_ok)} |")
    assert rows == want


def test_suite_arguments():
    part1 = gpu_check.parse_args(["--suite", "gpu_scaling:1"])
    assert [c.name for c in part1.cells] == [c.name for c in gpu_check.SUITE_CELLS if c.part == 1] and part1.part == 1
    assert len(gpu_check.parse_args(["--suite", "gpu_scaling"]).cells) == 31  # 30 + the int4 hedge
    only = gpu_check.parse_args(["--suite", "gpu_scaling", "--only", "8b-int4-b64,1b-fp16"]).cells
    assert [c.name for c in only] == sorted(["8b-int4-b64", "1b-fp16"], key=lambda n: gpu_check.SUITE_CELLS.index(
        next(c for c in gpu_check.SUITE_CELLS if c.name == n)))
    smoke = gpu_check.parse_args(["--suite", "gpu_scaling", "--smoke"]).cells
    assert [c.name for c in smoke] == ["1b-fp16"] and smoke[0].overrides[-3:] == gpu_check.SMOKE
    assert [c.name for c in gpu_check.parse_args([]).cells][:2] == ["fp16", "llama8b_fp16"]  # the default, unchanged
    for bad in (["--suite", f"gpu_scaling:{gpu_check.SUITE_PARTS + 1}"], ["--suite", "scaling"],
                ["--only", "8b-int4"], ["--wheels-only"], ["--suite", "gpu_scaling:1", "--only", "1b-fp16"]):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(bad)
        assert exc.value.code == 2, bad


def test_dry_run_lists_every_part_with_its_estimate(tmp_path, capsys):
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--suite", "gpu_scaling", "--dry-run"]) == 0
    text = capsys.readouterr().out
    heads = [ln for ln in text.splitlines() if ln.startswith("# part ")]
    assert len(heads) == gpu_check.SUITE_PARTS and "estimated (not measured; budget 540 s)" in heads[0]
    assert f"--suite gpu_scaling:1 --budget-s {gpu_check.PART_BUDGET_S}" in heads[0]
    cmds = [ln for ln in text.splitlines() if "/run.py " in ln]
    assert len(cmds) == 31 and all("hydra.mode=RUN" in c and f"tracking.results_dir={out}/cells/" in c for c in cmds)
    assert "gpu_scaling.png" in text and not out.exists()


# ------------------------------------------------------------------------------------ a bundle without the model
def _sh_with_wheels_only(tmp_path, *args: str) -> subprocess.CompletedProcess:
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    env = {**os.environ, **NO_GPU, "QB_GPU_BUNDLE": str(bundle), "QB_GPU_SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(SH), str(tmp_path / "out"), "--dry-run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()
    return done


def test_the_shell_script_runs_the_suite_from_a_bundle_without_the_model(tmp_path):
    done = _sh_with_wheels_only(tmp_path, "--suite", "gpu_scaling:1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(ln.startswith("+ ") and "pip install" in ln for ln in done.stdout.splitlines())
    assert "+ cat " not in done.stdout and "bundle without a model" in done.stdout
    assert sum("/run.py " in ln for ln in done.stdout.splitlines()) == sum(c.part == 1 for c in gpu_check.SUITE_CELLS)


def test_the_default_cells_refuse_a_bundle_without_the_model_in_one_line(tmp_path):
    done = _sh_with_wheels_only(tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: no model in") and done.stderr.count("\n") == 1


def test_bundle_wheels_only_writes_no_model(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(cmd, **kw):  # pip download/wheel: a small wheel (or the sdist) where pip would put it
        calls.append(cmd)
        folder = cmd[cmd.index("-d") + 1] if "-d" in cmd else cmd[cmd.index("-w") + 1]
        name, version = cmd[-1].split("==")
        if any(a.startswith("--no-binary") for a in cmd):
            with open(os.path.join(folder, f"{name}-{version}.tar.gz"), "wb") as f:
                f.write(b"sdist")
        else:
            with zipfile.ZipFile(os.path.join(folder, f"{name}-{version}-py3-none-any.whl"), "w") as z:
                z.writestr(f"{name}-{version}.dist-info/RECORD", f"{name}-{version}.dist-info/RECORD,,\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    dest = tmp_path / "bundle"
    (dest / "model").mkdir(parents=True)  # an earlier full bundle's model is left alone, not rebuilt
    gpu_check.make_bundle(dest, wheels_only=True)
    wheels = sorted(p.name for p in (dest / "wheels").iterdir())
    assert len(wheels) == len(gpu_check.BUNDLE_WHEELS) + len(gpu_check.BUNDLE_SDISTS)
    assert not list((dest / "model").iterdir()) and not (dest / "tmp").exists()
    text = capsys.readouterr().out
    assert "no model (--wheels-only)" in text and f"carry [{dest}/wheels]" in text and "--suite gpu_scaling:N" in text


# ------------------------------------------------------------------------------------------ gpu_check's table
def _result(arch, fmt, tps, batch=1, status="OK", device="cuda", **metrics):
    name = f"{fmt}-b{batch}-{arch}"
    tags = {"model.arch": arch, "quantizer.name": fmt, "device": device, "device_name": "NVIDIA H200",
            "strategy.name": f"StaticBatch{batch}", "fast_path": "compiled", "sweep.cell": name,
            "kernel.linear": metrics.pop("kernel", "aten::mm [cutlass sm90 gemv]")}
    params = {"llama-3.2-1b": 1.24e9, "llama-3.2-3b": 3.21e9, "llama-3.1-8b": 8.03e9}.get(arch, 1e8)
    return {"status": status, "error": "" if status == "OK" else "boom", "run_name": name, "tags": tags,
            "metrics": {} if status != "OK" else {"decode_tokens_per_s": tps, "batch_size": float(batch),
                                                   "params": params, "load_s": 12.0, "peak_mem_mb": 9000.0,
                                                   **metrics},
            "config": {"strategy": {"batch_size": batch}}, "ended": f"2026-12-05T10:{len(name):02d}:00"}


def test_the_table_gets_the_floor_columns_and_ratios_within_a_shape_and_batch(tmp_path):
    floor = {"linear_floor_ms": 5.9, "linear_floor_share": 0.89, "step_rest_ms": 0.73}
    results = {"8b-fp16": _result("llama-3.1-8b", "fp16", 150.0, **floor),
               "8b-int4": _result("llama-3.1-8b", "int4", 300.0),
               "8b-fp16-b64": _result("llama-3.1-8b", "fp16", 6400.0, batch=64),
               "8b-int4-b64": _result("llama-3.1-8b", "int4", 3200.0, batch=64),
               "8b-gptq_int4": _result("llama-3.1-8b", "gptq_int4", None, status="FAILED")}
    rows = [gpu_check.row_from(n, 0, "", r, 10.0, 100) for n, r in results.items()]
    md, js = gpu_check.write_table(rows, tmp_path, {"gpu": "NVIDIA H200", "suite": "gpu_scaling:1"})
    text = md.read_text()
    assert "suite gpu_scaling:1" in text and "linear floor ms | floor share | rest ms |" in text
    table = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]] for ln in text.splitlines()
             if ln.startswith("| ") and not ln.startswith("| format")}
    assert all(len(cells) == 20 for cells in table.values())
    assert table["8b-int4"][6] == "2.00x" and table["8b-int4-b64"][6] == "0.50x" and table["8b-fp16"][6] == "1.00x"
    assert table["8b-fp16"][17:] == ["5.90", "0.89", "0.73"] and table["8b-int4"][17:] == ["-", "-", "-"]
    assert table["8b-gptq_int4"][1] == "FAILED" and table["8b-gptq_int4"][6] == "-"
    data = json.loads(js.read_text())
    assert data["rows"][0]["linear_floor_share"] == 0.89 and data["header"]["suite"] == "gpu_scaling:1"
    plain = gpu_check.markdown([gpu_check.row_from("fp16", 0, "", _result("x", "fp16", 100.0), 1.0, 60)], {"gpu": "?"})
    assert "linear floor" not in plain  # results without the floor metrics: the table as before


# ------------------------------------------------------------------------------------------ the report section
def test_crossover_arithmetic():
    at, words = gpu_scaling.crossover([(1, 2.0), (4, 1.5), (16, 0.8), (64, 0.4)])
    assert at == pytest.approx(2 ** (2 + 0.5 / 0.7 * 2)) and math.isclose(at, 10.77, abs_tol=0.01)
    assert words.startswith("~10.8 (between 4: 1.50x and 16: 0.80x)")
    assert gpu_scaling.crossover([(16, 0.5), (1, 1.9), (4, 1.0)])[0] == pytest.approx(4.0)  # unsorted input
    assert gpu_scaling.crossover([(1, 1.9), (4, 1.5), (16, 1.2), (64, 1.05)]) == (None, "not within 1-64 (still 1.05x "
                                                                                       "at 64)")
    assert gpu_scaling.crossover([(1, 0.9), (4, 0.7)]) == (None, "never ahead: 0.90x at batch 1")
    assert gpu_scaling.crossover([]) == (None, "—")


def _cells() -> list[dict]:
    floor = {"linear_floor_ms": 5.9, "linear_floor_share": 0.9, "step_rest_ms": 0.77}
    out = [_result("llama-3.2-1b", "fp16", 600.0), _result("llama-3.2-1b", "int4", 900.0),
           _result("llama-3.2-3b", "fp16", 300.0), _result("llama-3.2-3b", "int8", 420.0),
           _result("llama-3.1-8b", "gptq_int4", 280.0), _result("llama-3.1-8b", "bnb_int8", 90.0,
                                                                 kernel="not visible (compiled region)"),
           _result("llama-3.1-8b", "awq_int4", None, status="FAILED"),
           _result("llama-3.1-8b", "int8", 999.0, device="cpu")]  # not a GPU row: ignored
    for fmt, speeds in {"fp16": (150.0, 580.0, 2200.0, 7000.0), "int8": (220.0, 800.0, 2600.0, 8000.0),
                        "int4": (330.0, 1000.0, 2000.0, 3500.0)}.items():
        for batch, tps in zip((1, 4, 16, 64), speeds, strict=True):
            out.append(_result("llama-3.1-8b", fmt, tps, batch=batch, **(floor if (fmt, batch) == ("fp16", 1) else {})))
    return out


def test_the_section_gives_per_shape_ratios_the_targets_and_the_crossover():
    rows = [describe(c) for c in _cells()]
    text = gpu_scaling.section(rows)
    assert "## GPU scaling" in text and "on NVIDIA H200" in text
    lines = text.splitlines()
    row = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[1:-1]]
           for ln in lines if ln.startswith("| llama")}
    assert row[("llama-3.1-8b", "int4")][2:5] == ["330.0", "3.03", "2.20x"]
    assert row[("llama-3.1-8b", "fp16")][5:8] == ["5.90", "0.90", "0.77"]  # the floor columns where recorded
    assert row[("llama-3.1-8b", "int4")][5:8] == ["—", "—", "—"]  # and a dash where not
    assert row[("llama-3.2-3b", "int8")][4] == "1.40x" and row[("llama-3.2-1b", "int4")][4] == "1.50x"
    assert ("llama-3.1-8b", "awq_int4") not in row  # FAILED: no speed (report.md lists it)
    assert [k for k in row if k[0] == "llama-3.1-8b"] == [("llama-3.1-8b", f) for f in
                                                          ("fp16", "int8", "int4", "gptq_int4", "bnb_int8")]
    big = next(ln for ln in lines if ln.startswith("- llama-3.1-8b"))
    assert "best 4-bit int4 **2.20x** fp16 (meets 1.8x)" in big and "best 8-bit int8 **1.47x** fp16 (meets 1.45x)" in big
    assert "fp16 floor share **0.90** (meets 0.85)" in big and "kernel named in 4/5 rows (not: bnb_int8)" in big
    assert "fp16 floor 5.90 ms vs 4.65 ms measured before (+27%: outside 10%)" in big  # the H200's reference floor
    small = next(ln for ln in lines if ln.startswith("- llama-3.2-3b"))
    assert "best 8-bit int8 **1.40x** fp16 (below 1.45x)" in small and "floor share not recorded" in small
    batch = {ln.split("|")[1].strip(): ln for ln in lines[lines.index(next(ln for ln in lines if ln.startswith(
        "### Batch"))):] if ln.startswith("| ") and not ln.startswith("| format")}
    assert set(batch) == {"fp16", "int8", "int4"}
    assert "| 1000 (1.72x) | 2000 (0.91x) | 3500 (0.50x) | ~13.7 (between 4: 1.72x and 16: 0.91x) |" in batch["int4"]
    assert batch["int8"].endswith("| not within 1-64 (still 1.14x at 64) |") and "(baseline)" in batch["fp16"]


def test_the_section_stays_out_of_sweeps_it_does_not_describe():
    cpu = [describe(_result("llama-3.1-8b", f, 10.0, device="cpu")) for f in ("fp16", "int4")]
    assert gpu_scaling.section(cpu) == "" and gpu_scaling.write(ROOT / "never-written", cpu) == []
    no_base = [describe(_result("llama-3.1-8b", f, 10.0)) for f in ("int8", "int4")]
    assert gpu_scaling.section(no_base) == ""


def test_the_figure_is_written(tmp_path):
    rows = [describe(c) for c in _cells()]
    (path,) = gpu_scaling.write(tmp_path, rows, "sweep gpu_scaling")
    assert path == tmp_path / "gpu_scaling.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_batch1 = [r for r in rows if r["batch"] == 1]  # no batch axis: the x fp16 panel alone
    (path,) = gpu_scaling.write(tmp_path / "b1", only_batch1)
    assert path.stat().st_size > 1000


def test_the_command_merges_the_parts_folders(tmp_path, capsys):
    cells = _cells()
    for i, cell in enumerate(cells):  # gpu_check's layout, spread over two parts' OUT folders
        runs = tmp_path / f"part{1 + i % 2}" / "cells" / cell["run_name"] / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        (runs / f"r{i}.json").write_text(json.dumps(cell))
    (tmp_path / "part1" / "table.json").write_text(json.dumps({"header": {}, "rows": []}))  # not a result
    rerun = _result("llama-3.1-8b", "int4", 400.0)
    rerun["ended"] = "2026-12-06T00:00:00"  # a later run of the same cell wins
    (tmp_path / "part2" / "rerun.json").write_text(json.dumps(rerun))
    out = tmp_path / "merged"
    assert gpu_scaling.main([str(tmp_path / "part1"), str(tmp_path / "part2"), "--out", str(out)]) == 0
    text = (out / "gpu_scaling.md").read_text()
    assert "| llama-3.1-8b | int4 | 400.0 | 2.50 | 2.67x |" in text and (out / "gpu_scaling.png").is_file()
    assert "wrote " in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert gpu_scaling.main([str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("error: no OK CUDA results")


def test_a_sweeps_report_has_the_section_and_the_figure(tmp_path, monkeypatch):
    from harness.records import report

    drawn = []
    for module, name in ((report, "plot"), (report.frontier_plot, "write"), (report.crossover, "write")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: [] if _n == "write" else tmp_path / "report.png")
    monkeypatch.setattr(report.gpu_scaling, "write", lambda folder, rows, title: drawn.append(title) or [])
    report.write_report(tmp_path, _cells(), baseline="fp16", title="sweep gpu_scaling")
    text = (tmp_path / "report.md").read_text()
    assert "## GPU scaling: weight formats by shape and batch on NVIDIA H200" in text and "~13.7 (between 4" in text
    assert drawn == ["sweep gpu_scaling"]


def _wheel(path: Path, files: dict[str, bytes], mode: int = 0o644) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 12, 7, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else mode) << 16
            z.writestr(info, data)
    return path


MSLK_FILES = {"mslk/__init__.py": b"import os\n", "mslk/mslk.so": bytes(range(256)) * 64,
              "mslk/gemm/__init__.py": b"", "mslk_cuda-1.1.0.dist-info/RECORD": b"mslk/__init__.py,,\n",
              "mslk_cuda-1.1.0.data/platlib/mslk_extra.py": b"x = 1\n", "mslk_cuda-1.1.0.data/scripts/tool": b"#!/bin/sh\n"}


def test_mslks_tree_round_trips_through_the_xz_archive(tmp_path):
    """The wheel's installed tree as an xz tar, extracted with the standard library (the GPU machine's step, via the
    command line gpu_check.sh uses): the same files, `.data/platlib` at the top, scripts left out, .so executable."""
    wheel = _wheel(tmp_path / "mslk_cuda-1.1.0-cp312-cp312-manylinux_2_28_x86_64.whl", MSLK_FILES)
    (tmp_path / "wheels").mkdir()
    archive = gpu_check.wheel_to_txz(wheel, tmp_path / "wheels" / gpu_check.MSLK_ARCHIVE)
    site = tmp_path / "site"
    (site / "torchao").mkdir(parents=True)  # the wheels pip installed first stay
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(site), "--extract",
                           str(archive)], env={**os.environ, **NO_GPU}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # no GPU needed for this step
    assert "extracted mslk, mslk_cuda-1.1.0.dist-info, mslk_extra.py into" in done.stdout
    got = {p.relative_to(site).as_posix(): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    want = {n: d for n, d in MSLK_FILES.items() if ".data/" not in n} | {"mslk_extra.py": b"x = 1\n"}
    assert got == want and (site / "torchao").is_dir() and os.access(site / "mslk" / "mslk.so", os.X_OK)
    assert not list((tmp_path / "wheels").glob("*.tmp"))


def test_bundle_with_mslk_puts_its_archive_in_the_one_carry_and_counts_it(tmp_path, monkeypatch, capsys):
    def fake_run(cmd, **kw):  # pip download/wheel: a small wheel (or the sdist) where pip would put it
        folder = Path(cmd[cmd.index("-d") + 1] if "-d" in cmd else cmd[cmd.index("-w") + 1])
        name, version = cmd[-1].split("==")
        if any(a.startswith("--no-binary") for a in cmd):
            (folder / f"{name}-{version}.tar.gz").write_bytes(b"sdist")
        elif name == "mslk-cuda":
            _wheel(folder / f"mslk_cuda-{version}-cp312-cp312-manylinux_2_28_x86_64.whl", MSLK_FILES)
        else:
            _wheel(folder / f"{name}-{version}-py3-none-any.whl", {f"{name}-{version}.dist-info/RECORD": b""})
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    monkeypatch.setattr(gpu_check, "tree_bytes", lambda root=ROOT: 2_500_000)
    dest = tmp_path / "bundle"
    (dest / "mslk").mkdir(parents=True)  # an older bundle's separate mslk carry: gone
    gpu_check.make_bundle(dest, wheels_only=True, with_mslk=True)
    wheels = dest / "wheels"
    assert (wheels / gpu_check.MSLK_ARCHIVE).is_file() and not (dest / "mslk").exists()
    assert not (dest / "tmp-mslk").exists() and not list(wheels.glob("mslk*.whl"))
    carried = sum(f.stat().st_size for f in wheels.iterdir())
    text = capsys.readouterr().out
    assert f"+ {gpu_check.MSLK_ARCHIVE} " in text and f"= {(carried + 2_500_000) / 2**20:.1f} MiB of the 64 MiB" in text
    # the archive counts: a tree that leaves less room than it takes is refused (the wheels alone would fit)
    archive = (wheels / gpu_check.MSLK_ARCHIVE).stat().st_size
    monkeypatch.setattr(gpu_check, "tree_bytes", lambda root=ROOT: gpu_check.CARRY_LIMIT - carried + archive // 2)
    with pytest.raises(SystemExit, match="does not fit one device call"):
        gpu_check.make_bundle(dest, wheels_only=True, with_mslk=True)
    with pytest.raises(SystemExit) as exc:  # beside the model's parts it would not fit: refused
        gpu_check.parse_args(["--bundle", "--with-mslk"])
    assert exc.value.code == 2


def test_the_shell_script_extracts_mslk_from_the_wheels_folder(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "wheels" / gpu_check.MSLK_ARCHIVE).write_bytes(b"xz")
    env = {**os.environ, **NO_GPU, "QB_GPU_BUNDLE": str(bundle), "QB_GPU_SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(SH), str(tmp_path / "out"), "--dry-run", "--suite", "gpu_scaling:1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    step = f"gpu_check.py {tmp_path / 'site'} --extract {bundle / 'wheels' / gpu_check.MSLK_ARCHIVE}"
    assert any(ln.startswith("+ ") and ln.endswith(step) for ln in lines), done.stdout
    pip = next(i for i, ln in enumerate(lines) if "pip install" in ln)
    assert pip < next(i for i, ln in enumerate(lines) if "--extract" in ln)  # after the wheels: torchao is there
    assert not any("pip install" in ln and "mslk" in ln for ln in lines)
