"""Every shipped experiment completes on the embedded model (SmolLM2-135M): every cell OK, or SKIPPED
with a one-line reason where this machine cannot run it (awq_int4 without CUDA).

Each experiment runs whole (all of its cells, through the real CLI) with the sizes narrowed: 3 new
tokens, one timed pass, tiny accuracy windows, and for the calibrating quantizers (gptq/rtn/awq) a tiny
calibration set in a second invocation of the same sweep (their own keys cannot be set on the other
cells). The full-size runs are done by hand (docs/quantizers.md, docs/sweeps.md). llama_bench and
crossover are covered on the tiny model in tests/test_experiments.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from omegaconf import OmegaConf

from harness.records.results import invocation_cells
from harness.sweep.settings import FAULT_ENV, STATE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # ~10 min: `make test-heavy`, not CI

NARROW = ["model=smollm2_135m", "measure.max_new_tokens=3", "measure.repetitions=1", "measure.warmup=0",
          "accuracy.max_tokens=64", "accuracy.context_length=32", "accuracy.stride=32",
          "sweep.timeout_s=1200"]  # smoke's 300 s is for the tiny model; a loaded 2-core CI box needs more here
# `++`: Hydra composes a sweep's base config with the experiment's default quantizer (none), which has no
# calibration keys; plain `quantizer.calibration_samples=2` fails there ("Key ... is not in struct")
TINY_CALIBRATION = ["++quantizer.calibration_samples=2", "++quantizer.calibration_length=32"]


def swept(name: str, key: str) -> list[str]:
    params = OmegaConf.load(ROOT / "conf" / "experiment" / f"{name}.yaml").hydra.sweeper.params
    return str(params[key]).split(",")


def calibrates(quantizer: str) -> bool:
    return "calibration_samples" in OmegaConf.load(ROOT / "conf" / "quantizer" / f"{quantizer}.yaml")


def invocations(name: str) -> list[list[str]]:
    """The command lines that together run every cell of experiment `name` (what a user's one command runs)."""
    if name != "quant_sweep":
        return [[]]
    qs = swept(name, "quantizer")
    return [["quantizer=" + ",".join(q for q in qs if not calibrates(q))],
            ["quantizer=" + ",".join(q for q in qs if calibrates(q)), *TINY_CALIBRATION]]


@pytest.mark.parametrize("name", ["smoke", "quant_sweep", "batch_scaling", "spec_decode"])
def test_every_cell_of_the_experiment_ends_ok_or_skipped_on_the_embedded_model(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    statuses: dict[str, str] = {}
    for extra in invocations(name):
        done = subprocess.run([sys.executable, "run.py", f"+experiment={name}", *NARROW, *extra,
                               f"tracking.results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/hydra",
                               "tracking.experiment=experiments"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1500)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        cells = invocation_cells(tmp_path / name)
        assert cells and all(c["status"] in ("OK", "SKIPPED") for c in cells), out[-4000:]
        for c in cells:
            label = c["tags"]["sweep.cell"]
            statuses[label] = c["status"]
            if c["status"] == "OK":
                assert c["metrics"]["decode_tokens_per_s"] > 0 and "SmolLM2-135M" in c["tags"]["model.name"], label
            else:
                assert c["error"] and "\n" not in c["error"], label  # the one-line reason
    if name == "quant_sweep":  # every quantizer the experiment lists ran (or was skipped) exactly once
        assert sorted(statuses) == sorted(f"quantizer={q}" for q in swept(name, "quantizer"))
        if not torch.cuda.is_available():
            assert statuses["quantizer=awq_int4"] == "SKIPPED"
    skipped = {k for k, s in statuses.items() if s == "SKIPPED"}
    assert skipped <= {"quantizer=awq_int4"}, skipped  # nothing else may be skipped on this CPU
