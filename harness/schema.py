"""The bottom of the config layer: the allowed values config fields share, and the validation helpers.

It imports nothing from the harness but `errors`, so any module may use it (models, quantizers, the fast
path, the sweep settings) without importing `harness.config`, which in turn asks workloads and tasks to
check their own fields: the arrows point one way, config -> workloads -> models -> schema.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import urllib.parse
from typing import Any

from harness.errors import ConfigError
from harness.secret_uri import has_password, redact

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_MATCH = ("near_tie", "strict")  # how the compiled-vs-eager token check fails (harness/measure/fast_path.py)
COMPILE_BACKENDS = ("inductor", "zentorch")  # torch.compile backend of the decode step (harness/measure/fast_path.py)
DECODE_PATHS = ("best", "eager", "compiled", "freezing")  # measure.path (harness/measure/paths.py)
GEMV_KERNELS = ("auto", "onednn", "aten", "rows8")  # measure.gemv: one-row 16-bit matmuls on CPU (harness/measure/paths.py)
HUGEPAGES = ("auto", "on", "off")  # measure.hugepages: the weights on 2 MiB pages (harness/measure/hugepages.py)
# measure settings only a compiled decode step reads, with the values that ask nothing of it (defaults, and false):
# refused or tagged unused where the step runs eager (harness/measure/paths.py), on llama.cpp and in load runs
COMPILE_ONLY = {"compile_mode": ("auto",), "compile_freezing": (False,), "compile_fallback": (False,),
                "compile_match": ("near_tie",), "compile_backend": ("inductor",), "compile_cpp_wrapper": (False,),
                "compile_skip_guards": ("auto", False)}


def shown(value: object) -> str:
    """A config value as the command line spells it (true/false lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_apart(section: object, allowed: dict[str, tuple], prefix: str = "measure") -> list[str]:
    """`prefix.k=v` for each field of `section` whose value is not among `allowed[k]`."""
    return [f"{prefix}.{k}={shown(v)}" for k, ok in allowed.items() if (v := getattr(section, k, ok[0])) not in ok]


def no_password(problems: list[str], name: str, uri: str, fix: str) -> None:
    """A URI setting must not hold a password: the command line (`ps`), logs, result JSONs and MLflow params would
    all show it. The problem names the URI with the password masked, and `fix` says where the secret goes."""
    try:
        urllib.parse.urlsplit(str(uri))
    except ValueError as exc:
        problems.append(f"{name} is not a URI ({exc})")
        return
    if has_password(uri):  # in the user info or the query string, as the store's driver reads it (secret_uri.py)
        problems.append(f"{name} ({redact(uri)}) holds a password, which the command line, logs, results and MLflow "
                        f"params would show; give the URI without it and {fix}")


# tracking.uri schemes MLflow opens as a store (mlflow/tracking/_tracking_service/utils.py; a database's with its
# SQLAlchemy driver too: postgresql+psycopg2://). A file store (a bare path, file:) MLflow 3 refuses when it logs,
# after the whole run, unless MLFLOW_ALLOW_FILE_STORE=true; a plugin adds its scheme as an entry point.
STORE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


def store_uri(problems: list[str], name: str, uri: str, opened: bool = True) -> None:
    """Append to `problems` why `uri` (an MLflow tracking URI; empty = the default store) holds a password
    (`no_password`), or, where it is `opened` (tracking on), is not one MLflow can open; refused at config time,
    not when the finished run logs."""
    no_password(problems, name, uri, "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (an MLflow server), "
                                     "or use ~/.pgpass or PGPASSFILE (a database)")
    if not opened:  # tracking.enabled=false: the run never opens it
        return
    try:
        scheme = urllib.parse.urlsplit(str(uri)).scheme.lower().split("+", 1)[0]
    except ValueError:  # said by no_password
        return
    if not uri or uri == "databricks" or scheme in STORE_SCHEMES:  # databricks alone: the default profile
        return
    fix = "use sqlite:///<path>/mlflow.db, or an MLflow server's http(s)://<host>:<port>"
    if scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1"):
            problems.append(f"{name}={redact(uri)} is a file store, which MLflow refuses to log to (maintenance mode) "
                            f"unless MLFLOW_ALLOW_FILE_STORE=true; {fix}")
    elif scheme not in {e.name for e in importlib.metadata.entry_points(group="mlflow.tracking_store")}:
        problems.append(f"{name}={redact(uri)}: MLflow has no store for the scheme {scheme}:// (it takes "
                        f"{', '.join(STORE_SCHEMES)}, or a file store); {fix}")


def positive(problems: list[str], name: str, value: int | float, allow_zero: bool = False) -> None:
    """Append to `problems` why `value` (of field `name`) is not a finite number > 0 (>= 0 with `allow_zero`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as typed: true, not True
        problems.append(f"{name}={shown} must be a number")
    elif not math.isfinite(value):  # NaN fails every comparison: a nan timeout never fired
        problems.append(f"{name}={value!r} must be a finite number {'>= 0' if allow_zero else '> 0'}")
    elif value < 0 or (value == 0 and not allow_zero):
        problems.append(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


class Validated:
    """Mixin for a config dataclass: `__post_init__` runs `problems()` and raises them all at once."""

    _section = ""

    def problems(self) -> list[str]:  # pragma: no cover - overridden
        return []

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ConfigError(found)


def unchecked(cls: type, node: Any) -> Any:
    """An instance of the dataclass `cls` from `node` without `__post_init__`'s checks (unknown keys dropped): what
    cross-section checks read of a section whose own problems are reported already (harness/config.py `build`)."""
    obj, values = cls.__new__(cls), dict(node or {})
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        object.__setattr__(obj, f.name, values.get(f.name, None if default is dataclasses.MISSING else default))
    return obj
