"""benchmarks/gpu_check.{sh,py}: everything that can be checked without a GPU.

The cells themselves need CUDA (docs/gpu.md); here: the argument parsing, the cell list and its sizing,
that every cell's overrides compose into a valid config, the table from fake cell outcomes (a failed,
hung or crashed cell is a row with its one-line error and the others still run), the no-CUDA error
before any setup, --dry-run, and the bundle helpers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

# loaded by path: benchmarks/ on sys.path would shadow the quantizers and strategies packages
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up while the class is made
_spec.loader.exec_module(gpu_check)

SH = ROOT / "benchmarks" / "gpu_check.sh"
NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_SMI": "/bin/false"}  # no GPU even on a machine with one


def test_arguments_and_the_cell_list():
    args = gpu_check.parse_args([])
    assert args.out == "results/gpu_check" and not args.dry_run
    assert [c.name for c in args.cells] == ["fp16", "llama8b_fp16", "llama8b_fp16_compiled", "bnb_int8", "bnb_nf4",
                                            "fp16_compiled_cudagraphs", "gptq_int4"]
    args = gpu_check.parse_args(["/tmp/x", "--only", "gptq_int4,fp16", "--budget-s", "100"])
    assert [c.name for c in args.cells] == ["fp16", "gptq_int4"] and args.out == "/tmp/x" and args.budget_s == 100
    smoke = gpu_check.parse_args(["--smoke"]).cells
    assert [c.name for c in smoke] == ["fp16"] and smoke[0].overrides[-3:] == gpu_check.SMOKE
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--only", "fp8"])
    assert exc.value.code == 2

    cells = {c.name: c.overrides for c in gpu_check.CELLS}
    assert {"quantizer=gptq_int4", "quantizer.calibration_samples=8",
            "quantizer.calibration_length=128"} <= set(cells["gptq_int4"])
    assert {"measure.cache=static", "measure.compile=true",
            "measure.compile_mode=reduce-overhead"} <= set(cells["fp16_compiled_cudagraphs"])
    assert {"measure.device=cuda", "tracking.enabled=false", "model=smollm2_135m"} <= set(gpu_check.COMMON)
    assert args.budget_s < 600  # no cell starts, and none runs, past it: the whole check stays under 10 min


SMOKE_CELL = gpu_check.parse_args(["--smoke"]).cells[0]


@pytest.mark.parametrize("cell", [*gpu_check.CELLS, SMOKE_CELL],
                         ids=[c.name for c in gpu_check.CELLS] + ["smoke"])
def test_every_cell_is_a_valid_config(cell, compose):
    from harness.config import build

    # measure.device=cpu only so that building does not ask for the GPU this machine lacks
    cfg = compose([o for o in gpu_check.cell_overrides(cell) if o != "measure.device=cuda"] + ["measure.device=cpu"])
    exp = build(cfg)
    smoke = cell is SMOKE_CELL
    assert (exp.measure.max_new_tokens, exp.measure.repetitions) == ((8, 1) if smoke else (32, 2))
    if cell.name.startswith(gpu_check.BIG):  # the 8B shape, fp16, batch 1, random weights (no accuracy pass)
        assert (exp.model.arch, exp.model.dtype, exp.quantizer.name) == ("llama-3.1-8b", "float16", "fp16")
        assert exp.strategy.batch_size == 1 and not exp.accuracy.enabled
        compiled = (exp.measure.cache, exp.measure.compile, exp.measure.compile_mode)
        assert compiled == (("static", True, "reduce-overhead") if cell.name.endswith("_compiled") else
                            (exp.measure.cache, False, exp.measure.compile_mode)), compiled


def _result(status, tps=None, error="", **tags):
    return {"status": status, "error": error, "metrics": {} if tps is None else {
        "decode_tokens_per_s": tps, "ttft_ms": 12.5, "peak_mem_mb": 900.0, "weight_bytes": 269e6, "perplexity": 11.1},
        "tags": {"kernel_path": "torch.Linear[Parameter]", "quantizer.backend": "torch", **tags}}


# the 8B row as the run would record it on an H200: 16.06 GB per step, 250 tok/s, NVML energy
_big = _result("OK", 250.0, **{"energy.method": "nvml"})
_big["metrics"].update({"bytes_per_step": 16.06e9, "roofline_fraction": 0.9, "energy_j_per_token": 2.5})
_big_compiled = _result("OK", 148.4, fast_path="compiled")
_big_compiled["metrics"].update({"bytes_per_step": 16.06e9, "roofline_fraction": 0.53})


def test_a_failed_hung_or_crashed_cell_is_a_row_and_the_others_run(tmp_path):
    outcomes = {
        "fp16": (0, "", _result("OK", 100.0)),
        "llama8b_fp16": (0, "", _big),
        "llama8b_fp16_compiled": (0, "", _big_compiled),
        "bnb_int8": (None, "loading...\n", None),  # timed out, killed
        "bnb_nf4": (1, "ok\nINFO x\nerror: quantizer bnb_nf4 needs bitsandbytes with CUDA\n", None),
        "fp16_compiled_cudagraphs": (0, "", _result("OK", 250.0, fast_path="compiled")),
        "gptq_int4": (1, "", _result("FAILED", error="ImportError: No module named 'pcre'\nsecond line")),
    }
    seen = []

    def fake(cell, out):
        seen.append((cell.name, cell.timeout_s))
        if cell.name == "bnb_nf4":
            raise OSError("cannot start")
        return outcomes[cell.name]

    rows = gpu_check.run_cells(list(gpu_check.CELLS), tmp_path, budget_s=540, runner=fake)
    assert [n for n, _ in seen] == [c.name for c in gpu_check.CELLS]
    assert all(t <= 540 for _, t in seen)
    by = {r.cell: r for r in rows}
    assert by["fp16"].status == "OK" and by["fp16"].decode_tokens_per_s == 100.0
    assert by["bnb_int8"].status == "TIMEOUT" and "killed" in by["bnb_int8"].error
    assert by["bnb_nf4"].status == "CRASHED" and "OSError: cannot start" in by["bnb_nf4"].error
    assert by["fp16_compiled_cudagraphs"].kernel_path == "torch.Linear[Parameter] [compiled]"
    assert by["gptq_int4"].status == "FAILED" and by["gptq_int4"].error == "ImportError: No module named 'pcre' second line"

    md, js = gpu_check.write_table(rows, tmp_path / "out", {"gpu": "NVIDIA H200", "torch": "2.11.0"})
    text = md.read_text()
    assert "NVIDIA H200" in text and "torch 2.11.0" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| format")]
    assert len(table) == 7 and all(ln.count("|") == 18 for ln in table)  # one line per cell, no broken cells
    assert "| 2.50x |" in next(ln for ln in table if ln.startswith("| fp16_compiled_cudagraphs"))
    # the 8B row: 4.00 ms/token against the H200 datasheet floor of 16.06 GB / 4.8 TB/s = 3.35 ms, NVML energy
    big = [c.strip() for c in next(ln for ln in table if ln.startswith("| llama8b_fp16 ")).split("|")[1:-1]]
    assert big[3:6] == ["4.00", "3.35", "0.90"] and big[6] == "-" and big[11:13] == ["2.500", "nvml"]
    compiled = [c.strip() for c in next(ln for ln in table if ln.startswith("| llama8b_fp16_compiled")).split("|")[1:-1]]
    assert compiled[3:7] == ["6.74", "3.35", "0.53", "-"]  # no "vs fp16" ratio against the 135M model
    assert "4.80 TB/s" in text
    data = json.loads(js.read_text())
    assert [r["status"] for r in data["rows"]] == ["OK", "OK", "OK", "TIMEOUT", "CRASHED", "OK", "FAILED"]
    assert data["rows"][1]["datasheet_ms"] == pytest.approx(3.346, abs=1e-3) and data["rows"][1]["ms_per_token"] == 4.0
    # the datasheet's floor and the measured one (`linear floor ms`) are two columns of two names
    assert "| ms/token | datasheet ms | roofline |" in text and "| floor ms |" not in text
    assert data["rows"][0]["weight_bytes"] == 269e6 and data["header"]["gpu"] == "NVIDIA H200"


def test_row_from_a_cell_without_a_result_names_why():
    row = gpu_check.row_from("x", 2, "INFO a\nerror: measure.foo: no such key\n", None, 1.0, 60)
    assert row.status == "FAILED" and row.error == "exit 2: error: measure.foo: no such key"
    row = gpu_check.row_from("x", -11, "Traceback ...\n  File x\nRuntimeError: CUDA error: illegal address\n",
                             None, 1.0, 60)
    assert row.status == "CRASHED" and row.error == "exit -11: RuntimeError: CUDA error: illegal address"


def test_a_row_from_a_result_keeps_the_kernel_tags_a_reader_checks():
    tags = {"kernel.linear": "marlin::Marlin", "kernel.linear_share": "48%", "kernel.lm_head": "gemv2T_kernel_val",
            "kernel.lm_head_share": "44%", "fast_path": "compiled", "quantizer.backend": "gptqmodel"}
    row = gpu_check.row_from("1b-gptq", 0, "", {"status": "OK", "metrics": {"decode_tokens_per_s": 300.0},
                                                "tags": tags}, 1.0, 60)
    assert row.kernel_path == "marlin::Marlin [compiled]" and row.backend == "gptqmodel"
    assert row.extra == {"kernel.linear_share": "48%", "kernel.lm_head": "gemv2T_kernel_val",
                         "kernel.lm_head_share": "44%"}
    # a cell that fell back says why, in table.json and in table.md's error column, with the path it was given
    why = {"fast_path": "eager-fallback", "fast_path.error": "AssertionError: wrong number of dimensions2 for op",
           "quantizer.gpu_path": "torchao_int4 kernel=preshuffled group_size=128", "quantizer.gpu_path_by": "sm_90",
           "gpu.arch": "hopper", "compile.inductor": "coordinate_descent_tuning=True",
           "kernel.linear_path_share": "81%", "kernel.linear": "cutlass"}
    row = gpu_check.row_from("8b-int4", 0, "", {"status": "OK", "metrics": {"decode_tokens_per_s": 40.0},
                                                "tags": why}, 1.0, 60)
    assert {k: row.extra[k] for k in why if k not in ("fast_path", "kernel.linear")} == {
        k: v for k, v in why.items() if k not in ("fast_path", "kernel.linear")}
    assert row.status == "OK" and row.error == "eager fallback: AssertionError: wrong number of dimensions2 for op"
    assert "| eager fallback: AssertionError: wrong number of dimensions2 for op |" in gpu_check.markdown(
        [row], {"gpu": "NVIDIA H200"})
    assert not gpu_check.ran_whole(row)  # and its hedge runs


def test_the_budget_skips_cells_instead_of_overrunning(tmp_path):
    called = []
    rows = gpu_check.run_cells(list(gpu_check.CELLS), tmp_path, budget_s=30,
                               runner=lambda c, o: called.append(c) or (0, "", None))
    assert not called and {r.status for r in rows} == {"SKIPPED"}


def test_no_cuda_is_one_line_and_exit_2_before_any_setup(tmp_path):
    env = {**os.environ, **NO_GPU}
    out = tmp_path / "out"
    for cmd in (["bash", str(SH), str(out)], [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out)]):
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.startswith("error: no CUDA device is visible") and done.stderr.count("\n") == 1
        assert "setup" not in done.stdout and not out.exists()


def test_dry_run_prints_the_setup_and_every_cell_command_and_runs_nothing(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "model").mkdir()
    (bundle / "model" / "part-1").write_bytes(b"GGUF")
    env = {**os.environ, **NO_GPU, "QB_GPU_BUNDLE": str(bundle), "QB_GPU_SITE": str(tmp_path / "site")}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SH), str(out), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "part-2 is missing" in done.stderr  # a bundle carried by halves is found out

    (bundle / "model" / "part-2").write_bytes(b"rest")
    done = subprocess.run(["bash", str(SH), str(out), "--dry-run", "--only", "fp16,gptq_int4"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(ln.startswith("+ ") and "pip install" in ln and f"--target {tmp_path / 'site'}" in ln for ln in lines)
    assert any(ln.startswith("+ cat ") and "part-1" in ln and "part-2" in ln for ln in lines)
    cmds = [ln for ln in lines if "/run.py " in ln]
    assert len(cmds) == 2 and all(f"tracking.results_dir={out}/cells/" in c for c in cmds)
    assert "quantizer.calibration_samples=8" in cmds[1] and "measure.max_new_tokens=32" in cmds[0]
    assert not out.exists() and not (tmp_path / "site").exists()


def test_bundle_helpers_prune_a_wheel_and_split_a_file(tmp_path):
    src = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = ["bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda118.so",
             "bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes-0.50.2.dist-info/METADATA"]
    with zipfile.ZipFile(src, "w") as z:
        for n in names:
            z.writestr(n, "x" * 10)
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "".join(f"{n},sha256=abc,10\n" for n in names)
                   + "bitsandbytes-0.50.2.dist-info/RECORD,,\n")
    dst = gpu_check.prune_wheel(src, tmp_path / "pruned.whl", gpu_check.bnb_keep)
    with zipfile.ZipFile(dst) as z:
        kept = set(z.namelist())
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert "bitsandbytes/libbitsandbytes_cuda118.so" not in kept and "cuda118" not in record
    assert {"bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so",
            "bitsandbytes/__init__.py"} <= kept and "cuda130" in record and "RECORD,," in record

    blob = bytes(range(256)) * 40
    (tmp_path / "m.gguf").write_bytes(blob)
    parts = gpu_check.split_file(tmp_path / "m.gguf", tmp_path / "parts", 1000)
    assert [p.stat().st_size for p in parts] == [1000, len(blob) - 1000]
    assert b"".join(p.read_bytes() for p in parts) == blob


PART1 = [c for c in gpu_check.SUITE_CELLS if c.part == 1]
_COMPILED = {"status": "OK", "metrics": {"decode_tokens_per_s": 150.0},
             "tags": {"kernel.linear": "k", "fast_path": "compiled", "compile.graph_breaks": "0"}}
_FELL_BACK = {"status": "OK", "metrics": {"decode_tokens_per_s": 40.0},
              "tags": {"kernel.linear": "k", "fast_path": "eager-fallback", "fast_path.error": "wrong number of dims"}}


def _on_a_fake_clock(cells, budget_s, elapsed_s, took, results=None):
    """run_cells with each cell taking `took[name]` seconds (default its estimate) on a fake clock, killed at its
    timeout; (names run, rows, seconds spent from the script's start)."""
    ran, now = [], [0.0]

    def runner(cell, out):
        ran.append(cell.name)
        needs = took.get(cell.name, cell.estimate_s)
        now[0] += min(needs, cell.timeout_s)
        return (0, "", (results or {}).get(cell.name, _COMPILED)) if needs <= cell.timeout_s else (None, "", None)

    rows = gpu_check.run_cells(cells, Path("/nonexistent"), budget_s=budget_s, elapsed_s=elapsed_s, runner=runner,
                               clock=lambda: now[0])
    return ran, rows, elapsed_s + now[0]


def test_the_budget_counts_from_the_scripts_start_and_skips_a_cell_it_cannot_finish(tmp_path):
    """`elapsed_s` (the installs before the first cell) is spent budget; a cell whose estimate no longer fits is
    SKIPPED with both numbers rather than killed mid-compile; the table is written after every row."""
    assert [c.name for c in PART1] == ["8b-fp16", "8b-int4", "8b-int4-tinygemm", "8b-int8"]  # the done-when's cells
    by_name = {c.name: c for c in gpu_check.SUITE_CELLS}
    plain = [by_name[n] for n in ("3b-fp16", "3b-int8", "1b-fp16")]  # the third is cheaper than the second
    assert not any(c.try_s for c in plain) and plain[2].estimate_s < 70 < plain[1].estimate_s
    flushed, now, ran = [], [0.0], []

    def runner(cell, out):  # each cell takes exactly its estimate on a fake clock
        ran.append(cell.name)
        now[0] += cell.estimate_s
        return 0, "", None

    budget = 300
    rows = gpu_check.run_cells(plain, tmp_path, budget_s=budget, elapsed_s=budget - plain[0].estimate_s - 70,
                               runner=runner, on_row=lambda rs: flushed.append(len(rs)), clock=lambda: now[0])
    assert ran == [plain[0].name] and flushed == [1, 2, 3]
    assert rows[1].status == "SKIPPED" and f"70 s of the {budget} s budget left, under its estimate of " \
        f"{plain[1].estimate_s} s" == rows[1].error
    # a later, cheaper cell does not run in the place of a skipped one: the list is in priority order
    assert rows[2].status == "SKIPPED" and rows[2].error.startswith(f"after {plain[1].name} was skipped for time")
    assert gpu_check.run_cells(PART1, tmp_path, budget_s=420, elapsed_s=400, runner=lambda c, o: 1 / 0)[0].error \
        == "time budget of 420 s spent"


@pytest.mark.parametrize("install", [30, 60, 90])
@pytest.mark.parametrize("slow", ["", "8b-fp16", "8b-int4", "8b-int8"])
def test_part_1_runs_8b_int4_before_int8_and_never_a_later_cell_in_a_skipped_ones_place(install, slow):
    """Whatever a cell takes (its estimate, or 1.6x it for one of them), under the documented budget: 8b-int4 runs
    right after 8b-fp16 and is never SKIPPED while a later cell runs; a done-when cell starts with at least TRY_S left
    even under its estimate, its timeout the time left; nothing runs past the budget."""
    budget = gpu_check.PART1_BUDGET_S
    took = {slow: 1.6 * next(c.estimate_s for c in PART1 if c.name == slow)} if slow else {}
    cells = PART1 + [c for c in gpu_check.SUITE_CELLS if c.name == "3b-fp16"]  # a cheaper, later cell after them
    ran, rows, spent = _on_a_fake_clock(cells, budget, install, took)
    assert ran[:2] == ["8b-fp16", "8b-int4"] and spent <= budget
    skipped = [i for i, r in enumerate(rows) if r.status == "SKIPPED" and not r.error.startswith("not needed")]
    if skipped:
        assert all(r.cell not in ran for r in rows[skipped[0]:]), [(r.cell, r.status, r.error) for r in rows]
    assert rows[1].status != "SKIPPED"  # 8b-int4 gets its try even after a slow 8b-fp16


def test_a_done_when_cell_starts_under_its_estimate_with_the_time_left_as_its_timeout():
    seen = {}

    def runner(cell, out):
        seen[cell.name] = cell.timeout_s
        return 0, "", _COMPILED

    int8 = next(c for c in PART1 if c.name == "8b-int8")
    gpu_check.run_cells([int8], Path("/nonexistent"), budget_s=500, elapsed_s=500 - 100, runner=runner,
                        clock=lambda: 0.0)
    assert int8.estimate_s > 100 and seen == {"8b-int8": 100}  # 100 s left: started, killed at the budget if need be
    seen.clear()
    rows = gpu_check.run_cells([int8], Path("/nonexistent"), budget_s=500, elapsed_s=500 - gpu_check.TRY_S + 1,
                               runner=runner, clock=lambda: 0.0)
    assert not seen and rows[0].status == "SKIPPED"


def test_the_hedge_runs_next_when_8b_int4_falls_back_before_int8():
    """8b-int4 ran, but on its eager fallback (e.g. a kernel inductor could not compile): the tinygemm hedge runs right
    after it, before 8b-int8, within the documented budget and an install of a minute."""
    ran, rows, _ = _on_a_fake_clock(PART1, gpu_check.PART1_BUDGET_S, 60, {}, {"8b-int4": _FELL_BACK})
    assert ran[:3] == ["8b-fp16", "8b-int4", "8b-int4-tinygemm"]
    assert rows[2].status == "OK" and rows[1].extra["fast_path.error"] == "wrong number of dims"
    ran, rows, _ = _on_a_fake_clock(PART1, gpu_check.PART1_BUDGET_S, 60, {})  # compiled: no hedge, int8 runs
    assert ran == ["8b-fp16", "8b-int4", "8b-int8"] and rows[2].error.startswith("not needed")
    assert gpu_check.estimate_s("8b", "int8", 1) == gpu_check.estimate_s("8b", "int4", 1) + \
        gpu_check.EST_FLOOR_COMPILE_S["int8"]["8b"]  # int8's floor pass compiles a second time


def test_flat_output_is_few_shallow_files_with_the_cells_packed(tmp_path):
    """The device tool returns at most 8 files from $OUT, none more than two folders down: --flat keeps the
    cells' folders in --work and packs them into cells.tar.gz beside the table."""
    import tarfile

    work, out = tmp_path / "work", tmp_path / "out"
    run = work / "cells" / "8b-fp16" / "runs" / "x.json"
    run.parent.mkdir(parents=True)
    run.write_text("{}")
    (work / "logs").mkdir()
    (work / "logs" / "8b-fp16.log").write_text("ok\n")
    packed = gpu_check.pack(work, out)
    gpu_check.write_table([gpu_check.Row(cell="8b-fp16", status="OK")], out, {"gpu": "NVIDIA H200"})
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["cells.tar.gz", "table.json", "table.md"] and packed == out / "cells.tar.gz"
    with tarfile.open(packed) as tar:
        assert sorted(tar.getnames()) == ["cells", "cells/8b-fp16", "cells/8b-fp16/runs", "cells/8b-fp16/runs/x.json",
                                          "logs", "logs/8b-fp16.log"]
    assert not list(work.glob("*.tmp"))


def _ok(fast_path: str, breaks: str = "0") -> dict:
    return {"status": "OK", "metrics": {"decode_tokens_per_s": 100.0},
            "tags": {"kernel.linear": "k", "fast_path": fast_path, "compile.graph_breaks": breaks}}


@pytest.mark.parametrize("first, hedge_runs", [
    ((0, "", _ok("compiled")), False),
    ((0, "", _ok("eager-fallback")), True),  # mslk's kernel did not capture: the number would be eager's
    ((0, "", _ok("compiled", breaks="224")), True),  # an op without a shape rule broke the graph at every linear
    ((1, "", {"status": "FAILED", "error": "RuntimeError: mslk"}), True),
])
def test_the_int4_hedge_runs_only_where_8b_int4_did_not_run_compiled(tmp_path, first, hedge_runs):
    cells = [c for c in gpu_check.SUITE_CELLS if c.name in ("8b-int4", "8b-int4-tinygemm")]
    ran = []

    def runner(cell, out):
        ran.append(cell.name)
        return first if cell.name == "8b-int4" else (0, "", _ok("compiled"))

    rows = gpu_check.run_cells(cells, tmp_path, budget_s=10_000, runner=runner)
    assert ran == (["8b-int4", "8b-int4-tinygemm"] if hedge_runs else ["8b-int4"])
    assert rows[1].status == "OK" if hedge_runs else rows[1].error == "not needed: 8b-int4 ran compiled, in whole graphs"
    if first[2]["status"] == "OK":  # the table keeps the count that decided it
        assert rows[0].extra["compile.graph_breaks"] == first[2]["tags"]["compile.graph_breaks"]


# ------------------------------------------------------------------------------ the next GPU session's device calls
START_S, WINDOW_S, GIVE_BACK_S, DEVICE_S = 150, 30, 5, 900  # docs/gpu.md's table: a start, the warm window, 15 min
CALL = re.compile(r"^call (\d): kind (\S+), carry \[(.*)\], timeout_s (\d+)\n(.+)$", re.M)


def _documented_calls() -> list[tuple[int, str, list[str], int, str]]:
    text = (ROOT / "docs" / "gpu.md").read_text()
    return [(int(n), kind, json.loads(f"[{carry}]"), int(t), cmd) for n, kind, carry, t, cmd in CALL.findall(text)]


def test_the_documented_device_calls_leave_room_for_a_rerun_within_the_sessions_device_time():
    """docs/gpu.md's first call and its warm rerun: on an H200 (the floor target is the H200's), one carry each,
    within the tool's limits, and start + call 1 + the warm window + the rerun + give_back within 900 s, as the
    doc's own table adds it up; the probe gets what call 1 leaves after gpu_check's budget and report."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    calls = _documented_calls()
    assert [c[0] for c in calls] == [1, 2]
    for _, kind, carry, timeout, cmd in calls:
        assert kind == "nvidia-h200" and carry == [".device/gpu_check/wheels"]
        assert timeout <= 600 and len(cmd) <= 2000
        check = shlex.split(cmd.split(";")[0])
        assert check[:3] == ["bash", "benchmarks/gpu_check.sh", "$OUT"]
        args = gpu_check.parse_args(check[2:])
        assert args.flat and args.part == 1 and args.budget_s < timeout
    (_, _, _, t1, first), (_, _, _, t2, rerun) = calls
    assert f"--budget-s {gpu_check.PART1_BUDGET_S} " in first
    probe_end = int(re.search(r"timeout \$\(\((\d+) - SECONDS\)\) python3 benchmarks/gpu_paths_probe\.py", first)[1])
    probe_start = int(re.search(r"--budget-s \$\(\((\d+) - SECONDS\)\)", first)[1])
    assert gpu_check.PART1_BUDGET_S + 20 + 90 <= probe_end <= t1 - 5 and probe_start < probe_end
    total = START_S + t1 + WINDOW_S + t2 + GIVE_BACK_S
    assert total <= DEVICE_S and f"| **total** | **{total}** | of {DEVICE_S} |" in text
    assert f"| call 1 | {t1} |" in text and f"| rerun (call 2), only where needed | {t2} |" in text
    # the rerun: one done-when cell of part 1 with its 60 s to try, its budget inside its timeout
    rerun_args = gpu_check.parse_args(shlex.split(rerun)[2:])
    assert [c.name for c in rerun_args.cells] == ["8b-int8"] and rerun_args.budget_s + 10 <= t2
    named = re.findall(r"^\| .* \| `([\w-]+)`(?: \(.*\))? \|$", text[text.index("| call 1's table says"):], re.M)
    assert set(named) == {"8b-int8", "8b-int4-tinygemm", "8b-int4", "8b-fp16"}
    assert all(c.try_s and c.try_s < rerun_args.budget_s for c in PART1 if c.name in named)


def test_a_warm_rerun_finds_the_bundle_installed_and_installs_nothing(tmp_path):
    """gpu_check.sh writes a stamp (the carried files' names and sizes) after its installs; a second call on the warm
    machine with the same files skips them (the rerun's seconds go to its cell), one with other files installs."""
    bundle, site = tmp_path / "bundle", tmp_path / "site"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"abc")
    (bundle / "wheels" / "mslk.tar.xz").write_bytes(b"xz!!")
    site.mkdir()
    env = {**os.environ, **NO_GPU, "QB_GPU_BUNDLE": str(bundle), "QB_GPU_SITE": str(site)}

    def dry() -> str:
        done = subprocess.run(["bash", str(SH), str(tmp_path / "out"), "--dry-run", "--suite", "gpu_scaling:1"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    (site / ".qb-bundle").write_text("a-1.0-py3-none-any.whl 3\nmslk.tar.xz 4\n")
    (site / ".qb-mslk").write_text("installed\n")
    out = dry()
    assert "already installed" in out and "mslk: installed" in out and "pip install" not in out
    assert "--extract" not in out and sorted(p.name for p in site.iterdir()) == [".qb-bundle", ".qb-mslk"]
    (site / ".qb-bundle").write_text("a-1.0-py3-none-any.whl 2\nmslk.tar.xz 4\n")  # another wheel: install
    out = dry()
    assert "already installed" not in out and "pip install" in out and "--extract" in out
    assert (site / ".qb-bundle").exists()  # a dry run changes nothing


def test_a_flat_run_packs_only_its_own_cells_when_work_holds_an_earlier_calls(tmp_path, monkeypatch):
    """--flat runs the cells in --work (/tmp/qb-gpu-work), which a warm machine's rerun finds full of call 1's
    cells: they are cleared at the start, so cells.tar.gz and the report hold this call's cells alone."""
    import tarfile

    work, out = tmp_path / "work", tmp_path / "out"
    for sub in ("cells/8b-fp16/runs", "logs", "hydra/8b-fp16"):
        (work / sub).mkdir(parents=True)
    (work / "cells" / "8b-fp16" / "runs" / "old.json").write_text("{}")
    (work / "logs" / "8b-fp16.log").write_text("call 1\n")
    monkeypatch.setattr(gpu_check, "cuda_problem", lambda: "")
    monkeypatch.setattr(gpu_check, "device_header", lambda: {"gpu": "NVIDIA H200"})
    monkeypatch.setattr(gpu_check, "suite_report", lambda work, out=None: None)

    def run_subprocess(cell, where):  # this call's one cell writes its log, as the real one does
        (where / "logs").mkdir(parents=True, exist_ok=True)
        (where / "logs" / f"{cell.name}.log").write_text("call 2\n")
        return 0, "", _COMPILED

    monkeypatch.setattr(gpu_check, "run_subprocess", run_subprocess)
    assert gpu_check.main([str(out), "--suite", "gpu_scaling:1", "--only", "8b-int8", "--flat", "--work", str(work),
                           "--budget-s", "300"]) == 0
    with tarfile.open(out / "cells.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/8b-int8.log" in names and not any("8b-fp16" in n for n in names), names


def test_the_datasheet_is_looked_up_by_whole_words():
    """"l4" in "nvidia l40s" gave an L40S the L4's 300 GB/s (3x its datasheet ms); "h200" in "gh200" a GH200 the
    H200's bandwidth. The lent H100/H200 names keep their rows."""
    from harness.analysis.bandwidth import DEVICES

    assert gpu_check.datasheet_bandwidth("NVIDIA H200") == DEVICES["h200"]
    assert gpu_check.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == DEVICES["h100"]
    assert gpu_check.datasheet_bandwidth("NVIDIA H100 PCIe") == DEVICES["h100-pcie"]
    assert gpu_check.datasheet_bandwidth("NVIDIA A100-SXM4-80GB") == DEVICES["a100-80gb"]
    assert gpu_check.datasheet_bandwidth("NVIDIA L4") == DEVICES["l4"]
    assert gpu_check.datasheet_bandwidth("NVIDIA GeForce RTX 4090") == DEVICES["rtx4090"]
    assert gpu_check.datasheet_bandwidth("NVIDIA L40S") is None and gpu_check.datasheet_bandwidth("NVIDIA GH200") is None
