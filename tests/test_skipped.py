"""A run that cannot run on this machine (it needs CUDA) ends SKIPPED with a one-line reason, not FAILED.

SKIPPED comes from errors.Unsupported raised by a preflight check, before anything loads. A sweep counts
it as done (exit 0), the report lists it under "Cells skipped on this machine", and MLflow ends the run
FINISHED with tag status=SKIPPED and the reason in tag `error`. These tests need a machine without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import warm
from conftest import FAST, ROOT

from harness.errors import QuantbenchError, Unsupported
from harness.records.results import invocation_cells
from harness.run import runner
from harness.sweep.settings import FAULT_ENV, STATE_ENV

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="SKIPPED means 'needs CUDA' here: needs a CPU-only host")


def test_a_cuda_only_quantizer_is_skipped_with_a_one_line_reason(compose, results_overrides, mlflow_dir):
    from mlflow.tracking import MlflowClient

    from harness.records.tracking import record

    cfg = compose([*FAST, "quantizer=awq_int4", "tracking.experiment=skipped", *results_overrides])
    result = runner.run(cfg)
    assert result.status == "SKIPPED", result.error
    assert result.error.startswith("needs CUDA: quantizer awq_int4") and "\n" not in result.error
    assert "use quantizer=gptq_int4" in result.error and result.traceback == "" and not result.metrics
    assert result.tags["status"] == "SKIPPED" and result.tags["error"] == result.error

    record(result, runner.build(cfg).tracking)
    c = MlflowClient(f"sqlite:///{mlflow_dir}/mlflow.db")
    (run,) = c.search_runs([c.get_experiment_by_name("skipped").experiment_id])
    assert run.info.status == "FINISHED"  # not a failure
    assert run.data.tags["status"] == "SKIPPED" and run.data.tags["error"] == result.error


def test_other_hardware_checks_raise_unsupported_but_bad_input_does_not(compose):
    from harness.measure import resolve_device
    from quantizers.torchao import TorchAoInt4

    with pytest.raises(Unsupported, match="^needs CUDA: measure.device=cuda"):
        resolve_device("cuda")
    with pytest.raises(Unsupported, match="^needs CUDA: quantizer torchao_int4 kernel=tinygemm"):
        TorchAoInt4(kernel="tinygemm").preflight("cpu")
    assert runner.classify(Unsupported("x")) == "SKIPPED"
    assert runner.classify(QuantbenchError("a bad file")) == "FAILED"  # not hardware: still a failure


def test_a_sweep_with_a_cuda_only_cell_exits_0_and_reports_it_skipped(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    done = warm.run(["run.py", "-m", "model=tiny_random", "quantizer=fp32,awq_int4", "measure.max_new_tokens=2",
                     "measure.repetitions=1", "measure.warmup=0", "accuracy.enabled=false", "name=skip",
                     "tracking.experiment=skip", f"tracking.results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/hydra"],
                    ROOT, env, tmp_path / "procs", timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    cells = {c["tags"]["sweep.cell"]: c for c in invocation_cells(tmp_path / "skip")}
    assert {k: c["status"] for k, c in cells.items()} == {"quantizer=fp32": "OK", "quantizer=awq_int4": "SKIPPED"}
    assert cells["quantizer=awq_int4"]["error"].startswith("needs CUDA: ")
    assert "1 OK, 1 SKIPPED" in out and "[SKIPPED] quantizer=awq_int4: needs CUDA: " in out, out[-3000:]
    text = (tmp_path / "skip" / "report.md").read_text()
    assert "| SKIPPED |" in text and "## Cells skipped on this machine" in text
    assert "Cells that did not finish" not in text
