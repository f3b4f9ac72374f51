"""Test-only slowdowns of a decode step, for calibrating the regression gate (benchmarks/gate_calibration.py).

Both act inside the timed region of every decode step (strategies/decode.py, the gate's block decoder; a
speculative step, draft + verify, in strategies/speculative.py; llama.cpp's in harness/run/llama_cpp.py):

- `inject_slowdown=f` (spin-wait): every step also busy-waits for f x that step's own CPU time, counted
  in this thread's CPU time (`time.thread_time`). It is not work: it neither uses the caches nor competes
  with the model for them. CPU time, not wall time: on a starved machine (niced beside other work) a
  step's wall time is mostly waiting for a core, and a wall-clock spin of f x the step's wall time burnt
  several times f of CPU (measured -20% to -38% for a nominal -9.1%, AMD EPYC Zen 3, 2 cores, nice 19
  under load). Per step, not sized once: a size taken at load time is wrong when the host's load changes
  before the measurement (a spin sized on a starved start measured -11% to -22% for -9.1%).
- `inject_work=f` (real work): every step also runs `reps` products of a 128 x 128 fp32 matrix with a
  128 x 8 one, on the step's device and threads, like one extra small layer. `reps` is sized once per
  decode setup (per `DecodeOptions` object) from measured times: a typical step (`StepSizer`, the first
  `SIZING_STEPS` steps, run without the extra work) and the median time of one product, so the extra
  work costs about f x a step on this machine, as it was when sized (the host's load may change later:
  the calibration reports the change the gate actually measured). Being real work, its cost varies with the host like the
  model's own, and what it really costs is whatever the gate measures (the calibration prints it).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from harness.measure import now, sync

SIZING_STEPS = 16  # decode steps measured (without extra work) before the work is sized
UNIT_SHAPE = (128, 128, 8)  # one unit of work: (128 x 128) @ (128 x 8), fp32


class StepSizer:
    """The typical duration of a step, from the first SIZING_STEPS steps (run without injected cost).

    The smaller of the median wall time and the median CPU time of this thread between consecutive
    calls: on a quiet machine they agree; on a starved one (niced beside other work) the wall time is
    mostly waiting for a core, and sizing from it would inject several times f of real cost (measured:
    -29% for a nominal -9.1% of work, AMD EPYC Zen 3, 2 cores, nice 19 under load).
    """

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self._cpu = -1.0
        self.step_s = 0.0  # the sized typical step; 0 until sized

    def add(self, dt: float) -> bool:
        """Record one step of wall duration `dt`; True once sized."""
        cpu = time.thread_time()
        if self._cpu >= 0:
            self.cpus.append(cpu - self._cpu)
        self._cpu = cpu
        self.walls.append(dt)
        if len(self.walls) >= SIZING_STEPS:
            self.step_s = min(statistics.median(self.walls), statistics.median(self.cpus))
            return True
        return False


class ExtraWork:
    """A fixed amount of real matrix work per decode step, sized from measured step times (module docstring)."""

    def __init__(self, fraction: float, device: str):
        import torch

        self.fraction, self.device = fraction, device
        m, k, n = UNIT_SHAPE
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(m, k, generator=gen).to(device)
        self.b = torch.randn(k, n, generator=gen).to(device)
        self.out = torch.empty(m, n, device=device)
        self.sizer = StepSizer()
        self.reps = 0  # 0 until sized
        self.unit_s = 0.0

    def _unit(self) -> None:
        import torch

        torch.mm(self.a, self.b, out=self.out)

    def _size(self) -> None:
        times = []
        for _ in range(64):
            t = now()
            self._unit()
            sync(self.device)
            times.append(now() - t)
        self.unit_s = statistics.median(times[8:])
        self.reps = max(1, round(self.fraction * self.sizer.step_s / self.unit_s))

    def run(self, dt: float) -> bool:
        """Called inside a timed step whose own duration so far is `dt`; False while still sizing."""
        if not self.reps:
            if self.sizer.add(dt):
                self._size()
            return False
        for _ in range(self.reps):
            self._unit()
        sync(self.device)
        return True


class Spin:
    """A busy wait of f x this step's own CPU time, in this thread's CPU time (module docstring)."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        self._cpu = -1.0  # this thread's CPU time at the end of the previous step

    def run(self, dt: float) -> bool:
        """Called inside a timed step whose own wall duration is `dt`; spins f x the step's CPU time."""
        cpu = time.thread_time()
        # the CPU this thread used since the previous step (the step, plus a little bookkeeping), but never
        # more than the step's wall time: between two blocks the other side's block ran on this thread too
        step_cpu = min(cpu - self._cpu, dt) if self._cpu >= 0 else dt
        # spin, not sleep: sleep(0.1 ms) measured 0.18 ms median here (OS wake-up latency), so a 10% sleep
        # stretched tiny-model steps by far more than 10% and would overstate the gate's power
        until = cpu + self.fraction * step_cpu
        while time.thread_time() < until:
            pass
        self._cpu = time.thread_time()
        return True


def injected_step(opts: Any, t: float, dt: float) -> float:
    """Apply `opts.inject_work` then `opts.inject_slowdown` to a step that started at `t` and took `dt`.

    Returns the step's duration including the injected cost (the caller records it as the step time).
    """
    if getattr(opts, "inject_work", 0.0) > 0:
        work = opts.__dict__.get("_extra_work")
        if work is None or work.fraction != opts.inject_work:
            work = opts.__dict__["_extra_work"] = ExtraWork(opts.inject_work, opts.device)
        if work.run(dt):
            dt = now() - t
    if opts.inject_slowdown > 0:
        spin = opts.__dict__.get("_spin")
        if spin is None or spin.fraction != opts.inject_slowdown:
            spin = opts.__dict__["_spin"] = Spin(opts.inject_slowdown)
        if spin.run(dt):
            dt = now() - t
    return dt
