"""Energy of the timed passes, from the hardware's own counters; where none is readable, nothing (no estimate).

- GPU (`nvml`): NVML's total-energy counter of the device (`nvmlDeviceGetTotalEnergyConsumption`, mJ since
  the driver loaded; Volta and newer), through nvidia-ml-py (`import pynvml`). It counts the whole board.
- CPU (`rapl`): the powercap sysfs RAPL counters of every CPU package (`/sys/class/powercap/intel-rapl:N/
  energy_uj`; AMD's RAPL shows up under the same name), summed, wrap-around handled with
  `max_energy_range_uj`. It counts the whole package: every process on it, not only this run's.
- `none`: no counter readable (a VM without powercap, as the 2-core test hosts; a GPU without NVML).
  The metrics are then absent rather than guessed from a TDP.

Engines wrap their timed repetitions in an `EnergyMeter`; the run records tag `energy.method` (nvml, rapl,
none; with `energy.why` for none) and, when measured, metrics `energy_j` (the timed passes) and
`energy_j_per_token` (over the tokens those passes generated, prefill's first token included). Work a strategy
does beside what it measures (speculative decoding's plain-greedy reference and its near-tie replay) runs in
`paused()`: the counter's advance over it is left out, as exactly as the counter's update interval allows.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
PACKAGE = re.compile(r"intel-rapl:\d+")  # packages only: intel-rapl:N:M are sub-domains (core, dram) of N


def _rapl_domains(root: Path) -> list[Path]:
    """Package domains whose counter this process can read."""
    out = []
    for d in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
        if PACKAGE.fullmatch(d.name):
            try:
                int((d / "energy_uj").read_text())
                out.append(d)
            except (OSError, ValueError):
                continue
    return out


def _rapl_reader(domains: list[Path]) -> Callable[[], list[int]]:
    return lambda: [int((d / "energy_uj").read_text()) for d in domains]


def _nvml(device: str) -> tuple[Callable[[], float] | None, str]:
    """(read mJ, why not) for the CUDA device `device`."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        index = int(device.split(":")[1]) if ":" in device else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if visible and visible.split(",")[index].strip().isdigit():  # NVML numbers all devices, CUDA the visible
            index = int(visible.split(",")[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # raises NVMLError_NotSupported before Volta
    except Exception as exc:  # noqa: BLE001 - any NVML failure means: no counter here
        return None, f"NVML total-energy counter not readable ({type(exc).__name__}: {exc})"
    return lambda: float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)), ""


class EnergyMeter:
    """Joules between `start()` and `stop()` from the device's counter (see module docstring)."""

    def __init__(self, device: str, powercap: str | Path = POWERCAP) -> None:
        self.method, self.why, self.domains = "none", "", []
        self._start: float | list[int] | None = None
        self._paused: list[tuple[float | list[int], float | list[int]]] = []  # counter readings around paused()
        self._read_mj: Callable[[], float] | None = None
        self._read_uj: Callable[[], list[int]] | None = None
        if device.startswith("cuda"):
            self._read_mj, self.why = _nvml(device)
            if self._read_mj is not None:
                self.method = "nvml"
            return
        root = Path(powercap)
        self.domains = _rapl_domains(root)
        if self.domains:
            self.method = "rapl"
            self._read_uj = _rapl_reader(self.domains)
        else:
            self.why = f"no readable RAPL counter under {root}"

    def _read(self) -> float | list[int] | None:
        return self._read_mj() if self._read_mj else (self._read_uj() if self._read_uj else None)

    def start(self) -> None:
        self._start, self._paused = self._read(), []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside is not metered: `stop()` leaves out the counter's advance over it."""
        if self._start is None:
            yield
            return
        before = self._read()
        try:
            yield
        finally:
            self._paused.append((before, self._read()))

    def _joules(self, a: float | list[int], b: float | list[int]) -> float | None:
        if self._read_mj is not None:
            return (float(b) - float(a)) / 1e3
        total = 0
        for d, x, y in zip(self.domains, a, b, strict=True):
            if y < x:  # the counter wrapped around
                try:
                    y += int((d / "max_energy_range_uj").read_text())
                except (OSError, ValueError):
                    return None
            total += y - x
        return total / 1e6

    def stop(self) -> float | None:
        """Joules since `start()`, less those spent in `paused()`; None when no counter is readable."""
        if self._start is None:
            return None
        spans = [(self._start, self._read()), *self._paused]
        joules = [self._joules(a, b) for a, b in spans]
        if any(j is None for j in joules):
            return None
        return joules[0] - sum(joules[1:])

    def record(self, joules: float | None, tokens: float, metrics: dict, tags: dict) -> None:
        """Tag `energy.method` always; metrics only when measured (absent, never estimated, otherwise)."""
        tags["energy.method"] = self.method if joules is not None else "none"
        if joules is None:
            tags["energy.why"] = self.why or "the counter could not be read"
            return
        if self.domains:
            tags["energy.domains"] = ",".join(d.name for d in self.domains)
        metrics["energy_j"] = joules
        if tokens > 0:
            metrics["energy_j_per_token"] = joules / tokens
