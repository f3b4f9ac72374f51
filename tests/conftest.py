"""Shared fixtures: in-process Hydra compose, a session MLflow store, fast tiny-model overrides."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from harness import quiet_third_party  # noqa: E402
from harness.cache import LOCK_ENV, cache_root  # noqa: E402
from harness.env import wikitext_dir  # noqa: E402

quiet_third_party()


def _standin_task_cache() -> None:
    """Every test and subprocess reads the stand-in BIG-bench tasks (tests/standin_tasks.py), never the real cache:
    the suite needs no 360 MB download, and the same data on every machine. One per process (a few ms)."""
    import atexit
    import shutil
    import tempfile

    from standin_tasks import build

    from harness.analysis.tasks import TASKS_DIR_ENV

    if os.environ.get("QB_STANDIN_TASKS_OWNER") not in (None, str(os.getpid())):
        return  # a subprocess of a test process: it inherits that process's stand-in
    tmp = Path(tempfile.mkdtemp(prefix="qb-standin-tasks-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    os.environ[TASKS_DIR_ENV] = str(build(tmp / "bigbench"))
    os.environ["QB_STANDIN_TASKS_OWNER"] = str(os.getpid())


_standin_task_cache()

# Small enough for seconds on 2 cores, large enough that every code path runs.
FAST = [
    "model=tiny_random",
    "measure.max_new_tokens=8",
    "measure.repetitions=2",
    "measure.warmup=1",
    "accuracy.max_tokens=300",
    "accuracy.context_length=128",
    "accuracy.stride=96",
]

SHARED_DATA = wikitext_dir()  # $QUANTBENCH_WIKITEXT, ../shared/..., or beside the origin checkout
REAL_CACHE = cache_root()  # read before any test points QUANTBENCH_CACHE elsewhere


def fresh_cache(path: Path) -> Path:
    """An empty cache root at `path`, but for the kernels setup built (`ext/`, linked to the real cache's): a run in
    it does not rebuild quantizers/rows8.py's library (~10 s on one core) unless the test is about building."""
    path.mkdir(parents=True, exist_ok=True)
    if (REAL_CACHE / "ext").is_dir() and not (path / "ext").exists():
        (path / "ext").symlink_to(REAL_CACHE / "ext")
    return path


@pytest.fixture(autouse=True)
def _settle_warnings_afresh():
    """Each test reads the settle warnings of its own runs: paths.warn_once remembers the lines this process logged
    (per config), and tests in one worker settle the same configs again."""
    paths = sys.modules.get("harness.measure.paths")
    if paths is not None:
        paths._WARNED.clear()


@pytest.fixture(scope="session")
def mlflow_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture()
def results_overrides(mlflow_dir, tmp_path) -> list[str]:
    """Route a run's JSON to a fresh folder and MLflow to the session's SQLite store."""
    return [f"tracking.results_dir={tmp_path}", f"tracking.uri=sqlite:///{mlflow_dir}/mlflow.db"]


@pytest.fixture()
def compose():
    from harness.config import compose as _compose

    return _compose


def pytest_configure(config):
    """Under pytest-xdist (`make test`), measure this host's memory bandwidth in the controller, before any worker
    starts. Measured beside a busy worker it would read low, and the value is cached for every later run on this
    host (harness/analysis/bandwidth.py) as its roofline bound."""
    if hasattr(config, "workerinput"):
        _pin_worker(config.workerinput)
        return
    if not getattr(config.option, "numprocesses", None):
        return
    from harness.analysis.bandwidth import host_bandwidth

    for threads in sorted({1, os.cpu_count() or 1}):
        host_bandwidth("cpu", threads)


def _pin_worker(workerinput: dict) -> None:
    """Give each xdist worker its own share of the cores (worker i of n: cores i, i+n, ...), inherited by the runs
    and servers it starts. Unpinned, two workers each ran torch with one thread per core of the machine: on 2 cores
    4 threads fought over 2, and an OpenMP region waits for its slowest thread, so a test beside another ran
    up to 2.6x its time alone instead of ~2x. `QUANTBENCH_TEST_PIN=0` leaves the workers unpinned."""
    if os.environ.get("QUANTBENCH_TEST_PIN", "1") == "0":
        return
    cores = sorted(os.sched_getaffinity(0))
    n, i = int(workerinput.get("workercount", 1)), int(str(workerinput.get("workerid", "gw0"))[2:] or 0)
    if n > 1 and len(cores) >= n:
        share = cores[i % n::n]
        os.sched_setaffinity(0, share)
        os.environ.setdefault("OMP_NUM_THREADS", str(len(share)))
        # sweeps of different workers run on different cores: each worker's cells take turns among themselves only
        # (harness/sweep/isolated.py measuring_turn); one lock for both made either worker idle while the other's
        # cell preflighted, measured and recorded
        os.environ.setdefault(LOCK_ENV, str(cache_root() / f"measure-{workerinput.get('workerid', 'gw0')}.lock"))
        if "torch" in sys.modules:  # imported before this hook: its pool was sized for all cores
            sys.modules["torch"].set_num_threads(len(share))


@pytest.hookimpl(optionalhook=True)  # the serial pass runs without xdist (-p no:xdist), which defines this hook
def pytest_xdist_make_scheduler(config, log):
    """How `make test`'s xdist workers share the suite: one module at a time, so a module's fixtures (the embedded
    model's runs, reference models) are built once, not once per worker; but tests/test_docs.py, the longest module,
    command by command, except that the commands serving on the fixed port 5000 go to one worker (never together),
    and so do the commands that log to a live MLflow server (test_docs.py's `live_mlflow`: one server start, not two).

    (pytest-xdist's own `--dist loadgroup` would do the grouping from marks, but its group suffix on the node id has
    no effect under pytest 9: measured, the marked tests still went to both workers.)
    """
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndDocCommands(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            if not path.endswith("tests/test_docs.py") or not rest.startswith("test_documented_command_runs["):
                return path
            if "harness.records.server" in rest:
                return "docs-port5000"
            return "docs-live-mlflow" if "http://127.0.0.1:5000" in rest else nodeid

    return ModulesAndDocCommands(config, log)
