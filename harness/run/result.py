"""The record of one run (`Result`) and the names of how a run ends, apart from the code that runs it.

Kept free of torch and the pipeline: what reads and writes result JSONs (harness/records/results.py, the report,
`tracking upload`) imports this, not harness/run/runner.py, so it starts in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

STATUSES = ("OK", "SKIPPED", "FAILED", "OOM", "TIMEOUT", "CRASHED", "KILLED")
SUCCESS = ("OK", "SKIPPED")  # statuses a sweep counts as done (SKIPPED: cannot run on this hardware)


@dataclass
class Result:
    """The record of one run: what the result JSON holds and what MLflow receives."""

    status: str
    config: dict
    metrics: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)
    error: str = ""
    traceback: str = ""
    run_name: str = ""
    config_hash: str = ""
    started: float = 0.0
    ended: float = 0.0
    mlflow_run_id: str = ""
    children: list = field(default_factory=list)  # a load run's rates, each {label, status, error, metrics, tags}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Result:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def config_hash(config: dict) -> str:
    """Hash of what determines the measurement (tracking settings and Hydra's own keys excluded)."""
    relevant = {k: v for k, v in config.items() if k not in ("tracking", "hydra", "sweep")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]
