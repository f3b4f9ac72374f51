"""A new local MLflow store starts as a copy of an empty one: `seeded(uri)`.

MLflow builds a new SQLite store by running its whole schema history (~60 alembic migrations): ~1.5-2.5 s on
2 cores, paid by every new results folder, so by the first run of every user and by most tests. The result is
always the same empty database, so quantbench builds it once per MLflow version into the cache
(`$QUANTBENCH_CACHE/mlflow/empty-<version>.db`, by MLflow itself) and copies it. The one row that depends on
where it was made, the Default experiment's artifact location (`<cwd>/mlruns/0`, as MLflow writes it), is set for
this process as MLflow would set it. MLflow then finds its schema at head and runs nothing.

Safe with several processes creating the same store at once: the copy appears under its final name by a hard
link, which fails if the file is already there (the other process's store, then used as is). Anything unexpected
(no hard links, an unwritable cache) leaves the store to MLflow, as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from harness.cache import cache_root

log = logging.getLogger("quantbench")
PREFIX = "sqlite:///"


def seeded(uri: str) -> str:
    """`uri`, after copying an empty store to its file where it is a local SQLite store that does not exist."""
    if not uri.startswith(PREFIX) or "?" in uri:
        return uri
    target = Path(uri[len(PREFIX):])
    if target.exists() or not target.parent.is_dir():
        return uri
    try:
        _copy(_template(), target)
    except OSError as exc:  # MLflow builds it, as without this
        log.debug("mlflow store not seeded (%s): MLflow builds it", exc)
    return uri


def missing_store(uri: str) -> Path | None:
    """The file of local SQLite store `uri` when it does not exist (None for an existing one or another kind):
    a reader must not make an empty store just to find nothing in it."""
    if not uri.startswith(PREFIX):
        return None
    path = Path(uri[len(PREFIX):].split("?", 1)[0])
    return None if path.exists() else path


def _template() -> Path:
    import mlflow
    from mlflow.tracking import MlflowClient

    path = cache_root() / "mlflow" / f"empty-{mlflow.__version__}.db"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".db")
        os.close(fd)
        os.unlink(tmp)  # MLflow creates the file itself
        try:
            MlflowClient(tracking_uri=PREFIX + tmp).search_experiments()  # builds the schema
            _link(Path(tmp), path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return path


def _copy(template: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".seed")
    os.close(fd)
    try:
        shutil.copyfile(template, tmp)
        with sqlite3.connect(tmp) as con:  # the Default experiment's folder, as MLflow would name it from here
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                        (os.path.join(os.path.abspath("mlruns"), "0"),))
        con.close()
        _link(Path(tmp), target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except FileExistsError:
        pass  # made at the same moment by another process: theirs is the same empty store
