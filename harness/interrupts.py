"""SIGTERM as the same clean stop as Ctrl-C, for every long-running command here: a sweep (harness/sweep/
callback.py), a single run (harness/cli.py) and a serving load run's rates (harness/load/run.py). The stop is a
KeyboardInterrupt, so each `finally` runs (a server stopped and reaped, a cell's child killed) and the run is
recorded KILLED (harness/run/runner.py `killed`) before the process exits 143."""

from __future__ import annotations

import signal
import threading
from typing import Any


class Interrupted(KeyboardInterrupt):
    """SIGTERM turned into Ctrl-C's stop (a sweep: kill the cell, record KILLED, close the sweep; a single run:
    record it KILLED); `signame` names the signal, `exit_code` is 143."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signame = signal.Signals(signum).name
        self.exit_code = 128 + signum

    def __reduce__(self) -> tuple:  # pickled (a launcher's job result) as the signal's number, as __init__ takes it
        return type(self), (signal.Signals[self.signame].value,)


def _on_sigterm(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def sigterm_interrupts() -> Any:
    """From now on SIGTERM raises Interrupted, a KeyboardInterrupt: the same clean stop as Ctrl-C. Only the main
    thread can set it; returns the handler it replaced (None elsewhere), for signal.signal to put back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)
