"""What every part of a sweep shares: its settings (`sweep:` section), its state file, and cell names."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from harness.config import TrackingConfig, to_plain
from harness.errors import ConfigError
from harness.records.results import DEFAULT_BASELINE, write_json_atomic
from harness.schema import Validated, positive

STATE_ENV = "QUANTBENCH_SWEEP_STATE"
FAULT_ENV = "QUANTBENCH_TEST_FAULTS"  # test-only, see harness/sweep/__init__.py
FAULTS = ("kill", "hang", "oom")
DRIFT_PROBES = ("all", "baseline", "none")  # which cells run again after the last (harness/sweep/drift.py)
START_METHODS = ("forkserver", "spawn")  # forkserver: forked from a pre-imported server; spawn: fresh interpreter
PRELOAD = ("harness.sweep.preload",)  # what the forkserver imports once for every cell
DEFAULT_NAME = "adhoc"  # sweep folder for a multirun without an experiment name


@dataclass
class SweepSettings(Validated):
    """`sweep:` section (conf/config.yaml; experiments override it). Not part of the config hash."""

    timeout_s: float = 3600.0  # per cell, counted from when the child is ready (imports done)
    startup_timeout_s: float = 600.0  # the child's imports (torch, transformers) under a loaded machine
    resume: bool = True  # reuse cells with an OK result for the same config hash and resume key
    baseline: str = DEFAULT_BASELINE  # quantizer name the report's speed ratio compares with
    start_method: str = "forkserver"  # forkserver (warm: imports done once) | spawn (a fresh interpreter per cell)
    drift_probe: str = "none"  # all | baseline | none: cells run again (speed only) after the last: the drift between cells
    label: str = ""  # tag `quantbench.label` of the parent run: select sweeps by it (python -m harness.report --frontier)

    _section = "sweep"

    def problems(self) -> list[str]:
        p: list[str] = []
        positive(p, "sweep.timeout_s", self.timeout_s)
        positive(p, "sweep.startup_timeout_s", self.startup_timeout_s)
        if not isinstance(self.resume, bool):
            p.append(f"sweep.resume={self.resume!r} must be true or false")
        if self.drift_probe not in DRIFT_PROBES:
            p.append(f"sweep.drift_probe={self.drift_probe!r} is not allowed; choose one of: {', '.join(DRIFT_PROBES)}")
        if self.start_method not in START_METHODS:
            p.append(f"sweep.start_method={self.start_method!r} is not allowed; choose one of: "
                     f"{', '.join(START_METHODS)}")
        return p


def settings_from(config: dict) -> SweepSettings:
    """The sweep settings of a plain config; an unknown key is a ConfigError naming the allowed ones."""
    node = config.get("sweep") or {}
    try:
        return SweepSettings(**node)
    except TypeError as exc:
        allowed = ", ".join(f for f in SweepSettings.__dataclass_fields__ if not f.startswith("_"))
        raise ConfigError([f"sweep: {exc}; allowed keys: {allowed}"]) from None


@dataclass
class SweepState:
    """What every job of one sweep invocation needs (results/<sweep>/sweep.json)."""

    name: str
    folder: str
    invocation: str
    commit: str
    owner: str
    tracking: dict
    parent_run_id: str = ""
    planned: int = 0  # cells the sweeper will launch (0 = unknown, e.g. a non-basic sweeper)
    varying: tuple = ()  # override keys that differ between cells (they name the cells)
    started: float = 0.0
    code: str = ""  # resume.code_version() at the sweep's start: part of every cell's resume key
    sweep: dict = field(default_factory=dict)  # the `sweep:` settings (SweepSettings as a dict)
    earlier_parent_run_id: str = ""  # the previous invocation's parent run, kept when MLflow was down at start
    # how the invocation ended (finish_sweep), so `upload` can settle a parent run MLflow missed
    status: str = ""
    summary: str = ""
    reports: list = field(default_factory=list)
    parent_closed: bool = False

    @property
    def tcfg(self) -> TrackingConfig:
        return TrackingConfig(**self.tracking)

    def save(self) -> Path:
        return write_json_atomic(Path(self.folder) / "sweep.json", {**asdict(self), "varying": list(self.varying)})

    @classmethod
    def load(cls, path: Path) -> SweepState:
        data = json.loads(Path(path).read_text())
        data["varying"] = tuple(data.get("varying") or ())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def sweep_folder(config: dict) -> Path:
    """results/<sweep name>: where a sweep keeps its state, cells, manifest and report."""
    results = (config.get("tracking") or {}).get("results_dir") or "results"
    return Path(results) / (config.get("name") or DEFAULT_NAME)


def find_state(config: dict) -> SweepState | None:
    """The state of the sweep this job belongs to ($QUANTBENCH_SWEEP_STATE, else its folder's sweep.json)."""
    for candidate in (os.environ.get(STATE_ENV, ""), str(sweep_folder(config) / "sweep.json")):
        if candidate and Path(candidate).exists():
            try:
                return SweepState.load(Path(candidate))
            except (OSError, ValueError, TypeError):
                continue
    return None


def owner_id() -> str:
    """host:pid:start-time of this process (the start time makes a recycled pid harmless)."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(psutil.Process().create_time())}"


def owner_alive(owner: str) -> bool | None:
    """True/False for an owner on this host; None when it ran elsewhere (cannot tell)."""
    try:
        host, pid, created = owner.rsplit(":", 2)
        pid_i, created_i = int(pid), int(created)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        return int(psutil.Process(pid_i).create_time()) == created_i
    except psutil.Error:
        return False


def planned_cells(hydra_cfg: Any) -> list[list[str]] | None:
    """The override list of every cell Hydra's basic sweeper will launch (None for other sweepers)."""
    sweeper = OmegaConf.to_container(hydra_cfg.sweeper, resolve=False) or {}
    if "BasicSweeper" not in str(sweeper.get("_target_", "")):
        return None
    args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    args += list(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))
    parsed = OverridesParser.create().parse_overrides(args)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(cell) for batch in batches for cell in batch]


def varying_keys(cells: list[list[str]]) -> tuple[str, ...]:
    """The override keys whose value differs between cells, in first-seen order."""
    values: dict[str, set[str]] = {}
    order: list[str] = []
    for cell in cells:
        for ov in cell:
            key, _, value = ov.partition("=")
            if key not in values:
                values[key] = set()
                order.append(key)
            values[key].add(value)
    return tuple(k for k in order if len(values[k]) > 1)


def cell_label(task_overrides: list[str], varying: tuple[str, ...], planned: bool = False) -> str:
    """A cell's name (terminal lines, MLflow run name): its values of the keys the sweep varies; "default" when the
    cells are `planned` (known) and none varies (a sweep of one cell); all its overrides when they are unknown (a
    sweeper other than the basic one). Never the experiment, tracking.* or hydra.*: where results go, not what
    was measured (a one-cell sweep was named `...,tracking.uri=sqlite\\:////tmp/...`)."""
    kept = [ov for ov in task_overrides if not ov.lstrip("+~").startswith(("experiment=", "hydra.", "tracking."))]
    chosen = [ov for ov in kept if ov.partition("=")[0] in varying] if varying or planned else kept
    return ",".join(chosen) or "default"


def plain_without_hydra(config: Any) -> dict:
    """The job config as plain data, without resolving the `hydra` node (it holds per-job values)."""
    if isinstance(config, DictConfig):
        config = OmegaConf.masked_copy(config, [k for k in config.keys() if k != "hydra"])
    plain = to_plain(config)
    plain.pop("hydra", None)
    return plain
