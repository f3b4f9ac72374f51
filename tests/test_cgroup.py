"""This process's cgroup limits (harness/cgroup.py) on fake cgroup trees: the memory the estimate may use and the
default thread count, read from the process's own cgroup and every level above it, not the root alone."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from harness import cgroup, config, measure
from harness.measure import memory

GIB = 2**30


def _files(d, **files):
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(f"{text}\n")


@pytest.fixture()
def tree(tmp_path, monkeypatch):
    """An empty cgroup mount and this process's /proc/self/cgroup, both fake; the module reads them."""
    root, proc = tmp_path / "cg", tmp_path / "proc-self-cgroup"
    root.mkdir()
    monkeypatch.setattr(cgroup, "ROOT", root)
    monkeypatch.setattr(cgroup, "PROC", proc)
    return root, proc


def test_v2_the_own_cgroup_and_the_tightest_level_above_it(tree):
    root, proc = tree
    proc.write_text("0::/system.slice/job.scope\n")
    _files(root, **{"memory.stat": "inactive_file 0"})  # the v2 root has no memory.max
    job = root / "system.slice" / "job.scope"
    _files(job, **{"memory.max": 4 * GIB, "memory.current": GIB, "memory.stat": f"anon {GIB}\ninactive_file {GIB // 2}"})
    assert cgroup.memory_left() == 3.5 * GIB  # its inactive page cache counts as free
    avail, how = memory.available_bytes("cpu")
    assert avail == min(3.5 * GIB, psutil.virtual_memory().available)
    assert (how == "cgroup limit minus usage") == (avail == 3.5 * GIB)
    _files(root / "system.slice", **{"memory.max": 2 * GIB, "memory.current": int(1.5 * GIB)})  # a parent binds
    assert cgroup.memory_left() == 0.5 * GIB
    proc.write_text("0::/elsewhere\n")  # a path not under this mount: the root's files, as before
    assert cgroup.memory_left() is None


def test_v1_the_memory_hierarchy_of_the_own_cgroup(tree):
    root, proc = tree
    proc.write_text("5:cpu,cpuacct:/slurm/job1\n4:memory:/slurm/job1\n1:name=systemd:/x\n")
    _files(root / "memory", **{"memory.limit_in_bytes": 9223372036854771712, "memory.usage_in_bytes": 5 * GIB})
    _files(root / "memory" / "slurm" / "job1", **{"memory.limit_in_bytes": 4 * GIB, "memory.usage_in_bytes": GIB,
                                                  "memory.stat": f"total_inactive_file {GIB}"})
    assert cgroup.memory_left() == 4 * GIB
    proc.unlink()  # unreadable: the root files alone (no limit there)
    assert cgroup.memory_left() is None


@pytest.mark.parametrize("layout, files, expected", [
    ("v2", {"cpu.max": "150000 100000"}, 2),  # 1.5 CPUs: two threads
    ("v2", {"cpu.max": "max 100000"}, None),
    ("v2", {"cpu.max": "20000 100000"}, 1),  # at least one
    ("v1", {"cpu.cfs_quota_us": 100000, "cpu.cfs_period_us": 100000}, 1),
    ("v1", {"cpu.cfs_quota_us": -1, "cpu.cfs_period_us": 100000}, None),
])
def test_a_cpu_quota_caps_the_default_threads(tree, layout, files, expected):
    root, proc = tree
    if layout == "v2":
        proc.write_text("0::/job\n")
        _files(root / "job", **files)
    else:
        proc.write_text("3:cpu,cpuacct:/job\n")
        _files(root / "cpu,cpuacct" / "job", **files)
    assert cgroup.cpu_quota() == expected
    cores = len(os.sched_getaffinity(0))
    assert cgroup.usable_cpus() == min(cores, expected or cores)
    before = torch.get_num_threads()
    try:
        assert measure.set_threads(0) == cgroup.usable_cpus() and measure.set_threads(1) == 1
    finally:
        torch.set_num_threads(before)


def test_measure_threads_beyond_the_cpu_quota_is_refused(tree):
    root, proc = tree
    proc.write_text("0::/job\n")
    _files(root / "job", **{"cpu.max": "100000 100000"})  # one CPU's worth, whatever the affinity
    assert "measure.threads=2 is more than the 1 cores this process may use" in config.cores_problem(2, None)
    assert config.cores_problem(1, None) is None
