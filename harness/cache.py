"""quantbench's cache on disk: where it lives, keys for what it holds, and writes that are never half done.

The cache root is `$QUANTBENCH_CACHE` (default ~/.cache/quantbench): converted GGUF weights, references,
measured bandwidths, task files. Everything in it is keyed by content (`short_hash`, `file_key`) and
written whole (`atomic_dir`), so concurrent sweeps share it safely.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from harness.errors import QuantbenchError

# the sweep cells' measuring lock in another file than <cache root>/measure.lock (harness/sweep/isolated.py): for
# processes pinned to cores of their own, as the suite's xdist workers are (tests/conftest.py)
LOCK_ENV = "QUANTBENCH_MEASURE_LOCK"


def cache_dir() -> Path:
    """The cache root's path ($QUANTBENCH_CACHE, else ~/.cache/quantbench), not created."""
    return Path(os.environ.get("QUANTBENCH_CACHE", Path.home() / ".cache" / "quantbench"))


def cache_root() -> Path:
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def short_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_key(path: Path) -> dict:
    """A cache key for a weights file that survives reinstalls: name, size and a digest of its first and last
    MiB (not its mtime or path, so two venvs holding the same package share one converted copy)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            digest.update(f.read(1 << 20))
    return {"name": path.name, "size": size, "sample": digest.hexdigest()[:16]}


def require_free(directory: Path, need_bytes: float, what: str) -> None:
    """Refuse in one line, before writing, when `directory`'s disk cannot hold `need_bytes` (+10% and 256 MiB)."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < need_bytes * 1.1 + (256 << 20):
        raise QuantbenchError(
            f"{what} needs about {need_bytes / 2**20:,.0f} MiB in {directory}, but only {free / 2**20:,.0f} MiB "
            f"are free; free disk space (`make clean-cache` drops quantbench's cache) or point QUANTBENCH_CACHE "
            f"at a larger disk")


@contextlib.contextmanager
def build_lock(final: Path):
    """Hold `<final>.lock` while `final` is built: a second process that needs the same entry (a sweep's
    cells, parallel test workers) waits for the first one's result instead of computing it again beside it.
    The writes stay atomic either way; the lock only saves the duplicate work (minutes for a conversion)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        yield


def atomic_dir(final: Path, build) -> Path:
    """Build a directory with `build(tmp_path)` and rename it into place (one builder at a time, `build_lock`)."""
    if final.exists():
        return final
    with build_lock(final):
        if final.exists():  # built by the process we waited for
            return final
        return _build_dir(final, build)


def _build_dir(final: Path, build) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is as good as ours
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
