#!/usr/bin/env python
"""quantbench entry point: `python run.py [+experiment=<name>] [group=option ...] [key=value ...]`.

Composes the Hydra config, validates all of it (one line per problem, before any model loads), runs the
experiment and records it (result JSON under results/, then MLflow). Exit codes: 0 ok, 1 the run
failed (recorded as FAILED), 2 invalid input.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from harness.config import register_configs

CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "quantizer", "strategy", "engine", "experiment")


def check_group_choices(argv: list[str]) -> str | None:
    """Catch an unknown `group=option` before Hydra prints a multi-line error."""
    for arg in argv:
        if "=" not in arg or arg.startswith("hydra"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS or value.startswith(("choice(", "range(", "glob(")):
            continue
        allowed = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
        for choice in value.split(","):
            if choice and choice not in allowed:
                return f"{key}={choice!r} is not an option; choose one of: {', '.join(allowed)}"
    return None


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from harness.cli import run_one

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from harness.sweep import run_cell

        return run_cell(cfg)  # isolated child per cell, resume; the sweep goes on after a failed cell
    code = run_one(cfg)
    if code:
        sys.exit(code)
    return code


if __name__ == "__main__":
    if (problem := check_group_choices(sys.argv[1:])):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from harness import quiet_third_party

    quiet_third_party()
    register_configs()
    from harness import sweep

    try:
        main()
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM during a sweep: close it KILLED, nothing left RUNNING
        sweep.abort()
        sys.exit(getattr(exc, "exit_code", 130))
    sys.exit(sweep.exit_code())  # set by harness.sweep.SweepCallback: 1 when any cell was not OK
