"""quantbench harness: config, models, measurement, accuracy, tracking (see README)."""

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

VERBOSE_FLAGS = ("-v", "--verbose")  # run.py: show third-party output on the terminal
VERBOSE_ENV = "QUANTBENCH_VERBOSE"  # set by -v; inherited by a sweep's cell processes
LOG_ENV = "QUANTBENCH_LOG_FILE"  # the run's log file; run.py sets Hydra's job log (results/hydra/.../run.log)


NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "mlflow.store.db.utils", "alembic.runtime.migration")
# libraries that log a warning on every call of a hot function: bitsandbytes' LLM.int8 logs "inputs will be
# cast from torch.bfloat16 to float16" on every matmul (215,880 terminal lines in one quant_sweep, written
# inside the timed decode). Each distinct message goes to the run's log file once, never to the terminal.
PER_CALL_LOGGERS = ("bitsandbytes.autograd._functions",)


class _OncePerMessage(logging.Filter):
    """Lets each distinct (logger, message template) through once per process."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _RunLogHandler(logging.Handler):
    """Appends records to the run's log file ($QUANTBENCH_LOG_FILE, read per record: it is set once Hydra
    has made the run's folder, after the imports); without one they are dropped. Never the terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:  # a real error stays visible too
            logging.getLogger().handle(record)
        path = os.environ.get(LOG_ENV)
        if not path:
            return
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - a log line must never fail a run
            pass


def quiet_third_party() -> None:
    """Send import-time noise that says nothing about the run to the run's log file instead of the terminal:
    torchao's optional CUDA kernels missing on a CPU machine, torch's `_pytree` deprecation warnings about
    torchao's enums (both printed when transformers first imports torchao), MLflow's schema migrations; and
    warnings a library logs on every call (PER_CALL_LOGGERS), once each. Call it before those imports; `-v` ($QUANTBENCH_VERBOSE) leaves them on the terminal."""
    if verbose():
        return
    handler = _RunLogHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in NOISY_LOGGERS + PER_CALL_LOGGERS:
        lib = logging.getLogger(name)
        lib.handlers = [h for h in lib.handlers if not isinstance(h, _RunLogHandler)] + [handler]
        lib.propagate = False  # not up to torch's or the root's console handlers
        if name in PER_CALL_LOGGERS and not any(isinstance(f, _OncePerMessage) for f in lib.filters):
            lib.addFilter(_OncePerMessage())  # a logger's filter runs before any handler: no file write per call


def set_verbose() -> None:
    os.environ[VERBOSE_ENV] = "1"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def run_log(results_dir: str | os.PathLike = "results") -> Path:
    """Where third-party output of this run goes: $QUANTBENCH_LOG_FILE, else a file under <results_dir>/logs/."""
    if os.environ.get(LOG_ENV):
        return Path(os.environ[LOG_ENV])
    return Path(results_dir) / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def _is_console(stream, originals) -> bool:
    if stream is None or any(stream is s for s in (*originals, sys.__stdout__, sys.__stderr__)):
        return True
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def third_party_output(path: str | os.PathLike | None):
    """Send what libraries write to stdout/stderr inside the block to the log file `path`.

    Why: gptqmodel alone prints ~24k progress lines while it calibrates. Both the file descriptors 1 and
    2 (native code, subprocesses, handlers bound to the original streams) and Python's sys.stdout and
    sys.stderr are redirected, so nothing escapes by either route. quantbench's own log records still
    reach the terminal (and the file). With `-v` ($QUANTBENCH_VERBOSE) nothing is redirected.
    """
    if path is None or verbose():
        yield None
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    originals = (sys.stdout, sys.stderr)
    for stream in originals:
        with contextlib.suppress(Exception):
            stream.flush()
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    text = os.fdopen(os.dup(log_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    terminal = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
    ours = logging.getLogger("quantbench")
    handlers = [logging.StreamHandler(terminal), logging.StreamHandler(text)]
    for h in handlers:
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    propagate = ours.propagate
    swapped = []  # console handlers of the root logger (basicConfig's, Hydra's): library records go to the file
    try:
        for h in logging.getLogger().handlers:
            if isinstance(h, logging.StreamHandler) and _is_console(h.stream, originals):
                swapped.append((h, h.setStream(text)))
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        ours.propagate = False  # ours: once to the terminal, once to the file, never via the redirected fds
        for h in handlers:
            ours.addHandler(h)
        text.write(f"--- third-party output, {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            yield path
    finally:
        for stream in (*originals, text):
            with contextlib.suppress(Exception):
                stream.flush()
        for h in handlers:
            ours.removeHandler(h)
        ours.propagate = propagate
        for h, stream in swapped:
            h.setStream(stream)
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        for f in (text, terminal):
            f.close()
        os.close(log_fd)
