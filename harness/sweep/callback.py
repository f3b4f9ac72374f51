"""The Hydra callback that makes every multirun a sweep (conf/config.yaml: hydra.callbacks.sweep).

It opens the sweep before the first cell and closes it after the last (harness/sweep/parent.py), and
turns SIGTERM into the same clean stop as Ctrl-C while the sweep runs (`sigterm_interrupts`; a single run
uses it too: harness/cli.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from hydra.experimental.callback import Callback

from harness.errors import QuantbenchError
from harness.sweep.parent import finish_sweep, start_sweep
from harness.sweep.settings import STATE_ENV, SweepState, find_state, plain_without_hydra

FULL_ERROR = "HYDRA_FULL_ERROR"  # set: Hydra re-raises an error instead of printing it and exiting


class SweepInterrupted(KeyboardInterrupt):
    """SIGTERM turned into the same clean stop as Ctrl-C (a sweep: kill the cell, record KILLED, close the sweep;
    a single run: record it KILLED); `exit_code` 143."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signame = signal.Signals(signum).name
        self.exit_code = 128 + signum


def _on_sigterm(signum: int, _frame: Any) -> None:
    raise SweepInterrupted(signum)


def sigterm_interrupts() -> Any:
    """From now on SIGTERM raises SweepInterrupted, a KeyboardInterrupt: the same clean stop as Ctrl-C. Only the
    main thread can set it; returns the handler it replaced (None elsewhere), for signal.signal to put back."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


class SweepCallback(Callback):
    """Hydra callback (conf/config.yaml hydra.callbacks): opens and closes the sweep around a multirun."""

    def __init__(self) -> None:
        self.state: SweepState | None = None
        self._old_sigterm: Any = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        try:
            self.state = start_sweep(config)
        except QuantbenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None  # SystemExit passes Hydra's callback guard: stop before any cell
        self._old_sigterm = sigterm_interrupts()
        # an error raised out of the sweep (a launcher giving up on a job) reaches run.py, which closes the sweep
        # (parent.launcher_failed), instead of Hydra printing a trace and exiting 1 with the sweep left open
        os.environ[FULL_ERROR] = "1"

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        state = self.state or find_state(plain_without_hydra(config))
        if state is not None:
            finish_sweep(state)
        os.environ.pop(STATE_ENV, None)
