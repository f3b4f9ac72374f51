"""One cell in a child process of its own, with a timeout; how it ended, classified.

The child is started by multiprocessing's `forkserver` (warm: forked from a server that imported torch,
transformers and the harness once, harness/sweep/preload.py) or `spawn` (a fresh interpreter). It gets
the sweep's environment and working directory, its own process group (a terminal Ctrl-C goes to the
sweep, which ends it cleanly), and a thread that ends it when the sweep is gone. It reports "ready"
once its imports are done (the cell's timeout starts then) and sends its Result back through a pipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import psutil

from harness import quiet_third_party
from harness.cache import LOCK_ENV, cache_dir, cache_root
from harness.errors import QuantbenchError
from harness.run import runner
from harness.run.result import Result, config_hash
from harness.sweep import progress
from harness.sweep.settings import FAULT_ENV, FAULTS, PRELOAD, SweepSettings

log = logging.getLogger("quantbench")
MEASURE_LOCK = "measure.lock"  # under the cache root: held while a sweep cell runs (harness/sweep/cell.py)


def fault_for(config: dict) -> str:
    """Test-only: the fault $QUANTBENCH_TEST_FAULTS assigns to this cell ('' for none)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return ""
    for fault, when in json.loads(spec).items():
        if fault not in FAULTS:
            raise QuantbenchError(f"{FAULT_ENV}: unknown fault {fault!r}; choose one of: {', '.join(FAULTS)}")
        if all(str(_get(config, key)) == str(value) for key, value in when.items()):
            return fault
    return ""


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _alive(pid: int, created: float | None) -> bool:
    try:
        return created is None or psutil.Process(pid).create_time() == created  # a recycled pid is not it
    except psutil.Error:
        return False


def _watch_parent(parent_pid: int) -> None:
    # A SIGKILLed sweep cannot kill its child; the child notices and exits instead of running on. The
    # sweep is the child's parent (spawn) or its grandparent (forkserver: the server outlives the sweep
    # while this child holds its pipe), so watch the sweep's pid itself, and the parent too.
    first_ppid = os.getppid()
    try:
        created: float | None = psutil.Process(parent_pid).create_time()
    except psutil.Error:
        os._exit(70)
    while True:
        if os.getppid() != first_ppid or not _alive(parent_pid, created):
            os._exit(70)
        time.sleep(1.0)


def child_main(config: dict, conn: Any, fault: str, parent_pid: int, environ: dict | None = None,
               cwd: str | None = None) -> None:
    """Entry point of the cell's child: run one cell and send its Result back."""
    try:
        os.setpgrp()  # own process group: a terminal Ctrl-C goes to the sweep, which ends us cleanly
    except OSError:
        pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if environ is not None:  # a forkserver child inherits the server's environment, not the sweep's of now
        os.environ.clear()
        os.environ.update(environ)
    if cwd:
        os.chdir(cwd)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party()
    import torch  # noqa: F401 - heavy and load-dependent: imported here so the cell's timeout starts after it

    conn.send(("ready", os.getpid()))
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        while True:
            time.sleep(60)
    try:
        if fault == "oom":
            raise MemoryError("test fault: simulated out of memory")
        result = runner.run(config)
    except BaseException as exc:  # noqa: BLE001 - runner.run never raises; this catches what it lets through
        result = getattr(exc, "result", None)  # a SIGINT sent to the child itself: the run KILLED as it stood
        if not isinstance(result, Result):
            status = "OOM" if isinstance(exc, MemoryError) else "FAILED"
            result = Result(status=status, config=config, error=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc(), started=time.time(), ended=time.time())
            result.config_hash = config_hash(config)
            result.tags.update({"config_hash": result.config_hash, "status": status, "error": result.error})
    conn.send(("result", result.to_dict()))
    conn.close()


def _kill_group(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, OSError, ValueError):
        pass
    proc.join(10)


def crash_message(exitcode: int | None) -> str:
    """Why a child that sent no result ended, in one line (the signal and what usually sends it)."""
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name if -exitcode in signal.Signals._value2member_map_ else str(-exitcode)
        why = {"SIGKILL": " (killed from outside, or by the kernel's out-of-memory killer)",
               "SIGSEGV": " (a native library crashed)", "SIGABRT": " (a native library aborted)"}.get(sig, "")
        return f"cell's child process died from {sig}{why}; see the log above, rerun the sweep to retry it"
    return f"cell's child process exited with code {exitcode} before reporting a result"


def mp_context(method: str = "forkserver") -> Any:
    """The multiprocessing context cells start with (warm cells: harness/sweep/__init__.py)."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (once per process)
    return ctx


def warm_up(settings: SweepSettings) -> None:
    """Start the forkserver now, so its imports overlap the sweep's own start (MLflow, first cell's checks)."""
    if settings.start_method == "forkserver":
        mp_context("forkserver")
        forkserver.ensure_running()


def finish(result: Result, config: dict, started: float) -> Result:
    """Complete a result the sweep made itself (no child result): hash, times, status tags."""
    result.config_hash = config_hash(config)
    result.started, result.ended = started, time.time()
    result.tags.update({"config_hash": result.config_hash, "status": result.status, "error": result.error})
    return result


@contextlib.contextmanager
def measuring_turn(exclusive: bool = True) -> Iterator[None]:
    """Hold the measuring lock (`<cache root>/measure.lock`) while a sweep cell runs, when `exclusive`.

    Cells started on this machine measure one at a time whatever started them: submitit_local launches every
    cell at once, and two sweeps may run side by side; cells sharing the cores would record each other's load
    (a smoke sweep read 50 tok/s instead of 958). The child's imports wait too (they load the cores). The
    kernel drops the lock when its holder dies, SIGKILL included, so it is never stale. The lock is per cache
    root ($QUANTBENCH_CACHE, else the user's ~/.cache/quantbench; $QUANTBENCH_MEASURE_LOCK names another file):
    sweeps with another cache root do not wait.
    A cache root that cannot be opened (read-only, or another user's lock file) still locks through a read-only
    descriptor; one that cannot be opened at all is warned in one line and the cell runs without a turn."""
    if not exclusive:  # cells on nodes of their own (SLURM): a lock in a shared home would serialize the cluster
        yield
        return
    custom = os.environ.get(LOCK_ENV)
    path = Path(custom) if custom else cache_dir() / MEASURE_LOCK
    try:
        if not custom:
            cache_root()  # created
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # O_CLOEXEC: children never hold it
    except OSError:
        try:  # a read-only cache, or another user's lock file: flock works on a read-only descriptor too
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            log.warning("cells are not taking turns: cannot open %s (%s); set QUANTBENCH_CACHE to a writable folder",
                        path, exc.strerror or exc)
            yield
            return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace") or "?"
            progress.say(f"[wait] another cell on this machine is measuring ({holder}); this one starts after it "
                         "(its timeout counts from then)")
            fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):  # who holds it, for the next cell's [wait] line (not on a read-only fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_isolated(config: dict, settings: SweepSettings, fault: str = "", exclusive: bool = True) -> Result:
    """Run one cell in a child process of its own; classify how it ended. Never raises (but re-raises
    KeyboardInterrupt after killing the child, so an interrupted sweep can record and stop).

    `exclusive`: wait for this host's other cells first (`measuring_turn`); the wait is not part of the cell's
    timeouts nor of its metrics. Metrics `cell_start_s` (until the child is ready: fork or interpreter start and
    imports) and `cell_wall_s` (the whole cell as the sweep sees it) are added to a result the child returns."""
    with measuring_turn(exclusive):
        return _run_child(config, settings, fault)


def _run_child(config: dict, settings: SweepSettings, fault: str) -> Result:
    ctx = mp_context(settings.start_method)  # one process per cell: no CUDA/thread state or leaks shared
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child_main, args=(config, send, fault, os.getpid(), dict(os.environ), os.getcwd()),
                       name="quantbench-cell")
    started, t0, ready_s = time.time(), time.monotonic(), None
    proc.start()
    send.close()
    deadline = time.monotonic() + settings.startup_timeout_s
    limit, phase, payload = settings.startup_timeout_s, "startup", None
    try:
        while payload is None:
            if recv.poll(0.2):
                try:
                    kind, value = recv.recv()
                except (EOFError, OSError):
                    break  # the child died; its exit code says how
                if kind == "ready":
                    ready_s = time.monotonic() - t0
                    phase, limit = "run", settings.timeout_s
                    deadline = time.monotonic() + settings.timeout_s
                elif kind == "result":
                    payload = value
            elif not proc.is_alive() and not recv.poll(0):
                break
            elif time.monotonic() > deadline:
                _kill_group(proc)
                key = "sweep.timeout_s" if phase == "run" else "sweep.startup_timeout_s"
                result = Result(status="TIMEOUT", config=config,
                                error=f"cell exceeded {key}={limit:g}s and was killed; raise {key} or make "
                                      "the cell smaller")
                return finish(result, config, started)
    except BaseException:  # Ctrl-C, or a launcher's job limit signalled in this job: the child must not run on
        _kill_group(proc)
        raise
    finally:
        recv.close()
    if payload is not None:
        proc.join(30)
        if proc.is_alive():
            _kill_group(proc)
        result = Result.from_dict(payload)
        result.started = result.started or started
        result.metrics.update({"cell_start_s": ready_s if ready_s is not None else float("nan"),
                               "cell_wall_s": time.monotonic() - t0})
        result.tags["sweep.start_method"] = settings.start_method
        return result
    proc.join(10)
    return finish(Result(status="CRASHED", config=config, error=crash_message(proc.exitcode)), config, started)
