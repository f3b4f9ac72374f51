"""This process's cgroup limits: the memory it may still take and the CPUs its quota pays for.

`/proc/self/cgroup` names the process's own cgroup: v2 one line `0::/path`, v1 one line per controller hierarchy
(`4:memory:/path`, `3:cpu,cpuacct:/path`). Limits nest, and a parent's binds its children: a Slurm job, a systemd
unit or a container without a cgroup namespace sets its limit below the root, where the root's own files say
nothing. So every level from the process's cgroup up to the mount root is read and the tightest limit holds.
A cgroup namespace shows the process at `/` and mounts its own cgroup as the root: the root's files, as before.
A path that is not under the mount (another namespace's) falls back to the root files too.

`ROOT` and `PROC` are module constants so tests point them at a fake tree (tests/test_random_model.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc/self/cgroup")
UNLIMITED = 2**60  # v1 writes "no limit" as a page-rounded 2**63 - 1


def own_paths(proc: Path | None = None) -> dict[str, str]:
    """Controller -> this process's cgroup path ("" for v2's unified hierarchy); {} where unreadable."""
    paths: dict[str, str] = {}
    try:
        lines = (proc or PROC).read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths.setdefault(controller, parts[2])
    return paths


def levels(mount: Path, path: str | None) -> list[Path]:
    """The cgroup directories from `mount`/`path` up to `mount`, deepest first (only `mount` where the path is
    unknown or not under it)."""
    if path is None:
        return [mount]
    deepest = mount / path.strip("/")
    if not deepest.is_dir():
        return [mount]
    chain = [deepest, *deepest.parents]
    return chain[: chain.index(mount) + 1] if mount in chain else [mount]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _left(level: Path, limit: str, usage: str, cache: str) -> float | None:
    """What one level still allows: its limit minus its usage, its inactive page cache counted as free (the kernel
    drops it before it refuses an allocation, as MemAvailable counts it); None without a limit there."""
    raw, used = _read(level / limit), _read(level / usage)
    try:
        if raw is None or raw == "max" or int(raw) >= UNLIMITED or used is None:
            return None
        left = int(raw) - int(used)
    except ValueError:
        return None
    stat = _read(level / "memory.stat") or ""
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key == cache and value.strip().isdigit():
            left += int(value)
    return float(left)


def memory_left(root: Path | None = None, proc: Path | None = None) -> float | None:
    """Bytes the tightest memory limit from this process's cgroup up to the root still allows (v2 and v1), or
    None where no level sets one."""
    root, paths = root or ROOT, own_paths(proc)
    found = [_left(d, "memory.max", "memory.current", "inactive_file") for d in levels(root, paths.get("", "/"))]
    found += [_left(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
              for d in levels(root / "memory", paths.get("memory", "/"))]
    found = [x for x in found if x is not None]
    return min(found) if found else None


def _quota(level: Path) -> float | None:
    """CPUs one level's quota pays for (quota / period), or None without one."""
    v2 = _read(level / "cpu.max")
    try:
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        quota, period = _read(level / "cpu.cfs_quota_us"), _read(level / "cpu.cfs_period_us")
        if quota is None or period is None or int(quota) <= 0:
            return None
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def cpu_quota(root: Path | None = None, proc: Path | None = None) -> int | None:
    """ceil(quota / period) of the tightest CPU quota from this process's cgroup up (v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`), at least 1; None where no level sets one."""
    root, paths = root or ROOT, own_paths(proc)
    dirs = levels(root, paths.get("", "/"))
    v1 = next((root / name for name in ("cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
    if v1 is not None:
        dirs += levels(v1, paths.get("cpu", "/"))
    found = [q for q in map(_quota, dirs) if q is not None and q > 0]
    return max(1, math.ceil(min(found) - 1e-9)) if found else None


def usable_cpus(root: Path | None = None, proc: Path | None = None) -> int:
    """The cores this process may run on (its affinity), capped by its cgroup's CPU quota: the default thread
    count (threads beyond the quota are throttled, each step waits for the next period)."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota(root, proc)
    return min(cores, quota) if quota else cores
