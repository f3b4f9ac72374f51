"""Run a `python ...` command line warm: forked from a server that imported torch, transformers and the harness once.

tests/test_docs.py runs every command the docs show. As fresh interpreters each would pay 10-30 s of imports
on 2 cores before doing seconds of work; forked from a pre-imported `forkserver` (the same preload the sweeps
use, harness/sweep/preload.py) they start in well under a second. The child is still its own process with the
command's argv, working directory, environment and file descriptors 1 and 2, and it runs the script or
module as `__main__` exactly as `python` would (`runpy`), so what is tested is the documented entry point.
Only the interpreter start is skipped; anything that needs a fresh interpreter (servers, `make`) is run as
a plain subprocess by the caller.

A sweep run this way forks its cells from this same server instead of starting its own (`_share_server`):
the sweep's server would import the same modules again, 9 s on one core, paid by each of the ~20 sweeps
the docs show. The cells still run harness/sweep/isolated.py's `child_main` in a process of their own, with
the sweep's environment and folder; a sweep starting its own server is what tests/test_sweep.py and
tests/test_fault_drills.py run (`python run.py -m ...` as a fresh subprocess).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.process as mp_process
import os
import subprocess
import sys
from multiprocessing import forkserver
from pathlib import Path

PRELOAD = ["harness.sweep.preload", "hydra", "mlflow", "harness.records.tracking", "harness.config", "harness.cli"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _share_server(address: str) -> None:
    """In the forked child: start later forkserver processes (a sweep's cells) from the server that forked us.

    The child already holds the server's "alive" pipe and the resource tracker (multiprocessing hands both to
    every forkserver child); only the server's address and "it is running" are unknown to it.
    """
    server = forkserver._forkserver
    server._forkserver_address = address
    # it is running: it forked this process (the module-level name is a bound method of its own)
    server.ensure_running = forkserver.ensure_running = lambda: None
    # a cell resolves the sweep's relative `__main__` path (run.py) against this, inherited from the server
    mp_process.ORIGINAL_DIR = os.getcwd()


def _child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, address: str = "") -> None:
    """In the forked child: become `python <argv>` and exit with its code."""
    import runpy
    import warnings

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if address:
        _share_server(address)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # what `python` puts first on sys.path: the script's folder, or the working directory for `-m`
    sys.path.insert(0, cwd if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0])))
    code = 0
    try:
        # runpy warns when `-m pkg.mod` is already in sys.modules (the preload imported it): harmless here
        warnings.filterwarnings("ignore", message=".*found in sys.modules.*", category=RuntimeWarning)
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # what an uncaught exception does to `python`: traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], cwd: Path, env: dict[str, str], workdir: Path, timeout: float = 900
        ) -> subprocess.CompletedProcess:
    """`python *argv` (argv without the interpreter), forked warm; returns what subprocess.run would."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob("*.out")))
    out, err = workdir / f"{n}.out", workdir / f"{n}.err"
    ctx = _context()
    forkserver.ensure_running()
    address = forkserver._forkserver._forkserver_address
    proc = ctx.Process(target=_child, args=(list(argv), str(cwd), dict(env), str(out), str(err), address))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise subprocess.TimeoutExpired(["python", *argv], timeout)
    return subprocess.CompletedProcess(["python", *argv], proc.exitcode, out.read_text(errors="replace"),
                                       err.read_text(errors="replace"))
