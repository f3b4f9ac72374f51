"""Hydra launchers as a sweep sees them: which run cells on this machine, and whether their job limit fits.

A launcher that runs cells on this machine (LOCAL_LAUNCHERS) shares its cores between them, so its cells
measure one at a time (harness/sweep/isolated.py `measuring_turn`); the others (SLURM) give each cell a node's
cores. submitit's launchers also end a job at `hydra.launcher.timeout_min`: a limit the sweep's own per-cell
timeouts can exceed ends the whole sweep in a traceback, so `time_limit_problem` refuses it before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf

LOCAL_LAUNCHERS = ("BasicLauncher", "LocalLauncher", "JoblibLauncher")  # cells on this machine (its cores)
SIGNAL_DELAY_S = 30  # submitit's local executor warns a job this long before its limit (SLURM: signal_delay_s)


@dataclass
class LocalLauncherConf(LocalQueueConf):
    """hydra/launcher=local's schema (conf/hydra/launcher/local.yaml): the plugin's, plus max_num_timeout (its
    local schema lacks the field, and submitit's local executor then requeues a timed-out job 3 times)."""

    max_num_timeout: int = 0


def register(cs: ConfigStore) -> None:
    cs.store(group="hydra/launcher", name="quantbench_local", node=LocalLauncherConf, provider="quantbench")


def launcher_name(launcher: Any) -> str:
    """'LocalLauncher': the class a Hydra launcher config (hydra.launcher) instantiates, without its module."""
    return str((launcher or {}).get("_target_", "")).rsplit(".", 1)[-1]


def time_limit_problem(launcher: Any, timeout_s: float, startup_timeout_s: float, cells: int) -> str | None:
    """One line when the launcher's job limit (hydra.launcher.timeout_min) could end a job whose cell the sweep's
    own timeouts still let run, else None (no limit: the basic launcher). A local launcher starts every cell's job
    at once and the cells then measure one at a time, so the last one's job lives through all `cells` of them."""
    limit = launcher.get("timeout_min")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        return None
    per_cell = timeout_s + startup_timeout_s
    if not math.isfinite(per_cell):  # refused by the sweep settings (harness/schema.py positive); no limit fits it
        return (f"sweep.startup_timeout_s + sweep.timeout_s = {per_cell:g} s: give both as finite numbers of seconds "
                f"(hydra.launcher.timeout_min={limit} must outlast them)")
    in_turn = launcher_name(launcher) in LOCAL_LAUNCHERS
    span = per_cell * (max(cells, 1) if in_turn else 1)
    delay = launcher.get("signal_delay_s", SIGNAL_DELAY_S)
    if limit * 60 - delay > span:
        return None
    need = math.floor((span + delay) / 60) + 1
    what = (f"the {cells} cell(s) of this sweep measure one at a time on this machine, each up to "
            if in_turn and cells > 1 else "a cell may take ")
    return (f"hydra.launcher.timeout_min={limit} is too short: {what}sweep.startup_timeout_s + sweep.timeout_s = "
            f"{per_cell:g} s, and the launcher's job limit must let the sweep's own timeouts fire first (else it ends "
            f"the sweep); set hydra.launcher.timeout_min={need} or more, or lower sweep.timeout_s")
