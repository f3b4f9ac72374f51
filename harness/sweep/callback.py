"""The Hydra callback that makes every multirun a sweep (conf/config.yaml: hydra.callbacks.sweep).

It opens the sweep before the first cell and closes it after the last (harness/sweep/parent.py), and
turns SIGTERM into the same clean stop as Ctrl-C while the sweep runs (harness/interrupts.py; a single run
and a load run's rates use it too).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from hydra.experimental.callback import Callback

from harness.errors import QuantbenchError
from harness.interrupts import sigterm_interrupts
from harness.sweep.parent import finish_sweep, start_sweep
from harness.sweep.settings import STATE_ENV, SweepState, find_state, plain_without_hydra

FULL_ERROR = "HYDRA_FULL_ERROR"  # set: Hydra re-raises an error instead of printing it and exiting


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
