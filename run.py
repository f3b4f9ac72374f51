#!/usr/bin/env python
"""quantbench entry point: `python run.py [-v] [-m] [+experiment=<name>] [group=option ...] [key=value ...]`.

Composes the Hydra config, validates all of it (every cell of a sweep too: one line, before any model
loads; harness.cli.precheck), runs the experiment and records it (result JSON under results/, then
MLflow). Exit codes: 0 ok, 1 the run failed or cannot run on this machine (recorded FAILED, or SKIPPED with
a one-line reason such as "needs CUDA"; a sweep counts SKIPPED cells as done but exits 1 when no cell ran
OK: nothing was measured), 2 invalid input, 130/143 stopped by Ctrl-C/SIGTERM (a run or the sweep's running cell
recorded KILLED, with the line saying where). Third-party output
(gptqmodel's progress, library warnings) goes to the run's log file; `-v` shows it on the terminal.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

# harness.cli and harness.sweep.* import no model library at module level (torch, transformers, torchao, mlflow
# load later, inside the run), so a bad argument still gets its one-line error fast and quiet_third_party()
# below still runs before anything noisy is imported.
from harness import LOG_ENV, VERBOSE_FLAGS, quiet_third_party, set_verbose
from harness.cli import precheck, run_one
from harness.config import group_choice_problem, register_configs
from harness.sweep.cell import run_cell
from harness.sweep.parent import abort, exit_code, launcher_failed


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> int:
    hc = HydraConfig.get()  # the job's log file (Hydra's) also takes third-party output (cells' children inherit it)
    os.environ[LOG_ENV] = str(Path(hc.runtime.output_dir) / f"{hc.job.name}.log")
    if hc.mode == RunMode.MULTIRUN:
        return run_cell(cfg)  # isolated child per cell, resume; the sweep goes on after a failed cell
    code = run_one(cfg)
    if code:
        sys.exit(code)
    return code


if __name__ == "__main__":
    if any(a in VERBOSE_FLAGS for a in sys.argv[1:]):  # ours, not Hydra's: taken out before Hydra parses argv
        set_verbose()
        sys.argv = [a for a in sys.argv if a not in VERBOSE_FLAGS]
    if (problem := group_choice_problem(sys.argv[1:]) or precheck(sys.argv[1:])):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party()
    register_configs()
    try:
        main()
    # Ctrl-C or SIGTERM during a sweep: close it KILLED, nothing left RUNNING (a single run recorded itself KILLED
    # and returned 130/143 in harness.cli.run_one; this is a second Ctrl-C while it recorded, or one before it ran)
    except KeyboardInterrupt as exc:
        abort()
        sys.exit(getattr(exc, "exit_code", 130))
    except Exception as exc:  # raised out of a sweep (its callback lets it through): close the sweep first
        if (line := launcher_failed(exc)) is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    sys.exit(exit_code())  # set by harness.sweep.callback.SweepCallback: 1 when any cell was not OK, or none was OK
